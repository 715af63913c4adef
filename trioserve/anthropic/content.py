"""The conversation of a Messages request: ``system``, the ``messages``
turns and their content blocks, read into the chat the template renders
(what each block becomes: :mod:`trioserve.anthropic.requests`), with the
bounds of the whole request (:class:`MessagesLimits`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Final

import attrs

from trioserve import protocol as p
from trioserve.vocabulary.strict_json import show
from trioserve.vocabulary.tools import ToolCall

from .errors import AnthropicError, invalid

__all__ = ["DEFAULT_LIMITS", "MEDIA_PLACEHOLDER", "MessagesLimits", "read_messages", "read_system"]

_INFER: Final = p.request_fields("infer")


def _limit(name: str, limit: str) -> int:
    return int(_INFER[name].rule.limits[limit])


@attrs.frozen(kw_only=True)
class MessagesLimits:
    """Bounds on a request's fields, checked before any work (the WebSocket
    protocol's declared bounds where a field is shared)."""

    max_messages: int = _limit("messages", "max_messages")
    #: Content blocks of one message, and text blocks of ``system``.
    max_blocks: int = 1024
    max_stop_sequences: int = _limit("stop_conditions", "max_stop_conditions")
    max_stop_sequence_chars: int = _limit("stop_conditions", "max_stop_string_chars")
    max_tools: int = 128
    #: Claude Code's own tools run to 19,000 characters.
    max_description_chars: int = 131072
    max_id_chars: int = 256


DEFAULT_LIMITS: Final = MessagesLimits()

#: Content blocks of other modalities and of Anthropic's own tools.
_MEDIA: Final = frozenset(
    {"image", "document", "search_result", "container_upload", "file", "audio"}
)
_SERVER_RESULTS: Final = frozenset(
    {
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "mcp_tool_use",
        "mcp_tool_result",
        "tool_search_tool_result",
        "tool_reference",
    }
)
#: What stands in for a media block of an earlier turn: the model reads text.
MEDIA_PLACEHOLDER: Final = "[{kind} omitted: this model reads text only]"
#: Keys of a block that change nothing here.
_BLOCK_EXTRAS: Final = frozenset({"cache_control", "citations", "caller", "toolset_name"})
_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: Claude Code's per-request billing line in the system prompt.
_BILLING: Final = re.compile(r"^x-anthropic-billing-header:[^\n]*\n?", re.MULTILINE)


def _text(where: str, value: Any, *, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise invalid(
            f"{where}: must be a {'' if empty else 'non-empty '}string, got {show(value)}"
        )
    return value


def _object(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"{where}: must be an object, got {show(value)}")
    return value


def _keys(where: str, obj: Mapping[str, Any], known: frozenset[str]) -> None:
    for key in obj:
        if key not in known:
            raise invalid(f"{where}: unknown field {show(key)}")


def _blocks(where: str, value: Any, limits: MessagesLimits) -> list[dict[str, Any]]:
    """A content value as blocks: a string is one text block."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise invalid(f"{where}: must be a string or a list of content blocks, got {show(value)}")
    if len(value) > limits.max_blocks:
        raise invalid(f"{where}: at most {limits.max_blocks} blocks, got {len(value)}")
    return [_object(f"{where}[{i}]", block) for i, block in enumerate(value)]


def _text_block(where: str, block: Mapping[str, Any]) -> str:
    _keys(where, block, frozenset({"type", "text"}) | _BLOCK_EXTRAS)
    return _text(f"{where}.text", block.get("text"))


def _refuse_block(where: str, kind: Any) -> AnthropicError:
    if not isinstance(kind, str):
        return invalid(f"{where}.type: must be a string, got {show(kind)}")
    if kind in _MEDIA:
        return invalid(f"{where}.type: {kind} blocks are not supported: this model reads text only")
    if kind in _SERVER_RESULTS:
        return invalid(f"{where}.type: {kind} blocks belong to Anthropic's server tools")
    return invalid(f"{where}.type: unknown content block type {show(kind)}")


def read_system(value: Any, limits: MessagesLimits) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        text = value
    else:
        texts = []
        for i, block in enumerate(_blocks("system", value, limits)):
            where = f"system[{i}]"
            if block.get("type") != "text":
                raise invalid(
                    f"{where}.type: system blocks must be text, got {show(block.get('type'))}"
                )
            texts.append(_text_block(where, block))
        text = "\n".join(texts)
    return _BILLING.sub("", text)


def _tool_input(where: str, value: Any) -> str:
    if not isinstance(value, dict):
        raise invalid(f"{where}: must be an object, got {show(value)}")
    return json.dumps(value, ensure_ascii=False)


def _media_or_refuse(where: str, kind: Any, final: bool) -> str:
    """A media block of an earlier turn as a placeholder (a coding agent's
    history keeps a file it once read; refusing it would end the session),
    of the final turn a 400 (the question is about it)."""
    if final or not isinstance(kind, str) or kind not in _MEDIA:
        raise _refuse_block(where, kind)
    return MEDIA_PLACEHOLDER.format(kind=kind)


def _call_id(where: str, value: Any, limits: MessagesLimits) -> str:
    """A tool call's id (a ``tool_use``'s, or the one a ``tool_result`` answers)."""
    if not isinstance(value, str) or not 0 < len(value) <= limits.max_id_chars:
        raise invalid(
            f"{where}: must be a string of 1 to {limits.max_id_chars} characters, got {show(value)}"
        )
    return value


def _tool_result(
    where: str,
    block: Mapping[str, Any],
    open_calls: dict[str, str],
    limits: MessagesLimits,
    final: bool,
) -> dict[str, Any]:
    _keys(where, block, frozenset({"type", "tool_use_id", "content", "is_error"}) | _BLOCK_EXTRAS)
    call_id = _call_id(f"{where}.tool_use_id", block.get("tool_use_id"), limits)
    if call_id not in open_calls:
        why = (
            f"the calls still open are {', '.join(sorted(open_calls))}"
            if open_calls
            else "the assistant turn before it has no tool_use blocks"
        )
        raise invalid(f"{where}.tool_use_id: {show(call_id)} answers no tool_use: {why}")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise invalid(f"{where}.is_error: must be true or false, got {show(is_error)}")
    content = block.get("content", "")
    texts = []
    for i, part in enumerate(_blocks(f"{where}.content", content, limits)):
        kind = part.get("type")
        if kind != "text":
            texts.append(_media_or_refuse(f"{where}.content[{i}]", kind, final))
            continue
        texts.append(_text_block(f"{where}.content[{i}]", part))
    text = "\n".join(texts)
    return {
        "role": "tool",
        "content": f"Error: {text}" if is_error else text,
        "tool_call_id": call_id,
        "name": open_calls.pop(call_id),
    }


def _add_user(out: list[dict[str, Any]], text: str) -> None:
    """A user turn; one right after another user turn joins it, as Anthropic
    reads consecutive turns of one role (templates that require the roles to
    alternate would refuse the chat otherwise)."""
    if out and out[-1]["role"] == "user":
        out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{text}"}
    else:
        out.append({"role": "user", "content": text})


def read_messages(
    value: Any, system: str, limits: MessagesLimits
) -> tuple[tuple[dict[str, Any], ...], str]:
    """The template's messages and the prefill of a final assistant turn."""
    if not isinstance(value, list) or not value:
        raise invalid(f"messages: must be a non-empty list of messages, got {show(value)}")
    if len(value) > limits.max_messages:
        raise invalid(f"messages: at most {limits.max_messages} messages, got {len(value)}")
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    open_calls: dict[str, str] = {}
    prefix = ""
    for index, item in enumerate(value):
        where = f"messages[{index}]"
        message = _object(where, item)
        _keys(where, message, frozenset({"role", "content"}))
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise invalid(
                f"{where}.role: must be 'user', 'assistant' or 'system', got {show(role)}"
            )
        if "content" not in message:
            raise invalid(f"{where}.content: is required")
        blocks = _blocks(f"{where}.content", message["content"], limits)
        if not blocks or message["content"] == "":
            raise invalid(f"{where}.content: must not be empty")
        final = index == len(value) - 1
        texts: list[str] = []
        if role == "system":
            # Anthropic's mid-conversation system turn (Claude Code sends one).
            for i, block in enumerate(blocks):
                at = f"{where}.content[{i}]"
                if block.get("type") != "text":
                    raise invalid(f"{at}.type: system turns hold text blocks only")
                texts.append(_text_block(at, block))
            out.append({"role": "system", "content": "\n".join(texts)})
            continue
        if role == "assistant":
            calls: list[ToolCall] = []
            seen_ids: set[str] = set()
            for i, block in enumerate(blocks):
                at, kind = f"{where}.content[{i}]", block.get("type")
                if kind == "text":
                    texts.append(_text_block(at, block))
                elif kind == "tool_use":
                    _keys(at, block, frozenset({"type", "id", "name", "input"}) | _BLOCK_EXTRAS)
                    call_id = _call_id(f"{at}.id", block.get("id"), limits)
                    if call_id in seen_ids:
                        raise invalid(f"{at}.id: {show(call_id)} is given twice")
                    seen_ids.add(call_id)
                    name = block.get("name")
                    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
                        raise invalid(
                            f"{at}.name: must be 1 to 128 letters, digits, '_' or '-',"
                            f" got {show(name)}"
                        )
                    calls.append(
                        ToolCall(call_id, name, _tool_input(f"{at}.input", block.get("input")))
                    )
                elif kind == "thinking":
                    _keys(at, block, frozenset({"type", "thinking", "signature"}) | _BLOCK_EXTRAS)
                    _text(f"{at}.thinking", block.get("thinking"))
                elif kind == "redacted_thinking":
                    _keys(at, block, frozenset({"type", "data"}) | _BLOCK_EXTRAS)
                else:
                    raise _refuse_block(at, kind)
            if not final and out and out[-1]["role"] == "assistant":
                # Consecutive assistant turns are one, as Anthropic reads them.
                previous = out.pop()
                earlier = list(previous.get("tool_calls", ()))
                if seen_ids & {call.id for call in earlier}:
                    raise invalid(f"{where}: repeats a tool_use id of the assistant turn before it")
                calls = [*earlier, *calls]
                texts = [previous["content"], *texts]
            open_calls = {call.id: call.name for call in calls}
            if final and calls:
                raise invalid(
                    f"{where}: a final assistant turn with tool_use blocks needs a user turn"
                    " with their tool_result blocks after it"
                )
            if final:
                prefix = "".join(texts)
                if prefix != prefix.rstrip():
                    raise invalid(
                        f"{where}.content: a final assistant turn (a prefill) cannot"
                        " end with whitespace"
                    )
                continue
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                turn["tool_calls"] = tuple(calls)
            out.append(turn)
            continue
        for i, block in enumerate(blocks):
            at, kind = f"{where}.content[{i}]", block.get("type")
            if kind == "text":
                texts.append(_text_block(at, block))
            elif kind == "tool_result":
                out.append(_tool_result(at, block, open_calls, limits, final))
            else:
                texts.append(_media_or_refuse(at, kind, final))
        open_calls = {}
        if any(text.strip() for text in texts) or not any(
            b.get("type") == "tool_result" for b in blocks
        ):
            _add_user(out, "\n".join(texts))
    if all(m["role"] == "system" for m in out):
        raise invalid(
            "messages: holds no user turn (a final assistant turn is a prefill, which"
            " continues the turns before it)"
        )
    return tuple(out), prefix
