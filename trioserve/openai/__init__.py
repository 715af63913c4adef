"""The OpenAI-compatible API as a pure core: request bodies in, typed
requests out (:mod:`.requests`); answers, stream chunks (:mod:`.responses`)
and errors (:mod:`.errors`) in OpenAI's shape; the reply to a request from
the state of its choices, whole or streamed, tool calls and logprob offsets
included (:mod:`.replies`); vLLM's tokenizer routes (:mod:`.tokenize`). No
I/O, no trio, no torch.

What is accepted is listed in ``docs/openai.md``; its field table is
generated from the declarations (:func:`field_table`).
"""

from .errors import OpenAIError, error_body
from .logprobs import LegacyLogprobs, LogprobsAsked, chat_logprobs
from .replies import ChoiceState, Reply
from .requests import (
    COMPLETIONS_MAX_TOKENS,
    OPENAI_DEFAULTS,
    OPENAI_NAMES,
    OPENAI_RANGES,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAILimits,
    parse_chat_request,
    parse_completion_request,
)
from .responses import (
    SSE_DONE,
    ChatChoice,
    ChatCompletionStream,
    CompletionChoice,
    CompletionStream,
    FinishReason,
    TokenUsage,
    chat_completion_response,
    completion_response,
    finish_reason,
    model_object,
    models_response,
    new_id,
    sse_event,
)
from .tokenize import (
    DetokenizeRequest,
    TokenizeRequest,
    TokenizerLimits,
    detokenize_response,
    parse_detokenize_request,
    parse_tokenize_request,
    requested_model,
    tokenize_response,
    tokenizer_info_response,
)

__all__ = [
    "COMPLETIONS_MAX_TOKENS",
    "OPENAI_DEFAULTS",
    "OPENAI_NAMES",
    "OPENAI_RANGES",
    "SSE_DONE",
    "ChatChoice",
    "ChatCompletionRequest",
    "ChatCompletionStream",
    "ChatMessage",
    "ChoiceState",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionStream",
    "DetokenizeRequest",
    "FinishReason",
    "LegacyLogprobs",
    "LogprobsAsked",
    "OpenAIError",
    "OpenAILimits",
    "Reply",
    "TokenUsage",
    "TokenizeRequest",
    "TokenizerLimits",
    "chat_completion_response",
    "chat_logprobs",
    "completion_response",
    "detokenize_response",
    "error_body",
    "finish_reason",
    "model_object",
    "models_response",
    "new_id",
    "parse_chat_request",
    "parse_completion_request",
    "parse_detokenize_request",
    "parse_tokenize_request",
    "requested_model",
    "sse_event",
    "tokenize_response",
    "tokenizer_info_response",
]
