"""Who runs next: the waiting jobs of every client, and the slots each holds.

Pure bookkeeping, no trio and no engine, so that the admission rules can be
tested alone. A free slot goes to the waiting client that holds the fewest
slots (clients that hold as many take turns), then to that client's owners
(its connections) in turn, and one client holds at most
``max_running_per_client`` engine slots.

With an engine that can pause a running job (the CPU engine), the cap is the
whole engine: a lone client uses every slot, and a newcomer who finds none
free takes one from the client holding the most, whose newest job is paused
and waits at the head of its connection's queue (:meth:`FairQueue.victim`,
:meth:`FairQueue.push_paused`). Without one, the cap is all but one slot, so
that a newcomer always finds one free.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable
from typing import Generic, Protocol, TypeVar

import attrs

__all__ = ["FairQueue", "Waiting"]


class Waiting(Protocol):
    """What the queue needs of a job."""

    @property
    def job_id(self) -> int: ...

    @property
    def fair_key(self) -> Hashable: ...

    @property
    def client_key(self) -> Hashable: ...


J = TypeVar("J", bound=Waiting)


@attrs.define(eq=False)
class _ClientQueue(Generic[J]):
    """One client's waiting jobs, per owner, and the owners' turn order."""

    owners: dict[Hashable, dict[int, J]] = attrs.Factory(dict)
    rotation: collections.deque[Hashable] = attrs.Factory(collections.deque)


class FairQueue(Generic[J]):
    """Waiting jobs in fair order, and the running jobs per client."""

    def __init__(self, max_running_per_client: int) -> None:
        if max_running_per_client < 1:
            raise ValueError(f"max_running_per_client must be >= 1, got {max_running_per_client!r}")
        self.max_running_per_client = max_running_per_client
        self.waiting = 0
        self._queues: dict[Hashable, _ClientQueue[J]] = {}
        self._rotation: collections.deque[Hashable] = collections.deque()
        self._running: collections.Counter[Hashable] = collections.Counter()

    def __bool__(self) -> bool:
        return self.waiting > 0

    def push(self, job: J) -> None:
        """Queue ``job`` behind its owner's earlier jobs."""
        self._owner_queue(job)[job.job_id] = job
        self.waiting += 1

    def push_paused(self, job: J) -> None:
        """Queue a running ``job`` that gave its slot back (paused) ahead of
        its owner's other waiting jobs: the owner's jobs still start in
        arrival order, and the paused one resumes first."""
        self._running_release(job.client_key)
        queue = self._owner_queue(job)
        rest = dict(queue)
        queue.clear()
        queue[job.job_id] = job
        queue.update(rest)
        self.waiting += 1

    def _owner_queue(self, job: J) -> dict[int, J]:
        client = self._queues.get(job.client_key)
        if client is None:
            client = self._queues[job.client_key] = _ClientQueue()
            self._rotation.append(job.client_key)
        queue = client.owners.get(job.fair_key)
        if queue is None:
            queue = client.owners[job.fair_key] = {}
            client.rotation.append(job.fair_key)
        return queue

    def __contains__(self, job: J) -> bool:
        client = self._queues.get(job.client_key)
        if client is None:
            return False
        queue = client.owners.get(job.fair_key)
        return queue is not None and job.job_id in queue

    def remove(self, job: J) -> None:
        """Take a waiting ``job`` out (stopped, refused, or admitted)."""
        client = self._queues[job.client_key]
        queue = client.owners[job.fair_key]
        del queue[job.job_id]
        self.waiting -= 1
        if not queue:
            del client.owners[job.fair_key]
            client.rotation.remove(job.fair_key)
        if not client.owners:
            del self._queues[job.client_key]
            self._rotation.remove(job.client_key)

    def may_run(self, client: Hashable) -> bool:
        """Whether ``client`` holds fewer slots than its cap."""
        return self._running[client] < self.max_running_per_client

    def running(self, client: Hashable) -> int:
        """The slots ``client`` holds."""
        return self._running[client]

    def _next_client(self) -> Hashable | None:
        """The waiting client under its cap that holds the fewest slots; of
        several, the first in the rotation."""
        best: Hashable | None = None
        for key in self._rotation:
            if self.may_run(key) and (best is None or self._running[key] < self._running[best]):
                best = key
        return best

    def pop(self) -> J | None:
        """The first waiting job of the next owner of the waiting client that
        holds the fewest slots (see :meth:`_next_client`), counted as
        running; that client, and that owner within it, go to the back of
        their rotations. None when no waiting client may take a slot."""
        key = self._next_client()
        if key is None:
            return None
        self._rotation.remove(key)
        self._rotation.append(key)
        client = self._queues[key]
        owner = client.rotation[0]
        client.rotation.rotate(-1)
        job = next(iter(client.owners[owner].values()))
        self.remove(job)
        self._running[key] += 1
        return job

    def victim(self, running: Iterable[J]) -> J | None:
        """The job to pause so that a waiting client gets a slot when none is
        free: the newest of ``running`` (the last in their order) of the
        client holding the most slots, when that client holds at least two
        more than the waiting client that would take the slot; otherwise
        None (shares as even as whole slots allow are never shuffled, so
        pausing cannot go round in circles)."""
        waiter = self._next_client()
        if waiter is None:
            return None
        newest: dict[Hashable, J] = {}
        for job in running:
            newest[job.client_key] = job
        if not newest:
            return None
        holder = max(newest, key=lambda key: self._running[key])
        if self._running[holder] < self._running[waiter] + 2:
            return None
        return newest[holder]

    def release(self, job: J) -> None:
        """A running ``job`` gave its slot back (it ended)."""
        self._running_release(job.client_key)

    def _running_release(self, key: Hashable) -> None:
        self._running[key] -= 1
        if self._running[key] <= 0:
            del self._running[key]

    def drain(self) -> list[J]:
        """Every waiting job, in no particular order; the queue is then empty."""
        jobs = [
            job
            for client in self._queues.values()
            for queue in client.owners.values()
            for job in queue.values()
        ]
        self._queues.clear()
        self._rotation.clear()
        self._running.clear()
        self.waiting = 0
        return jobs
