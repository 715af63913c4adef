"""The admission order alone (no trio, no engine): clients in turn, then each
client's connections in turn, and a client's slots capped."""

from __future__ import annotations

from collections.abc import Hashable

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trioserve.generation.fairness import FairQueue

pytestmark = pytest.mark.unit


@attrs.frozen
class J:
    job_id: int
    fair_key: Hashable
    client_key: Hashable


def test_clients_take_turns_then_their_connections() -> None:
    queue: FairQueue[J] = FairQueue(max_running_per_client=10)
    jobs = [
        J(1, "a1", "A"),
        J(2, "a1", "A"),
        J(3, "a2", "A"),
        J(4, "b1", "B"),
        J(5, "b1", "B"),
    ]
    for job in jobs:
        queue.push(job)
    order = [queue.pop() for _ in jobs]
    # A, B, A (its second connection), B, A.
    assert [j.job_id for j in order if j is not None] == [1, 4, 3, 5, 2]
    assert queue.pop() is None and queue.waiting == 0


def test_a_client_holds_at_most_its_cap_and_a_newcomer_gets_a_slot() -> None:
    queue: FairQueue[J] = FairQueue(max_running_per_client=2)
    for i in range(5):
        queue.push(J(i, f"a{i}", "A"))
    assert [queue.pop(), queue.pop()] == [J(0, "a0", "A"), J(1, "a1", "A")]
    assert queue.pop() is None  # A is at its cap, whatever connection asks
    queue.push(J(9, "b", "B"))
    assert queue.pop() == J(9, "b", "B")
    queue.release(J(0, "a0", "A"))
    assert queue.pop() == J(2, "a2", "A")


def test_remove_and_drain() -> None:
    queue: FairQueue[J] = FairQueue(max_running_per_client=1)
    a, b = J(1, "x", "A"), J(2, "y", "B")
    queue.push(a)
    queue.push(b)
    assert a in queue
    queue.remove(a)
    assert a not in queue and queue.waiting == 1
    assert queue.drain() == [b]
    assert not queue and queue.pop() is None


def test_the_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_running_per_client"):
        FairQueue(0)


@given(
    st.lists(
        st.tuples(st.sampled_from("ABC"), st.integers(0, 2)),
        min_size=1,
        max_size=40,
    ),
    st.integers(1, 4),
)
def test_every_job_runs_once_and_no_client_passes_its_cap(
    pushes: list[tuple[str, int]], cap: int
) -> None:
    queue: FairQueue[J] = FairQueue(cap)
    jobs = [J(i, (client, conn), client) for i, (client, conn) in enumerate(pushes)]
    for job in jobs:
        queue.push(job)
    running: dict[str, int] = {}
    ran: list[J] = []
    while queue:
        popped = queue.pop()
        if popped is None:
            # Every waiting client is at its cap: one finishes.
            finished = next(j for j in ran if running.get(str(j.client_key), 0) > 0)
            queue.release(finished)
            running[str(finished.client_key)] -= 1
            continue
        running[str(popped.client_key)] = running.get(str(popped.client_key), 0) + 1
        assert running[str(popped.client_key)] <= cap
        ran.append(popped)
    assert sorted(j.job_id for j in ran) == [j.job_id for j in jobs]
    # Within one connection, jobs run in arrival order.
    for key in {j.fair_key for j in jobs}:
        ids = [j.job_id for j in ran if j.fair_key == key]
        assert ids == sorted(ids)
