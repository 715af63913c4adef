"""What to generate, whichever door asked (:class:`GenerationRequest`,
declared in the vocabulary, :mod:`trioserve.vocabulary.request`), the
errors a request can get before it runs (:class:`InvalidGeneration`,
:class:`Overloaded`), and the pure steps from a request to an engine job:
:func:`check_request` (the checks that need no tokenizer), :func:`fit_prompt`
and :func:`trim_prompt` (the context), :func:`build_spec` (the job), and
:func:`with_seed_offset` (the seed of one of ``n`` choices). No trio, no I/O:
tested on their own.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import attrs

from trioserve.engine.base import EngineInfo, GenerationSpec
from trioserve.errors import TrioserveError
from trioserve.vocabulary.request import Fit, GenerationRequest

if TYPE_CHECKING:  # llguidance and torch load with the engine, not with this module
    from trioserve.engine.grammars import CompiledGrammar

__all__ = [
    "Fit",
    "GenerationRequest",
    "InvalidGeneration",
    "Overloaded",
    "admit_client",
    "build_spec",
    "check_request",
    "continued_prompt",
    "fit_prompt",
    "tail_chars",
    "trim_prompt",
    "with_seed_offset",
]


class InvalidGeneration(TrioserveError):
    """The request cannot run on this model; a client's mistake.

    ``field`` is the request's field by its neutral name (``prompt``,
    ``messages``, ``max_new_tokens``, ``stop_token_ids``, ``banned_ids``,
    ``logit_bias``, ``constraint``); ``index`` the element of a list field;
    each door names it in its own wire terms. ``code`` is a machine-readable
    reason where one helps a client (``context_length_exceeded``,
    ``no_chat_template``, ``chat_template_error``). ``wire_name`` is the field
    as the client wrote it, when the request knows it (a constraint's).
    """

    def __init__(
        self,
        message: str,
        field: str,
        *,
        index: int | None = None,
        code: str | None = None,
        wire_name: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.index = index
        self.code = code
        self.wire_name = wire_name


class Overloaded(TrioserveError):
    """No room for the job now (queue full, the client's limit, or the server
    is shutting down); the client may retry."""

    def __init__(self, message: str, *, draining: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.draining = draining


def admit_client(
    in_flight: collections.Counter[Hashable], client: Hashable, n: int, limit: int
) -> None:
    """Raise :class:`Overloaded` unless ``client``, holding ``in_flight``'s
    count, may start ``n`` more generations under ``limit``."""
    held = in_flight[client]
    if held + n > limit:
        asks = "" if n == 1 else f" and this request asks for {n} choices"
        raise Overloaded(
            f"this client already has {held} requests in flight{asks} (the limit is "
            f"{limit}); wait for one to finish"
        )


# --------------------------------------------------------------------------
# The pure part


def check_request(
    request: GenerationRequest,
    info: EngineInfo,
    *,
    max_new_tokens: int,
    renders_messages: bool,
) -> None:
    """The checks that depend on the model and need no tokenizer (protocol
    section 3.4): ``max_new_tokens`` within the server's cap (and at least
    ``min_tokens``), token ids within the vocabulary, ``messages`` only where
    the model has a chat template.
    Raises :class:`InvalidGeneration`."""
    if request.max_new_tokens is not None and request.max_new_tokens > max_new_tokens:
        raise InvalidGeneration(
            f"max_new_tokens must be at most {max_new_tokens} for this model (context length "
            f"{info.context_length}), got {request.max_new_tokens!r}",
            "max_new_tokens",
        )
    vocab = info.vocab_size
    for field, ids, what in (
        ("prompt", request.prompt_ids or (), "prompt token ids"),
        ("stop_token_ids", request.stop_token_ids, "stop token ids"),
        ("banned_ids", request.banned_ids, "banned token ids"),
    ):
        for index, token in enumerate(ids):
            if not 0 <= token < vocab:
                raise InvalidGeneration(
                    f"{what} must be in 0..{vocab - 1}, got {token!r}", field, index=index
                )
    for index, (token, _) in enumerate(request.sampling.logit_bias):
        if not 0 <= token < vocab:
            raise InvalidGeneration(
                f"logit_bias keys must be token ids in 0..{vocab - 1}, got {str(token)!r}",
                "logit_bias",
                index=index,
            )
    if (request.logprobs, request.prompt_logprobs) != (None, None) and not info.logprobs:
        raise InvalidGeneration(
            f"the {info.engine} engine does not report log probabilities",
            "logprobs",
            code="unsupported_parameter",
        )
    least = request.sampling.min_tokens
    if request.max_new_tokens is not None and least > request.max_new_tokens:
        raise InvalidGeneration(
            f"min_tokens must be at most the request's limit on new tokens"
            f" ({request.max_new_tokens}), got {least}",
            "min_tokens",
        )
    if request.max_new_tokens == 0 and request.prompt_logprobs is None:
        raise InvalidGeneration(
            "max_new_tokens may be 0 only to score the prompt (with its log probabilities)",
            "max_new_tokens",
        )
    if request.messages is not None and not renders_messages:
        raise InvalidGeneration(
            "this model has no chat template to render messages with: send the prompt as text",
            "messages",
            code="no_chat_template",
        )
    constraint = request.constraint
    if constraint is not None:
        if constraint.kind not in info.constraints:
            supported = ", ".join(info.constraints) or "none"
            raise InvalidGeneration(
                f"the {info.engine} engine does not enforce {constraint.kind} constraints"
                f" (it enforces: {supported})",
                "constraint",
                wire_name=constraint.field,
            )
        if request.token_healing:
            raise InvalidGeneration(
                "token_healing cannot be used with a constraint: it would let the first token"
                " bypass it",
                "token_healing",
            )
    tools = request.tools
    if tools is not None and tools.calls_allowed:
        if "grammar" not in info.constraints:
            raise InvalidGeneration(
                f"the {info.engine} engine cannot constrain tool calls (it enforces no grammars)",
                "tools",
            )
        if request.token_healing:
            raise InvalidGeneration(
                "token_healing cannot be used with tools: it would let the first token bypass"
                " the calls' grammar",
                "token_healing",
            )


def trim_prompt(ids: Sequence[int], keep: int, *, keep_first: bool) -> list[int]:
    """The last ``keep`` ids of ``ids``; with ``keep_first``, the first id stays
    in front (the ``customBos`` rule of protocol.md 3.4)."""
    if len(ids) <= keep:
        return list(ids)
    if keep_first:
        return [ids[0], *ids[len(ids) - (keep - 1) :]] if keep > 1 else [ids[0]]
    return list(ids[len(ids) - keep :])


def fit_prompt(
    request: GenerationRequest, ids: Sequence[int], info: EngineInfo, *, max_new_tokens: int
) -> tuple[list[int], int]:
    """``ids`` fitted to the context for ``request``: the prompt ids (trimmed
    when the request says so) and the job's ``max_new_tokens`` (the request's,
    or what the context leaves up to the server's cap ``max_new_tokens``).
    Raises :class:`InvalidGeneration` for an empty prompt, or one that does
    not fit and may not be trimmed."""
    field = request.prompt_field
    if not ids:
        raise InvalidGeneration("the prompt must encode to at least one token", field)
    context = info.context_length
    if request.max_new_tokens is None:
        room = context - len(ids)
        if room < 1 and request.fit == "refuse":
            raise InvalidGeneration(
                f"this model's maximum context length is {context} tokens, and the prompt has "
                f"{len(ids)}: no room is left to generate",
                field,
                code="context_length_exceeded",
            )
        cap = max_new_tokens
        if request.default_max_new_tokens is not None:
            # The door's default gives way to min_tokens; the server's cap does not.
            default = max(request.default_max_new_tokens, request.sampling.min_tokens)
            cap = min(cap, default)
        new = max(1, min(cap, room))
    else:
        new = request.max_new_tokens
    keep = context - new
    if len(ids) <= keep:
        return list(ids), new
    if request.fit == "refuse":
        raise InvalidGeneration(
            f"this model's maximum context length is {context} tokens; the prompt has "
            f"{len(ids)} and max_new_tokens asks for {new}: reduce one of them",
            "max_new_tokens" if request.max_new_tokens is not None else field,
            code="context_length_exceeded",
        )
    return trim_prompt(ids, keep, keep_first=bool(request.custom_bos)), new


#: The largest seed a request may give (:class:`SamplingSettings`' bound).
_MAX_SEED: int = 2**64 - 1


def with_seed_offset(request: GenerationRequest, offset: int) -> GenerationRequest:
    """``request`` with its seed moved on by ``offset`` (wrapping within the
    seed's range), so that the choices of one seeded request each draw
    their own reproducible stream; unchanged when it has no seed."""
    seed = request.sampling.seed
    if seed is None:
        return request
    moved = seed + offset
    if moved > _MAX_SEED:
        moved -= _MAX_SEED + 1
    return attrs.evolve(request, sampling=attrs.evolve(request.sampling, seed=moved))


def tail_chars(info: EngineInfo, keep: int) -> int | None:
    """How many characters at the end of a prompt can matter when it is
    trimmed to ``keep`` tokens, or None when the engine cannot say.

    One token covers at most ``max_token_chars`` characters, so the last
    ``keep`` tokens of a text lie within its last ``keep * max_token_chars``
    characters. A margin of 64 tokens more keeps the tokens near the cut
    (where tokenizing the tail alone may split a word differently) out of
    the kept part.
    """
    if info.max_token_chars is None:
        return None
    return (keep + 64) * max(1, info.max_token_chars)


def build_spec(
    job_id: int,
    request: GenerationRequest,
    prompt_ids: Sequence[int],
    info: EngineInfo,
    *,
    max_new_tokens: int,
    constraint: CompiledGrammar | None = None,
    share_prompt: bool = False,
    kept_special: frozenset[str] = frozenset(),
) -> GenerationSpec:
    """The engine's job for ``request`` with its fitted prompt ids and
    ``max_new_tokens`` (:func:`fit_prompt`), and its constraint compiled;
    ``share_prompt`` when other choices of the request will follow it;
    ``kept_special``: the markers the reply is parsed by, written even where
    special tokens are skipped."""
    eos = frozenset() if request.ignore_eos else frozenset(info.eos_token_ids)
    return GenerationSpec(
        job_id=job_id,
        prompt_ids=tuple(prompt_ids),
        max_new_tokens=max_new_tokens,
        sampling=request.sampling,
        stop_token_ids=eos | frozenset(request.stop_token_ids),
        stop_strings=request.stop_strings,
        banned_ids=frozenset(request.banned_ids),
        token_healing=request.token_healing,
        constraint=constraint,
        logprobs=request.logprobs,
        prompt_logprobs=request.prompt_logprobs,
        share_prompt=share_prompt,
        ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
        kept_special=kept_special | frozenset(request.stop_strings)
        if request.skip_special_tokens
        else frozenset(),
        include_stop_str=request.include_stop_str,
    )


def continued_prompt(closed: str, prefix: str) -> str | None:
    """The prompt that continues a final assistant message ``prefix``: the
    chat rendered with it as the last turn, cut where its text ends (its
    end-of-turn dropped), as transformers' ``continue_final_message`` does,
    so that the message stands where the template puts an assistant's words
    (after an empty thinking section, for Qwen3's). None when the template
    did not write the text as it was (then it follows the generation prompt)."""
    where = closed.rfind(prefix)
    if where < 0:
        return None
    return closed[: where + len(prefix)]
