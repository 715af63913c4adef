"""How one step's rows are sampled: the ids each job may take now, its
biases, its constraint's mask, and the draws (:func:`sample_jobs`);
:class:`StepSampler` lets each job take its token, and then, while the
token is the draft fed after it, the next position's (speculative decoding).

Everything here works on the rows of one step (:class:`~trioserve.engine.cpu.jobs.CpuJob`
each) and touches neither the slots nor the KV cache.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch
from torch import Tensor

from trioserve.engine.cpu import llama
from trioserve.engine.cpu.jobs import CpuJob
from trioserve.engine.cpu.logprobs import Exact, RawLogprob, TokenTexts, row_logprobs
from trioserve.engine.cpu.speculative import DraftCounts, merged
from trioserve.engine.grammars import MaskRows
from trioserve.engine.samplers import xtc_protected_ids
from trioserve.engine.sampling import SamplingError, sample
from trioserve.engine.tokenizer import Tokenizer
from trioserve.vocabulary.results import Failed, Finished, Update

__all__ = ["StepSampler", "XtcProtected", "sample_jobs"]

log = logging.getLogger("trioserve.engine")


class XtcProtected:
    """The ids XTC never removes (``[V]`` bool), built when a job first uses XTC."""

    def __init__(self, tokenizer: Tokenizer, vocab: int, device: torch.device) -> None:
        self._tokenizer = tokenizer
        self._vocab = vocab
        self._device = device
        self._mask: Tensor | None = None

    def __call__(self, rows: Sequence[CpuJob]) -> Tensor | None:
        """The mask, or None when no row uses XTC."""
        if all(job.spec.sampling.xtc_probability == 0 for job in rows):
            return None
        if self._mask is None:
            mask = torch.zeros(self._vocab, dtype=torch.bool)
            mask[[i for i in xtc_protected_ids(self._tokenizer) if i < self._vocab]] = True
            self._mask = mask.to(self._device)
        return self._mask


@attrs.frozen
class StepSampler:
    """What sampling a step's rows needs of the engine, made once at its load."""

    vocab: int
    device: torch.device
    texts: TokenTexts
    xtc: XtcProtected
    #: The step's constraint bitmask, allocated once.
    masks: MaskRows | None
    #: Drafts fed and accepted so far.
    drafts: DraftCounts = attrs.field(factory=DraftCounts)

    def sample(
        self,
        weights: llama.LlamaWeights,
        rows: list[CpuJob],
        drafts: Sequence[Sequence[int]],
        hidden: Tensor,
        finish: Callable[[CpuJob], None],
        fail: Callable[[CpuJob, str], Failed],
    ) -> list[Update]:
        """Sample the step's tokens and let each job take them; their updates.

        ``hidden`` (``[R, D]``) holds, job after job, the hidden state of
        each position the step fed it: its pending token's (or its last
        prompt token's), then one per draft of ``drafts[i]`` (row i's drafts,
        fed after it). See :meth:`settle`.
        """
        exact = _exact_rows(weights, hidden)
        return self.settle(rows, drafts, llama.logits(weights, hidden), exact, finish, fail)

    def settle(
        self,
        rows: list[CpuJob],
        drafts: Sequence[Sequence[int]],
        logits: Tensor,
        exact: Exact,
        finish: Callable[[CpuJob], None],
        fail: Callable[[CpuJob, str], Failed],
    ) -> list[Update]:
        """:meth:`sample` from the rows' ``logits`` (``[R, V]``, and
        ``exact`` logits of some of their ids for log probabilities).

        A job takes the token sampled at its first position, then, while
        that token is the draft fed after it, the next position's
        (:mod:`trioserve.engine.cpu.speculative`); its updates are merged into
        one. ``finish`` is called with each job that ended (it frees the
        slot); ``fail`` gives the failure of a job that could not be sampled.
        """
        starts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
        taken: list[list[Update]] = [[] for _ in rows]
        row_of = {job: row for row, job in enumerate(rows)}
        first_token = {job: len(job.tokens) for job in rows}
        order: list[int] = []  # sample_jobs' order: the jobs that failed early first
        live = list(range(len(rows)))
        depth = 0
        while live:
            index = None  # the usual step, no drafts: every row, as it is
            if len(live) != logits.shape[0]:
                index = torch.tensor([starts[row] + depth for row in live], device=logits.device)
            outcomes = sample_jobs(
                [rows[row] for row in live],
                logits if index is None else logits.index_select(0, index),
                self.xtc,
                vocab=self.vocab,
                device=self.device,
                masks=self.masks,
                exact=exact if index is None else _kept_rows(exact, index),
            )
            live = []
            for job, outcome, raw in outcomes:
                row = row_of[job]
                if depth == 0:
                    order.append(row)
                if isinstance(outcome, str):
                    # A constraint's own failure says so (the request's cause);
                    # the sampler's gets its prefix.
                    if outcome.startswith("the constraint"):
                        taken[row].append(attrs.evolve(fail(job, outcome), cause="request"))
                    else:
                        taken[row].append(fail(job, f"sampling failed: {outcome}"))
                    continue
                update = job.accept(outcome, None if raw is None else self.texts.entry(raw))
                taken[row].append(update)
                agreed = depth < len(drafts[row]) and outcome == drafts[row][depth]
                self.drafts.accepted += agreed
                if isinstance(update, Finished):
                    finish(job)
                elif agreed:
                    # The draft fed at the next position is the token taken:
                    # that position's keys, values and logits are the job's.
                    job.cached += 1
                    live.append(row)
            live.sort()
            depth += 1
        for job, draft in zip(rows, drafts, strict=True):
            if draft:
                job.drafts_taken(len(draft), len(job.tokens) - 1 - first_token[job])
        self.drafts.drafted += sum(len(draft) for draft in drafts)
        return [update for row in order for update in merged(taken[row])]


def _exact_rows(weights: llama.LlamaWeights, hidden: Tensor) -> Exact:
    """The exact logits of some ids of some rows of ``hidden``."""
    return lambda index, ids: llama.exact_logits(weights, hidden[index], ids)


def sample_jobs(
    rows: list[CpuJob],
    logits: Tensor,
    xtc_protected: Callable[[Sequence[CpuJob]], Tensor | None],
    *,
    vocab: int,
    device: torch.device,
    masks: MaskRows | None = None,
    exact: Exact | None = None,
) -> list[tuple[CpuJob, int | str, RawLogprob | None]]:
    """One token for each row of ``logits`` (``[B, V]``, row i is job
    ``rows[i]``), or why the job cannot be sampled: each job once, in the
    order its update is to be given (the jobs whose DRY or constraint failed
    first), with the token's log probabilities when its job asks for them
    (:mod:`trioserve.engine.cpu.logprobs`).

    ``xtc_protected`` gives the XTC mask for the rows sampled (None when no
    row uses XTC); ``masks`` fills the constrained rows' allowed tokens. The
    jobs are not changed (see :meth:`CpuJob.accept`), but their matchers
    compute their next mask. ``exact`` gives the exact logits of some ids of
    some rows (of ``logits``) for the log probabilities.
    """
    outcomes: list[tuple[CpuJob, int | str, RawLogprob | None]] = []
    kept: Tensor | None = None  # the rows of `logits` still sampled
    constrained = _constraint_masks(rows, masks or MaskRows(vocab, len(rows)), device)
    bias, failed_early = _biases(rows, vocab, device)
    for row, job in enumerate(rows):
        problem = None if job.matcher is None else job.matcher.problem()
        if problem is not None:
            failed_early.setdefault(row, problem)
    if failed_early:
        for row in sorted(failed_early):
            outcomes.append((rows[row], failed_early[row], None))
        keep = [row for row in range(len(rows)) if row not in failed_early]
        rows = [rows[row] for row in keep]
        if not rows:
            return outcomes
        index = torch.tensor(keep, device=logits.device)
        kept = index
        logits = logits.index_select(0, index)
        if bias is not None:
            bias = bias.index_select(0, index.to(bias.device))
        if constrained is not None:
            constrained = constrained.index_select(0, index.to(constrained.device))
    banned = allowed = None
    bans = [job.banned_now for job in rows]
    if any(ban is not None for ban in bans):
        empty = torch.zeros(vocab, dtype=torch.bool, device=device)
        banned = torch.stack([empty if ban is None else ban for ban in bans])
    if any(job.allowed is not None for job in rows):
        full = torch.ones(vocab, dtype=torch.bool, device=device)
        allowed = torch.stack([full if job.allowed is None else job.allowed for job in rows])
    if constrained is not None:
        allowed = constrained if allowed is None else allowed & constrained
    failed: dict[int, str] = {}
    settings = [job.spec.sampling for job in rows]
    # The counts only serve the penalties: a [B, V] copy not made for rows
    # without any (the sampler skips them then, whatever the counts).
    penalised = any(s.penalised for s in settings)
    try:
        ids = sample(
            logits,
            settings,
            [job.generator for job in rows],
            counts=torch.stack([job.counts for job in rows]) if penalised else None,
            banned=banned,
            allowed=allowed,
            bias=bias,
            states=[job.state for job in rows],
            xtc_protected=xtc_protected(rows),
        )
    except SamplingError as exc:
        failed = exc.reasons
        if exc.ids is None:
            # No row was sampled: every job of the step fails, each with its
            # own reason where the sampler gave one.
            return outcomes + [
                (job, failed.get(row, str(exc)), None) for row, job in enumerate(rows)
            ]
        ids = exc.ids
    tokens = ids.tolist()
    asking = [
        row for row, job in enumerate(rows) if job.spec.logprobs is not None and row not in failed
    ]
    found: dict[int, RawLogprob] = {}
    if asking:
        computed = row_logprobs(
            logits,
            asking,
            [tokens[row] for row in asking],
            [rows[row].spec.logprobs or 0 for row in asking],
            bias=[rows[row].bias for row in asking],
            banned=banned,
            allowed=allowed,
            exact=_kept_rows(exact, kept),
        )
        found = dict(zip(asking, computed, strict=True))
    for row, (job, token) in enumerate(zip(rows, tokens, strict=True)):
        outcomes.append((job, failed.get(row, token), found.get(row)))
    return outcomes


def _kept_rows(exact: Exact | None, kept: Tensor | None) -> Exact | None:
    """``exact`` over the rows that remain after failed ones were dropped."""
    if exact is None or kept is None:
        return exact
    return lambda index, ids: exact(kept.index_select(0, index.to(kept.device)), ids)


def _constraint_masks(rows: list[CpuJob], masks: MaskRows, device: torch.device) -> Tensor | None:
    """The ``[B, V]`` allowed tokens of the step's rows (all True for rows
    without a constraint), or None when no row has one. Each matcher
    computes its mask here, on the engine thread: tens of microseconds for a
    usual grammar; a costly one is charged for it and fails over its budget
    (:class:`~trioserve.engine.grammars.MaskBudget`)."""
    matchers = {row: job.matcher for row, job in enumerate(rows) if job.matcher is not None}
    if not matchers:
        return None
    filled = masks.fill(list(matchers.values()))
    if len(matchers) == len(rows):
        return filled.to(device)
    # Assembled in numpy: one thread (see MaskRows).
    allowed = np.ones((len(rows), masks.vocab_size), dtype=np.bool_)
    allowed[list(matchers)] = filled.numpy()
    return torch.from_numpy(allowed).to(device)


def _biases(
    rows: list[CpuJob], vocab: int, device: torch.device
) -> tuple[Tensor | None, dict[int, str]]:
    """The step's additive ``[B, V]`` bias (``logit_bias`` and DRY), or None
    when no row has one; and the rows whose DRY could not be computed, each
    with why (they fail alone)."""
    if all(job.bias is None and job.dry is None for job in rows):
        return None, {}
    bias = torch.zeros((len(rows), vocab), dtype=torch.float32, device=device)
    failed: dict[int, str] = {}
    for row, job in enumerate(rows):
        if job.bias is not None:
            bias[row] += job.bias
        if job.dry is None:
            continue
        try:
            found = job.dry.penalties(job.spec.sampling)
        except Exception as exc:
            log.exception("dry penalties of job %s failed", job.spec.job_id)
            failed[row] = f"dry failed: {type(exc).__name__}: {exc}"[:200]
            continue
        if found is not None:
            ids, values = found
            bias[row].index_add_(0, ids.to(device), -values.to(device))
    return bias, failed
