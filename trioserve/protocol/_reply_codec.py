"""Reply frames: typed replies out to JSON, and (for clients and tests) back,
telling replies apart by ``action`` and ``response_type``. The same
converter and error paths as the requests' (:mod:`._codec`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Final, cast

from cattrs.errors import ClassValidationError
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from trioserve.vocabulary.strict_json import json_kind, show

from ._codec import (
    _ECHOED,
    _ID_KEYS,
    _INFER_ID_KEYS,
    _converter,
    _parse_frame,
    _passthrough,
    _validation_error,
)
from ._messages import ChatMessage
from ._replies import (
    EchoReply,
    ErrorDetail,
    ErrorReply,
    EstimateTokenReply,
    InferChunk,
    InferFinal,
    InfoReply,
    LefttrimTokenReply,
    ProtocolError,
    Reply,
    StopReply,
)

__all__ = ["decode_reply", "encode_reply", "structure_reply", "unstructure_reply"]


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
_converter.register_unstructure_hook(ChatMessage, make_dict_unstructure_fn(ChatMessage, _converter))
_omit_echoed = override(omit=True)
_reply_unstructure: dict[type[Any], Callable[[Any], dict[str, Any]]] = {}
for _cls in (*_REPLY_HEADS, ErrorReply):
    _converter.register_structure_hook(
        _cls,
        make_dict_structure_fn(_cls, _converter, echoed=override(struct_hook=_passthrough)),
    )
    _extra: dict[str, Any] = {}
    if _cls is InferChunk:
        _extra = {
            "response": override(omit_if_default=True),
            "util_text": override(omit_if_default=True),
            "logprobs": override(omit_if_default=True),
        }
    elif _cls is InferFinal:
        _extra = {
            "logprobs": override(omit_if_default=True),
            "reasoning": override(omit_if_default=True),
        }
    elif _cls is InfoReply:
        _extra = {
            "status": override(omit_if_default=True),
            "models": override(omit_if_default=True),
        }
    elif _cls is ErrorReply:
        _extra = {"action": override(omit=True)}
    _reply_unstructure[_cls] = make_dict_unstructure_fn(
        _cls, _converter, echoed=_omit_echoed, **_extra
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
    """The text frame of a reply: compact JSON, non-ASCII text as is.

    Echoed values come from decoded requests, whose nesting is at most
    ``MAX_JSON_DEPTH``: ``json.dumps`` (recursive in C) stays far from any
    recursion limit."""
    return json.dumps(unstructure_reply(reply), ensure_ascii=False, separators=(",", ":"))


def structure_reply(obj: Any) -> Reply:
    """Turn one decoded JSON value into a typed reply, telling replies apart
    by ``action`` and ``response_type``; raise :class:`ProtocolError` when it
    is no reply of this protocol."""
    if not isinstance(obj, dict):
        raise ProtocolError(
            "invalid_json", f"a frame must hold one json object, got {json_kind(obj)}"
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
            f"no reply has action {show(action)} with response_type {show(response_type)}",
            action=action if isinstance(action, str) else None,
            echoed=echoed,
        )
    if cls is ErrorReply and action is not None and not isinstance(action, str):
        raise ProtocolError(
            "invalid_request",
            f"action must be a string or null, got {show(action)}",
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
        raise _validation_error(
            exc, lambda name: name, action if isinstance(action, str) else None, echoed
        ) from None


def decode_reply(frame: str | bytes) -> Reply:
    """Decode one reply frame (for clients and tests); the inverse of
    :func:`encode_reply`."""
    return structure_reply(_parse_frame(frame))
