"""Request frames in, typed requests out, and back: the codec, built from
the field declarations of ``_messages`` (:mod:`._reply_codec` does the
replies with the same converter).

Validation is strict on purpose: the seed server coerced what it could and
dropped the request silently when it could not, so a misspelt or ill-typed
field was a request that never got an answer. Here every such frame gets one
``invalid_request`` error that names the field (``$.top_k``), says what is
allowed, and for an unknown key suggests the closest known one.

All structuring goes through one configured ``cattrs`` converter. Each request
field's structure hook is its declared rule; a failing hook's error comes
back from cattrs inside ``ClassValidationError`` / ``IterableValidationError``
with the attribute or index in the exception notes, and the error's path
(``$.stop_conditions[2]``, ``$.messages[0].role``) is read from those notes,
never from formatted messages.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Final, cast

import attrs
import cattrs
from cattrs.errors import (
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
)
from cattrs.gen import make_dict_structure_fn, override

from trioserve.vocabulary.rules import WIRE, BadValue, Wire, as_float, as_int, closest
from trioserve.vocabulary.strict_json import (
    MAX_JSON_DEPTH,
    JsonError,
    json_depth_exceeds,
    json_kind,
    parse_json,
    show,
)

from ._messages import (
    ACTIONS,
    ENVELOPE,
    EchoRequest,
    EstimateTokenRequest,
    InferRequest,
    InfoRequest,
    LefttrimTokenRequest,
    Request,
    StopRequest,
)
from ._replies import (
    ProtocolError,
)

__all__ = [
    "INFER_DEFAULTS",
    "INFER_FIELDS",
    "decode_request",
    "encode_request",
    "infer_field_table",
    "request_fields",
    "structure_request",
    "unstructure_request",
]

# The payload key under which decoding hands the echoed ids to the generated
# structure functions. It is never a wire field of any action, so a frame that
# carries it is rejected as an unknown key before structuring.
_ECHOED: Final = "echoed"

_ID_KEYS: Final = ("request_id", "response_id")
_INFER_ID_KEYS: Final = ("request_id", "response_id", "tag")

#: Keys longer than this are not put in an error's ``field`` path (an 8 MiB
#: key would come back whole); the message still shows them cut short.
_MAX_PATH_KEY_CHARS: Final = 256


# --------------------------------------------------------------------------
# The converter


def _strict_int(value: Any, _: Any) -> int:
    number = as_int(value)
    if number is None:
        raise BadValue(f"must be an integer, got {show(value)}")
    return number


def _strict_float(value: Any, _: Any) -> float:
    number = as_float(value)
    if number is None:
        raise BadValue(f"must be a finite number, got {show(value)}")
    return number


def _strict_str(value: Any, _: Any) -> str:
    if not isinstance(value, str):
        raise BadValue(f"must be a string, got {show(value)}")
    return value


def _strict_bool(value: Any, _: Any) -> bool:
    if not isinstance(value, bool):
        raise BadValue(f"must be true or false, got {show(value)}")
    return value


def _passthrough(value: Any, _: Any) -> Any:
    return value


def _unstructure_tuple(value: tuple[Any, ...]) -> list[Any]:
    return [_converter.unstructure(item) for item in value]


#: The one converter of the protocol. ``forbid_extra_keys`` is a second line of
#: defence behind the explicit unknown-key check (which names the key and
#: suggests the closest one); detailed validation puts each failing
#: attribute's name or index in the exception notes.
_converter: Final = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
_converter.register_structure_hook(int, _strict_int)
_converter.register_structure_hook(float, _strict_float)
_converter.register_structure_hook(str, _strict_str)
_converter.register_structure_hook(bool, _strict_bool)
_converter.register_unstructure_hook(tuple, _unstructure_tuple)


# --------------------------------------------------------------------------
# Request fields, from the declarations


@attrs.frozen
class _Field:
    attribute: str
    wire: Wire
    required: bool
    default: Any


def _fields_of(cls: type[Any]) -> dict[str, _Field]:
    """Wire name -> field, for every wire field of a request class."""
    out = {}
    for a in attrs.fields(cls):
        wire = a.metadata.get(WIRE)
        if wire is None:
            continue
        wire = attrs.evolve(wire, name=wire.name or a.name)
        out[wire.name] = _Field(a.name, wire, a.default is attrs.NOTHING, a.default)
    return out


@attrs.frozen
class _ActionSpec:
    """How one action's request frames are read."""

    cls: type[Any]
    #: Envelope keys copied into ``echoed``.
    id_keys: tuple[str, ...]
    #: Wire name -> field, in declaration order.
    fields: Mapping[str, _Field]
    #: Group name -> wire names of which exactly one must be given.
    groups: Mapping[str, tuple[str, ...]]
    structure: Callable[[dict[str, Any]], Any]
    #: Set name -> wire names of which at most one may be given.
    exclusive: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)

    def wire_name(self, attribute: str) -> str:
        for name, field in self.fields.items():
            if field.attribute == attribute:
                return name
        return attribute


def _make_spec(cls: type[Any], id_keys: tuple[str, ...] = _ID_KEYS) -> _ActionSpec:
    fields = _fields_of(cls)
    overrides: dict[str, Any] = {
        f.attribute: override(
            rename=name if name != f.attribute else None, struct_hook=f.wire.rule.hook
        )
        for name, f in fields.items()
    }
    fn = make_dict_structure_fn(
        cls, _converter, **overrides, echoed=override(struct_hook=_passthrough)
    )
    groups: dict[str, tuple[str, ...]] = {}
    exclusive: dict[str, tuple[str, ...]] = {}
    for name, f in fields.items():
        if f.wire.group is not None:
            groups[f.wire.group] = (*groups.get(f.wire.group, ()), name)
        if f.wire.exclusive is not None:
            exclusive[f.wire.exclusive] = (*exclusive.get(f.wire.exclusive, ()), name)

    def structure(payload: dict[str, Any]) -> Any:
        return fn(payload, cls)

    return _ActionSpec(cls, id_keys, fields, groups, structure, exclusive)


def _structure_stop(payload: dict[str, Any]) -> StopRequest:
    if "target" in payload:
        target = _STOP_TARGET.wire.rule.hook(payload["target"], None)
        return StopRequest(has_target=True, target=target, echoed=payload[_ECHOED])
    return StopRequest(echoed=payload[_ECHOED])


_STOP_TARGET: Final = _fields_of(StopRequest)["target"]

_ACTION_SPECS: Final[Mapping[str, _ActionSpec]] = {
    "echo": _make_spec(EchoRequest),
    "estimate_token": _make_spec(EstimateTokenRequest),
    "lefttrim_token": _make_spec(LefttrimTokenRequest),
    "infer": _make_spec(InferRequest, _INFER_ID_KEYS),
    "stop": _ActionSpec(StopRequest, _ID_KEYS, _fields_of(StopRequest), {}, _structure_stop),
    "info": _make_spec(InfoRequest),
}

_KNOWN_ACTIONS_TEXT: Final = ", ".join(ACTIONS)


def request_fields(action: str) -> Mapping[str, Wire]:
    """Wire name -> declaration of every field of ``action`` besides the
    envelope (``request_id``, ``response_id``, and ``tag`` for infer)."""
    return {name: f.wire for name, f in _ACTION_SPECS[action].fields.items()}


#: Wire names of every ``infer`` field, in declaration order (``tag`` is part
#: of the envelope).
INFER_FIELDS: Final[tuple[str, ...]] = tuple(_ACTION_SPECS["infer"].fields)

#: Wire name -> default of every optional infer field that has a default value
#: (``seed`` and ``messages`` are absent when not given; ``text`` is required
#: unless ``messages`` is given).
INFER_DEFAULTS: Final[Mapping[str, Any]] = {
    name: f.default
    for name, f in _ACTION_SPECS["infer"].fields.items()
    if not f.required and f.default is not None
}


# --------------------------------------------------------------------------
# Error paths


def _key_path(key: str | int) -> str:
    if isinstance(key, int):
        return f"[{key}]"
    if key.isidentifier():
        return f".{key}"
    return f"[{json.dumps(key, ensure_ascii=False)}]"


def _first_failure(exc: BaseException) -> tuple[list[str | int], BaseException]:
    """The path (attribute names and indices, outermost first) and the leaf
    exception of the first failure in a cattrs validation error, read from
    the notes cattrs (or a rule) attached to each inner exception."""
    path: list[str | int] = []
    while True:
        if isinstance(exc, ClassValidationError):
            with_notes, others = exc.group_exceptions()
            if with_notes:
                exc, attribute_note = with_notes[0]
                path.append(attribute_note.name)
                continue
            exc = others[0]
        elif isinstance(exc, IterableValidationError):
            with_index, others = exc.group_exceptions()
            if with_index:
                exc, index_note = with_index[0]
                path.append(index_note.index)
                continue
            exc = others[0]
        else:
            return path, exc


def _leaf_message(exc: BaseException) -> str:
    if isinstance(exc, BadValue):
        return str(exc)
    if isinstance(exc, KeyError):
        return "is required"
    # An attrs validator of a reply class, or a hook of the converter.
    return f"is invalid: {str(exc)[:200]}"


def _validation_error(
    exc: ClassValidationError,
    spec_wire_name: Callable[[str], str],
    action: str | None,
    echoed: Mapping[str, Any],
) -> ProtocolError:
    """The first failure of a structuring error, as an ``invalid_request``
    naming its path with wire names."""
    path, leaf = _first_failure(exc)
    if isinstance(leaf, ForbiddenExtraKeysError):
        # Only replies get here: requests check their keys first.
        key = sorted(leaf.extra_fields)[0]
        prefix = "$" + "".join(_key_path(part) for part in path)
        return ProtocolError(
            "invalid_request",
            f"unknown field {show(key)}",
            field=prefix + _key_path(key),
            action=action,
            echoed=echoed,
        )
    if not path:
        return ProtocolError("invalid_request", _leaf_message(leaf), action=action, echoed=echoed)
    head = path[0]
    parts: list[str | int] = [spec_wire_name(head) if isinstance(head, str) else head, *path[1:]]
    if any(isinstance(p, str) and len(p) > _MAX_PATH_KEY_CHARS for p in parts):
        return ProtocolError("invalid_request", _leaf_message(leaf), action=action, echoed=echoed)
    field = "$" + "".join(_key_path(part) for part in parts)
    return ProtocolError(
        "invalid_request",
        f"{field[2:]} {_leaf_message(leaf)}",
        field=field,
        action=action,
        echoed=echoed,
    )


# --------------------------------------------------------------------------
# Requests


def _invalid(
    message: str, field: str | None, action: str | None, echoed: Mapping[str, Any]
) -> ProtocolError:
    return ProtocolError("invalid_request", message, field=field, action=action, echoed=echoed)


def _read_envelope(
    obj: dict[str, Any], keys: tuple[str, ...], echoed: dict[str, Any]
) -> tuple[str, BadValue] | None:
    """Copy the envelope ``keys`` present in ``obj`` into ``echoed``; the
    first that breaks its limit is left out and returned (it must not be
    echoed: its size is the problem)."""
    problem = None
    for key in keys:
        if key not in obj:
            continue
        try:
            echoed[key] = ENVELOPE[key].rule.read(obj[key])
        except BadValue as error:
            problem = problem or (key, error)
    return problem


def _structure(obj: Any, *, depth_checked: bool) -> Request:
    if not isinstance(obj, dict):
        raise ProtocolError(
            "invalid_json", f"a frame must hold one json object, got {json_kind(obj)}"
        )
    if not depth_checked and json_depth_exceeds(obj, MAX_JSON_DEPTH):
        raise ProtocolError(
            "invalid_json",
            f"frame is nested too deeply: arrays and objects may nest {MAX_JSON_DEPTH} deep",
        )
    echoed: dict[str, Any] = {}
    problem = _read_envelope(obj, _ID_KEYS, echoed)
    if "action" not in obj:
        raise _invalid(
            f"action is required: one of {_KNOWN_ACTIONS_TEXT}", "$.action", None, echoed
        )
    action = obj["action"]
    if not isinstance(action, str):
        raise _invalid(
            f"action must be a string, one of {_KNOWN_ACTIONS_TEXT}; got {show(action)}",
            "$.action",
            None,
            echoed,
        )
    spec = _ACTION_SPECS.get(action)
    if spec is None:
        raise ProtocolError(
            "unknown_action",
            f"unknown action {show(action)}; known actions: {_KNOWN_ACTIONS_TEXT}",
            field="$.action",
            action=action,
            echoed=echoed,
        )
    if "tag" in spec.id_keys:
        problem = problem or _read_envelope(obj, ("tag",), echoed)
    if problem is not None:
        key, error = problem
        raise _invalid(f"{key} {error}", f"$.{key}", action, echoed)
    payload: dict[str, Any] = {}
    for key, value in obj.items():
        if key == "action" or key in spec.id_keys:
            continue
        if key not in spec.fields:
            raise _unknown_field(key, spec, action, echoed)
        payload[key] = value
    for name, field in spec.fields.items():
        if field.required and name not in payload:
            raise _invalid(
                f"{name} is required: {field.wire.rule.allowed}", f"$.{name}", action, echoed
            )
    for names in spec.groups.values():
        given = [name for name in names if name in payload]
        if len(given) != 1:
            raise _group_error(names, given, spec, action, echoed)
    for names in spec.exclusive.values():
        given = [name for name in names if name in payload and payload[name] is not None]
        if len(given) > 1:
            raise _invalid(
                f"give at most one of {', '.join(names)}; got {' and '.join(given)}",
                f"$.{given[-1]}",
                action,
                echoed,
            )
    payload[_ECHOED] = echoed
    try:
        return cast(Request, spec.structure(payload))
    except ClassValidationError as exc:
        raise _validation_error(exc, spec.wire_name, action, echoed) from None
    except BadValue as exc:  # the stop target, read outside cattrs
        raise _invalid(f"target {exc}", "$.target", action, echoed) from None


def _group_error(
    names: tuple[str, ...],
    given: list[str],
    spec: _ActionSpec,
    action: str,
    echoed: Mapping[str, Any],
) -> ProtocolError:
    """Fields of a group are alternatives (``text`` or ``messages``): exactly
    one must be given."""
    listed = " and ".join(names)
    if given:
        return _invalid(f"give exactly one of {listed}, not both", f"$.{given[-1]}", action, echoed)
    first = names[0]
    others = ", ".join(names[1:])
    return _invalid(
        f"{first} is required: {spec.fields[first].wire.rule.allowed} "
        f"(or give {others}: exactly one of {listed})",
        f"$.{first}",
        action,
        echoed,
    )


def _unknown_field(
    key: Any, spec: _ActionSpec, action: str, echoed: Mapping[str, Any]
) -> ProtocolError:
    if not isinstance(key, str):  # only from callers that parse JSON themselves
        return _invalid(f"object keys must be strings, got {show(key)}", None, action, echoed)
    known = sorted([*spec.fields, *spec.id_keys])
    hint = closest(key, known)
    advice = f" (did you mean {hint!r}?)" if hint is not None else ""
    return _invalid(
        f"unknown field {show(key)} for action {action!r}{advice}; "
        f"allowed fields: {', '.join(known)}",
        "$" + _key_path(key) if len(key) <= _MAX_PATH_KEY_CHARS else None,
        action,
        echoed,
    )


def structure_request(obj: Any) -> Request:
    """Turn one decoded JSON value into a typed request, or raise
    :class:`ProtocolError` saying what is wrong (see :func:`decode_request`).

    ``obj`` is what a JSON parser gives. Its nesting depth is checked here
    (without recursion); the checks that belong to parsing (no NaN or
    infinities, valid Unicode) are :func:`decode_request`'s, so a caller that
    parses frames itself must make them too, or echoed ids may not encode
    back to JSON.
    """
    return _structure(obj, depth_checked=False)


def decode_request(frame: str | bytes) -> Request:
    """Decode one WebSocket frame into a typed request.

    Raises :class:`ProtocolError` for anything that cannot be served: a binary
    frame, text that is not a JSON object, or JSON nested deeper than
    ``MAX_JSON_DEPTH`` (``invalid_json``); a missing, unknown, ill-typed or
    out-of-range field (``invalid_request`` naming it in ``field``); an
    unknown action (``unknown_action``). The error carries the action and
    echoed ids whenever they could be read.
    """
    return _structure(_parse_frame(frame), depth_checked=True)


def _parse_frame(frame: str | bytes) -> Any:
    if not isinstance(frame, str):
        raise ProtocolError(
            "invalid_json", "binary frames are not accepted: send one json object in a text frame"
        )
    try:
        return parse_json(frame)
    except JsonError as exc:
        raise ProtocolError("invalid_json", str(exc)) from None


_REQUEST_ACTIONS: Final[Mapping[type[Any], str]] = {
    spec.cls: action for action, spec in _ACTION_SPECS.items()
}


def unstructure_request(request: Request) -> dict[str, Any]:
    """The wire form of a request: ``action``, the echoed ids, then the
    fields (all of them, except those absent by default, such as ``seed``,
    when not set)."""
    action = _REQUEST_ACTIONS[type(request)]
    out: dict[str, Any] = {"action": action, **request.echoed}
    if isinstance(request, StopRequest):
        if request.has_target:
            out["target"] = request.target
        return out
    for name, field in _ACTION_SPECS[action].fields.items():
        value = getattr(request, field.attribute)
        if value is None and field.default is None:
            continue
        out[name] = field.wire.rule.write(value, _converter.unstructure)
    return out


def encode_request(request: Request) -> str:
    """The text frame of a request (compact JSON)."""
    return json.dumps(unstructure_request(request), ensure_ascii=False, separators=(",", ":"))


# --------------------------------------------------------------------------
# Checks that need the model


# --------------------------------------------------------------------------
# The docs' field table


def _default_doc(field: _Field) -> str:
    if field.wire.default_doc is not None:
        return field.wire.default_doc
    if field.required:
        return "required"
    if field.default is None:
        return "absent"
    default = field.default
    if isinstance(default, float) and default.is_integer():
        default = int(default)  # 0, not 0.0
    return f"`{json.dumps(field.wire.rule.write(default, _converter.unstructure))}`"


def infer_field_table() -> str:
    """The Markdown table of ``infer``'s fields, as docs/protocol.md shows
    it: the ExLlamaV2 server's fields in declaration order, then ``tag``,
    then the extensions."""
    fields = _ACTION_SPECS["infer"].fields
    tag = ENVELOPE["tag"]
    rows = [(name, f.wire, _default_doc(f)) for name, f in fields.items() if not f.wire.extension]
    rows.append(("tag", tag, "absent"))
    rows += [(name, f.wire, _default_doc(f)) for name, f in fields.items() if f.wire.extension]
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, wire, default in rows:
        meaning = f"extension: {wire.meaning}" if wire.extension else wire.meaning
        lines.append(f"| `{name}` | {wire.rule.doc} | {default} | {meaning} |")
    return "\n".join(lines) + "\n"
