"""Anthropic's Messages API as a pure core: request bodies in, a typed
:class:`MessagesRequest` out (:mod:`.requests`); the reply, whole or as the
named events of a stream (:mod:`.replies`); errors in Anthropic's shape
(:mod:`.errors`). No I/O, no trio, no torch. The server's routes
(``trioserve.server.anthropic_routes``) run it through the one pipeline.

What is accepted is listed in ``docs/anthropic.md``.
"""

from .errors import OVERLOADED, AnthropicError, error_body
from .replies import GenerationState, MessageReply, new_message_id, sse
from .requests import (
    MESSAGES_DEFAULTS,
    MessagesLimits,
    MessagesRequest,
    parse_count_request,
    parse_messages_request,
)

__all__ = [
    "MESSAGES_DEFAULTS",
    "OVERLOADED",
    "AnthropicError",
    "GenerationState",
    "MessageReply",
    "MessagesLimits",
    "MessagesRequest",
    "error_body",
    "new_message_id",
    "parse_count_request",
    "parse_messages_request",
    "sse",
]
