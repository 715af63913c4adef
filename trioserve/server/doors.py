"""The two doors' requests as one :class:`GenerationRequest`, and the one
pipeline's errors in each door's terms.

A WebSocket ``infer`` trims a prompt that does not fit (protocol.md 3.4); an
OpenAI request refuses it (``context_length_exceeded``). Everything else is
the same request: the same sampler settings, stops, bans and limits.
:class:`~trioserve.generation.InvalidGeneration` names a field by its neutral
name; :func:`websocket_path` and :func:`openai_param` name it as each door's
client sent it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Final

import attrs

from trioserve import openai as oa
from trioserve import protocol as p
from trioserve.generation import Generation, GenerationRequest, InvalidGeneration

from .http_types import Network, RequestHead, client_address

__all__ = [
    "ClientIdentity",
    "from_infer",
    "from_openai",
    "infer_error",
    "infer_final",
    "openai_error",
    "openai_param",
    "websocket_path",
]


def from_infer(request: p.InferRequest) -> GenerationRequest:
    """The generation of a WebSocket ``infer``."""
    messages = None
    if request.messages is not None:
        messages = tuple({"role": m.role, "content": m.content} for m in request.messages)
    return GenerationRequest(
        text=request.text or "",
        custom_bos=request.custom_bos if messages is None else "",
        messages=messages,
        max_new_tokens=request.max_new_tokens,
        fit="trim",
        sampling=request.sampling_settings(),
        stop_strings=request.stop_strings,
        stop_token_ids=tuple(c for c in request.stop_conditions if isinstance(c, int)),
        banned_ids=tuple(request.bann_bann),
        token_healing=request.token_healing,
        constraint=request.constraint(),
        logprobs=request.logprobs,
    )


def from_openai(request: oa.CompletionRequest | oa.ChatCompletionRequest) -> GenerationRequest:
    """The generation of an OpenAI completion or chat completion."""
    text = ""
    prompt_ids = messages = tools = None
    default = scored = None
    if isinstance(request, oa.ChatCompletionRequest):
        messages = tuple(request.template_messages())
        tools = request.tools
    else:
        default = oa.COMPLETIONS_MAX_TOKENS
        # echo with logprobs: the prompt's tokens come with theirs.
        scored = request.logprobs.top if request.echo else None
        if isinstance(request.prompt, str):
            text = request.prompt
        else:
            prompt_ids = tuple(request.prompt)
    return GenerationRequest(
        text=text,
        messages=messages,
        prompt_ids=prompt_ids,
        max_new_tokens=request.max_tokens,
        default_max_new_tokens=default,
        fit="refuse",
        sampling=request.sampling_settings(),
        stop_strings=request.stop,
        stop_token_ids=request.stop_token_ids,
        banned_ids=request.bann_bann,
        token_healing=request.token_healing,
        constraint=request.constraint,
        tools=tools,
        logprobs=request.logprobs.top,
        prompt_logprobs=scored,
    )


_WEBSOCKET_NAMES: Final = {
    "prompt": "text",
    "banned_ids": "bann_bann",
}


def websocket_path(error: InvalidGeneration, request: p.InferRequest) -> str:
    """The JSON path of the ``infer`` field ``error`` is about."""
    if error.wire_name:
        return error.wire_name
    if error.field == "stop_token_ids":
        # The ids are the int entries of stop_conditions: name the entry.
        ints = [i for i, c in enumerate(request.stop_conditions) if isinstance(c, int)]
        if error.index is not None and error.index < len(ints):
            return f"$.stop_conditions[{ints[error.index]}]"
        return "$.stop_conditions"
    if error.field == "logit_bias" and error.index is not None:
        token = request.logit_bias[error.index][0]
        return f'$.logit_bias["{token}"]'
    name = _WEBSOCKET_NAMES.get(error.field, error.field)
    if error.index is not None:
        return f"$.{name}[{error.index}]"
    return f"$.{name}"


def infer_error(error: InvalidGeneration, request: p.InferRequest) -> p.ProtocolError:
    """``error`` as the WebSocket door answers it: ``invalid_request``, the
    field as the client sent it."""
    return p.ProtocolError(
        "invalid_request",
        error.message,
        field=websocket_path(error, request),
        action="infer",
        echoed=request.echoed,
    )


def infer_final(request: p.InferRequest, generation: Generation) -> p.InferFinal:
    """The final frame of a WebSocket ``infer`` whose generation ended."""
    return p.infer_final(
        request,
        generation.finished,
        response=generation.response,
        util_text=generation.util_text,
        usage=p.Usage(
            prompt_tokens=generation.prompt_tokens,
            trimmed_tokens=generation.trimmed_tokens,
            generated_tokens=generation.generated_tokens,
            cached_tokens=generation.cached_tokens,
        ),
        queued_s=generation.queued_s,
        first_token_s=generation.first_token_s,
        total_s=generation.total_s,
        logprobs=generation.logprobs,
    )


_OPENAI_NAMES: Final = {
    "max_new_tokens": "max_tokens",
    "banned_ids": "bann_bann",
}


def openai_param(error: InvalidGeneration) -> str:
    """OpenAI's ``param`` for the field ``error`` is about."""
    if error.wire_name:
        return error.wire_name
    name = _OPENAI_NAMES.get(error.field, error.field)
    if error.index is not None and error.field not in ("prompt", "logit_bias"):
        return f"{name}[{error.index}]"
    return name


def openai_error(error: InvalidGeneration) -> oa.OpenAIError:
    """``error`` as the OpenAI door answers it: 400, the field as ``param``."""
    message = error.message
    if error.field == "max_new_tokens":
        message = message.replace("max_new_tokens", "max_tokens")
    return oa.OpenAIError(400, message, param=openai_param(error), code=error.code)


@attrs.frozen
class ClientIdentity:
    """Who a request comes from, the same for both doors: its API key when
    the server has keys, else its address (taken from ``X-Forwarded-For``
    only when the peer is a trusted proxy). One client's requests share the
    per-client request limit and the slot guarantee."""

    keyed: bool
    trusted_proxies: tuple[Network, ...] = ()

    def of(self, head: RequestHead) -> Hashable:
        if self.keyed:
            key = head.bearer_key() or head.query_param("api_key") or ""
            # The key itself never leaves the request: its digest names the client.
            return ("key", _digest(key))
        return ("address", client_address(head, self.trusted_proxies))


def _digest(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
