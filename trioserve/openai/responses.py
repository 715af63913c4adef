"""OpenAI responses: whole answers, Server-Sent Events of streamed ones, and
the model list, as bytes. No I/O."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, TypeAlias

import attrs

from trioserve.vocabulary.results import Finished
from trioserve.vocabulary.tools import ToolCall

from .errors import OpenAIError

__all__ = [
    "SSE_DONE",
    "ChatChoice",
    "ChatCompletionStream",
    "CompletionChoice",
    "CompletionStream",
    "FinishReason",
    "TokenUsage",
    "chat_completion_response",
    "completion_response",
    "finish_reason",
    "model_object",
    "models_response",
    "new_id",
    "sse_event",
    "tool_call_json",
]

FinishReason: TypeAlias = Literal["stop", "length", "tool_calls"]

#: The end of every stream.
SSE_DONE: Final = b"data: [DONE]\n\n"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def new_id(kind: Literal["cmpl", "chatcmpl"]) -> str:
    """A response id as OpenAI writes them (``chatcmpl-...``)."""
    return f"{kind}-{secrets.token_hex(12)}"


def finish_reason(finished: Finished) -> FinishReason:
    """``length`` when max_tokens ended the job, ``stop`` for a stop token or
    a stop string."""
    return "length" if finished.reason == "max_new_tokens" else "stop"


@attrs.frozen
class TokenUsage:
    """Token counts of one request: ``completion_tokens`` counts the stop
    token too (as ``generated_tokens`` does on the WebSocket side);
    ``cached_tokens`` is how many prompt tokens the engine did not compute."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@attrs.frozen(kw_only=True)
class CompletionChoice:
    """One choice of a whole ``/v1/completions`` answer."""

    text: str
    finish_reason: FinishReason
    index: int = 0
    logprobs: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": self.text,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
        }


@attrs.frozen(kw_only=True)
class ChatChoice:
    """One choice of a whole ``/v1/chat/completions`` answer (its
    ``content`` is null when the answer is tool calls alone, as OpenAI
    writes it)."""

    content: str
    finish_reason: FinishReason
    index: int = 0
    tool_calls: Sequence[ToolCall] = ()
    logprobs: dict[str, Any] | None = None
    #: A thinking model's reasoning, apart from ``content`` (vLLM's and
    #: llama-server's ``reasoning_content``); absent when there is none.
    reasoning: str = ""

    def as_json(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.content if self.content or not self.tool_calls else None,
            "refusal": None,
        }
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [tool_call_json(call) for call in self.tool_calls]
        return {
            "index": self.index,
            "message": message,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
        }


def completion_response(
    *,
    id: str,
    created: int,
    model: str,
    choices: Sequence[CompletionChoice],
    usage: TokenUsage,
) -> bytes:
    """The body of a whole ``/v1/completions`` answer."""
    return _dumps(
        {
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice.as_json() for choice in choices],
            "usage": usage.as_json(),
            "system_fingerprint": None,
        }
    )


def chat_completion_response(
    *,
    id: str,
    created: int,
    model: str,
    choices: Sequence[ChatChoice],
    usage: TokenUsage,
) -> bytes:
    """The body of a whole ``/v1/chat/completions`` answer."""
    return _dumps(
        {
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [choice.as_json() for choice in choices],
            "usage": usage.as_json(),
            "system_fingerprint": None,
        }
    )


def sse_event(obj: Any) -> bytes:
    """One Server-Sent Event carrying ``obj`` as JSON (compact, so it holds
    no newline and the event is one ``data:`` line)."""
    return b"data: " + _dumps(obj) + b"\n\n"


@attrs.define
class _Stream:
    id: str
    created: int
    model: str
    include_usage: bool

    def _chunk(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if self.include_usage:
            # OpenAI puts "usage": null in every chunk but the last when the
            # client asked for usage.
            chunk["usage"] = None
        return chunk

    _object: str = attrs.field(default="", init=False)

    def end(self, usage: TokenUsage) -> bytes:
        """The end of the stream, after every choice's last chunk: the usage
        chunk when the client asked for it, then ``[DONE]``."""
        out = b""
        if self.include_usage:
            final = self._chunk(self._object, [])
            final["usage"] = usage.as_json()
            out += sse_event(final)
        return out + SSE_DONE

    def finish_choice(
        self,
        reason: FinishReason,
        text: str = "",
        logprobs: dict[str, Any] | None = None,
        *,
        index: int = 0,
    ) -> bytes:
        """Choice ``index``'s last chunk (its finish reason)."""
        raise NotImplementedError

    def finish(
        self,
        reason: FinishReason,
        usage: TokenUsage,
        text: str = "",
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        """The one choice's last chunk, then the end."""
        return self.finish_choice(reason, text, logprobs) + self.end(usage)

    def error(self, error: OpenAIError) -> bytes:
        """An error after the stream began (the status is already sent): an
        event in OpenAI's error shape, which the SDKs raise, then the end."""
        return b"data: " + error.body() + b"\n\n" + SSE_DONE


@attrs.define
class CompletionStream(_Stream):
    """The events of one streamed ``/v1/completions`` answer, in order:
    :meth:`text` for each piece, then :meth:`finish` (its finish reason,
    the usage chunk when asked for, and ``[DONE]``). With several choices,
    each piece names its choice (``index``), each choice ends with
    :meth:`finish_choice`, and :meth:`end` ends the stream."""

    _object: str = attrs.field(default="text_completion", init=False)

    def text(self, text: str, logprobs: dict[str, Any] | None = None, *, index: int = 0) -> bytes:
        return sse_event(
            self._chunk(
                self._object,
                [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}],
            )
        )

    def finish_choice(
        self,
        reason: FinishReason,
        text: str = "",
        logprobs: dict[str, Any] | None = None,
        *,
        index: int = 0,
    ) -> bytes:
        last = [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]
        return sse_event(self._chunk(self._object, last))


@attrs.define
class ChatCompletionStream(_Stream):
    """The events of one streamed ``/v1/chat/completions`` answer, in order:
    :meth:`start` (the assistant role), :meth:`text` for each piece, then
    :meth:`finish`. With several choices, each chunk names its choice
    (``index``): each starts with its role, ends with :meth:`finish_choice`,
    and :meth:`end` ends the stream."""

    _object: str = attrs.field(default="chat.completion.chunk", init=False)

    def _delta(
        self,
        index: int,
        delta: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
        reason: FinishReason | None = None,
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return sse_event(self._chunk(self._object, [choice]))

    def start(self, *, index: int = 0) -> bytes:
        return self._delta(index, {"role": "assistant", "content": ""})

    def text(self, text: str, logprobs: dict[str, Any] | None = None, *, index: int = 0) -> bytes:
        return self._delta(index, {"content": text}, logprobs)

    def reasoning(self, text: str, *, index: int = 0) -> bytes:
        """A piece of a thinking model's reasoning (``reasoning_content``)."""
        return self._delta(index, {"reasoning_content": text})

    def tool_call(
        self, call_index: int, *, id: str = "", name: str = "", arguments: str = "", index: int = 0
    ) -> bytes:
        """A piece of tool call ``call_index`` of choice ``index``: its first
        chunk carries the id, type and name (and no arguments yet), the next
        ones arguments only."""
        call: dict[str, Any] = {"index": call_index}
        if id:
            call.update(id=id, type="function", function={"name": name, "arguments": ""})
        else:
            call["function"] = {"arguments": arguments}
        return self._delta(index, {"tool_calls": [call]})

    def finish_choice(
        self,
        reason: FinishReason,
        text: str = "",
        logprobs: dict[str, Any] | None = None,
        *,
        index: int = 0,
    ) -> bytes:
        return self._delta(index, {"content": text} if text else {}, logprobs, reason)


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """A tool call as OpenAI writes it in a message."""
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def model_object(
    name: str,
    created: int,
    *,
    context_length: int | None = None,
    limits: Mapping[str, int] | None = None,
    kernels: str | None = None,
    status: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A model object: OpenAI's fields, vLLM's ``max_model_len`` (which
    clients read for the context), the server's ``limits`` (the same
    figures as the WebSocket ``info`` reply's, from the same declarations),
    the ``kernels`` that run the model (as ``info`` says them) and, on a
    server of several models, its ``status`` (llama-server's router's). Also
    the fields Anthropic's model objects have (``type``, ``display_name``,
    ``created_at``), so that its SDKs' ``models.list`` reads it too."""
    obj: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "trioserve",
        "type": "model",
        "display_name": name,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
    }
    if context_length is not None:
        obj["max_model_len"] = context_length
    if limits is not None:
        obj["limits"] = dict(limits)
    if kernels is not None:
        obj["kernels"] = kernels
    if status is not None:
        obj["status"] = dict(status)
    return obj


def models_response(models: Sequence[tuple[str, Mapping[str, Any]]], created: int) -> bytes:
    """The body of ``GET /v1/models``: each served model (its name and
    :func:`model_object`'s keywords), with the paging fields of Anthropic's
    list, and llama-server's ``models`` array in Ollama's shape, which some
    clients read instead of ``data``."""
    data = [model_object(name, created, **fields) for name, fields in models]
    listed = [
        {
            "name": name,
            "model": name,
            "type": "model",
            "description": "",
            "tags": [],
            "capabilities": ["completion"],
        }
        for name, _ in models
    ]
    names = [name for name, _ in models]
    return _dumps(
        {
            "object": "list",
            "data": data,
            "models": listed,
            "has_more": False,
            "first_id": names[0] if names else None,
            "last_id": names[-1] if names else None,
        }
    )
