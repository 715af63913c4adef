"""OpenAI's Responses API as a pure core: request bodies in, a typed
:class:`ResponsesRequest` out (:mod:`.requests`, the conversation of
:mod:`.items`); the reply, whole or as the named events of a stream
(:mod:`.replies`); the bounded store that ``previous_response_id``, ``GET``
and ``DELETE`` read (:mod:`.store`). Errors are OpenAI's
(:class:`~trioserve.openai.OpenAIError`). No I/O, no trio, no torch. The
server's routes (``trioserve.server.responses_routes``) run it through the
one pipeline.

What is accepted is listed in ``docs/responses.md``.
"""

from .items import DEFAULT_LIMITS, ResponsesLimits, Turns
from .replies import ResponseReply, new_response_id, sse
from .requests import (
    ResponsesRequest,
    parse_responses_body,
    parse_responses_request,
    previous_id,
)
from .store import DEFAULT_STORE_MIB, DEFAULT_STORE_TTL_S, ResponseStore, StoredResponse

__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_STORE_MIB",
    "DEFAULT_STORE_TTL_S",
    "ResponseReply",
    "ResponseStore",
    "ResponsesLimits",
    "ResponsesRequest",
    "StoredResponse",
    "Turns",
    "new_response_id",
    "parse_responses_body",
    "parse_responses_request",
    "previous_id",
    "sse",
]
