"""The reply to one Responses API request, sans-IO: from the state of its
generation to a whole ``response`` object, or to the named Server-Sent
Events of a stream in OpenAI's order::

    response.created, response.in_progress
    response.output_item.added                       (a message)
      response.content_part.added
      response.output_text.delta ...
      response.output_text.done, response.content_part.done
    response.output_item.done
    response.output_item.added                       (a function call)
      response.function_call_arguments.delta ...
      response.function_call_arguments.done
    response.output_item.done
    response.completed | response.incomplete | response.failed

each event's data carrying its ``sequence_number``. When the request gives
tools, the released text is split into message and ``function_call`` items
as it streams. It does no I/O and knows no trio: the server follows the
generation, calls :meth:`ResponseReply.advance` when it has released text,
and writes the bytes it gets.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from trioserve.openai.errors import OpenAIError
from trioserve.vocabulary.results import GenerationState
from trioserve.vocabulary.tools import (
    CallArguments,
    CallEnd,
    CallStart,
    Content,
    ToolCall,
    ToolCallReader,
    ToolEvent,
)

from .items import Turns, history_after
from .requests import ResponsesRequest

__all__ = ["ResponseReply", "new_response_id", "sse"]

#: The message of a reply whose generation the server's shutdown interrupted.
SHUTTING_DOWN = "the server is shutting down"


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


def _item_id(kind: Literal["msg", "fc", "rs"]) -> str:
    return f"{kind}_{secrets.token_hex(24)}"


def sse(data: dict[str, Any]) -> bytes:
    """One named Server-Sent Event: its name is the data's ``type``."""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {data['type']}\ndata: {payload}\n\n".encode()


@attrs.define(eq=False)
class _Item:
    """One output item as it is written."""

    kind: Literal["message", "function_call", "reasoning"]
    id: str
    text: str = ""
    call_id: str = ""
    name: str = ""

    def object(self, status: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {
                "type": "reasoning",
                "id": self.id,
                "summary": [],
                "content": [] if status == "in_progress" else [_reasoning_part(self.text)],
                "status": status,
            }
        if self.kind == "message":
            content = [] if status == "in_progress" else [_text_part(self.text)]
            return {
                "type": "message",
                "id": self.id,
                "status": status,
                "role": "assistant",
                "content": content,
            }
        return {
            "type": "function_call",
            "id": self.id,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.text,
            "status": status,
        }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _part(item: _Item, text: str) -> dict[str, Any]:
    return _reasoning_part(text) if item.kind == "reasoning" else _text_part(text)


#: The delta and done events of an item's text, by its kind.
_TEXT_EVENTS: dict[str, str] = {
    "message": "response.output_text",
    "reasoning": "response.reasoning_text",
}


@attrs.define(eq=False)
class ResponseReply:
    """The answer to one started request: whole (:meth:`body`) or streamed
    (:meth:`opening`, then :meth:`advance` at each wake-up, until
    :attr:`broken` or :attr:`complete`, then :meth:`error` or :meth:`end`).
    :meth:`response` is the ``response`` object at any point (what a stored
    response keeps), :meth:`history` the conversation it leaves."""

    request: ResponsesRequest
    model: str
    state: GenerationState
    id: str = attrs.Factory(new_response_id)
    created_at: int = attrs.Factory(lambda: int(time.time()))
    _reader: ToolCallReader | None = attrs.field(init=False, default=None)
    _sent: int = attrs.field(init=False, default=0)
    _thought: int = attrs.field(init=False, default=0)
    _sequence: int = attrs.field(init=False, default=0)
    #: Items done, and the one being written.
    _done: list[_Item] = attrs.field(init=False, factory=list)
    _open: _Item | None = attrs.field(init=False, default=None)
    _ended: bool = attrs.field(init=False, default=False)
    #: The whole reply's items (:meth:`body`), read once.
    _whole: list[_Item] | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.state.tool_format is not None:
            self._reader = ToolCallReader(self.state.tool_format)

    @property
    def finished(self) -> bool:
        return self.state.finished is not None

    # ------------------------------------------------------------------
    # The response object

    def usage(self) -> dict[str, Any]:
        state = self.state
        return {
            "input_tokens": state.prompt_tokens,
            "input_tokens_details": {"cached_tokens": state.cached_tokens},
            "output_tokens": state.generated_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": state.prompt_tokens + state.generated_tokens,
        }

    def _status(self) -> Literal["in_progress", "completed", "incomplete", "failed"]:
        finished = self.state.finished
        if finished is None:
            return "failed" if self.state.outcome is not None else "in_progress"
        return "incomplete" if finished.reason == "max_new_tokens" else "completed"

    def _items(self) -> list[_Item]:
        """The items written: a stream's as they went out, a whole reply's
        read once from the finished text."""
        if self._sequence > 0:
            return self._done
        if self._whole is None:
            if self.state.finished is None:
                return []
            events: list[ToolEvent] = [Content(self.state.response)]
            if self._reader is not None:
                reader = ToolCallReader(self._reader.fmt)
                events = reader.feed(self.state.response) + reader.finish()
            self._whole = _collect(events)
            if self.state.reasoning:
                thought = _Item("reasoning", _item_id("rs"), text=self.state.reasoning)
                self._whole.insert(0, thought)
        return self._whole

    def response(self, error: OpenAIError | None = None) -> dict[str, Any]:
        """The ``response`` object as it stands."""
        request = self.request
        status = "failed" if error is not None else self._status()
        item_status = "incomplete" if status == "incomplete" else "completed"
        output = [item.object(item_status) for item in self._items()]
        texts = [item.text for item in self._items() if item.kind == "message"]
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None
            if error is None
            else {"code": _error_code(error), "message": error.message},
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": request.instructions or None,
            "max_output_tokens": request.max_output_tokens,
            "model": self.model,
            "output": output,
            "output_text": "".join(texts),
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": dict(request.reasoning or {"effort": None, "summary": None}),
            "service_tier": "default",
            "store": request.store,
            "temperature": float(request.sampling_settings().temperature),
            "text": dict(request.text),
            "tool_choice": request.tool_choice,
            "tools": list(request.tool_objects),
            "top_p": float(request.sampling_settings().top_p),
            "truncation": "disabled",
            "usage": None if status == "in_progress" else self.usage(),
            "user": request.user,
            "metadata": dict(request.metadata),
        }

    def history(self) -> Turns:
        """The conversation after this response: what ``previous_response_id``
        continues."""
        items = self._items()
        text = "".join(item.text for item in items if item.kind == "message")
        calls = [
            ToolCall(item.call_id, item.name, item.text)
            for item in items
            if item.kind == "function_call"
        ]
        return history_after(self.request.turns, text, calls)

    def outcome(self) -> Literal["num_tokens", "eos"]:
        finished = self.state.finished
        assert finished is not None
        return "num_tokens" if finished.reason == "max_new_tokens" else "eos"

    def failure(
        self, *, draining: bool, message: str = SHUTTING_DOWN
    ) -> tuple[Literal["internal", "interrupted", "invalid_request"], OpenAIError]:
        """The error of a reply whose generation did not finish, and the
        outcome to count: the request's own failure (its constraint broke
        down) is a 400, the engine's a 500, the server's shutdown a 503."""
        state = self.state
        if state.outcome == "failed" and state.failure_cause == "request":
            message = state.failure or "the request cannot be generated"
            return "invalid_request", OpenAIError(400, message, code="constraint_failed")
        if state.outcome == "failed" and not draining:
            return "internal", OpenAIError(
                500, state.failure or "the engine failed", code="server_error"
            )
        return "interrupted", OpenAIError(503, message, code="server_error", retry_after=1)

    # ------------------------------------------------------------------
    # Whole

    def body(self) -> bytes:
        """The whole ``response`` object; the generation has finished."""
        if self.state.finished is None:
            raise ValueError("a whole reply needs its generation finished")
        return json.dumps(self.response(), ensure_ascii=False).encode()

    # ------------------------------------------------------------------
    # Streamed

    @property
    def broken(self) -> bool:
        return self._ended and self.state.finished is None

    @property
    def complete(self) -> bool:
        return self._ended and self.state.finished is not None

    def _event(self, data: dict[str, Any]) -> bytes:
        data["sequence_number"] = self._sequence
        self._sequence += 1
        return sse(data)

    def opening(self) -> bytes:
        """``response.created`` and ``response.in_progress``."""
        response = self.response()
        return self._event({"type": "response.created", "response": response}) + self._event(
            {"type": "response.in_progress", "response": response}
        )

    def _start(self, item: _Item) -> bytes:
        out = self._finish_item()
        self._open = item
        index = len(self._done)
        out += self._event(
            {
                "type": "response.output_item.added",
                "output_index": index,
                "item": item.object("in_progress"),
            }
        )
        if item.kind != "function_call":
            out += self._event(
                {
                    "type": "response.content_part.added",
                    "item_id": item.id,
                    "output_index": index,
                    "content_index": 0,
                    "part": _part(item, ""),
                }
            )
        return out

    def _finish_item(self) -> bytes:
        item = self._open
        if item is None:
            return b""
        self._open = None
        index = len(self._done)
        self._done.append(item)
        out = b""
        if item.kind != "function_call":
            done: dict[str, Any] = {
                "type": _TEXT_EVENTS[item.kind] + ".done",
                "item_id": item.id,
                "output_index": index,
                "content_index": 0,
                "text": item.text,
            }
            if item.kind == "message":
                done["logprobs"] = []
            out += self._event(done)
            out += self._event(
                {
                    "type": "response.content_part.done",
                    "item_id": item.id,
                    "output_index": index,
                    "content_index": 0,
                    "part": _part(item, item.text),
                }
            )
        else:
            out += self._event(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item.id,
                    "output_index": index,
                    "name": item.name,
                    "arguments": item.text,
                }
            )
        status = "incomplete" if self._status() == "incomplete" else "completed"
        return out + self._event(
            {
                "type": "response.output_item.done",
                "output_index": index,
                "item": item.object(status),
            }
        )

    def _events(self, events: Sequence[ToolEvent]) -> bytes:
        out = b""
        for event in events:
            if isinstance(event, Content):
                if not event.text:
                    continue
                if self._open is None or self._open.kind != "message":
                    out += self._start(_Item("message", _item_id("msg")))
                assert self._open is not None
                self._open.text += event.text
                out += self._event(
                    {
                        "type": "response.output_text.delta",
                        "item_id": self._open.id,
                        "output_index": len(self._done),
                        "content_index": 0,
                        "delta": event.text,
                        "logprobs": [],
                    }
                )
            elif isinstance(event, CallStart):
                out += self._start(
                    _Item("function_call", _item_id("fc"), call_id=event.id, name=event.name)
                )
            elif isinstance(event, CallArguments):
                if event.text and self._open is not None:
                    self._open.text += event.text
                    out += self._event(
                        {
                            "type": "response.function_call_arguments.delta",
                            "item_id": self._open.id,
                            "output_index": len(self._done),
                            "delta": event.text,
                        }
                    )
            elif isinstance(event, CallEnd):
                if self._open is not None and self._open.kind == "function_call":
                    # The reader's own reading of the arguments is the call's.
                    self._open.text = event.call.arguments
                out += self._finish_item()
        return out

    def _thinking(self, thought: str) -> bytes:
        """The events of new reasoning: it comes first, in an item of its own
        (no answer is released before it ends)."""
        if not thought:
            return b""
        self._thought += len(thought)
        out = b""
        if self._open is None or self._open.kind != "reasoning":
            out += self._start(_Item("reasoning", _item_id("rs")))
        assert self._open is not None
        self._open.text += thought
        return out + self._event(
            {
                "type": "response.reasoning_text.delta",
                "item_id": self._open.id,
                "output_index": len(self._done),
                "content_index": 0,
                "delta": thought,
            }
        )

    def advance(self) -> bytes:
        """The events of what was released since the last call; when the
        generation has ended, the last item's ``done`` events."""
        if self._ended:
            return b""
        state = self.state
        ended = state.outcome is not None
        out = self._thinking(state.reasoning[self._thought :])
        text = state.response[self._sent :]
        self._sent += len(text)
        if self._reader is None:
            out += self._events([Content(text)]) if text else b""
        else:
            out += self._events(self._reader.feed(text)) if text else b""
        if not ended:
            return out
        self._ended = True
        if self._reader is not None:
            out += self._events(self._reader.finish())
        if state.finished is None:
            return out
        return out + self._finish_item()

    def end(self) -> bytes:
        """``response.completed``, or ``response.incomplete`` when
        ``max_output_tokens`` (or the context) cut it short."""
        kind = "response.incomplete" if self._status() == "incomplete" else "response.completed"
        return self._event({"type": kind, "response": self.response()})

    def error(self, error: OpenAIError) -> bytes:
        """The stream's end when the generation failed or was interrupted:
        ``response.failed``, the error in its ``response``."""
        self._open = None
        return self._event({"type": "response.failed", "response": self.response(error)})


def _error_code(error: OpenAIError) -> str:
    if error.code is not None:
        return error.code
    return "server_error" if error.status >= 500 else "invalid_request"


def _collect(events: Sequence[ToolEvent]) -> list[_Item]:
    """The items of a whole reply."""
    items: list[_Item] = []
    for event in events:
        if isinstance(event, Content) and event.text:
            if items and items[-1].kind == "message":
                items[-1].text += event.text
            else:
                items.append(_Item("message", _item_id("msg"), text=event.text))
        elif isinstance(event, CallEnd):
            call = event.call
            items.append(
                _Item(
                    "function_call",
                    _item_id("fc"),
                    text=call.arguments,
                    call_id=call.id,
                    name=call.name,
                )
            )
    return items
