"""The CPU engine's jobs: what each running job holds, how a spec is checked
and turned into one, and how a step's rows are sampled.

:class:`~trioserve.engine.cpu.engine.CpuEngine` owns the slots and the KV cache;
everything here works on one job, or on the rows of one step, and touches
neither.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch
from torch import Tensor

from trioserve.engine.base import GenerationSpec
from trioserve.engine.cpu import llama
from trioserve.engine.cpu.logprobs import (
    EntryQueue,
    Exact,
    RawLogprob,
    TokenTexts,
    prompt_logprobs,
    row_logprobs,
)
from trioserve.engine.cpu.plan import JobState
from trioserve.engine.cpu.prefix import PrefixCache
from trioserve.engine.cpu.speculative import DraftCounts, NgramIndex, draft_budget, merged
from trioserve.engine.grammars import JobMatcher, MaskRows
from trioserve.engine.samplers import (
    DryHistory,
    bias_row,
    sequence_breaker_ids,
    xtc_protected_ids,
)
from trioserve.engine.sampling import (
    RowState,
    SamplingError,
    make_generator,
    sample,
    settings_problem,
)
from trioserve.engine.text import TextStream
from trioserve.engine.tokenizer import Tokenizer
from trioserve.vocabulary.results import (
    MAX_TOP_LOGPROBS,
    Failed,
    Finished,
    FinishReason,
    TextUpdate,
    TokenLogprob,
    Update,
)

__all__ = [
    "CpuJob",
    "StepSampler",
    "XtcProtected",
    "decode_rows",
    "draft_rows",
    "prefill_chunk",
    "sample_jobs",
    "score_prompt",
    "spec_problem",
    "start_job",
    "text_in_context",
]

log = logging.getLogger("trioserve.engine")

#: Prompt ids decoded before the healed token to give it its context.
_HEALING_CONTEXT = 8
#: Prompt positions whose logits are computed at once for prompt log
#: probabilities: 128 rows of a 49152-token vocabulary are 24 MiB of float32.
_SCORED_ROWS = 128


@attrs.define(eq=False)
class CpuJob:
    """A job that holds a slot."""

    spec: GenerationSpec
    #: The prompt actually run (token healing drops the last id).
    prompt: tuple[int, ...]
    slot: int
    stream: TextStream
    generator: torch.Generator
    #: How often each id occurs in the job's context, for the penalties. [V]
    counts: Tensor
    banned: Tensor | None  # [V] bool
    #: Token healing's constraint on the first sample. [V] bool
    allowed: Tensor | None
    #: ``logit_bias`` as a row to add to the logits. [V] float32
    bias: Tensor | None = None
    #: The context as DRY reads it, when the job uses DRY.
    dry: DryHistory | None = None
    #: What the sampler keeps between steps (mirostat's mu).
    state: RowState = attrs.field(factory=RowState)
    #: Positions written to the KV cache so far.
    cached: int = 0
    #: The last sampled id, to be fed at the next decode step.
    pending: int | None = None
    generated: int = 0
    #: The prompt, then every sampled id: ``tokens[:cached]`` are the ids
    #: whose keys and values the slot holds.
    tokens: list[int] = attrs.field(factory=list)
    #: Prompt tokens served from the prefix cache.
    reused: int = 0
    #: The prefix cache's blocks still to be copied into the slot (at the
    #: job's first step, once the cache has room).
    restore: list[Tensor] = attrs.field(factory=list)
    #: The job's own matcher, when its spec has a constraint.
    matcher: JobMatcher | None = None
    #: With ``spec.logprobs``: the entries waiting for their text.
    entries: EntryQueue | None = None
    #: Characters of text released so far.
    released: int = 0
    #: With ``spec.prompt_logprobs``: the prompt's entries computed so far.
    prompt_entries: list[TokenLogprob] = attrs.field(factory=list)
    #: Where the context's n-grams last ended, once the job drafts.
    lookup: NgramIndex | None = None
    #: Drafts to feed at the next step that finds some, at most (see
    #: :meth:`drafts_taken`); None: as many as the engine allows.
    draft_limit: int | None = None

    def state_for_plan(self) -> JobState:
        return JobState(len(self.prompt), self.cached, decoding=self.pending is not None)

    def draft(self, most: int) -> tuple[int, ...]:
        """Up to ``most`` tokens to feed after the pending one, looked up in
        the job's context (:mod:`trioserve.engine.cpu.speculative`); no more than
        its ``max_new_tokens`` leave room to sample after them."""
        most = min(most, self.draft_limit or most, self.spec.max_new_tokens - self.generated - 1)
        if most <= 0:
            return ()
        if self.lookup is None:
            self.lookup = NgramIndex()
        return self.lookup.draft(self.tokens, most)

    def drafts_taken(self, fed: int, taken: int) -> None:
        """Adapt the draft length to how often this job's drafts are taken
        (the heuristic of Hugging Face's assisted generation): two more after
        a step that took every draft, one fewer (but at least one) after a
        step that did not. A draft that is not taken costs a row of the
        forward: a job whose context does not predict its text drafts one
        token at a time."""
        if taken >= fed:
            self.draft_limit = fed + 2
        else:
            self.draft_limit = max(1, min(self.draft_limit or fed, fed) - 1)

    def accept(self, token: int, entry: TokenLogprob | None = None) -> TextUpdate | Finished:
        """Take the sampled ``token`` (it is fed at the next decode step) and
        say what it gives: more text, or the job's end (the engine then
        frees its slot). ``entry`` is its log-probability entry, when the
        job asks for them."""
        self.allowed = None
        matcher = self.matcher
        if matcher is not None and token not in self.spec.stop_token_ids:
            # A stop token ends the job whatever the matcher says; it allowed
            # one only in an accepting state.
            matcher.consume(token)
        self.pending = token
        self.tokens.append(token)
        self.generated += 1
        self.counts[token] += 1
        if self.dry is not None:
            self.dry.append(token)
        spec = self.spec
        if token in spec.stop_token_ids:
            # The stop token's own text is never emitted (its entry goes apart);
            # held text was not a stop string after all, so it is released.
            text = self.stream.flush()
            self.released += len(text)
            stop_entry = entry if self.entries is not None else None
            return self._finished(text, "stop_token", stop_token=token, stop_entry=stop_entry)
        piece = self.stream.push([token])
        self.released += len(piece.text)
        if self.entries is not None and entry is not None:
            self.entries.add(entry, self.released + self.stream.stop_pending)
        if piece.stop_string is not None:
            return self._finished(piece.text, "stop_string", stop_string=piece.stop_string)
        complete = matcher is not None and matcher.complete
        if complete or self.generated >= spec.max_new_tokens:
            tail = self.stream.flush()
            self.released += len(tail)
            text = piece.text + tail
            if self.stream.stop_string is not None:
                # The flushed tail completed a stop string after all.
                return self._finished(text, "stop_string", stop_string=self.stream.stop_string)
            # A complete value ends the job at once: its grammar allows only
            # the end now, so sampling that end would cost a forward for nothing.
            return self._finished(text, "constraint" if complete else "max_new_tokens")
        entries = () if self.entries is None else self.entries.release(self.released)
        return TextUpdate(spec.job_id, piece.text, self.stream.held, self.generated, entries)

    def finish_scored(self) -> Finished:
        """The end of a job that only scores its prompt (``max_new_tokens`` 0)."""
        return self._finished("", "max_new_tokens")

    def _finished(
        self,
        text: str,
        reason: FinishReason,
        *,
        stop_string: str | None = None,
        stop_token: int | None = None,
        stop_entry: TokenLogprob | None = None,
    ) -> Finished:
        entries: tuple[TokenLogprob, ...] = ()
        if self.entries is not None:
            stopped = reason == "stop_string"
            entries = self.entries.cut(self.released) if stopped else self.entries.flush()
        return Finished(
            job_id=self.spec.job_id,
            text=text,
            reason=reason,
            stop_string=stop_string,
            stop_token=stop_token,
            prompt_tokens=len(self.prompt),
            generated_tokens=self.generated,
            cached_tokens=self.reused,
            logprobs=entries,
            prompt_logprobs=tuple(self.prompt_entries),
            stop_logprob=stop_entry,
        )


def prefill_chunk(
    weights: llama.LlamaWeights,
    config: llama.LlamaConfig,
    cache: llama.KVCache,
    rope: tuple[Tensor, Tensor],
    device: torch.device,
    job: CpuJob,
    start: int,
    end: int,
    texts: TokenTexts,
) -> Tensor:
    """Run the job's prompt positions ``start`` to ``end`` into its slot; the
    hidden state of the last one (``[1, D]``). A job that asks for its
    prompt's log probabilities gets the entries of these positions' tokens."""
    scored = job.spec.prompt_logprobs is not None
    hidden = llama.forward(
        weights,
        config,
        cache,
        rope,
        torch.tensor([job.prompt[start:end]], device=device),
        torch.arange(start, end, device=device)[None],
        torch.tensor([job.slot], device=device),
        every_position=scored,
    )
    if not scored:
        return hidden
    score_prompt(job, hidden[0], start, end, weights, texts)
    return hidden[:, -1]


def draft_rows(
    decoding: Sequence[CpuJob], draft_tokens: int
) -> list[tuple[tuple[int, ...], CpuJob]]:
    """Each decoding job with its drafts (up to ``draft_tokens`` each, as
    many in all as :func:`~trioserve.engine.cpu.speculative.draft_budget`
    allows, first come first served), the jobs without drafts first: their
    rows' slots stay consecutive (one attention call for them all)."""
    budget = draft_budget(len(decoding), draft_tokens)
    drafted = []
    for job in decoding:
        draft = job.draft(min(draft_tokens, budget))
        budget -= len(draft)
        drafted.append((draft, job))
    return sorted(drafted, key=lambda pair: len(pair[0]) > 0)


def decode_rows(
    weights: llama.LlamaWeights,
    config: llama.LlamaConfig,
    cache: llama.KVCache,
    rope: tuple[Tensor, Tensor],
    device: torch.device,
    drafted: Sequence[tuple[Sequence[int], CpuJob]],
) -> Tensor:
    """Feed each decoding job its pending token, then its drafts, a row each
    (in the job's slot, at its next positions), in one batched forward; the
    rows' hidden states (``[R, D]``). A job's rows attend as decode rows do,
    so each gives the logits that plain decoding would (see
    ``trioserve.engine.cpu.attention._spans``)."""
    fed = [(t, job, i) for draft, job in drafted for i, t in enumerate((job.pending, *draft))]
    return llama.forward(
        weights,
        config,
        cache,
        rope,
        torch.tensor([t for t, _, _ in fed], device=device)[:, None],
        torch.tensor([job.cached + i for _, job, i in fed], device=device)[:, None],
        torch.tensor([job.slot for _, job, _ in fed], device=device),
    )


def score_prompt(
    job: CpuJob,
    hidden: Tensor,
    start: int,
    end: int,
    weights: llama.LlamaWeights,
    texts: TokenTexts,
) -> None:
    """Add to ``job.prompt_entries`` the entries of the prompt tokens that a
    prefill chunk's positions ``start`` to ``end`` (``hidden``: ``[end -
    start, D]``) predict: position p predicts token p + 1, and the prompt's
    last position predicts the first generated token, no prompt token. A few
    rows of exact logits at a time, keeping only the figures asked for."""
    last = min(end, len(job.prompt) - 1)
    top = job.spec.prompt_logprobs or 0
    for first in range(start, last, _SCORED_ROWS):
        stop = min(last, first + _SCORED_ROWS)
        logits = llama.exact_logits(weights, hidden[first - start : stop - start])
        raw = prompt_logprobs(logits, job.prompt[first + 1 : stop + 1], top)
        job.prompt_entries.extend(texts.entry(r) for r in raw)


def text_in_context(tokenizer: Tokenizer, prompt: Sequence[int]) -> str:
    """The text the prompt's last token adds after the ids before it.

    Decoded alone, a token can lose what only its context gives it: a
    SentencePiece-style decoder drops the leading space of the first token it
    sees (``"▁lazy"`` alone is ``"lazy"``, after ``"▁the"`` it is ``" lazy"``).
    The healed token is decoded after the same context the text stream gives
    the generated ids, so that the prefix it drops is the one they produce.
    """
    context = list(prompt[-1 - _HEALING_CONTEXT : -1])
    before = tokenizer.decode(context)
    after = tokenizer.decode([*context, prompt[-1]])
    if context and after.startswith(before):
        return after[len(before) :]
    # The context ends inside a character that the last token completes:
    # there is no clean split, so fall back to the token alone.
    return tokenizer.decode(prompt[-1:])


def spec_problem(spec: GenerationSpec, *, vocab: int, context: int) -> str | None:
    """What makes ``spec`` impossible to run (one lowercase sentence), or
    None. (Whether its job_id is in use is the engine's to check.)"""
    if not spec.prompt_ids:
        return "prompt_ids must not be empty"
    least = 1 if spec.prompt_logprobs is None else 0
    if spec.max_new_tokens < least:
        return f"max_new_tokens must be >= {least}, got {spec.max_new_tokens!r}"
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(spec, name)
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            return f"{name} must be None or in [0, {MAX_TOP_LOGPROBS}], got {value!r}"
    if spec.prompt_logprobs is not None and spec.token_healing:
        return "token_healing cannot be used with prompt_logprobs (it changes the prompt)"
    total = len(spec.prompt_ids) + spec.max_new_tokens
    if total > context:
        return (
            f"prompt tokens plus max_new_tokens must be <= the context length {context},"
            f" got {len(spec.prompt_ids)} + {spec.max_new_tokens} = {total}"
        )
    bad = [i for i in spec.prompt_ids if not 0 <= i < vocab]
    if bad:
        return f"prompt_ids must be in [0, {vocab}), got {bad[0]!r}"
    bad = [i for i in spec.banned_ids if not 0 <= i < vocab]
    if bad:
        return f"banned_ids must be in [0, {vocab}), got {bad[0]!r}"
    if any(not s for s in spec.stop_strings):
        return "stop_strings must not contain an empty string"
    problem = settings_problem(spec.sampling)
    if problem is not None:
        return problem
    if spec.constraint is not None and spec.token_healing:
        return "token_healing cannot be used with a constraint (it would bypass it)"
    bad = [i for i, _ in spec.sampling.logit_bias if i >= vocab]
    if bad:
        return f"logit_bias ids must be in [0, {vocab}), got {bad[0]!r}"
    return None


def start_job(
    spec: GenerationSpec,
    slot: int,
    *,
    tokenizer: Tokenizer,
    vocab: int,
    device: torch.device,
    prefix_cache: PrefixCache,
    texts: TokenTexts,
) -> CpuJob:
    """A new job in ``slot`` for a checked ``spec``: token healing's
    constraint, the penalties' counts, the sampler's rows, and the prefix
    cache's blocks it starts from."""
    prompt = spec.prompt_ids
    allowed: Tensor | None = None
    skip_prefix = ""
    last = prompt[-1]
    if (
        spec.token_healing
        and len(prompt) >= 2
        and last not in tokenizer.special_ids
        and last < tokenizer.vocab_size
    ):
        ids = tokenizer.ids_with_prefix(tokenizer.token_bytes(last))
        allowed = torch.zeros(vocab, dtype=torch.bool, device=device)
        allowed[[i for i in ids if i < vocab]] = True
        prompt = prompt[:-1]
        skip_prefix = text_in_context(tokenizer, spec.prompt_ids)
    banned: Tensor | None = None
    if spec.banned_ids:
        banned = torch.zeros(vocab, dtype=torch.bool, device=device)
        banned[sorted(spec.banned_ids)] = True
    counts = torch.bincount(torch.tensor(prompt), minlength=vocab).to(
        device=device, dtype=torch.int32
    )
    # At least the last prompt token is run: its logits give the first sample.
    # Prompt log probabilities need every position's logits: nothing is reused.
    scored = spec.prompt_logprobs is not None
    restore = [] if scored else prefix_cache.lookup(prompt, len(prompt) - 1)
    reused = sum(int(block.shape[2]) for block in restore)
    stream = TextStream(
        tokenizer.decode, spec.stop_strings, context_ids=prompt, skip_prefix=skip_prefix
    )
    sampling = spec.sampling
    bias = bias_row(sampling.logit_bias, vocab).to(device) if sampling.logit_bias else None
    dry = None
    if sampling.dry:
        # Breakers are token ids, computed from the strings once per job
        # (and cached across jobs that send the same strings).
        breakers = sequence_breaker_ids(tokenizer, sampling.dry_sequence_breakers)
        dry = DryHistory.start(prompt, len(prompt) + spec.max_new_tokens, breakers, vocab)
    return CpuJob(
        matcher=None if spec.constraint is None else JobMatcher.start(spec.constraint),
        spec=spec,
        prompt=prompt,
        slot=slot,
        stream=stream,
        generator=make_generator(sampling.seed, device),
        counts=counts,
        banned=banned,
        allowed=allowed,
        bias=bias,
        dry=dry,
        cached=reused,
        tokens=list(prompt),
        reused=reused,
        restore=restore,
        entries=None if spec.logprobs is None else EntryQueue(),
        prompt_entries=[texts.first(prompt[0])] if scored else [],
    )


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
            index = torch.tensor([starts[row] + depth for row in live], device=logits.device)
            whole = index.numel() == logits.shape[0]  # the usual step: no drafts
            outcomes = sample_jobs(
                [rows[row] for row in live],
                logits if whole else logits.index_select(0, index),
                self.xtc,
                vocab=self.vocab,
                device=self.device,
                masks=self.masks,
                exact=exact if whole else _kept_rows(exact, index),
            )
            live = []
            for job, outcome, raw in outcomes:
                row = row_of[job]
                if depth == 0:
                    order.append(row)
                if isinstance(outcome, str):
                    # A constraint's own failure says so; the sampler's gets its prefix.
                    failure = outcome if outcome.startswith("the constraint") else None
                    taken[row].append(fail(job, failure or f"sampling failed: {outcome}"))
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
    if any(job.banned is not None for job in rows):
        empty = torch.zeros(vocab, dtype=torch.bool, device=device)
        banned = torch.stack([empty if job.banned is None else job.banned for job in rows])
    if any(job.allowed is not None for job in rows):
        full = torch.ones(vocab, dtype=torch.bool, device=device)
        allowed = torch.stack([full if job.allowed is None else job.allowed for job in rows])
    if constrained is not None:
        allowed = constrained if allowed is None else allowed & constrained
    failed: dict[int, str] = {}
    try:
        ids = sample(
            logits,
            [job.spec.sampling for job in rows],
            [job.generator for job in rows],
            counts=torch.stack([job.counts for job in rows]),
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
