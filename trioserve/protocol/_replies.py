"""The protocol's replies as typed messages: what the server sends back for
each action (the codec writes them; :mod:`._semantics` builds the final and
chunk frames of an ``infer``), and :class:`ProtocolError`, the error a
request is answered with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

import attrs

from trioserve.errors import TrioserveError

from ._messages import FIELD_LIMITS, ErrorType, _echoed_field

__all__ = [
    "EchoReply",
    "EosReason",
    "ErrorDetail",
    "ErrorReply",
    "EstimateTokenReply",
    "InferChunk",
    "InferFinal",
    "InfoReply",
    "LefttrimTokenReply",
    "Limits",
    "ModelInfo",
    "ProtocolError",
    "Reply",
    "ServerInfo",
    "Status",
    "StopReason",
    "StopReply",
    "Timing",
    "Usage",
]


# --------------------------------------------------------------------------
# Errors


class ProtocolError(TrioserveError):
    """A frame that cannot be served, with everything needed to answer it.

    Raised by ``decode_request`` for anything a client got wrong, and by the
    server itself for ``overloaded``, ``internal`` and limits that depend on
    the model. It keeps as much of the envelope as could be read (``action``
    and the echoed ids, plus ``tag`` for infer) so that the error frame
    reaches the right request on the client side even when another field was
    bad.
    """

    error_type: ErrorType
    message: str
    field: str | None
    action: str | None
    echoed: Mapping[str, Any]

    def __init__(
        self,
        error_type: ErrorType,
        message: str,
        *,
        field: str | None = None,
        action: str | None = None,
        echoed: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.message = message
        self.field = field
        self.action = action
        self.echoed = {} if echoed is None else echoed

    def reply(self) -> ErrorReply:
        """The error frame that answers the request (protocol section 5)."""
        return ErrorReply(
            action=self.action,
            error=ErrorDetail(type=self.error_type, message=self.message, field=self.field),
            echoed=self.echoed,
        )

    def __repr__(self) -> str:
        return (
            f"ProtocolError({self.error_type!r}, {self.message!r}, field={self.field!r}, "
            f"action={self.action!r}, echoed={self.echoed!r})"
        )


@attrs.frozen
class EchoReply:
    echoed: Mapping[str, Any] = _echoed_field()


@attrs.frozen
class EstimateTokenReply:
    num_tokens: int
    echoed: Mapping[str, Any] = _echoed_field()


@attrs.frozen
class LefttrimTokenReply:
    trimmed_text: str
    echoed: Mapping[str, Any] = _echoed_field()


@attrs.frozen
class InferChunk:
    """New text of a streaming infer. ``response`` (the completion so far) is
    set only when the request asked for ``stream_full``; ``util_text`` (the
    prompt used) is set unless it asked for ``compact_chunks``."""

    chunk: str
    response: str | None = None
    util_text: str | None = None
    #: With the request's ``logprobs``: the entries of the tokens of ``chunk``.
    logprobs: tuple[Mapping[str, Any], ...] | None = None
    echoed: Mapping[str, Any] = _echoed_field()


@attrs.frozen
class Usage:
    prompt_tokens: int
    trimmed_tokens: int
    generated_tokens: int
    #: Prompt tokens the engine took from its prefix cache instead of computing.
    cached_tokens: int = 0


@attrs.frozen
class Timing:
    """Seconds from arrival: until the job reached the engine, until its
    first token (None when it produced none), until its final frame."""

    queued_s: float
    first_token_s: float | None
    total_s: float


StopReason: TypeAlias = Literal["eos", "num_tokens", "interrupted"]
#: ``constraint``: the request's constraint was complete (its value ended).
EosReason: TypeAlias = Literal["stop_token", "stop_string", "constraint"]


@attrs.frozen(kw_only=True)
class InferFinal:
    """The terminal frame of a successful infer (protocol section 3.4).

    ``chunk`` is always ``""``: ExLlamaV2's server sends it, and clients that
    handle the final frame like a chunk frame append it."""

    chunk: str = attrs.field(default="", validator=attrs.validators.in_(("",)))
    response: str
    util_text: str
    stop_reason: StopReason
    eos_reason: EosReason | None
    stop_string: str | None
    stop_token: int | None
    usage: Usage
    timing: Timing
    #: With the request's ``logprobs``: the entries of ``response``'s tokens.
    logprobs: tuple[Mapping[str, Any], ...] | None = None
    #: A thinking chat template's reasoning, apart from ``response`` (an
    #: extension; absent when there is none).
    reasoning: str | None = None
    echoed: Mapping[str, Any] = _echoed_field()


@attrs.frozen
class StopReply:
    stopped: int
    echoed: Mapping[str, Any] = _echoed_field()


@attrs.frozen
class ServerInfo:
    name: str
    version: str


@attrs.frozen
class ModelInfo:
    name: str
    engine: str
    context_length: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    max_batch: int
    batching: bool
    #: The constraint fields this engine enforces (``json_schema``,
    #: ``regex``, ``choice``, ``grammar``); an engine without any answers
    #: ``invalid_request`` to them.
    constraints: tuple[str, ...] = ()
    #: Which kernels run the model (``"native avx2"``, ``"torch (why)"``,
    #: ``"exllamav2 cuda"``), or None where the engine does not say.
    kernels: str | None = None


@attrs.frozen
class Limits:
    """The limits a client meets: the server's own (options), then the
    protocol's per-field limits (the same on every server; their defaults
    come from the field declarations)."""

    max_message_bytes: int
    max_requests_per_connection: int
    max_waiting_jobs: int
    max_new_tokens: int
    max_json_depth: int = FIELD_LIMITS["max_json_depth"]
    max_id_bytes: int = FIELD_LIMITS["max_id_bytes"]
    max_tag_bytes: int = FIELD_LIMITS["max_tag_bytes"]
    max_stop_conditions: int = FIELD_LIMITS["max_stop_conditions"]
    max_stop_string_chars: int = FIELD_LIMITS["max_stop_string_chars"]
    max_banned_ids: int = FIELD_LIMITS["max_banned_ids"]
    max_messages: int = FIELD_LIMITS["max_messages"]
    max_role_chars: int = FIELD_LIMITS["max_role_chars"]
    max_logit_bias: int = FIELD_LIMITS["max_logit_bias"]
    max_dry_sequence_breakers: int = FIELD_LIMITS["max_dry_sequence_breakers"]
    max_dry_sequence_breaker_chars: int = FIELD_LIMITS["max_dry_sequence_breaker_chars"]
    max_schema_bytes: int = FIELD_LIMITS["max_schema_bytes"]
    max_regex_chars: int = FIELD_LIMITS["max_regex_chars"]
    max_grammar_chars: int = FIELD_LIMITS["max_grammar_chars"]
    max_choices: int = FIELD_LIMITS["max_choices"]
    max_choice_chars: int = FIELD_LIMITS["max_choice_chars"]


@attrs.frozen
class Status:
    """What the server holds now, so that a leak is visible from outside."""

    #: Open WebSocket connections.
    connections: int
    #: ``infer`` requests of all connections without their terminal frame yet.
    requests_in_flight: int
    #: Jobs the engine is working on, and jobs waiting for a slot.
    running_jobs: int
    waiting_jobs: int


@attrs.frozen
class ModelEntry:
    """One model of a server that serves several (``--models-dir``): its id,
    where it stands (``unloaded``, ``loading``, ``loaded``, ``unloading``,
    ``sleeping``, ``failed`` with its reason) and its aliases. An ``infer``
    or ``estimate_token`` names it in ``model``."""

    id: str
    status: str
    reason: str | None = None
    aliases: tuple[str, ...] = ()

    @classmethod
    def of(cls, described: Mapping[str, Any]) -> ModelEntry:
        """From ``GET /models``' entry."""
        status = described["status"]
        return cls(
            id=described["id"],
            status=status["value"],
            reason=status.get("reason"),
            aliases=tuple(described.get("aliases", ())),
        )


@attrs.frozen
class InfoReply:
    server: ServerInfo
    #: The model a request that names none is served by.
    model: ModelInfo
    limits: Limits
    status: Status | None = None
    echoed: Mapping[str, Any] = _echoed_field()
    #: A server of several models: every one, by id (absent with one model).
    models: tuple[ModelEntry, ...] | None = None


@attrs.frozen
class ErrorDetail:
    type: ErrorType
    message: str
    field: str | None = None


@attrs.frozen
class ErrorReply:
    """The one error frame of a request that cannot be served. ``action`` is
    None when the frame had no readable action."""

    action: str | None
    error: ErrorDetail
    echoed: Mapping[str, Any] = _echoed_field()


Reply: TypeAlias = (
    EchoReply
    | EstimateTokenReply
    | LefttrimTokenReply
    | InferChunk
    | InferFinal
    | StopReply
    | InfoReply
    | ErrorReply
)
