"""The CPU engine's step plan (trioserve.engine.cpu.plan), without torch or a model.

The examples pin each rule of the schedule; the properties drive the plan
through whole runs (jobs arriving, prefilling, decoding and leaving, with a
cost model standing in for the clock) and check what every step and every
run must satisfy.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trioserve.engine.cpu.plan import (
    SHORT_PREFILL,
    Chunk,
    JobState,
    PrefillRules,
    StepPlan,
    plan_step,
)

pytestmark = pytest.mark.unit

RULES = PrefillRules(chunk=512, share=0.5)


def prefilling(prompt: int, cached: int = 0) -> JobState:
    return JobState(prompt, cached, decoding=False)


def decoding(cached: int = 100) -> JobState:
    return JobState(cached - 1, cached, decoding=True)


def spans(plan: StepPlan) -> list[tuple[int, int, int]]:
    return [(chunk.job, chunk.start, chunk.end) for chunk in plan.chunks]


def test_the_plan_needs_no_torch() -> None:
    code = "import sys, trioserve.engine.cpu.plan; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_nothing_to_plan() -> None:
    plan = plan_step([], RULES, 0.0)
    assert plan == StepPlan((), (), (), (), contended=False, positions=0)


def test_decoding_jobs_decode_every_step_in_slot_order() -> None:
    jobs = [decoding(10), prefilling(5000), decoding(20), decoding(30)]
    for balance in (0.0, -100.0):
        plan = plan_step(jobs, RULES, balance)
        assert plan.decode == (0, 2, 3)
        assert all(chunk.job not in plan.decode for chunk in plan.chunks)


def test_shortest_remaining_prompt_first_arrival_order_among_equals() -> None:
    jobs = [prefilling(300), prefilling(100), prefilling(1000, 900), prefilling(100)]
    plan = plan_step(jobs, RULES, 0.0)
    # Remaining: 300, 100, 100, 100; the three of 100 in slot order, then 300.
    assert spans(plan) == [(1, 0, 100), (2, 900, 1000), (3, 0, 100)]
    assert plan.waiting == (0,)  # 300 > the 212 left of the budget


def test_chunks_end_at_multiples_of_the_chunk_size() -> None:
    # A prompt restored from the prefix cache up to 64 runs [64, 512) first,
    # so that its later chunks have the boundaries of a prompt run whole.
    job = prefilling(1400, 64)
    assert spans(plan_step([job], RULES, 0.0)) == [(0, 64, 512)]
    assert spans(plan_step([prefilling(1400, 512)], RULES, 0.0)) == [(0, 512, 1024)]
    last = plan_step([prefilling(1400, 1024)], RULES, 0.0)
    assert last.chunks == (Chunk(0, 1024, 1400, completes=True),)
    assert not plan_step([job], RULES, 0.0).chunks[0].completes


def test_a_step_runs_one_chunk_past_its_budget_only_when_it_is_its_first() -> None:
    # Small chunks share one step's budget.
    plan = plan_step([prefilling(100), prefilling(200), prefilling(150)], RULES, 0.0)
    assert spans(plan) == [(0, 0, 100), (2, 0, 150), (1, 0, 200)]
    # A first chunk always runs, whatever the budget.
    assert spans(plan_step([prefilling(600)], PrefillRules(chunk=512), 0.0)) == [(0, 0, 512)]
    # A later one that does not fit waits, and so does every one after it,
    # even one that would fit (the step stops at the first that does not).
    jobs = [prefilling(100), prefilling(450), prefilling(960, 448)]
    plan = plan_step(jobs, RULES, 0.0)
    assert spans(plan) == [(0, 0, 100)]
    assert plan.waiting == (1, 2)
    # Exactly the budget fits.
    plan = plan_step([prefilling(100), prefilling(412)], RULES, 0.0)
    assert spans(plan) == [(0, 0, 100), (1, 0, 412)]


def test_prefill_defers_only_when_contended_with_a_share_spent() -> None:
    long = prefilling(2000)
    # Contended, share spent: the long prompt waits, the stream decodes.
    plan = plan_step([decoding(), long], RULES, -0.001)
    assert plan.contended
    assert plan.deferred == (1,)
    assert plan.chunks == ()
    assert plan.decode == (0,)
    # A balance of 0 is not spent.
    assert spans(plan_step([decoding(), long], RULES, 0.0)) == [(1, 0, 512)]
    # No stream: prefill runs, whatever the balance.
    plan = plan_step([long], RULES, -100.0)
    assert not plan.contended
    assert spans(plan) == [(0, 0, 512)]
    assert plan.deferred == ()


def test_a_share_of_one_never_defers() -> None:
    plan = plan_step([decoding(), prefilling(5000)], PrefillRules(share=1.0), -100.0)
    assert plan.contended
    assert plan.deferred == ()
    assert spans(plan) == [(1, 0, 512)]


def test_prompts_of_at_most_128_tokens_left_are_never_deferred() -> None:
    assert SHORT_PREFILL == 128
    jobs = [
        decoding(),
        prefilling(SHORT_PREFILL + 1),
        prefilling(SHORT_PREFILL),
        prefilling(2000, 2000 - SHORT_PREFILL),  # a long prompt's last 128
        prefilling(3000),
    ]
    plan = plan_step(jobs, RULES, -1.0)
    assert spans(plan) == [(2, 0, 128), (3, 1872, 2000)]
    assert plan.deferred == (1, 4)
    assert plan.waiting == ()


def test_positions_bound_every_write_of_the_step() -> None:
    jobs = [decoding(700), prefilling(1400, 64), prefilling(100)]
    # A prefilling job is counted with a whole chunk (576), not its aligned
    # one (512): the cache is fitted before the step runs.
    assert plan_step(jobs, RULES, 0.0).positions == 701
    jobs = [decoding(10), prefilling(1400, 64)]
    assert plan_step(jobs, RULES, -1.0).positions == 64 + 512  # deferred, still counted


def test_the_balance_gains_the_share_pays_prefill_and_never_saves_credit() -> None:
    contended = plan_step([decoding(), prefilling(2000)], RULES, 0.0)
    # A chunk of 0.8 s in a step of 1 s: +0.5 - 0.8.
    assert contended.balance_after(0.0, 0.5, 1.0, 0.8) == pytest.approx(-0.3)
    # Decoding alone earns back half its time...
    assert contended.balance_after(-0.3, 0.5, 0.2, 0.0) == pytest.approx(-0.2)
    # ... up to 0: no credit is saved up for later chunks.
    assert contended.balance_after(-0.05, 0.5, 0.2, 0.0) == 0.0


def test_the_balance_is_kept_between_contentions() -> None:
    share = RULES.share
    balance = 0.0
    # The stream decodes beside a long prompt: the first chunk runs and
    # spends the share.
    plan = plan_step([decoding(), prefilling(3000)], RULES, balance)
    assert spans(plan) == [(1, 0, 512)]
    balance = plan.balance_after(balance, share, 1.0, 0.9)
    assert balance < 0
    # The stream ends: the prompt prefills alone, and the balance stays.
    plan = plan_step([prefilling(3000, 512)], RULES, balance)
    assert not plan.contended
    assert plan.balance_after(balance, share, 1.0, 1.0) == balance
    # A new stream starts: the prompt does not get a chunk at once.
    plan = plan_step([prefilling(3000, 1024), decoding()], RULES, balance)
    assert plan.deferred == (0,)
    # A step that only decodes (no prompt waits) leaves it as well.
    plan = plan_step([decoding()], RULES, balance)
    assert plan.balance_after(balance, share, 0.1, 0.0) == balance


# --- whole runs ---------------------------------------------------------------


@attrs.define
class SimJob:
    """A job of a simulated run."""

    arrival: int
    prompt: int
    cached: int
    max_new: int
    decoding: bool = False
    generated: int = 0
    spans: list[tuple[int, int]] = attrs.field(factory=list)
    first_cached: int = 0

    def state(self) -> JobState:
        return JobState(self.prompt, self.cached, self.decoding)


@attrs.frozen
class Run:
    steps: int
    jobs: list[SimJob]
    deferrals: int
    #: Seconds of contended steps and of their prefill.
    contended_seconds: float
    contended_prefill_seconds: float


def check_step(
    jobs: Sequence[JobState], rules: PrefillRules, balance: float, plan: StepPlan
) -> None:
    """What every plan satisfies."""
    decoders = [i for i, job in enumerate(jobs) if job.decoding]
    prompts = [i for i, job in enumerate(jobs) if not job.decoding]
    assert list(plan.decode) == decoders
    # Each prefilling job runs a chunk, is deferred or waits: exactly one.
    chunked = [chunk.job for chunk in plan.chunks]
    assert sorted(chunked + list(plan.deferred) + list(plan.waiting)) == prompts
    assert plan.contended == bool(decoders and prompts)
    budget = rules.chunk
    for chunk in plan.chunks:
        job = jobs[chunk.job]
        assert chunk.start == job.cached < chunk.end <= job.prompt
        assert chunk.end - chunk.start <= rules.chunk
        assert chunk.end % rules.chunk == 0 or chunk.end == job.prompt
        assert chunk.completes == (chunk.end == job.prompt)
        assert plan.positions >= job.cached + (chunk.end - chunk.start)
        budget -= chunk.end - chunk.start
    assert budget >= 0 or len(plan.chunks) == 1
    # Shortest remaining first.
    remaining = [jobs[i].remaining for i in chunked]
    assert remaining == sorted(remaining)
    if plan.waiting:
        assert plan.chunks  # a step that has a budget left runs a chunk
        assert min(jobs[i].remaining for i in plan.waiting) >= remaining[-1]
    if plan.deferred:
        assert plan.contended and rules.share < 1.0 and balance < 0.0
        assert all(jobs[i].remaining > rules.short for i in plan.deferred)
        assert all(jobs[i].remaining <= rules.short for i in chunked)
    for i in decoders:
        assert plan.positions >= jobs[i].cached + 1


def simulate(
    arrivals: list[tuple[int, int, int, int]],
    rules: PrefillRules,
    *,
    token_seconds: float,
    decode_seconds: float,
    max_batch: int = 4,
    max_steps: int = 100_000,
) -> Run:
    """Run the plan over jobs ``(arrival step, prompt, restored, max_new)``
    as the engine does (admission in arrival order into free slots, slots
    kept packed), with prefill costing ``token_seconds`` a token and a decode
    step ``decode_seconds``."""
    pending = sorted(
        (SimJob(a, p, c, m, first_cached=c) for a, p, c, m in arrivals), key=lambda j: j.arrival
    )
    slots: list[SimJob] = []
    done: list[SimJob] = []
    balance = 0.0
    deferrals = 0
    contended_seconds = prefill_in_contention = 0.0
    for step in range(max_steps):
        while pending and pending[0].arrival <= step and len(slots) < max_batch:
            slots.append(pending.pop(0))
        if not slots:
            if not pending:
                return Run(step, done, deferrals, contended_seconds, prefill_in_contention)
            continue
        states = [job.state() for job in slots]
        plan = plan_step(states, rules, balance)
        check_step(states, rules, balance, plan)
        deferrals += bool(plan.deferred)
        prefill = 0.0
        for chunk in plan.chunks:
            job = slots[chunk.job]
            job.spans.append((chunk.start, chunk.end))
            job.cached = chunk.end
            prefill += (chunk.end - chunk.start) * token_seconds
        finished: list[SimJob] = []
        for i in plan.decode:
            job = slots[i]
            job.cached += 1
            job.generated += 1
        for chunk in plan.chunks:
            if chunk.completes:
                slots[chunk.job].decoding = True
                slots[chunk.job].generated += 1  # its first token
        for job in slots:
            if job.generated >= job.max_new:
                finished.append(job)
        seconds = prefill + (decode_seconds if plan.decode else 0.0)
        if plan.contended:
            contended_seconds += seconds
            prefill_in_contention += prefill
        new = plan.balance_after(balance, rules.share, seconds, prefill)
        assert new <= 0.0
        if not plan.contended:
            assert new == balance
        balance = new
        for job in finished:
            slots.remove(job)
            done.append(job)
    raise AssertionError(f"the run did not end in {max_steps} steps")


arrival = st.tuples(
    st.integers(0, 30),  # step
    st.integers(1, 3000),  # prompt tokens
    st.integers(0, 40),  # restored blocks of 64 (capped below)
    st.integers(1, 40),  # max_new
).map(lambda a: (a[0], a[1], min(64 * a[2], (a[1] - 1) // 64 * 64), a[3]))

rules_st = st.builds(
    PrefillRules,
    chunk=st.sampled_from([16, 64, 100, 512]),
    share=st.sampled_from([0.1, 0.25, 0.5, 0.9, 1.0]),
)


@given(
    arrivals=st.lists(arrival, min_size=1, max_size=8),
    rules=rules_st,
    token_seconds=st.floats(1e-4, 1e-3),
    decode_seconds=st.floats(1e-2, 0.1),
)
def test_every_prompt_is_prefilled_once_in_order_and_every_job_ends(
    arrivals: list[tuple[int, int, int, int]],
    rules: PrefillRules,
    token_seconds: float,
    decode_seconds: float,
) -> None:
    run = simulate(arrivals, rules, token_seconds=token_seconds, decode_seconds=decode_seconds)
    assert len(run.jobs) == len(arrivals)
    for job in run.jobs:
        # The spans are contiguous, never overlap, and cover the prompt past
        # what was restored exactly once.
        ends = [job.first_cached] + [end for _, end in job.spans]
        assert [start for start, _ in job.spans] == ends[:-1]
        assert ends[-1] == job.prompt
        assert job.generated == job.max_new
    if rules.share == 1.0:
        assert run.deferrals == 0


@given(
    prompt=st.integers(SHORT_PREFILL + 1, 4000),
    rules=rules_st,
    # A chunk of 512 costs 5 to 100 decode steps, as on a CPU.
    token_seconds=st.floats(1e-4, 1e-3),
    decode_seconds=st.floats(1e-2, 0.1),
)
def test_a_prompt_beside_an_endless_stream_gets_its_share(
    prompt: int, rules: PrefillRules, token_seconds: float, decode_seconds: float
) -> None:
    """The stream never ends, yet the prompt is prefilled, and its prefill
    takes at most the share of the contended time, give or take one chunk."""
    never = 10**9
    slots = [SimJob(0, 9, 10, never, decoding=True), SimJob(1, prompt, 0, 1)]
    balance = 0.0
    contended = prefill_total = 0.0
    for _ in range(200_000):
        states = [job.state() for job in slots]
        plan = plan_step(states, rules, balance)
        check_step(states, rules, balance, plan)
        prefill = 0.0
        for chunk in plan.chunks:
            slots[chunk.job].cached = chunk.end
            prefill += (chunk.end - chunk.start) * token_seconds
        slots[0].cached += 1
        seconds = prefill + decode_seconds
        contended += seconds
        prefill_total += prefill
        balance = plan.balance_after(balance, rules.share, seconds, prefill)
        if slots[1].cached == prompt:
            break
    else:
        raise AssertionError("the prompt was never prefilled")
    # Past the share by at most the chunk that spent it, and the last
    # SHORT_PREFILL tokens, which are never deferred.
    slack = (rules.chunk + SHORT_PREFILL) * token_seconds
    assert prefill_total <= rules.share * contended + slack + 1e-9
