"""The CPU engine's step plan: which prompt chunks run, which jobs decode,
which prompts wait. Pure: plain numbers in, a plan out, no torch.

:class:`~trioserve.engine.cpu.engine.CpuEngine` admits jobs and fits its KV cache,
asks :func:`plan_step` what the step runs, runs it (prefill forwards, one
batched decode forward, one sampling call), and settles the prefill share's
balance with :meth:`StepPlan.balance_after` from the times it measured. Every rule
of the schedule is here, so it is tested without a model:

- a job with a sampled token to feed decodes, every step; the others prefill;
- prefill runs shortest remaining prompt first (arrival order among equals):
  a short prompt that arrives during a long one's prefill gets its first
  token after a step of its own size, not after the long one's chunks;
- chunks end at multiples of the chunk size, whatever else runs, so that a
  job's numbers (hence its greedy text) do not depend on which jobs arrived
  with it; which step runs a chunk changes no job's numbers;
- a step's chunks add up to at most one chunk size, except that a step runs
  its first chunk whatever its size (a chunk is never split);
- while jobs decode beside prompts that wait for their prefill (the step is
  *contended*), prefill takes at most ``share`` of the engine's time: a step
  that finds the balance negative defers every prompt with more than
  ``short`` tokens left (a chat turn's new part costs about what a few decode
  rows do, so it is never deferred), and a share of 1 never defers.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = [
    "SHORT_PREFILL",
    "Chunk",
    "JobState",
    "PrefillRules",
    "StepPlan",
    "plan_step",
]

#: Prompt tokens left to prefill at or under which a job is never deferred by
#: the prefill share (a chat turn's new part costs about what a few decode
#: rows do).
SHORT_PREFILL = 128


@attrs.frozen
class PrefillRules:
    """The engine's prefill settings, as the plan reads them."""

    #: Prompt tokens per chunk, and the prefill budget of one step.
    chunk: int = 512
    #: The share of the engine's time that prefill may take while jobs decode
    #: (0 < share <= 1).
    share: float = 0.5
    #: Prompt tokens left at or under which a job is never deferred.
    short: int = SHORT_PREFILL


@attrs.frozen
class JobState:
    """One running job, as the plan sees it."""

    #: Tokens of the prompt that is run.
    prompt: int
    #: Positions in the KV cache (prompt tokens prefilled or restored, then
    #: one per fed token).
    cached: int
    #: Whether the job has a sampled token to feed (its prompt is done).
    decoding: bool

    @property
    def remaining(self) -> int:
        """Prompt tokens still to prefill (0 once the job decodes)."""
        return 0 if self.decoding else self.prompt - self.cached


@attrs.frozen
class Chunk:
    """Prompt positions ``[start, end)`` of job ``job`` (an index into the
    jobs planned), run by one prefill forward."""

    job: int
    start: int
    end: int
    #: The chunk ends the prompt: its last logits give the job's first sample.
    completes: bool


@attrs.frozen
class StepPlan:
    """What one step runs; jobs are indices into the sequence planned."""

    #: The prefill forwards, in the order they run.
    chunks: tuple[Chunk, ...]
    #: The jobs fed one token by the batched decode, in job order.
    decode: tuple[int, ...]
    #: Prompts the share held back this step (the engine counts the steps
    #: that have any: its ``prefill_deferrals``).
    deferred: tuple[int, ...]
    #: Prompts the step's budget left for later steps.
    waiting: tuple[int, ...]
    #: Jobs decode beside prompts waiting for prefill: the step's time
    #: counts against the share (see :meth:`balance_after`).
    contended: bool
    #: Positions the KV cache must hold per slot for the step's writes (a
    #: bound: every prefilling job counted with a whole chunk).
    positions: int

    def balance_after(
        self, balance: float, share: float, step_seconds: float, prefill_seconds: float
    ) -> float:
        """The share's balance after the step, which took ``step_seconds``,
        ``prefill_seconds`` of them in prefill: a contended step adds
        ``share`` of its time and takes its prefill time.

        Never above 0 (no credit is saved up), and kept between contentions
        (a step alone, decoding or prefilling, leaves it as it is), so that a
        stream that ends and starts again does not hand a long prompt a chunk
        each time.
        """
        if not self.contended:
            return balance
        return min(0.0, balance + share * step_seconds - prefill_seconds)


def plan_step(jobs: Sequence[JobState], rules: PrefillRules, balance: float) -> StepPlan:
    """The plan of one step over ``jobs`` (in slot order), given the prefill
    share's ``balance`` (seconds prefill may still take; see
    :meth:`StepPlan.balance_after`)."""
    decode = tuple(i for i, job in enumerate(jobs) if job.decoding)
    # sorted() is stable: arrival (slot) order among equal remainders.
    prefilling = sorted(
        (i for i, job in enumerate(jobs) if not job.decoding), key=lambda i: jobs[i].remaining
    )
    positions = max(
        (job.cached + (1 if job.decoding else min(rules.chunk, job.remaining)) for job in jobs),
        default=0,
    )
    contended = bool(decode and prefilling)
    deferred: tuple[int, ...] = ()
    if contended and rules.share < 1.0 and balance < 0.0:
        # Prefill has had its share of the time since the contention began:
        # this step serves the decoding jobs, and prompts short enough to
        # cost about what a few decode rows do.
        deferred = tuple(i for i in prefilling if jobs[i].remaining > rules.short)
        prefilling = [i for i in prefilling if jobs[i].remaining <= rules.short]

    chunks: list[Chunk] = []
    budget = rules.chunk
    for taken, i in enumerate(prefilling):
        job = jobs[i]
        start = job.cached
        end = min((start // rules.chunk + 1) * rules.chunk, job.prompt)
        if end - start > budget and budget < rules.chunk:
            # A step runs one chunk past its budget only when it is its first.
            return StepPlan(
                tuple(chunks), decode, deferred, tuple(prefilling[taken:]), contended, positions
            )
        budget -= end - start
        chunks.append(Chunk(i, start, end, completes=end == job.prompt))
    return StepPlan(tuple(chunks), decode, deferred, (), contended, positions)
