"""What a trioserve job becomes in ExLlamaV2, and what ExLlamaV2's results become.

Each :class:`~trioserve.engine.base.GenerationSpec` is checked for what
ExLlamaV2 does not check (:func:`refusal`) and turned into the sampler
settings and stop conditions of one ``ExLlamaV2DynamicJob``
(:func:`sampler_fields`, :func:`stop_conditions`); each untyped result dict of
``generator.iterate()`` becomes a typed update at once
(:func:`updates_from_result`), its text decoded from the sampled tokens and
cut at stop strings by the CPU engine's rules (:class:`JobState`). Pure: the
ExLlamaV2 objects are taken duck-typed, and ``exllamav2`` is never imported
here (only :mod:`trioserve.engine.exllamav2.engine` imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias

import attrs

from trioserve.engine.base import GenerationSpec
from trioserve.engine.samplers import (
    DRY_MAX_NGRAM,
    bias_row,
    sequence_breaker_ids,
    xtc_protected_ids,
)
from trioserve.engine.sampling import settings_problem
from trioserve.engine.text import TextStream
from trioserve.engine.tokenizer import Tokenizer
from trioserve.vocabulary.results import Failed, Finished, FinishReason, TextUpdate, Update
from trioserve.vocabulary.sampling import SamplingSettings

__all__ = [
    "Decode",
    "JobState",
    "constrained_update",
    "refusal",
    "sampled_token",
    "sampler_fields",
    "stop_conditions",
    "updates_from_result",
]


def sampler_fields(
    settings: SamplingSettings, tokenizer: Tokenizer, vocab_size: int
) -> dict[str, Any]:
    """The ``ExLlamaV2Sampler.Settings`` attributes for ``settings``.

    Every field the sampler reads is set, also those the protocol cannot
    change, so that a later ExLlamaV2 release that changes a default does not
    change what trioserve computes. Greedy (temperature 0) is asked for
    explicitly as top_k 1 at temperature 1: the C++ sampler would also treat
    a temperature below 0.01 as greedy, but only as a side rule.

    Each trioserve field maps onto the attribute of the same name, but two:
    ``logit_bias`` becomes ``token_bias``, a float32 row of the vocabulary
    padded to a multiple of 32 as ``Settings.disallow_tokens`` makes it (the
    banned ids are added to it afterwards, as -inf, by that method), and the
    strings of ``dry_sequence_breakers`` become the token ids the CPU engine
    uses (:func:`~trioserve.engine.samplers.sequence_breaker_ids`). XTC's
    protected ids are given explicitly too, computed as the CPU engine
    computes them from ``tokenizer`` (trioserve's, over the model's
    tokenizer.json). The seed is set elsewhere: it belongs to the job.
    """
    greedy = settings.greedy
    token_bias = None
    if settings.logit_bias:
        token_bias = bias_row(settings.logit_bias, vocab_size + -vocab_size % 32)
    return {
        "token_repetition_penalty": settings.rep_pen,
        # -1: the penalties look at the whole context, prompt included, as the
        # seed server did.
        "token_repetition_range": -1,
        "token_repetition_decay": 0,
        "token_frequency_penalty": settings.freq_pen,
        "token_presence_penalty": settings.pres_pen,
        "temperature": 1.0 if greedy else settings.temperature,
        "top_k": 1 if greedy else settings.top_k,
        "top_p": settings.top_p,
        "top_a": settings.top_a,
        "min_p": settings.min_p,
        "typical": settings.typical,
        "skew": settings.skew,
        "tfs": 0.0,
        "smoothing_factor": settings.smoothing_factor,
        "min_temp": settings.min_temp,
        "max_temp": settings.max_temp,
        "temp_exponent": settings.temp_exponent,
        "temperature_last": settings.temperature_last,
        "mirostat": settings.mirostat,
        "mirostat_tau": settings.mirostat_tau,
        "mirostat_eta": settings.mirostat_eta,
        # None: the job's first draw starts mu at 2 * tau (sampling.cpp).
        "mirostat_mu": None,
        "token_bias": token_bias,
        "dry_multiplier": settings.dry_multiplier,
        "dry_base": settings.dry_base,
        "dry_allowed_length": settings.dry_allowed_length,
        "dry_range": settings.dry_range,
        "dry_sequence_breakers": set(
            sequence_breaker_ids(tokenizer, settings.dry_sequence_breakers)
        ),
        "dry_max_ngram": DRY_MAX_NGRAM,
        "xtc_probability": settings.xtc_probability,
        "xtc_threshold": settings.xtc_threshold,
        "xtc_ignore_tokens": xtc_protected_ids(tokenizer),
        "cfg_scale": None,
    }


def stop_conditions(spec: GenerationSpec, eos_token_ids: frozenset[int]) -> list[int | str]:
    """The job's ``stop_conditions``: every EOS id of the model, the request's
    stop ids, then its stop strings (not with ``min_tokens``: see below).

    ExLlamaV2's job adds no EOS id itself (dynamic.py, ExLlamaV2DynamicJob
    takes only what it is given), and its config keeps just the first of a
    list of EOS ids, which is why Llama 3 instruct models never stop there
    (turboderp-org/exllamav2#803 on GitHub); the engine passes them all.
    """
    eos = frozenset() if spec.ignore_eos else eos_token_ids
    ids: list[int | str] = sorted(spec.stop_token_ids | eos)
    if spec.sampling.min_tokens:
        # ExLlamaV2 holds back only the stop tokens (min_new_tokens); the
        # job's TextStream finds the stop strings after min_tokens, and a job
        # it ends is cancelled in ExLlamaV2 (updates_from_result).
        return ids
    return ids + list(dict.fromkeys(spec.stop_strings))


def refusal(
    spec: GenerationSpec,
    *,
    context_length: int,
    vocab_size: int,
    page_size: int,
    max_pages: int,
) -> str | None:
    """Why ``spec`` cannot be run, or None when it can.

    ExLlamaV2 checks only that a job fits in the cache pages (with an
    ``assert`` at enqueue, dynamic.py ``prepare_for_queue``); nothing checks a
    job against the model's context length, past which RoPE tables run out.
    """
    n = len(spec.prompt_ids)
    if n == 0:
        return "the prompt is empty: it must have at least one token"
    if spec.logprobs is not None or spec.prompt_logprobs is not None:
        # Its return_top_tokens / return_probs are the final sampling
        # probabilities, not the model's (docs/gpu.md, "Log probabilities").
        return "this engine does not report log probabilities"
    if spec.max_new_tokens < 1:
        return f"max_new_tokens must be at least 1, not {spec.max_new_tokens!r}"
    if n + spec.max_new_tokens > context_length:
        return (
            f"the prompt ({n} tokens) plus max_new_tokens ({spec.max_new_tokens}) exceeds "
            f"the context length ({context_length})"
        )
    # The job reserves pages for its whole length up front (prepare_for_queue:
    # len(sequence_ids) + max_new_tokens, plus one when healing dropped a token).
    pages = -(-(n + spec.max_new_tokens) // page_size)
    if pages > max_pages:
        return (
            f"the job needs {pages * page_size} cache tokens but the cache holds "
            f"{max_pages * page_size}; use a larger cache_size"
        )
    bad = sorted(i for i in spec.banned_ids if not 0 <= i < vocab_size)
    if bad:
        return f"banned ids must be between 0 and {vocab_size - 1}, not {bad!r}"
    bad_stop = sorted(i for i in spec.stop_token_ids if i < 0)
    if bad_stop:
        return f"stop token ids must not be negative, not {bad_stop!r}"
    if any(s == "" for s in spec.stop_strings):
        return "stop strings must not be empty"
    if any(not 0 <= i < vocab_size for i in spec.prompt_ids):
        return f"prompt ids must be between 0 and {vocab_size - 1}"
    if spec.constraint is not None and spec.token_healing:
        # As on the CPU engine: the healed first token is sampled without the
        # job's filters (ExLlamaV2DynamicJob.receive_logits passes filters
        # only once new_tokens >= 0, and receive_sample feeds them only then).
        return "token_healing cannot be used with a constraint (it would bypass it)"
    # The sampler's own guard, as the CPU engine has it: a bad value fails
    # this job here, never a step of ExLlamaV2's batch.
    problem = settings_problem(spec.sampling)
    if problem is not None:
        return problem
    bad = [i for i, _ in spec.sampling.logit_bias if i >= vocab_size]
    if bad:
        return f"logit_bias ids must be between 0 and {vocab_size - 1}, not {bad[0]!r}"
    return None


#: Decodes token ids to text, writing special tokens as their text.
Decode: TypeAlias = Callable[[Sequence[int]], str]


@attrs.define(eq=False)
class JobState:
    """What the engine remembers about one running job between steps."""

    job_id: int
    #: Prompt tokens prefilled (token healing takes the last one off).
    prompt_tokens: int
    #: Token healing is active: the first sampled token replaces the prompt's
    #: last one, and ExLlamaV2 does not count it (``new_tokens`` starts at -1).
    healing: bool
    #: The job's text, decoded from its tokens by the CPU engine's rules.
    stream: TextStream
    #: Tokens sampled so far, the healed token included.
    sampled: int = 0

    @classmethod
    def for_spec(cls, spec: GenerationSpec, decode: Decode) -> JobState:
        # ExLlamaV2DynamicJob heals only when the input has more than one token.
        healing = spec.token_healing and len(spec.prompt_ids) > 1
        prompt = spec.prompt_ids[:-1] if healing else spec.prompt_ids
        return cls(
            job_id=spec.job_id,
            prompt_tokens=len(prompt),
            healing=healing,
            stream=TextStream(
                decode,
                spec.stop_strings,
                context_ids=prompt,
                # The healed token re-generates the removed token's text,
                # which is not emitted again.
                skip_prefix=decode(spec.prompt_ids[-1:]) if healing else "",
                # ExLlamaV2 does not count the healed token in min_new_tokens.
                hold_stops=spec.sampling.min_tokens + (1 if healing else 0),
            ),
        )

    @property
    def generated(self) -> int:
        return self.sampled - (1 if self.healing else 0)


def sampled_token(job: Any) -> int:
    """The token an ``ExLlamaV2DynamicJob`` sampled last.

    ``receive_sample`` appends every sampled token, a stop token too, to each
    of the job's sequences before it decides anything (dynamic.py); the result
    dicts carry token ids only when they release text.
    """
    return int(job.sequences[0].sequence_ids.torch()[0, -1])


def updates_from_result(result: Mapping[str, Any], state: JobState, token: int) -> Update | None:
    """The typed update for one of ``generator.iterate()``'s result dicts.

    ``token`` is the token the job sampled in that step (:func:`sampled_token`).
    Returns None for the ``started`` and ``prefill`` stages, which the
    protocol does not report.

    ExLlamaV2 decides when a job ends at a stop token and at
    ``max_new_tokens`` (its ``eos_reason``); what text is released, what is
    held, and where a stop string cuts it, the engine decides itself from the
    tokens, with the CPU engine's :class:`~trioserve.engine.text.TextStream`
    and rules (``CpuEngine._emit``), so that the same tokens give the same
    text, ``stop_string`` and reason on both engines. ExLlamaV2's own text
    (``text``, ``held``, ``held_text``) is not used, because it departs from
    them in ways that depend on the tokens and even on ``PYTHONHASHSEED``
    (exllamav2/generator/dynamic.py, ``receive_sample``, at 0.3.2):

    * it tests stop strings one by one in the order of a ``set``, cuts at the
      first that occurs anywhere and names the first in that order that the
      rest starts with: with ``(" P", "aris!")`` and the tokens ``" Paris"``,
      ``"!"`` it may release ``" P"`` and name ``"aris!"``; and a string
      matching in part, tested first, holds a whole match of another;
    * it tests the length limit before it repairs held UTF-8, so a flush at
      ``max_new_tokens`` can hold the pieces of a character that the last
      token completed (``"日本���"`` for ``"日本語"``);
    * it writes each token's piece on its own (one U+FFFD per byte-level
      piece) and releases the pieces unrepaired once five U+FFFD are held,
      which invalid bytes followed by a split character reach;
    * at a stop token it keeps the held text (and the stop token's piece) in
      ``held`` instead of releasing it.

    A job that the rules end while ExLlamaV2 would go on (a stop string it
    held, or one it did not see) ends with a :class:`Finished` for a result
    whose ``eos`` is false: the caller cancels it in ExLlamaV2.
    """
    if result.get("stage") != "streaming":
        return None
    state.sampled += 1
    stream = state.stream
    reason = result.get("eos_reason") if result.get("eos", False) else None
    if reason == "stop_token":
        # The stop token's own text is never emitted; held text was not a
        # stop string after all, so it is released.
        stop_token = int(result.get("eos_triggering_token_id", token))
        return _finished(state, result, stream.flush(), "stop_token", stop_token=stop_token)
    if reason not in (None, "max_new_tokens", "stop_string"):
        # "end_filter" comes only from a filter's end tokens on the token-list
        # path (ExLlamaV2Sampler.sample); trioserve's filter takes the mask
        # path, where the sampler reports none.
        return Failed(job_id=state.job_id, message=f"exllamav2 ended the job for {reason!r}")
    piece = stream.push([token])
    if piece.stop_string is not None:
        return _finished(state, result, piece.text, "stop_string", stop_string=piece.stop_string)
    if reason is None:
        return TextUpdate(
            job_id=state.job_id,
            text=piece.text,
            held=stream.held,
            generated_tokens=state.generated,
        )
    # At the limit, or at a stop string ExLlamaV2 matched in its own text but
    # not found in the decoded one (a string with U+FFFD in it): everything
    # held is released, unless it completes a stop string after all.
    text = piece.text + stream.flush()
    if stream.stop_string is not None:
        return _finished(state, result, text, "stop_string", stop_string=stream.stop_string)
    if reason == "stop_string":
        theirs = str(result.get("eos_triggering_string", ""))
        return _finished(state, result, text, "stop_string", stop_string=theirs)
    return _finished(state, result, text, "max_new_tokens")


def constrained_update(
    update: Update, result: Mapping[str, Any], state: JobState, constraint: Constrained
) -> Update:
    """``update`` (from :func:`updates_from_result`) for a job with a
    constraint, by the CPU engine's rules (``CpuJob.accept``): a constraint
    that failed fails the job, before its token's text is released (that
    token was drawn without the grammar's mask); a complete value ends the job
    at once, with reason ``constraint``, even at ``max_new_tokens``, after
    any stop string its text completes. A stop token or a stop string keeps
    its reason. The caller cancels a job this ends in ExLlamaV2.
    """
    problem = constraint.problem
    if problem is not None:
        return Failed(job_id=state.job_id, message=problem, cause="request")
    if not constraint.complete:
        return update
    if isinstance(update, TextUpdate):
        text = update.text + state.stream.flush()
        if state.stream.stop_string is not None:
            # The flushed tail completed a stop string after all.
            stop = state.stream.stop_string
            return _finished(state, result, text, "stop_string", stop_string=stop)
        return _finished(state, result, text, "constraint")
    if isinstance(update, Finished) and update.reason == "max_new_tokens":
        return attrs.evolve(update, reason="constraint")
    return update


class Constrained(Protocol):
    """What :func:`constrained_update` reads of a job's constraint
    (:class:`~trioserve.engine.exllamav2.filter.GrammarMask`)."""

    @property
    def problem(self) -> str | None: ...

    @property
    def complete(self) -> bool: ...


def _finished(
    state: JobState,
    result: Mapping[str, Any],
    text: str,
    reason: FinishReason,
    *,
    stop_string: str | None = None,
    stop_token: int | None = None,
) -> Finished:
    return Finished(
        job_id=state.job_id,
        text=text,
        reason=reason,
        stop_string=stop_string,
        stop_token=stop_token,
        prompt_tokens=state.prompt_tokens,
        # ExLlamaV2's own count (new_tokens); it agrees with state.generated.
        generated_tokens=int(result.get("new_tokens", state.generated)),
        # Whole 256-token pages shared with other jobs (paged mode) plus the
        # tokens of a partly matching page copied from the cache, or in
        # unpaged mode the prefix shared with the previous job (dynamic.py,
        # ExLlamaV2DynamicJob.prefill and emit).
        cached_tokens=int(result.get("cached_tokens", 0)),
    )
