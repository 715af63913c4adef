"""The doors' requests as one :class:`GenerationRequest`, and the one
pipeline's errors in each door's terms.

Each door is a table (:class:`Door`): for each field of the
:class:`GenerationRequest`, the wire request's attribute it is read from (by
name: the same name then names the field in that door's errors) or, where it
is not one attribute, how it is computed. A field added to the request is a
row in each door's table.

A WebSocket ``infer`` trims a prompt that does not fit (protocol.md 3.4); an
OpenAI request refuses it (``context_length_exceeded``). Everything else is
the same request: the same sampler settings, stops, bans and limits.
:class:`~trioserve.generation.InvalidGeneration` names a field by its neutral
name; :func:`websocket_path` and :func:`openai_param` name it as each door's
client sent it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Final

import attrs

from trioserve import anthropic as an
from trioserve import openai as oa
from trioserve import protocol as p
from trioserve import responses as rs
from trioserve.generation import Generation, GenerationRequest, InvalidGeneration

from .http_types import Network, RequestHead, client_address

__all__ = [
    "CHAT",
    "COMPLETION",
    "INFER",
    "MESSAGES",
    "RESPONSES",
    "ClientIdentity",
    "Door",
    "anthropic_error",
    "from_anthropic",
    "from_infer",
    "from_openai",
    "from_responses",
    "infer_error",
    "infer_final",
    "openai_error",
    "openai_param",
    "responses_error",
    "websocket_path",
]

#: How a field is read from a wire request: its attribute's name, or a function.
Read = str | Callable[[Any], object]


@attrs.frozen
class Door:
    """One door's wire request as the pipeline's :class:`GenerationRequest`."""

    #: GenerationRequest field -> how the door's request gives it. A field
    #: not in the table keeps GenerationRequest's default.
    reads: Mapping[str, Read]
    #: The door's names for what the pipeline's errors name but no field of
    #: the table reads by name (the neutral ``prompt``).
    also_named: Mapping[str, str] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        fields = attrs.fields_dict(GenerationRequest)
        unknown = sorted(set(self.reads) - set(fields))
        required = {n for n, a in fields.items() if a.default is attrs.NOTHING}
        missing = sorted(required - set(self.reads))
        if unknown or missing:
            raise TypeError(
                f"a door's table: not GenerationRequest fields {unknown},"
                f" GenerationRequest's required fields not read {missing}"
            )

    def request(self, wire: object) -> GenerationRequest:
        """The generation ``wire`` asks for. (The values' types are checked
        by tests/test_door_tables.py against GenerationRequest's annotations: the
        table is beyond mypy's reach.)"""
        values: dict[str, Any] = {
            field: getattr(wire, how) if isinstance(how, str) else how(wire)
            for field, how in self.reads.items()
        }
        return GenerationRequest(**values)

    def name(self, field: str) -> str:
        """The door's name for the pipeline's ``field``."""
        how = self.reads.get(field)
        if isinstance(how, str):
            return how
        return self.also_named.get(field, field)


def _fixed(value: object) -> Callable[[Any], object]:
    return lambda _: value


def _chat_of(request: p.InferRequest) -> tuple[dict[str, str], ...] | None:
    if request.messages is None:
        return None
    return tuple({"role": m.role, "content": m.content} for m in request.messages)


#: The WebSocket ``infer``.
INFER: Final = Door(
    reads={
        "text": lambda r: r.text or "",
        "custom_bos": lambda r: r.custom_bos if r.messages is None else "",
        "messages": _chat_of,
        "max_new_tokens": "max_new_tokens",
        "fit": _fixed("trim"),
        "sampling": lambda r: r.sampling_settings(),
        "stop_strings": "stop_strings",
        # The ids are the int entries of stop_conditions (websocket_path
        # names the entry).
        "stop_token_ids": lambda r: tuple(c for c in r.stop_conditions if isinstance(c, int)),
        "banned_ids": "bann_bann",
        "token_healing": "token_healing",
        "constraint": lambda r: r.constraint(),
        "logprobs": "logprobs",
    },
    also_named={"prompt": "text"},
)

_OPENAI: Final[Mapping[str, Read]] = {
    "max_new_tokens": "max_tokens",
    "fit": _fixed("refuse"),
    "sampling": lambda r: r.sampling_settings(),
    "stop_strings": "stop",
    "stop_token_ids": "stop_token_ids",
    "banned_ids": "bann_bann",
    "token_healing": "token_healing",
    "constraint": "constraint",
    "logprobs": lambda r: r.logprobs.top,
    "ignore_eos": lambda r: r.extras.ignore_eos,
    "skip_special_tokens": lambda r: r.extras.skip_special_tokens,
    "include_stop_str": lambda r: r.extras.include_stop,
}
#: OpenAI's ``/v1/chat/completions``.
CHAT: Final = Door(
    reads={
        **_OPENAI,
        "messages": lambda r: tuple(r.template_messages()),
        "assistant_prefix": "prefix",
        "tools": "tools",
        "thinking": "thinking",
        "separate_reasoning": lambda r: r.extras.separate_reasoning,
    }
)
#: OpenAI's ``/v1/completions``: a prompt of text or of token ids, 16 new
#: tokens by default, and with ``echo`` the prompt's tokens scored.
COMPLETION: Final = Door(
    reads={
        **_OPENAI,
        "text": lambda r: r.prompt if isinstance(r.prompt, str) else "",
        "prompt_ids": lambda r: None if isinstance(r.prompt, str) else tuple(r.prompt),
        "default_max_new_tokens": _fixed(oa.COMPLETIONS_MAX_TOKENS),
        "prompt_logprobs": lambda r: r.logprobs.top if r.echo else None,
    }
)


#: Anthropic's ``/v1/messages``: a chat (a final assistant turn continued),
#: a prompt that does not fit refused. ``max_tokens`` is required and is an
#: upper bound: past what the context leaves (Claude Code asks for 32,000)
#: the reply ends there, with ``max_tokens``, rather than being refused.
MESSAGES: Final = Door(
    reads={
        "messages": "messages",
        "assistant_prefix": "prefix",
        "max_new_tokens": _fixed(None),
        "default_max_new_tokens": "max_tokens",
        "fit": _fixed("refuse"),
        "sampling": lambda r: r.sampling_settings(),
        "stop_strings": "stop_sequences",
        "constraint": "constraint",
        "tools": "tools",
        "thinking": "thinking",
        "thinking_budget": "thinking_budget",
        "skip_special_tokens": _fixed(True),
    }
)


#: OpenAI's ``/v1/responses``: the conversation under its instructions, a
#: prompt that does not fit refused, ``max_output_tokens`` an upper bound
#: (a reply it or the context cuts short is ``incomplete``).
RESPONSES: Final = Door(
    reads={
        "messages": lambda r: r.template_messages(),
        "max_new_tokens": _fixed(None),
        "default_max_new_tokens": "max_output_tokens",
        "fit": _fixed("refuse"),
        "sampling": lambda r: r.sampling_settings(),
        "constraint": "constraint",
        "tools": "tools",
        "thinking": "thinking",
        "ignore_eos": lambda r: r.extras.ignore_eos,
        "skip_special_tokens": lambda r: r.extras.skip_special_tokens,
        "include_stop_str": lambda r: r.extras.include_stop,
    }
)


def from_infer(request: p.InferRequest) -> GenerationRequest:
    """The generation of a WebSocket ``infer``."""
    return INFER.request(request)


def from_openai(request: oa.CompletionRequest | oa.ChatCompletionRequest) -> GenerationRequest:
    """The generation of an OpenAI completion or chat completion."""
    return (CHAT if isinstance(request, oa.ChatCompletionRequest) else COMPLETION).request(request)


def from_responses(request: rs.ResponsesRequest) -> GenerationRequest:
    """The generation of a Responses API request."""
    return RESPONSES.request(request)


def responses_error(error: InvalidGeneration) -> oa.OpenAIError:
    """``error`` as the Responses door answers it: OpenAI's shape, the
    fields under this API's names."""
    exc = openai_error(error)
    renamed = (
        ("max_tokens", "max_output_tokens"),
        ("messages", "input"),
        (".function.parameters", ".parameters"),
    )
    param, message = exc.param or "", exc.message
    for old, new in renamed:
        param, message = param.replace(old, new), message.replace(old, new)
    return oa.OpenAIError(400, message, param=param or None, code=exc.code)


def from_anthropic(request: an.MessagesRequest) -> GenerationRequest:
    """The generation of an Anthropic Messages request."""
    return MESSAGES.request(request)


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
    name = INFER.name(error.field)
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
        reasoning=generation.reasoning,
    )


def openai_param(error: InvalidGeneration) -> str:
    """OpenAI's ``param`` for the field ``error`` is about (chat and
    completion name the fields they share alike)."""
    if error.wire_name:
        return error.wire_name
    name = COMPLETION.name(error.field)
    if error.index is not None and error.field not in ("prompt", "logit_bias"):
        return f"{name}[{error.index}]"
    return name


def openai_error(error: InvalidGeneration) -> oa.OpenAIError:
    """``error`` as the OpenAI door answers it: 400, the field as ``param``."""
    message = error.message
    if error.field == "max_new_tokens":
        message = message.replace("max_new_tokens", COMPLETION.name("max_new_tokens"))
    return oa.OpenAIError(400, message, param=openai_param(error), code=error.code)


#: The context length and the prompt's tokens in fit_prompt's message.
_CONTEXT_COUNTS: Final = re.compile(
    r"context length is (\d+) tokens\W+(?:and )?the prompt has (\d+)"
)


def anthropic_error(error: InvalidGeneration) -> an.AnthropicError:
    """``error`` as the Messages door answers it: 400, the field named in
    the message as the client wrote it. A prompt too long for the context
    says so in the words Claude Code watches for (it then compacts the
    conversation)."""
    # Anthropic's names where the pipeline's (or OpenAI's) differ.
    renamed = (("max_new_tokens", "max_tokens"), (".function.parameters", ".input_schema"))
    name = error.wire_name or MESSAGES.name(error.field)
    message = error.message
    for old, new in renamed:
        name, message = name.replace(old, new), message.replace(old, new)
    if error.code == "context_length_exceeded":
        # Anthropic's words, with the counts first ("N tokens > M maximum"),
        # which Claude Code reads before it compacts a conversation.
        counts = _CONTEXT_COUNTS.search(message)
        if counts is not None:
            context, prompt = counts.group(1), counts.group(2)
            return an.AnthropicError(
                400, f"prompt is too long: {prompt} tokens > {context} maximum ({message})"
            )
        return an.AnthropicError(400, f"prompt is too long: {message}")
    if not message.startswith(name):
        message = f"{name}: {message}"
    return an.AnthropicError(400, message)


@attrs.frozen
class ClientIdentity:
    """Who a request comes from, the same for every door: its API key when
    the server has keys, else its address (taken from ``X-Forwarded-For``
    only when the peer is a trusted proxy). One client's requests share the
    per-client request limit and the slot guarantee.

    With ``key`` (the server's), an admitted request is that key's holder
    whatever else it sent: a second, made-up credential beside the right one
    (a Bearer token beside ``X-Api-Key``) must not make a new client."""

    keyed: bool
    trusted_proxies: tuple[Network, ...] = ()
    key: str | None = attrs.field(default=None, repr=False)

    def of(self, head: RequestHead) -> Hashable:
        if self.keyed:
            key = self.key
            if key is None:
                key = head.api_key() or head.query_param("api_key") or ""
            # The key itself never leaves the request: its digest names the client.
            return ("key", _digest(key))
        return ("address", client_address(head, self.trusted_proxies))


def _digest(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
