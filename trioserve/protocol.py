"""The wire protocol: frames in, typed messages out, and back. No I/O.

This module is the whole of ``docs/protocol.md`` sections 2, 3 and 5 as code.
The server hands every text frame to :func:`decode_request` and gets either a
typed request or a :class:`ProtocolError` that already knows its answer
(:meth:`ProtocolError.reply`); it turns every typed reply into a frame with
:func:`encode_reply`. The client does the reverse with :func:`encode_request`
and :func:`decode_reply`. Nothing here knows trio or torch, so the codec can
be tested and fuzzed alone.

Validation is strict on purpose: the seed server coerced what it could and
dropped the request silently when it could not, so a misspelt or ill-typed
field was a request that never got an answer. Here every such frame gets one
``invalid_request`` error that names the field (``$.top_k``) and says what is
allowed.

All structuring goes through one configured ``cattrs`` converter whose
per-field hooks and ``make_dict_structure_fn`` functions are built once at
import, because the server decodes every frame with it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, TypeAlias, TypeVar, cast

import attrs
import cattrs
from cattrs.errors import ClassValidationError, IterableValidationError, IterableValidationNote
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from trioserve.engine.base import SamplingSettings
from trioserve.errors import TrioserveError

__all__ = [
    "ACTIONS",
    "ERROR_TYPES",
    "INFER_DEFAULTS",
    "EchoReply",
    "EchoRequest",
    "ErrorDetail",
    "ErrorReply",
    "ErrorType",
    "EstimateTokenReply",
    "EstimateTokenRequest",
    "InferChunk",
    "InferFinal",
    "InferRequest",
    "InfoReply",
    "InfoRequest",
    "LefttrimTokenReply",
    "LefttrimTokenRequest",
    "Limits",
    "ModelInfo",
    "ProtocolError",
    "Reply",
    "Request",
    "ServerInfo",
    "StopReply",
    "StopRequest",
    "Timing",
    "Usage",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
    "json_equal",
    "structure_reply",
    "structure_request",
    "unstructure_reply",
    "unstructure_request",
]

#: The six actions, in the order the protocol document lists them.
ACTIONS: Final[tuple[str, ...]] = (
    "echo",
    "estimate_token",
    "lefttrim_token",
    "infer",
    "stop",
    "info",
)

ErrorType: TypeAlias = Literal[
    "invalid_json", "invalid_request", "unknown_action", "overloaded", "internal"
]

#: Every ``error.type`` an error frame may carry (protocol section 5).
ERROR_TYPES: Final[tuple[ErrorType, ...]] = (
    "invalid_json",
    "invalid_request",
    "unknown_action",
    "overloaded",
    "internal",
)

# Keys copied from a request into every frame answering it. ``tag`` belongs to
# infer only: the seed echoed it there and nowhere else.
_ID_KEYS: Final = ("request_id", "response_id")
_INFER_ID_KEYS: Final = ("request_id", "response_id", "tag")

# The payload key under which decoding hands the echoed ids to the generated
# structure functions. It is never a wire field of any action, so a frame that
# carries it is rejected as an unknown key before structuring.
_ECHOED: Final = "echoed"

# How far a 64-bit seed may go: torch accepts seeds in this range.
_SEED_MIN: Final = -(2**63)
_SEED_MAX: Final = 2**64 - 1


def _echoed_field() -> Any:
    # Echoed ids may hold lists and objects, which do not hash; equality still
    # compares them.
    return attrs.field(factory=dict, hash=False)


# --------------------------------------------------------------------------
# Errors


class ProtocolError(TrioserveError):
    """A frame that cannot be served, with everything needed to answer it.

    Raised by :func:`decode_request` for anything a client got wrong, and by
    the server itself for ``overloaded``, ``internal`` and limits that depend
    on the model. It keeps as much of the envelope as could be read
    (``action`` and the echoed ids, plus ``tag`` for infer) so that the error
    frame reaches the right request on the client side even when another
    field was bad.
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


# --------------------------------------------------------------------------
# Requests


@attrs.frozen
class EchoRequest:
    """``echo``: a ping / health check."""

    echoed: Mapping[str, Any] = _echoed_field()


@attrs.frozen
class EstimateTokenRequest:
    """``estimate_token``: how many tokens ``text`` encodes to."""

    text: str
    echoed: Mapping[str, Any] = _echoed_field()


@attrs.frozen
class LefttrimTokenRequest:
    """``lefttrim_token``: the last ``trimmed_length`` tokens of ``text``."""

    text: str
    trimmed_length: int
    echoed: Mapping[str, Any] = _echoed_field()


@attrs.frozen
class InferRequest:
    """``infer``: generate a completion of ``text``.

    Field names are the wire names except ``custom_bos`` (wire ``customBos``).
    ``echoed`` holds ``request_id``, ``response_id`` and ``tag`` as the client
    sent them.
    """

    text: str
    max_new_tokens: int
    stream: bool = False
    stream_full: bool = False
    top_k: int = 100
    top_p: float = 0.8
    top_a: float = 0.0
    min_p: float = 0.0
    typical: float = 0.0
    temperature: float = 0.9
    skew: float = 0.0
    rep_pen: float = 1.05
    freq_pen: float = 0.0
    pres_pen: float = 0.0
    custom_bos: str = ""
    stop_conditions: tuple[str | int, ...] = ()
    bann_bann: tuple[int, ...] = ()
    token_healing: bool = False
    seed: int | None = None
    echoed: Mapping[str, Any] = _echoed_field()

    @property
    def request_id(self) -> tuple[bool, Any]:
        """``(present, value)`` of the client's ``request_id``; what a scoped
        ``stop`` compares its ``target`` with."""
        return ("request_id" in self.echoed, self.echoed.get("request_id"))

    def matches_stop(self, stop: StopRequest) -> bool:
        """Whether ``stop`` targets this request (protocol section 3.5).

        A stop without ``target`` matches every request; with one, only
        requests whose ``request_id`` equals it as JSON values (``true`` is not
        ``1``, ``1`` is ``1.0``).
        """
        if not stop.has_target:
            return True
        present, value = self.request_id
        return present and json_equal(value, stop.target)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The string entries of ``stop_conditions``, in order."""
        return tuple(c for c in self.stop_conditions if isinstance(c, str))

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The int entries of ``stop_conditions`` (the model's EOS ids are
        added by the server, not here)."""
        return frozenset(c for c in self.stop_conditions if isinstance(c, int))

    def sampling_settings(self) -> SamplingSettings:
        """The sampler part of the request, for the engine."""
        return SamplingSettings(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            top_a=self.top_a,
            min_p=self.min_p,
            typical=self.typical,
            skew=self.skew,
            rep_pen=self.rep_pen,
            freq_pen=self.freq_pen,
            pres_pen=self.pres_pen,
            seed=self.seed,
        )


@attrs.frozen
class StopRequest:
    """``stop``: interrupt this connection's infers, all or those whose
    ``request_id`` equals ``target``. ``has_target`` tells an absent target
    from an explicit ``null`` one."""

    has_target: bool = False
    target: Any = attrs.field(default=None, hash=False)
    echoed: Mapping[str, Any] = _echoed_field()


@attrs.frozen
class InfoRequest:
    """``info``: what server, model and limits answer this connection."""

    echoed: Mapping[str, Any] = _echoed_field()


Request: TypeAlias = (
    EchoRequest
    | EstimateTokenRequest
    | LefttrimTokenRequest
    | InferRequest
    | StopRequest
    | InfoRequest
)

#: Wire name -> default of every optional infer field (``seed`` absent).
INFER_DEFAULTS: Final[Mapping[str, Any]] = {
    ("customBos" if a.name == "custom_bos" else a.name): a.default
    for a in attrs.fields(InferRequest)
    if a.default is not attrs.NOTHING and a.name not in ("seed", _ECHOED)
}


# --------------------------------------------------------------------------
# Replies


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
    """New text of a streaming infer; ``response`` (the completion so far) is
    set only when the request asked for ``stream_full``."""

    chunk: str
    response: str | None = None
    echoed: Mapping[str, Any] = _echoed_field()


@attrs.frozen
class Usage:
    prompt_tokens: int
    trimmed_tokens: int
    generated_tokens: int


@attrs.frozen
class Timing:
    """Seconds from arrival: until the job reached the engine, until its
    first token (None when it produced none), until its final frame."""

    queued_s: float
    first_token_s: float | None
    total_s: float


StopReason: TypeAlias = Literal["eos", "num_tokens", "interrupted"]
EosReason: TypeAlias = Literal["stop_token", "stop_string"]


@attrs.frozen
class InferFinal:
    """The terminal frame of a successful infer (protocol section 3.4)."""

    response: str
    util_text: str
    stop_reason: StopReason
    eos_reason: EosReason | None
    stop_string: str | None
    stop_token: int | None
    usage: Usage
    timing: Timing
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


@attrs.frozen
class Limits:
    max_message_bytes: int
    max_requests_per_connection: int
    max_waiting_jobs: int
    max_new_tokens: int


@attrs.frozen
class InfoReply:
    server: ServerInfo
    model: ModelInfo
    limits: Limits
    echoed: Mapping[str, Any] = _echoed_field()


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


# --------------------------------------------------------------------------
# JSON helpers


def json_equal(a: Any, b: Any) -> bool:
    """Equality of two decoded JSON values as JSON sees them.

    Python's ``==`` says ``True == 1``; JSON does not, and a ``stop`` target
    ``true`` must not hit the request ``1``. Numbers compare by value
    (``1`` equals ``1.0``).
    """
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


def _show(value: Any) -> str:
    """``repr`` of a bad value, cut short: a client's 8 MiB string must not
    come back in an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


def _key_path(key: str) -> str:
    return f"$.{key}" if key.isidentifier() else f"$[{json.dumps(key, ensure_ascii=False)}]"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a json value")


def _finite_float(text: str) -> float:
    # "1e999" is valid JSON syntax but reads as infinity, which no frame
    # may carry back (an echoed id would come out as the non-JSON "Infinity").
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"number {_show(text)} is too large")
    return number


_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def _has_lone_surrogate(obj: Any) -> bool:
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _parse_frame(frame: str | bytes) -> Any:
    """Parse one text frame as strict JSON (no NaN, no Infinity, valid
    Unicode), or raise an ``invalid_json`` ProtocolError."""
    if not isinstance(frame, str):
        raise ProtocolError(
            "invalid_json", "binary frames are not accepted: send one json object in a text frame"
        )
    # Lone UTF-16 surrogates (raw, or escaped as "\udXXX") are valid JSON
    # syntax but not Unicode: no tokenizer takes them and no frame carrying
    # them can be sent back, so they are refused here, once.
    if not frame.isascii():
        try:
            frame.encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError(
                "invalid_json", "frame is not valid unicode (it holds a lone surrogate)"
            ) from None
    try:
        obj = _DECODER.decode(frame)
    except json.JSONDecodeError as exc:
        raise ProtocolError(
            "invalid_json",
            f"frame is not valid json: {exc.msg[:1].lower()}{exc.msg[1:]}"
            f" at line {exc.lineno} column {exc.colno}",
        ) from None
    except ValueError as exc:  # NaN, Infinity, 1e999, or an integer too long to read
        raise ProtocolError("invalid_json", f"frame is not valid json: {exc}") from None
    except RecursionError:
        raise ProtocolError("invalid_json", "frame is not valid json: nested too deeply") from None
    if ("\\ud" in frame or "\\uD" in frame) and _has_lone_surrogate(obj):
        raise ProtocolError(
            "invalid_json", "frame is not valid unicode (it holds a lone surrogate escape)"
        )
    return obj


# --------------------------------------------------------------------------
# Field rules: one structure hook per request field, each knowing its range.


class _BadValue(ValueError):
    """A field value broke its rule; the message lacks only the field name."""


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            return None
    return None


_T = TypeVar("_T")
_Hook: TypeAlias = Callable[[Any, Any], Any]


@attrs.frozen
class _Rule:
    """How one request field is read: its hook and what it allows, in words."""

    allowed: str
    hook: _Hook


def _int_rule(lo: int | None = None, hi: int | None = None) -> _Rule:
    if lo is not None and hi is not None:
        allowed = f"an integer from {lo} to {hi}"
    elif lo is not None:
        allowed = f"an integer >= {lo}"
    else:
        allowed = "an integer"

    def hook(value: Any, _: Any) -> int:
        number = _as_int(value)
        if number is None or (lo is not None and number < lo) or (hi is not None and number > hi):
            raise _BadValue(f"must be {allowed}, got {_show(value)}")
        return number

    return _Rule(allowed, hook)


def _float_rule(
    lo: float | None = None, hi: float | None = None, *, lo_open: bool = False
) -> _Rule:
    if lo is not None and hi is not None:
        allowed = f"a number in [{lo:g}, {hi:g}]"
    elif lo is not None:
        allowed = f"a number {'>' if lo_open else '>='} {lo:g}"
    else:
        allowed = "a finite number"

    def hook(value: Any, _: Any) -> float:
        number = _as_float(value)
        if (
            number is None
            or (lo is not None and (number <= lo if lo_open else number < lo))
            or (hi is not None and number > hi)
        ):
            raise _BadValue(f"must be {allowed}, got {_show(value)}")
        return number

    return _Rule(allowed, hook)


def _str_hook(value: Any, _: Any) -> str:
    if not isinstance(value, str):
        raise _BadValue(f"must be a string, got {_show(value)}")
    return value


def _bool_hook(value: Any, _: Any) -> bool:
    if not isinstance(value, bool):
        raise _BadValue(f"must be true or false, got {_show(value)}")
    return value


def _passthrough(value: Any, _: Any) -> Any:
    return value


def _elements(
    value: Any, item: Callable[[Any], _T | None], allowed_item: str, allowed: str
) -> tuple[_T, ...]:
    """A list of items, or one item standing for a list of one (the seed
    accepted both for ``stop_conditions`` and ``bann_bann``)."""
    if not isinstance(value, list):
        single = item(value)
        if single is None:
            raise _BadValue(f"must be {allowed}, got {_show(value)}")
        return (single,)
    out: list[_T] = []
    for index, element in enumerate(value):
        checked = item(element)
        if checked is None:
            error = _BadValue(f"must be {allowed_item}, got {_show(element)}")
            error.__notes__ = [IterableValidationNote(f"@ index {index}", index, object)]
            raise IterableValidationError(f"invalid element {index}", [error], tuple)
        out.append(checked)
    return tuple(out)


def _stop_item(value: Any) -> str | int | None:
    if isinstance(value, str):
        return value if value else None
    return _as_int(value)


_STOP_ITEM_ALLOWED: Final = "a non-empty string or an integer"
_STOP_ALLOWED: Final = "a non-empty string, an integer, or a list of them"
_BANN_ALLOWED: Final = "an integer or a list of integers"


def _stop_conditions_hook(value: Any, _: Any) -> tuple[str | int, ...]:
    return _elements(value, _stop_item, _STOP_ITEM_ALLOWED, _STOP_ALLOWED)


def _bann_bann_hook(value: Any, _: Any) -> tuple[int, ...]:
    return _elements(value, _as_int, "an integer", _BANN_ALLOWED)


_STR = _Rule("a string", _str_hook)
_BOOL = _Rule("true or false", _bool_hook)
_UNIT = _float_rule(0.0, 1.0)
_NON_NEGATIVE = _float_rule(0.0)

#: attribute name -> rule, for every field of every action (wire names are the
#: attribute names except ``customBos``).
_INFER_RULES: Final[dict[str, _Rule]] = {
    "text": _STR,
    "max_new_tokens": _int_rule(1),
    "stream": _BOOL,
    "stream_full": _BOOL,
    "top_k": _int_rule(0),
    "top_p": _UNIT,
    "top_a": _NON_NEGATIVE,
    "min_p": _UNIT,
    "typical": _UNIT,
    "temperature": _NON_NEGATIVE,
    "skew": _float_rule(),
    "rep_pen": _float_rule(0.0, lo_open=True),
    "freq_pen": _float_rule(),
    "pres_pen": _float_rule(),
    "custom_bos": _STR,
    "stop_conditions": _Rule(_STOP_ALLOWED, _stop_conditions_hook),
    "bann_bann": _Rule(_BANN_ALLOWED, _bann_bann_hook),
    "token_healing": _BOOL,
    "seed": _int_rule(_SEED_MIN, _SEED_MAX),
}

_WIRE_NAMES: Final[Mapping[str, str]] = {"custom_bos": "customBos"}
_ATTR_NAMES: Final[Mapping[str, str]] = {v: k for k, v in _WIRE_NAMES.items()}


# --------------------------------------------------------------------------
# The converter


def _strict_int(value: Any, _: Any) -> int:
    number = _as_int(value)
    if number is None:
        raise _BadValue(f"must be an integer, got {_show(value)}")
    return number


def _strict_float(value: Any, _: Any) -> float:
    number = _as_float(value)
    if number is None:
        raise _BadValue(f"must be a finite number, got {_show(value)}")
    return number


def _unstructure_tuple(value: tuple[Any, ...]) -> list[Any]:
    return list(value)


#: The one converter of the protocol. ``forbid_extra_keys`` is a second line of
#: defence behind the explicit unknown-key check (which names the key), and
#: detailed validation gives ``transform_error`` the ``$.field`` paths.
_converter: Final = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
_converter.register_structure_hook(int, _strict_int)
_converter.register_structure_hook(float, _strict_float)
_converter.register_structure_hook(str, _str_hook)
_converter.register_structure_hook(bool, _bool_hook)
_converter.register_unstructure_hook(tuple, _unstructure_tuple)


@attrs.frozen
class _ActionSpec:
    """How one action's request frames are read."""

    cls: type[Any]
    #: Envelope keys copied into ``echoed``.
    id_keys: tuple[str, ...]
    #: Wire name -> rule of every field the action takes.
    fields: Mapping[str, _Rule]
    required: tuple[str, ...]
    structure: Callable[[dict[str, Any]], Any]


def _make_spec(
    cls: type[Any], rules: Mapping[str, _Rule], id_keys: tuple[str, ...] = _ID_KEYS
) -> _ActionSpec:
    overrides: dict[str, Any] = {
        name: override(rename=_WIRE_NAMES.get(name), struct_hook=rule.hook)
        for name, rule in rules.items()
    }
    fn = make_dict_structure_fn(
        cls, _converter, **overrides, echoed=override(struct_hook=_passthrough)
    )
    required = tuple(
        _WIRE_NAMES.get(a.name, a.name)
        for a in attrs.fields(cls)
        if a.default is attrs.NOTHING and a.name in rules
    )

    def structure(payload: dict[str, Any]) -> Any:
        return fn(payload, cls)

    return _ActionSpec(
        cls=cls,
        id_keys=id_keys,
        fields={_WIRE_NAMES.get(k, k): v for k, v in rules.items()},
        required=required,
        structure=structure,
    )


def _structure_stop(payload: dict[str, Any]) -> StopRequest:
    if "target" in payload:
        return StopRequest(has_target=True, target=payload["target"], echoed=payload[_ECHOED])
    return StopRequest(echoed=payload[_ECHOED])


_ACTION_SPECS: Final[Mapping[str, _ActionSpec]] = {
    "echo": _make_spec(EchoRequest, {}),
    "estimate_token": _make_spec(EstimateTokenRequest, {"text": _STR}),
    "lefttrim_token": _make_spec(
        LefttrimTokenRequest, {"text": _STR, "trimmed_length": _int_rule(0)}
    ),
    "infer": _make_spec(InferRequest, _INFER_RULES, _INFER_ID_KEYS),
    "stop": _ActionSpec(
        cls=StopRequest,
        id_keys=_ID_KEYS,
        fields={"target": _Rule("any json value", _passthrough)},
        required=(),
        structure=_structure_stop,
    ),
    "info": _make_spec(InfoRequest, {}),
}

_KNOWN_ACTIONS_TEXT: Final = ", ".join(ACTIONS)


def _format_exception(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, _BadValue):
        return str(exc)
    if isinstance(exc, KeyError):
        return "is required"
    return cattrs.v.format_exception(exc, type_)


def _validation_error(
    exc: ClassValidationError, action: str | None, echoed: Mapping[str, Any]
) -> ProtocolError:
    """The first field error of a structuring failure, as an
    ``invalid_request`` naming the field with its wire name."""
    for inner in exc.exceptions:
        if isinstance(inner, cattrs.ForbiddenExtraKeysError):
            key = sorted(inner.extra_fields)[0]
            return ProtocolError(
                "invalid_request",
                f"unknown field {_show(key)}",
                field=_key_path(key),
                action=action,
                echoed=echoed,
            )
    first = cattrs.transform_error(exc, format_exception=_format_exception)[0]
    message, _, path = first.rpartition(" @ ")
    if path.startswith("$."):
        head, sep, rest = path[2:].partition("[")
        name = _WIRE_NAMES.get(head, head) + sep + rest
        return ProtocolError(
            "invalid_request",
            f"{name} {message}",
            field=f"$.{name}",
            action=action,
            echoed=echoed,
        )
    return ProtocolError("invalid_request", message, action=action, echoed=echoed)


def structure_request(obj: Any) -> Request:
    """Turn one decoded JSON value into a typed request, or raise
    :class:`ProtocolError` saying what is wrong (see :func:`decode_request`).

    ``obj`` is what a JSON parser gives; the checks that belong to parsing
    (no NaN or infinities, valid Unicode) are :func:`decode_request`'s, so a
    caller that parses frames itself must make them too, or echoed ids may
    not encode back to JSON.
    """
    if not isinstance(obj, dict):
        raise ProtocolError(
            "invalid_json", f"a frame must hold one json object, got {_json_kind(obj)}"
        )
    echoed: dict[str, Any] = {key: obj[key] for key in _ID_KEYS if key in obj}
    if "action" not in obj:
        raise ProtocolError(
            "invalid_request",
            f"action is required: one of {_KNOWN_ACTIONS_TEXT}",
            field="$.action",
            echoed=echoed,
        )
    action = obj["action"]
    if not isinstance(action, str):
        raise ProtocolError(
            "invalid_request",
            f"action must be a string, one of {_KNOWN_ACTIONS_TEXT}; got {_show(action)}",
            field="$.action",
            echoed=echoed,
        )
    spec = _ACTION_SPECS.get(action)
    if spec is None:
        raise ProtocolError(
            "unknown_action",
            f"unknown action {_show(action)}; known actions: {_KNOWN_ACTIONS_TEXT}",
            field="$.action",
            action=action,
            echoed=echoed,
        )
    if "tag" in obj and "tag" in spec.id_keys:
        echoed["tag"] = obj["tag"]
    payload: dict[str, Any] = {}
    for key, value in obj.items():
        if key == "action" or key in spec.id_keys:
            continue
        if key not in spec.fields:
            allowed = ", ".join(sorted(spec.fields)) or "none besides request_id and response_id"
            raise ProtocolError(
                "invalid_request",
                f"unknown field {_show(key)} for action {action!r}; allowed fields: {allowed}",
                field=_key_path(key),
                action=action,
                echoed=echoed,
            )
        payload[key] = value
    for key in spec.required:
        if key not in payload:
            raise ProtocolError(
                "invalid_request",
                f"{key} is required: {spec.fields[key].allowed}",
                field=f"$.{key}",
                action=action,
                echoed=echoed,
            )
    payload[_ECHOED] = echoed
    try:
        return cast(Request, spec.structure(payload))
    except ClassValidationError as exc:
        raise _validation_error(exc, action, echoed) from None


def decode_request(frame: str | bytes) -> Request:
    """Decode one WebSocket frame into a typed request.

    Raises :class:`ProtocolError` for anything that cannot be served: a binary
    frame, text that is not a JSON object (``invalid_json``); a missing,
    unknown, ill-typed or out-of-range field (``invalid_request`` naming it in
    ``field``); an unknown action (``unknown_action``). The error carries the
    action and echoed ids whenever they could be read.
    """
    return structure_request(_parse_frame(frame))


def unstructure_request(request: Request) -> dict[str, Any]:
    """The wire form of a request: ``action``, the echoed ids, then the
    fields (all of them; ``seed`` only when set)."""
    out: dict[str, Any]
    if isinstance(request, EchoRequest):
        out = {"action": "echo", **request.echoed}
    elif isinstance(request, EstimateTokenRequest):
        out = {"action": "estimate_token", **request.echoed, "text": request.text}
    elif isinstance(request, LefttrimTokenRequest):
        out = {
            "action": "lefttrim_token",
            **request.echoed,
            "text": request.text,
            "trimmed_length": request.trimmed_length,
        }
    elif isinstance(request, InferRequest):
        out = {"action": "infer", **request.echoed}
        for a in attrs.fields(InferRequest):
            if a.name == _ECHOED or (a.name == "seed" and request.seed is None):
                continue
            value = getattr(request, a.name)
            out[_WIRE_NAMES.get(a.name, a.name)] = (
                list(value) if isinstance(value, tuple) else value
            )
    elif isinstance(request, StopRequest):
        out = {"action": "stop", **request.echoed}
        if request.has_target:
            out["target"] = request.target
    else:
        out = {"action": "info", **request.echoed}
    return out


def encode_request(request: Request) -> str:
    """The text frame of a request (compact JSON)."""
    return json.dumps(unstructure_request(request), ensure_ascii=False, separators=(",", ":"))


# --------------------------------------------------------------------------
# Replies on the wire

_REPLY_HEADS: Final[Mapping[type[Any], tuple[str, str | None]]] = {
    EchoReply: ("echo", None),
    EstimateTokenReply: ("estimate_token", None),
    LefttrimTokenReply: ("lefttrim_token", None),
    InferChunk: ("infer", "chunk"),
    InferFinal: ("infer", "full"),
    StopReply: ("stop", None),
    InfoReply: ("info", None),
}
_REPLY_CLASSES: Final[Mapping[tuple[str | None, str | None], type[Any]]] = {
    head: cls for cls, head in _REPLY_HEADS.items()
}

_converter.register_unstructure_hook(
    ErrorDetail,
    make_dict_unstructure_fn(ErrorDetail, _converter, field=override(omit_if_default=True)),
)
_omit_echoed = override(omit=True)
_reply_unstructure: dict[type[Any], Callable[[Any], dict[str, Any]]] = {}
for _cls in (*_REPLY_HEADS, ErrorReply):
    _converter.register_structure_hook(
        _cls,
        make_dict_structure_fn(_cls, _converter, echoed=override(struct_hook=_passthrough)),
    )
    _reply_unstructure[_cls] = make_dict_unstructure_fn(
        _cls,
        _converter,
        echoed=_omit_echoed,
        **cast(
            dict[str, Any],
            {"response": override(omit_if_default=True)}
            if _cls is InferChunk
            else {"action": override(omit=True)}
            if _cls is ErrorReply
            else {},
        ),
    )


def unstructure_reply(reply: Reply) -> dict[str, Any]:
    """The JSON object of a reply frame: ``action``, the echoed ids,
    ``response_type`` where the action has one, then the fields."""
    if isinstance(reply, ErrorReply):
        out: dict[str, Any] = {"action": reply.action, **reply.echoed, "response_type": "error"}
    else:
        action, response_type = _REPLY_HEADS[type(reply)]
        out = {"action": action, **reply.echoed}
        if response_type is not None:
            out["response_type"] = response_type
    out.update(_reply_unstructure[type(reply)](reply))
    return out


def encode_reply(reply: Reply) -> str:
    """The text frame of a reply: compact JSON, non-ASCII text as is."""
    return json.dumps(unstructure_reply(reply), ensure_ascii=False, separators=(",", ":"))


def structure_reply(obj: Any) -> Reply:
    """Turn one decoded JSON value into a typed reply, telling replies apart
    by ``action`` and ``response_type``; raise :class:`ProtocolError` when it
    is no reply of this protocol."""
    if not isinstance(obj, dict):
        raise ProtocolError(
            "invalid_json", f"a frame must hold one json object, got {_json_kind(obj)}"
        )
    action = obj.get("action")
    response_type = obj.get("response_type")
    cls: type[Any] | None
    if response_type == "error":
        cls = ErrorReply
    elif isinstance(action, str) and (response_type is None or isinstance(response_type, str)):
        cls = _REPLY_CLASSES.get((action, response_type))
    else:
        cls = None
    id_keys = _INFER_ID_KEYS if action == "infer" or cls is ErrorReply else _ID_KEYS
    echoed = {key: obj[key] for key in id_keys if key in obj}
    if cls is None:
        raise ProtocolError(
            "invalid_request",
            f"no reply has action {_show(action)} with response_type {_show(response_type)}",
            action=action if isinstance(action, str) else None,
            echoed=echoed,
        )
    if cls is ErrorReply and action is not None and not isinstance(action, str):
        raise ProtocolError(
            "invalid_request",
            f"action must be a string or null, got {_show(action)}",
            field="$.action",
            echoed=echoed,
        )
    payload = {
        key: value
        for key, value in obj.items()
        if key not in ("action", "response_type") and key not in id_keys
    }
    if _ECHOED in payload:
        raise ProtocolError(
            "invalid_request", "unknown field 'echoed'", field="$.echoed", echoed=echoed
        )
    if cls is ErrorReply:
        payload["action"] = action
    payload[_ECHOED] = echoed
    try:
        return cast(Reply, _converter.structure(payload, cls))
    except ClassValidationError as exc:
        raise _validation_error(exc, action if isinstance(action, str) else None, echoed) from None


def decode_reply(frame: str | bytes) -> Reply:
    """Decode one reply frame (for clients and tests); the inverse of
    :func:`encode_reply`."""
    return structure_reply(_parse_frame(frame))
