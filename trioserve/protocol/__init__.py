"""The wire protocol: frames in, typed messages out, and back. No I/O.

This package is the whole of ``docs/protocol.md`` sections 2 to 5 as code.
The server hands every text frame to :func:`decode_request` and gets either a
typed request or a :class:`ProtocolError` that already knows its answer
(:meth:`ProtocolError.reply`); it turns every typed reply into a frame with
:func:`encode_reply`. The client does the reverse with :func:`encode_request`
and :func:`decode_reply`. Nothing here knows trio or torch, so the codec can
be tested and fuzzed alone.

Each request field is declared once, on its message class (wire name, type,
range, default, doc line; sampler settings take default and range from
:class:`~trioserve.vocabulary.sampling.SamplingSettings`): the codec, the error paths,
the per-field limits reported by ``info`` (:data:`FIELD_LIMITS`) and the docs'
field table (:func:`infer_field_table`) are derived from those declarations.
Every frame is bounded before work: nesting at most :data:`MAX_JSON_DEPTH`,
checked before parsing; echoed ids, ``tag``, stop conditions, banned ids and
messages within their limits.
"""

from trioserve.vocabulary.rules import Wire
from trioserve.vocabulary.strict_json import MAX_JSON_DEPTH, json_equal

from ._codec import (
    INFER_DEFAULTS,
    INFER_FIELDS,
    decode_request,
    encode_request,
    infer_field_table,
    request_fields,
    structure_request,
    unstructure_request,
)
from ._messages import (
    ACTIONS,
    ENVELOPE,
    ERROR_TYPES,
    FIELD_LIMITS,
    ChatMessage,
    EchoRequest,
    ErrorType,
    EstimateTokenRequest,
    InferRequest,
    InfoRequest,
    LefttrimTokenRequest,
    Request,
    StopRequest,
)
from ._replies import (
    EchoReply,
    EosReason,
    ErrorDetail,
    ErrorReply,
    EstimateTokenReply,
    InferChunk,
    InferFinal,
    InfoReply,
    LefttrimTokenReply,
    Limits,
    ModelEntry,
    ModelInfo,
    ProtocolError,
    Reply,
    ServerInfo,
    Status,
    StopReason,
    StopReply,
    Timing,
    Usage,
)
from ._reply_codec import decode_reply, encode_reply, structure_reply, unstructure_reply
from ._semantics import action_name, infer_chunk, infer_final

__all__ = [
    "ACTIONS",
    "ENVELOPE",
    "ERROR_TYPES",
    "FIELD_LIMITS",
    "INFER_DEFAULTS",
    "INFER_FIELDS",
    "MAX_JSON_DEPTH",
    "ChatMessage",
    "EchoReply",
    "EchoRequest",
    "EosReason",
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
    "ModelEntry",
    "ModelInfo",
    "ProtocolError",
    "Reply",
    "Request",
    "ServerInfo",
    "Status",
    "StopReason",
    "StopReply",
    "StopRequest",
    "Timing",
    "Usage",
    "Wire",
    "action_name",
    "decode_reply",
    "decode_request",
    "encode_reply",
    "encode_request",
    "infer_chunk",
    "infer_field_table",
    "infer_final",
    "json_equal",
    "request_fields",
    "structure_reply",
    "structure_request",
    "unstructure_reply",
    "unstructure_request",
]
