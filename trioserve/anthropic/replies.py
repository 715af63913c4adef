"""The reply to one Messages API request, sans-IO: from the state of its
generation to a whole ``message`` object, or to the named Server-Sent
Events of a stream in Anthropic's order::

    message_start
    content_block_start, content_block_delta ..., content_block_stop   (each block)
    message_delta   (stop_reason, stop_sequence, usage)
    message_stop

with ``ping`` while the prompt is read and ``error`` when the generation
fails. When the request gives tools, the released text is split into
``text`` and ``tool_use`` blocks as it streams (a call's input goes out as
``input_json_delta`` pieces); a turn that called a tool ends in
``tool_use``. It does no I/O and knows no trio: the server follows the
generation, calls :meth:`MessageReply.advance` when it has released text,
and writes the bytes it gets.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from trioserve.vocabulary.results import Finished, GenerationState
from trioserve.vocabulary.tools import (
    CallArguments,
    CallEnd,
    CallStart,
    Content,
    ToolCall,
    ToolCallReader,
    ToolEvent,
)

from .errors import AnthropicError
from .requests import MessagesRequest

__all__ = ["GenerationState", "MessageReply", "StopReason", "new_message_id", "sse"]

StopReason = Literal[
    "end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"
]

#: The message of a reply whose generation the server's shutdown interrupted.
SHUTTING_DOWN = "the server is shutting down"


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic writes them (``toolu_...``)."""
    return "toolu_" + call_id.removeprefix("call_")


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One named Server-Sent Event."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event}\ndata: {payload}\n\n".encode()


def _input(call: ToolCall) -> Any:
    """A call's arguments as the ``input`` object: a call cut short by
    ``max_tokens`` has arguments that are not JSON yet, and gives ``{}``
    (the streamed ``input_json_delta`` pieces carry what was written)."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _thinking_block(text: str) -> dict[str, Any]:
    """A ``thinking`` block: the signature is empty (Anthropic signs its own
    models' thinking; a local model's is not signed)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def stop_reason(finished: Finished, called: bool, max_tokens: int | None = None) -> StopReason:
    """How a reply ended, in Anthropic's words. ``max_tokens`` is an upper
    bound here: a reply cut before it, by the context's room or the server's
    cap, ran out of context (asking again for more tokens cannot help)."""
    if finished.reason == "max_new_tokens":
        if max_tokens is not None and finished.generated_tokens < max_tokens:
            return "model_context_window_exceeded"
        return "max_tokens"
    if finished.reason == "stop_string":
        return "stop_sequence"
    return "tool_use" if called else "end_turn"


@attrs.define(eq=False)
class MessageReply:
    """The answer to one started request: whole (:meth:`body`) or streamed
    (:meth:`opening`, then :meth:`advance` at each wake-up, :meth:`keepalive`
    while nothing comes, until :attr:`broken` or :attr:`complete`, then
    :meth:`error` or :meth:`end`)."""

    request: MessagesRequest
    model: str
    state: GenerationState
    id: str = attrs.Factory(new_message_id)
    _reader: ToolCallReader | None = attrs.field(init=False, default=None)
    _sent: int = attrs.field(init=False, default=0)
    _thought: int = attrs.field(init=False, default=0)
    #: The open block's kind and index (-1: none yet).
    _block: str | None = attrs.field(init=False, default=None)
    _index: int = attrs.field(init=False, default=-1)
    _called: bool = attrs.field(init=False, default=False)
    _ended: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        if self.state.tool_format is not None:
            self._reader = ToolCallReader(self.state.tool_format)

    @property
    def finished(self) -> bool:
        return self.state.finished is not None

    def usage(self) -> dict[str, int]:
        """Anthropic counts the prompt's cached tokens apart from the rest."""
        state = self.state
        return {
            "input_tokens": state.prompt_tokens - state.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": state.cached_tokens,
            "output_tokens": state.generated_tokens,
        }

    def outcome(self) -> Literal["num_tokens", "eos"]:
        finished = self.state.finished
        assert finished is not None
        return "num_tokens" if finished.reason == "max_new_tokens" else "eos"

    def failure(
        self, *, draining: bool, message: str = SHUTTING_DOWN
    ) -> tuple[Literal["internal", "interrupted", "invalid_request"], AnthropicError]:
        """The error of a reply whose generation did not finish, and the
        outcome to count (as the OpenAI door's): the request's own failure
        (its constraint broke down) is a 400, the engine's a 500."""
        if self.state.outcome == "failed" and self.state.failure_cause == "request":
            message = self.state.failure or "the request cannot be generated"
            return "invalid_request", AnthropicError(400, message)
        if self.state.outcome == "failed" and not draining:
            return "internal", AnthropicError(500, self.state.failure or "the engine failed")
        # 503, not 529: a proxy in front (nginx) passes a 503 on to another
        # instance, and Anthropic's SDKs retry both.
        return "interrupted", AnthropicError(503, message, retry_after=1)

    def _message(
        self, content: list[dict[str, Any]], reason: StopReason | None, stop: str | None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop,
            "usage": self.usage(),
        }

    # ------------------------------------------------------------------
    # Whole

    def body(self) -> bytes:
        """The whole ``message`` object; the generation has finished."""
        finished = self.state.finished
        if finished is None:
            raise ValueError("a whole reply needs its generation finished")
        content: list[dict[str, Any]] = []
        if self.state.reasoning:
            content.append(_thinking_block(self.state.reasoning))
        events: list[ToolEvent] = [Content(self.state.response)]
        if self._reader is not None:
            reader = ToolCallReader(self._reader.fmt)
            events = reader.feed(self.state.response) + reader.finish()
        called = False
        for event in events:
            if isinstance(event, Content) and event.text:
                if content and content[-1]["type"] == "text":
                    content[-1]["text"] += event.text
                else:
                    content.append({"type": "text", "text": event.text})
            elif isinstance(event, CallEnd):
                called = True
                content.append(
                    {
                        "type": "tool_use",
                        "id": tool_use_id(event.call.id),
                        "name": event.call.name,
                        "input": _input(event.call),
                    }
                )
        reason = stop_reason(finished, called, self.request.max_tokens)
        stop = finished.stop_string if reason == "stop_sequence" else None
        return json.dumps(self._message(content, reason, stop), ensure_ascii=False).encode()

    # ------------------------------------------------------------------
    # Streamed

    @property
    def broken(self) -> bool:
        return self._ended and self.state.finished is None

    @property
    def complete(self) -> bool:
        return self._ended and self.state.finished is not None

    def opening(self) -> bytes:
        """``message_start``: the prompt is read, nothing is generated yet."""
        message = self._message([], None, None)
        message["usage"]["output_tokens"] = 0
        return sse("message_start", {"type": "message_start", "message": message})

    def keepalive(self) -> bytes:
        """What a stream sends while nothing else comes (a long prompt)."""
        return sse("ping", {"type": "ping"})

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._block = kind
        return out + sse(
            "content_block_start",
            {"type": "content_block_start", "index": self._index, "content_block": block},
        )

    def _close(self) -> bytes:
        if self._block is None:
            return b""
        self._block = None
        return sse("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse(
            "content_block_delta",
            {"type": "content_block_delta", "index": self._index, "delta": delta},
        )

    def _events(self, events: Sequence[ToolEvent]) -> bytes:
        out = b""
        for event in events:
            if isinstance(event, Content):
                if not event.text:
                    continue
                if self._block != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out += self._delta({"type": "text_delta", "text": event.text})
            elif isinstance(event, CallStart):
                self._called = True
                block = {
                    "type": "tool_use",
                    "id": tool_use_id(event.id),
                    "name": event.name,
                    "input": {},
                }
                out += self._open("tool_use", block)
            elif isinstance(event, CallArguments):
                if event.text:
                    out += self._delta({"type": "input_json_delta", "partial_json": event.text})
            elif isinstance(event, CallEnd):
                out += self._close()
        return out

    def _feed(self, text: str) -> bytes:
        if self._reader is None:
            return self._events([Content(text)])
        return self._events(self._reader.feed(text))

    def advance(self) -> bytes:
        """The events of what was released since the last call; when the
        generation has ended, the last block's ``content_block_stop``."""
        if self._ended:
            return b""
        state = self.state
        ended = state.outcome is not None
        out = b""
        thought = state.reasoning[self._thought :]
        if thought:
            # The thinking comes first: no answer is released before it ends.
            self._thought += len(thought)
            if self._block != "thinking":
                out += self._open("thinking", _thinking_block(""))
            out += self._delta({"type": "thinking_delta", "thinking": thought})
        text = state.response[self._sent :]
        self._sent += len(text)
        out += self._feed(text) if text else b""
        if not ended:
            return out
        self._ended = True
        if self._reader is not None:
            out += self._events(self._reader.finish())
        return out + self._close()

    def end(self) -> bytes:
        """``message_delta`` (how it stopped, the usage) and ``message_stop``."""
        finished = self.state.finished
        assert finished is not None
        reason = stop_reason(finished, self._called, self.request.max_tokens)
        delta = {
            "stop_reason": reason,
            "stop_sequence": finished.stop_string if reason == "stop_sequence" else None,
        }
        return sse(
            "message_delta", {"type": "message_delta", "delta": delta, "usage": self.usage()}
        ) + sse("message_stop", {"type": "message_stop"})

    def error(self, error: AnthropicError) -> bytes:
        """The stream's end when the generation failed or was interrupted."""
        return sse("error", error.event())
