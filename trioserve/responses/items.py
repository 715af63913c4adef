"""The conversation of a Responses request: ``input`` (a string, or a list of
items) read into the chat the template renders, after the conversation of a
``previous_response_id`` and under the request's ``instructions``.

What each item becomes:

* a message (``{"role", "content"}``, with or without ``"type":
  "message"``): ``user``, ``system``, ``developer`` (a system turn) or
  ``assistant``; content as a string or parts. ``input_text`` and
  ``output_text`` parts are text (an assistant's ``refusal`` too);
  ``input_image``, ``input_file`` and ``input_audio`` are refused by name in
  the last item (the question is about them) and stand as a placeholder in
  earlier ones (an agent's history keeps an image a tool once returned).
* ``function_call`` items are the assistant's tool calls (joined into the
  assistant turn before them); ``function_call_output`` items answer them,
  each naming a call made earlier in the conversation.
* ``reasoning`` items are accepted and not shown to the model (templates
  drop past reasoning).
* ``item_reference`` and the items of OpenAI's built-in tools
  (``web_search_call``, ``computer_call_output``, ...) are refused by name.

Consecutive turns of one role are joined (templates that need the roles to
alternate would refuse the chat otherwise; Codex CLI sends two user turns).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from trioserve import protocol as p
from trioserve.openai.errors import invalid as _invalid
from trioserve.openai.params import UNSUPPORTED, is_text, show
from trioserve.vocabulary.tools import ToolCall

__all__ = [
    "DEFAULT_LIMITS",
    "MEDIA_PLACEHOLDER",
    "ResponsesLimits",
    "Turns",
    "history_after",
    "read_input",
    "turns_nbytes",
    "with_instructions",
]

_INFER: Final = p.request_fields("infer")


def _limit(name: str, limit: str) -> int:
    return int(_INFER[name].rule.limits[limit])


@attrs.frozen(kw_only=True)
class ResponsesLimits:
    """Bounds on a request's fields, checked before any work (the WebSocket
    protocol's declared bounds where a field is shared)."""

    #: Items of ``input``, and turns of the conversation with a previous
    #: response's.
    max_items: int = _limit("messages", "max_messages")
    #: Content parts of one message or tool output.
    max_parts: int = 1024
    max_tools: int = 128
    max_description_chars: int = 131072
    max_id_chars: int = 256
    max_metadata_keys: int = 16
    max_metadata_key_chars: int = 64
    max_metadata_value_chars: int = 512
    max_include: int = 16


DEFAULT_LIMITS: Final = ResponsesLimits()

#: A conversation as the template reads it: ``role``, ``content``, and an
#: assistant turn's ``tool_calls`` or a tool result's ``tool_call_id`` and
#: ``name``.
Turns = tuple[Mapping[str, Any], ...]

#: What stands in for an image, a file or audio of an earlier item.
MEDIA_PLACEHOLDER: Final = "[{kind} omitted: this model reads text only]"
_MEDIA: Final = frozenset({"input_image", "input_file", "input_audio"})
_TEXT_PARTS: Final = frozenset({"input_text", "output_text", "text"})
#: Keys of an output text part that change nothing here.
_TEXT_EXTRAS: Final = frozenset({"annotations", "logprobs"})
_NAME: Final = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
#: Items of OpenAI's own tools: they run on OpenAI's side.
_BUILT_IN: Final = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "image_generation_call",
        "code_interpreter_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "custom_tool_call",
        "custom_tool_call_output",
        "tool_search_call",
        "tool_search_output",
        "compaction",
        "compaction_trigger",
        "additional_tools",
        "program",
        "program_output",
    }
)
_ITEM_EXTRAS: Final = frozenset({"id", "status"})


def _object(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _invalid(f"{where} must be an object, got {show(value)}", where)
    return value


def _keys(where: str, obj: Mapping[str, Any], known: frozenset[str]) -> None:
    for key in obj:
        if key not in known:
            name = key if isinstance(key, str) and len(key) <= 64 else "?"
            raise _invalid(
                f"unknown field {show(key)} in {where}", f"{where}.{name}", "unknown_parameter"
            )


def _text(where: str, value: Any) -> str:
    if not is_text(value):
        raise _invalid(f"{where} must be a string, got {show(value)}", where)
    return value


def _call_id(where: str, value: Any, limits: ResponsesLimits) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= limits.max_id_chars:
        raise _invalid(
            f"{where} must be a string of 1 to {limits.max_id_chars} characters, got {show(value)}",
            where,
        )
    return value


def _media(where: str, kind: str, final: bool) -> str:
    if final:
        raise _invalid(
            f"{where}.type: {kind} parts are not supported: this model reads text only",
            f"{where}.type",
            UNSUPPORTED,
        )
    return MEDIA_PLACEHOLDER.format(kind=kind.removeprefix("input_"))


def _parts(where: str, value: Any, limits: ResponsesLimits, final: bool, role: str) -> str:
    """A content value's text: a string, or parts joined (text parts as they
    are, media as a placeholder or refused)."""
    if isinstance(value, str):
        return _text(where, value)
    if not isinstance(value, list):
        raise _invalid(
            f"{where} must be a string or a list of content parts, got {show(value)}", where
        )
    if len(value) > limits.max_parts:
        raise _invalid(
            f"{where} may hold at most {limits.max_parts} parts, got {len(value)}", where
        )
    texts = []
    for index, item in enumerate(value):
        at = f"{where}[{index}]"
        part = _object(at, item)
        kind = part.get("type")
        # A type that is not a string is no known one (and may be unhashable).
        known = kind if isinstance(kind, str) else None
        if known in _TEXT_PARTS:
            _keys(at, part, frozenset({"type", "text"}) | _TEXT_EXTRAS)
            texts.append(_text(f"{at}.text", part.get("text")))
        elif kind == "refusal" and role == "assistant":
            _keys(at, part, frozenset({"type", "refusal"}))
            texts.append(_text(f"{at}.refusal", part.get("refusal")))
        elif known in _MEDIA:
            texts.append(_media(at, known, final))
        else:
            raise _invalid(
                f"{at}.type must be 'input_text' or 'output_text'"
                f"{' (or refusal)' if role == 'assistant' else ''}, got {show(kind)}",
                f"{at}.type",
            )
    return "".join(texts) if role == "assistant" else "\n".join(texts)


@attrs.define
class _Chat:
    """The turns being built, with the calls still waiting for an output."""

    turns: list[dict[str, Any]]
    #: call_id -> name of every call made so far (an output may answer any).
    calls: dict[str, str] = attrs.field(factory=dict)

    def add(self, role: str, text: str) -> None:
        last = self.turns[-1] if self.turns else None
        if last is not None and last["role"] == role and "tool_calls" not in last:
            separator = "" if role == "assistant" else "\n\n"
            self.turns[-1] = {"role": role, "content": f"{last['content']}{separator}{text}"}
        else:
            self.turns.append({"role": role, "content": text})

    def call(self, call: ToolCall) -> None:
        last = self.turns[-1] if self.turns else None
        if last is not None and last["role"] == "assistant":
            calls = (*last.get("tool_calls", ()), call)
            self.turns[-1] = {**last, "tool_calls": calls}
        else:
            self.turns.append({"role": "assistant", "content": "", "tool_calls": (call,)})
        self.calls[call.id] = call.name


def _history_calls(history: Turns) -> dict[str, str]:
    calls: dict[str, str] = {}
    for turn in history:
        for call in turn.get("tool_calls", ()):
            calls[call.id] = call.name
    return calls


def _message(
    where: str, item: Mapping[str, Any], chat: _Chat, limits: ResponsesLimits, final: bool
) -> None:
    _keys(where, item, frozenset({"type", "role", "content", "phase"}) | _ITEM_EXTRAS)
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise _invalid(
            f"{where}.role must be 'user', 'assistant', 'system' or 'developer', got {show(role)}",
            f"{where}.role",
        )
    if "content" not in item:
        raise _invalid(f"{where}.content is required", f"{where}.content")
    text = _parts(f"{where}.content", item["content"], limits, final, role)
    chat.add("system" if role == "developer" else role, text)


def _function_call(
    where: str, item: Mapping[str, Any], chat: _Chat, limits: ResponsesLimits
) -> None:
    _keys(
        where,
        item,
        frozenset({"type", "call_id", "name", "arguments", "namespace", "caller"}) | _ITEM_EXTRAS,
    )
    call_id = _call_id(f"{where}.call_id", item.get("call_id"), limits)
    if call_id in chat.calls:
        raise _invalid(f"{where}.call_id {show(call_id)} is given twice", f"{where}.call_id")
    name = item.get("name")
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise _invalid(
            f"{where}.name must be 1 to 128 letters, digits, '_', '-', '.' or ':',"
            f" got {show(name)}",
            f"{where}.name",
        )
    arguments = _text(f"{where}.arguments", item.get("arguments"))
    chat.call(ToolCall(call_id, name, arguments))


def _function_output(
    where: str, item: Mapping[str, Any], chat: _Chat, limits: ResponsesLimits, final: bool
) -> None:
    _keys(
        where,
        item,
        frozenset({"type", "call_id", "output", "name", "namespace", "caller"}) | _ITEM_EXTRAS,
    )
    call_id = _call_id(f"{where}.call_id", item.get("call_id"), limits)
    name = chat.calls.get(call_id)
    if name is None:
        raise _invalid(
            f"{where}.call_id: no function_call with call_id {show(call_id)} in the conversation",
            f"{where}.call_id",
        )
    if "output" not in item:
        raise _invalid(f"{where}.output is required", f"{where}.output")
    text = _parts(f"{where}.output", item["output"], limits, final, "tool")
    chat.turns.append({"role": "tool", "content": text, "tool_call_id": call_id, "name": name})


def read_input(value: Any, history: Turns, limits: ResponsesLimits) -> Turns:
    """The conversation: ``history`` (a previous response's) and then
    ``value`` (the request's ``input``). Raises :class:`OpenAIError` (400)
    naming the item."""
    chat = _Chat([dict(turn) for turn in history], _history_calls(history))
    if isinstance(value, str):
        chat.add("user", _text("input", value))
        return tuple(chat.turns)
    if not isinstance(value, list):
        raise _invalid(f"input must be a string or a list of items, got {show(value)}", "input")
    if len(value) > limits.max_items:
        raise _invalid(
            f"input may hold at most {limits.max_items} items, got {len(value)}", "input"
        )
    for index, raw in enumerate(value):
        where = f"input[{index}]"
        item = _object(where, raw)
        final = index == len(value) - 1
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _message(where, item, chat, limits, final)
        elif kind == "function_call":
            _function_call(where, item, chat, limits)
        elif kind == "function_call_output":
            _function_output(where, item, chat, limits, final)
        elif kind == "reasoning":
            # Past reasoning: accepted, not shown (templates drop it).
            _keys(
                where,
                item,
                frozenset({"type", "summary", "content", "encrypted_content"}) | _ITEM_EXTRAS,
            )
        elif kind == "item_reference":
            raise _invalid(
                f"{where}: item_reference is not supported: items are not kept by id on this"
                " server; send the item itself, or continue with previous_response_id",
                f"{where}.type",
                UNSUPPORTED,
            )
        elif isinstance(kind, str) and kind in _BUILT_IN:
            raise _invalid(
                f"{where}.type: {kind} items belong to tools this server does not run",
                f"{where}.type",
                UNSUPPORTED,
            )
        else:
            raise _invalid(f"{where}.type: unknown item type {show(kind)}", f"{where}.type")
    if len(chat.turns) > limits.max_items:
        raise _invalid(
            f"the conversation holds {len(chat.turns)} turns with the previous response's;"
            f" at most {limits.max_items}",
            "input",
        )
    if not any(turn["role"] != "system" for turn in chat.turns):
        raise _invalid("input holds no user turn", "input")
    return tuple(chat.turns)


def with_instructions(turns: Sequence[Mapping[str, Any]], instructions: str) -> Turns:
    """The turns the template renders: ``instructions`` as the system turn
    before them (joined with a first system turn of the input)."""
    if not instructions:
        return tuple(turns)
    if turns and turns[0]["role"] == "system":
        first = {"role": "system", "content": f"{instructions}\n\n{turns[0]['content']}"}
        return (first, *turns[1:])
    return ({"role": "system", "content": instructions}, *turns)


def history_after(turns: Turns, text: str, calls: Sequence[ToolCall]) -> Turns:
    """The conversation a stored response leaves: its turns, then the
    assistant turn it wrote (its text and its calls)."""
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = tuple(calls)
    return (*turns, turn)


def turns_nbytes(turns: Turns) -> int:
    """About the memory a stored conversation takes: its text in UTF-8 and a
    fixed cost per turn and call (the dicts and strings around the text)."""
    total = 0
    for turn in turns:
        total += 256 + len(str(turn["content"]).encode("utf-8", "surrogatepass"))
        for call in turn.get("tool_calls", ()):
            total += (
                256
                + len(call.id)
                + len(call.name)
                + len(call.arguments.encode("utf-8", "surrogatepass"))
            )
        total += len(str(turn.get("tool_call_id", ""))) + len(str(turn.get("name", "")))
    return total
