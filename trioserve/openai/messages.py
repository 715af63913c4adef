"""Chat messages of the OpenAI API: roles, text content, and the tool calls
and tool results of an agent's history.

An assistant message may carry ``tool_calls`` (or the legacy
``function_call``); a ``tool`` message answers one of them by its
``tool_call_id`` (a legacy ``function`` message by the function's name). A
tool message that answers no call of the assistant message before it is a
400 naming its ``tool_call_id``: the model would read a result of nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Literal

import attrs

from trioserve.vocabulary.tools import ToolCall

from .fields import OpenAILimits
from .params import UNSUPPORTED, BadParam, is_text, show

__all__ = ["ChatMessage", "messages_rule"]

#: Content part types of other models (images, audio, files): unsupported,
#: not malformed.
_MEDIA_PARTS: Final = frozenset({"image_url", "input_audio", "file", "audio", "image"})
_MESSAGE_KEYS: Final = frozenset(
    {"role", "content", "name", "tool_calls", "function_call", "refusal", "audio", "tool_call_id"}
)
#: A call's id as clients send it back (OpenAI's are about 30 characters).
_MAX_ID_CHARS: Final = 256
#: Calls one assistant message may carry.
_MAX_CALLS: Final = 128


@attrs.frozen
class ChatMessage:
    """One message of a chat, as the chat template sees it. ``developer``
    messages arrive as ``system`` (templates know that role); multi-part text
    content is joined with newlines; ``function`` messages arrive as
    ``tool`` messages."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def messages_rule(limits: OpenAILimits) -> Callable[[Any, Any], tuple[ChatMessage, ...]]:
    def hook(value: Any, _: Any) -> tuple[ChatMessage, ...]:
        if not isinstance(value, list) or not value:
            raise BadParam(
                "messages", f"messages must be a non-empty list of messages, got {show(value)}"
            )
        if len(value) > limits.max_messages:
            raise BadParam(
                "messages",
                f"messages may hold at most {limits.max_messages} messages, got {len(value)}",
            )
        messages = [_message(item, f"messages[{i}]", limits) for i, item in enumerate(value)]
        return tuple(_answered(messages))

    return hook


def _answered(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Each tool message answers a call of the last assistant message before
    it, each call once; a legacy function message (no id) answers the next
    unanswered call of its name."""
    open_calls: dict[str, ToolCall] = {}
    out = []
    for index, message in enumerate(messages):
        if message.role == "assistant":
            open_calls = {call.id: call for call in message.tool_calls}
        elif message.role == "tool":
            where = f"messages[{index}]"
            call_id = message.tool_call_id
            if call_id is None:
                named = [c for c in open_calls.values() if c.name == message.name]
                if not named:
                    raise BadParam(
                        f"{where}.name",
                        f"{where} is a function result, but the assistant message before it"
                        f" called no function named {show(message.name)}",
                    )
                call_id = named[0].id
            if call_id not in open_calls:
                if not open_calls:
                    why = "no assistant message with tool_calls comes before it"
                else:
                    why = f"the calls still open are {', '.join(sorted(open_calls))}"
                raise BadParam(
                    f"{where}.tool_call_id",
                    f"{where}.tool_call_id {show(call_id)} answers no tool call: {why}",
                )
            call = open_calls.pop(call_id)
            message = attrs.evolve(message, tool_call_id=call_id, name=call.name)
        else:
            open_calls = {}
        out.append(message)
    return out


def _message(obj: Any, path: str, limits: OpenAILimits) -> ChatMessage:
    if not isinstance(obj, dict):
        raise BadParam(path, f"{path} must be an object with role and content, got {show(obj)}")
    role = obj.get("role")
    for key in obj:
        if key not in _MESSAGE_KEYS:
            raise BadParam(f"{path}.{key}", f"unknown field {show(key)} in {path}")
    if role == "developer":
        role = "system"
    if role == "function":
        role = "tool"
    if role not in ("system", "user", "assistant", "tool"):
        raise BadParam(
            f"{path}.role",
            f"{path}.role must be one of system, developer, user, assistant, tool, function;"
            f" got {show(role)}",
        )
    if obj.get("audio") is not None:
        raise BadParam(f"{path}.audio", f"{path}.audio: audio is not supported", UNSUPPORTED)
    name = obj.get("name")
    if name is not None and (not is_text(name) or len(name) > limits.max_name_chars):
        raise BadParam(
            f"{path}.name",
            f"{path}.name must be a string of at most {limits.max_name_chars} characters, "
            f"got {show(name)}",
        )
    calls: tuple[ToolCall, ...] = ()
    call_id = None
    if role == "assistant":
        calls = _calls(obj, path)
    else:
        for key in ("tool_calls", "function_call"):
            if obj.get(key) not in (None, []):
                raise BadParam(f"{path}.{key}", f"{path}.{key} belongs to assistant messages")
    if role == "tool":
        call_id = obj.get("tool_call_id")
        if call_id is None and obj.get("role") == "tool":
            raise BadParam(f"{path}.tool_call_id", f"{path}.tool_call_id is required")
        if call_id is not None and (not is_text(call_id) or not 0 < len(call_id) <= _MAX_ID_CHARS):
            raise BadParam(
                f"{path}.tool_call_id",
                f"{path}.tool_call_id must be a string of 1 to {_MAX_ID_CHARS} characters,"
                f" got {show(call_id)}",
            )
        if obj.get("role") == "function" and name is None:
            raise BadParam(f"{path}.name", f"{path}.name is required in a function message")
    elif obj.get("tool_call_id") is not None:
        raise BadParam(f"{path}.tool_call_id", f"{path}.tool_call_id belongs to tool messages")
    content = _content(obj.get("content"), f"{path}.content", role, limits)
    return ChatMessage(
        role=role, content=content, name=name, tool_calls=calls, tool_call_id=call_id
    )


def _calls(obj: dict[str, Any], path: str) -> tuple[ToolCall, ...]:
    legacy = obj.get("function_call")
    listed = obj.get("tool_calls")
    if legacy is not None:
        if listed not in (None, []):
            raise BadParam(f"{path}.function_call", f"give {path}.tool_calls or function_call")
        return (_function(legacy, f"{path}.function_call", ToolCall.new_id()),)
    if listed is None:
        return ()
    if not isinstance(listed, list) or len(listed) > _MAX_CALLS:
        raise BadParam(
            f"{path}.tool_calls",
            f"{path}.tool_calls must be a list of at most {_MAX_CALLS} calls, got {show(listed)}",
        )
    calls = []
    seen: set[str] = set()
    for index, item in enumerate(listed):
        where = f"{path}.tool_calls[{index}]"
        if not isinstance(item, dict):
            raise BadParam(where, f"{where} must be an object, got {show(item)}")
        for key in item:
            if key not in ("id", "type", "function"):
                raise BadParam(f"{where}.{key}", f"unknown field {show(key)} in {where}")
        if item.get("type", "function") != "function":
            raise BadParam(f"{where}.type", f"{where}.type must be 'function'", UNSUPPORTED)
        call_id = item.get("id")
        if not is_text(call_id) or not 0 < len(call_id) <= _MAX_ID_CHARS:
            raise BadParam(
                f"{where}.id",
                f"{where}.id must be a string of 1 to {_MAX_ID_CHARS} characters,"
                f" got {show(call_id)}",
            )
        if call_id in seen:
            raise BadParam(f"{where}.id", f"{where}.id {show(call_id)} is given twice")
        seen.add(call_id)
        calls.append(_function(item.get("function"), f"{where}.function", call_id))
    return tuple(calls)


def _function(value: Any, where: str, call_id: str) -> ToolCall:
    if not isinstance(value, dict):
        raise BadParam(where, f"{where} must be an object {{name, arguments}}, got {show(value)}")
    for key in value:
        if key not in ("name", "arguments"):
            raise BadParam(f"{where}.{key}", f"unknown field {show(key)} in {where}")
    name = value.get("name")
    if not is_text(name) or not 0 < len(name) <= 64:
        raise BadParam(
            f"{where}.name",
            f"{where}.name must be a string of 1 to 64 characters, got {show(name)}",
        )
    arguments = value.get("arguments", "{}")
    if not is_text(arguments):
        raise BadParam(
            f"{where}.arguments",
            f"{where}.arguments must be a string (JSON), got {show(arguments)}",
        )
    # Not checked for JSON: a call cut short by max_tokens comes back as the
    # client got it, and the model reads it as written.
    return ToolCall(call_id, name, arguments)


def _content(value: Any, path: str, role: str, limits: OpenAILimits) -> str:
    if value is None:
        if role == "assistant":
            return ""  # an assistant turn that carried only a refusal or tool calls
        raise BadParam(path, f"{path} is required")
    if isinstance(value, str):
        if not is_text(value):
            raise BadParam(path, f"{path} is not valid unicode (it holds a lone surrogate)")
        return value
    if not isinstance(value, list):
        raise BadParam(path, f"{path} must be a string or a list of text parts, got {show(value)}")
    if len(value) > limits.max_content_parts:
        raise BadParam(path, f"{path} may hold at most {limits.max_content_parts} parts")
    texts: list[str] = []
    for index, part in enumerate(value):
        where = f"{path}[{index}]"
        if not isinstance(part, dict):
            raise BadParam(where, f"{where} must be an object, got {show(part)}")
        kind = part.get("type")
        if kind != "text":
            raise BadParam(
                f"{where}.type",
                f"{where}.type must be 'text' (this model reads text only), got {show(kind)}",
                UNSUPPORTED if isinstance(kind, str) and kind in _MEDIA_PARTS else None,
            )
        extra = set(part) - {"type", "text"}
        if extra:
            key = sorted(extra)[0]
            raise BadParam(f"{where}.{key}", f"unknown field {show(key)} in {where}")
        text = part.get("text")
        if not isinstance(text, str) or not is_text(text):
            raise BadParam(f"{where}.text", f"{where}.text must be a string, got {show(text)}")
        texts.append(text)
    return "\n".join(texts)
