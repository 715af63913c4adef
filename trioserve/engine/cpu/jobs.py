"""The CPU engine's jobs: what each running job holds, how a spec is checked
and turned into one, and the rows a job feeds to a step (prefill chunks,
decode and draft rows, prompt scoring). How a step's rows are sampled is in
:mod:`trioserve.engine.cpu.step`.

:class:`~trioserve.engine.cpu.engine.CpuEngine` owns the slots and the KV cache;
everything here works on one job, and touches neither.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import torch
from torch import Tensor

from trioserve.engine.base import GenerationSpec
from trioserve.engine.cpu import llama
from trioserve.engine.cpu.logprobs import (
    EntryQueue,
    TokenTexts,
    prompt_logprobs,
)
from trioserve.engine.cpu.plan import JobState
from trioserve.engine.cpu.prefix import PrefixCache
from trioserve.engine.cpu.speculative import NgramIndex, draft_budget
from trioserve.engine.grammars import JobMatcher
from trioserve.engine.samplers import (
    DryHistory,
    bias_row,
    sequence_breaker_ids,
)
from trioserve.engine.sampling import (
    RowState,
    make_generator,
    settings_problem,
)
from trioserve.engine.text import TextStream
from trioserve.engine.tokenizer import Tokenizer
from trioserve.vocabulary.results import (
    MAX_TOP_LOGPROBS,
    Finished,
    FinishReason,
    TextUpdate,
    TokenLogprob,
)

__all__ = [
    "CpuJob",
    "decode_rows",
    "draft_rows",
    "prefill_chunk",
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
    #: ``banned`` and the stop ids, while ``min_tokens`` holds the stops
    #: back (None without ``min_tokens``). [V] bool
    held: Tensor | None
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
    #: Special ids whose text the job leaves out (``skip_special_tokens``):
    #: their entries carry no text either.
    skipped: frozenset[int] = frozenset()
    #: With ``ignore_eos``: the model's EOS ids, which end neither the job
    #: nor its constraint's free text.
    skipped_ends: frozenset[int] = frozenset()
    #: Characters of text released so far.
    released: int = 0
    #: With ``spec.prompt_logprobs``: the prompt's entries computed so far.
    prompt_entries: list[TokenLogprob] = attrs.field(factory=list)
    #: Where the context's n-grams last ended, once the job drafts.
    lookup: NgramIndex | None = None
    #: Drafts to feed at the next step that finds some, at most (see
    #: :meth:`drafts_taken`); None: as many as the engine allows.
    draft_limit: int | None = None

    @property
    def new_tokens(self) -> int:
        """Tokens generated, the healed one (token healing's) not counted."""
        return self.generated - (len(self.spec.prompt_ids) - len(self.prompt))

    @property
    def banned_now(self) -> Tensor | None:
        """The ids the next sample may not take: the stop ids too while
        fewer than ``min_tokens`` tokens are generated."""
        if self.held is not None and self.new_tokens < self.spec.sampling.min_tokens:
            return self.held
        return self.banned

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
        ends = self.spec.stop_token_ids
        if matcher is not None and token not in ends and token not in self.skipped_ends:
            # A stop token ends the job whatever the matcher says; it allowed
            # one only in an accepting state. With ignore_eos the model's EOS
            # is neither: the matcher does not take it for its end either.
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
            if token in self.skipped:
                entry = attrs.evolve(entry, text="", bytes=b"")
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
            # With include_stop_str the stop string is part of the reply: its
            # tokens' entries go with it.
            cut = reason == "stop_string" and not self.spec.include_stop_str
            entries = self.entries.cut(self.released) if cut else self.entries.flush()
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
    held: Tensor | None = None
    if spec.sampling.min_tokens:
        held = torch.zeros(vocab, dtype=torch.bool, device=device) if banned is None else banned
        held = held.clone()
        held[sorted(i for i in spec.stop_token_ids if i < vocab)] = True
    counts = torch.bincount(torch.tensor(prompt), minlength=vocab).to(
        device=device, dtype=torch.int32
    )
    # At least the last prompt token is run: its logits give the first sample.
    # Prompt log probabilities need every position's logits: nothing is reused.
    scored = spec.prompt_logprobs is not None
    restore = [] if scored else prefix_cache.lookup(prompt, len(prompt) - 1)
    reused = sum(int(block.shape[2]) for block in restore)
    skipped = (
        tokenizer.skipped_special(spec.kept_special) if spec.skip_special_tokens else frozenset()
    )
    stream = TextStream(
        tokenizer.decoder(skipped),
        spec.stop_strings,
        context_ids=prompt,
        skip_prefix=skip_prefix,
        # The healed token is pushed first and is not one of min_tokens.
        hold_stops=spec.sampling.min_tokens + len(spec.prompt_ids) - len(prompt),
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
        held=held,
        allowed=allowed,
        bias=bias,
        dry=dry,
        cached=reused,
        tokens=list(prompt),
        reused=reused,
        restore=restore,
        entries=None if spec.logprobs is None else EntryQueue(),
        prompt_entries=[texts.first(prompt[0])] if scored else [],
        skipped=skipped,
        skipped_ends=tokenizer.eos_token_ids if spec.ignore_eos else frozenset(),
    )
