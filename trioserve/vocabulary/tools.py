"""Tool calls, whichever door asks for them: the tools in the prompt, the
constraint that keeps every call valid, and the calls read back out of the
generated text as it streams.

A model family writes its calls in its own format (:data:`TOOL_FORMATS`):
Hermes and Qwen ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``,
Llama 3.x a bare ``{"name": ..., "parameters": ...}``, Mistral
``[TOOL_CALLS][{"name": ..., "arguments": ...}]``. :func:`format_for` picks it
from the chat template (or takes the server's ``--tool-call-format``).

* **Prompt.** A template that takes ``tools`` renders them itself; for one
  that does not (the embedded SmolLM2), :func:`prompt_messages` writes them
  into the system message in the Hermes format, and turns earlier calls and
  tool results into text the model can read.
* **Constraint.** :func:`tool_grammar` is a Lark grammar for llguidance:
  ``required`` and a named function allow nothing but calls; ``auto`` lets
  the model write text, and once it writes the call marker the rest of the
  call is constrained (a lazy lexeme); each call's arguments must validate
  against its tool's JSON schema.
* **Reading.** :class:`ToolCallReader` splits the released text into content
  and calls, streaming-safe: no marker text reaches the content, and a call's
  arguments stream in pieces.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any, Final, Literal, TypeAlias

import attrs

from .constraint import Constraint

__all__ = [
    "ANSWER_KINDS",
    "TOOL_FORMATS",
    "CallArguments",
    "CallEnd",
    "CallStart",
    "Content",
    "Tool",
    "ToolCall",
    "ToolCallReader",
    "ToolEvent",
    "ToolFormat",
    "ToolUse",
    "answer_rule",
    "format_for",
    "prompt_messages",
    "schema_options",
    "tool_grammar",
]

ToolChoice: TypeAlias = Literal["none", "auto", "required"]


@attrs.frozen
class Tool:
    """A function the model may call; ``parameters`` is the JSON schema of
    its arguments (None: any JSON object)."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = attrs.field(default=None, eq=False)
    #: The client asked for its schema to hold exactly (OpenAI's and
    #: Anthropic's ``strict``): keywords the constraint engine does not
    #: implement are then refused, not left unenforced.
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        """As OpenAI and chat templates write a tool."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters or {"type": "object"})
        return {"type": "function", "function": function}


@attrs.frozen
class ToolUse:
    """A request's tools and how they may be used: ``choice`` ``none``
    (never), ``auto`` (the model decides), ``required`` (at least one call),
    or ``named`` (that function, once)."""

    tools: tuple[Tool, ...]
    choice: ToolChoice = "auto"
    named: str | None = None
    parallel: bool = True

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    def allowed_tools(self) -> tuple[Tool, ...]:
        if self.named is not None:
            return tuple(t for t in self.tools if t.name == self.named)
        return self.tools


@attrs.frozen
class ToolCall:
    """A call the model made (or a client sent back in its history)."""

    id: str
    name: str
    #: The arguments as JSON text (as OpenAI carries them).
    arguments: str

    @staticmethod
    def new_id() -> str:
        return "call_" + secrets.token_hex(12)


@attrs.frozen
class ToolFormat:
    """How one model family writes calls: each call is ``begin`` +
    ``{"name": NAME, "<arguments_key>": ARGUMENTS}`` + ``end``, calls are
    joined by ``separator`` and wrapped in ``open`` ... ``close``; the text
    ``trigger`` (a prefix of ``open + begin``) starts them."""

    name: str
    trigger: str
    open: str
    begin: str
    end: str
    separator: str
    close: str
    arguments_key: str = "arguments"

    def call_text(self, call: ToolCall) -> str:
        """One call as the model writes it (for the history in a prompt)."""
        return (
            self.begin
            + '{"name": '
            + json.dumps(call.name, ensure_ascii=False)
            + f', "{self.arguments_key}": '
            + call.arguments
            + "}"
            + self.end
        )

    def calls_text(self, calls: Sequence[ToolCall]) -> str:
        return self.open + self.separator.join(self.call_text(c) for c in calls) + self.close


HERMES: Final = ToolFormat(
    "hermes",
    trigger="<tool_call>",
    open="",
    begin="<tool_call>\n",
    end="\n</tool_call>",
    separator="\n",
    close="",
)
LLAMA3: Final = ToolFormat(
    "llama3",
    trigger='{"name": ',
    open="",
    begin="",
    end="",
    separator="; ",
    close="",
    arguments_key="parameters",
)
MISTRAL: Final = ToolFormat(
    "mistral",
    trigger="[TOOL_CALLS]",
    open="[TOOL_CALLS][",
    begin="",
    end="",
    separator=", ",
    close="]",
)
TOOL_FORMATS: Final[Mapping[str, ToolFormat]] = {f.name: f for f in (HERMES, LLAMA3, MISTRAL)}


def format_for(template_source: str | None, forced: str | None = None) -> ToolFormat:
    """The call format of a model: ``forced`` (the server's option) when
    given, else the one its chat template writes, else Hermes (the format
    trioserve writes into the prompt of a template without tools)."""
    if forced is not None and forced != "auto":
        return TOOL_FORMATS[forced]
    source = template_source or ""
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "<tool_call>" in source:
        return HERMES
    if "<|python_tag|>" in source or "ipython" in source:
        return LLAMA3
    return HERMES


def takes_tools(template_source: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself."""
    return template_source is not None and re.search(r"\btools\b", template_source) is not None


# --------------------------------------------------------------------------
# The prompt


#: What a template without tools gets in its system message (the Hermes
#: format Qwen and NousResearch models are trained on).
SYSTEM_TOOLS: Final = (
    "You may call one or more functions to help answer. The functions, as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object of its name and arguments inside"
    " <tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n'
    "</tool_call>"
)


def prompt_messages(
    messages: Sequence[Mapping[str, Any]], use: ToolUse | None, *, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` variable for the chat template.

    ``native``: the template renders tools and tool messages itself; they
    go through as Hugging Face templates expect them (a call's arguments as
    an object). Otherwise the tools are described in the system message and
    calls and results become text, in the Hermes format.
    """
    tools = [t.as_openai() for t in use.tools] if use is not None and use.calls_allowed else None
    if native:
        out = [_native(m) for m in messages]
        return out, tools
    out = []
    for message in messages:
        role = message.get("role")
        calls: Sequence[ToolCall] = message.get("tool_calls") or ()
        if role == "assistant" and calls:
            content = str(message.get("content") or "")
            text = HERMES.calls_text(calls)
            out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        elif role == "tool":
            body = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            out.append({"role": "user", "content": body})
        else:
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
    if tools:
        described = SYSTEM_TOOLS.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        )
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{described}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, None


def _native(message: Mapping[str, Any]) -> dict[str, Any]:
    calls: Sequence[ToolCall] = message.get("tool_calls") or ()
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    if calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _arguments_object(c.arguments)},
            }
            for c in calls
        ]
    return out


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# --------------------------------------------------------------------------
# The constraint

#: The arguments of a call are compact JSON with the usual separators, as
#: structured output writes it (docs/structured-output.md). Agents' tool
#: schemas use keywords llguidance does not implement (Claude Code's use
#: ``propertyNames``): those are left unenforced, the rest holds, unless the
#: tool is ``strict`` (:func:`schema_options`); a response format refuses them.
_COMPACT: Final = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def schema_options(tool: Tool) -> dict[str, Any]:
    """The ``x-guidance`` options of a tool's arguments schema."""
    return {**_COMPACT, "lenient": not tool.strict}


#: Constraints that can stand as the answer beside tools (a Lark rule of
#: their own): the kinds the grammar can embed.
ANSWER_KINDS: Final = ("json_schema", "choice", "regex")


def answer_rule(answer: Constraint) -> str:
    """``answer``'s Lark rule body: a JSON schema (compact, as structured
    output writes it, unless the schema says otherwise) or literal choices."""
    if answer.kind == "json_schema":
        schema = json.loads(answer.text)
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**_COMPACT, **schema.get("x-guidance", {})}}
        return f"%json {json.dumps(schema, ensure_ascii=False)}"
    if answer.kind == "choice":
        return " | ".join(_lit(choice) or '""' for choice in json.loads(answer.text))
    if answer.kind == "regex":
        return _lark_regex(answer.text)
    raise ValueError(f"a {answer.kind} constraint cannot stand as an answer's rule")


def _lark_regex(pattern: str) -> str:
    """``pattern`` as a Lark regex literal (``/.../``) that means the same
    and cannot end early: a slash is escaped unless it is already, an
    escape is kept whole (``\\/`` stays ``\\/``, where escaping its slash
    again would close the literal on ``\\\\``), and line breaks are written
    as escapes (a grammar's lines are its rules). A lone backslash at the
    end is a literal backslash."""
    out = []
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            escaped = pattern[index + 1 : index + 2] or "\\"
            out.append("\\" + _LINE_BREAKS.get(escaped, escaped))
            index += 2
            continue
        if char == "/":
            out.append("\\/")
        elif char in _LINE_BREAKS:
            out.append("\\" + _LINE_BREAKS[char])
        else:
            out.append(char)
        index += 1
    return "/" + "".join(out) + "/"


#: The line breaks a regex may hold, as the letters of their escapes.
_LINE_BREAKS: Final = {"\n": "n", "\r": "r"}


def tool_grammar(
    use: ToolUse,
    fmt: ToolFormat,
    *,
    special_trigger: bool = False,
    answer: Constraint | None = None,
) -> str | None:
    """A Lark grammar (llguidance's) for ``use``, or None when nothing is
    constrained (``none``). ``special_trigger``: the trigger is one special
    token of the model's tokenizer (Qwen's ``<tool_call>``, Mistral's
    ``[TOOL_CALLS]``), which the grammar then names as a token rather than
    as text. ``answer`` (of :data:`ANSWER_KINDS`): with ``auto``, the reply
    is either calls or an answer that matches it (OpenAI's structured
    output beside tools); a turn that must call ignores it."""
    if not use.calls_allowed:
        return None

    def text(literal: str) -> str:
        # The trigger inside a literal, as its special token when it is one.
        if special_trigger and fmt.trigger in literal:
            before, _, after = literal.partition(fmt.trigger)
            return _seq(_lit(before), fmt.trigger, _lit(after))
        return _lit(literal)

    lines = ["%llguidance {}"]
    names = []
    for index, tool in enumerate(use.allowed_tools()):
        schema = {**_closed(tool.parameters), "x-guidance": schema_options(tool)}
        names.append(f"tool_{index}")
        head = json.dumps(tool.name, ensure_ascii=False) + f', "{fmt.arguments_key}": '
        lines.append(
            f"tool_{index}: {_lit(head)} %json {json.dumps(schema, ensure_ascii=False)} {_lit('}')}"
        )
    lines.append("call_body: " + " | ".join(names))
    lines.append("call: " + _seq(text(fmt.begin + '{"name": '), "call_body", _lit(fmt.end)))
    single = not use.parallel or use.named is not None
    more = "" if single else f"({_lit(fmt.separator)} call)*"
    if use.choice == "required" or use.named is not None:
        lines.append("start: " + _seq(text(fmt.open), "call", more, _lit(fmt.close)))
        return "\n".join(lines)
    if answer is not None:
        # auto with an answer's format: the calls, or the answer itself.
        lines.append(f"answer: {answer_rule(answer)}")
        calls = _seq(text(fmt.open), "call", more, _lit(fmt.close))
        lines.append(f"start: answer | {calls}")
        return "\n".join(lines)
    # auto: free text; once the trigger is written, calls only (a lazy
    # lexeme: the shortest text that ends with the trigger).
    lines.append("TEXT: /(.|\\n)*/")
    if special_trigger:
        lines.append(f"calls_head: TEXT {fmt.trigger}")
    else:
        lines.append(f"calls_head[lazy]: TEXT {_lit(fmt.trigger)}")
    rest = (fmt.open + fmt.begin + '{"name": ')[len(fmt.trigger) :]
    first = _seq(_lit(rest), "call_body", _lit(fmt.end))
    lines.append(f"start: TEXT | calls_head {_seq(first, more, _lit(fmt.close))}")
    return "\n".join(lines)


def _closed(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """A tool's arguments schema, with no properties beyond the declared
    ones unless it allows them itself (as OpenAI's strict mode requires):
    a small model otherwise invents fields until its tokens run out."""
    schema = dict(parameters or {"type": "object"})
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else ""


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


# --------------------------------------------------------------------------
# Reading calls out of the text


@attrs.frozen
class Content:
    text: str


@attrs.frozen
class CallStart:
    index: int
    id: str
    name: str


@attrs.frozen
class CallArguments:
    index: int
    text: str


@attrs.frozen
class CallEnd:
    index: int
    call: ToolCall


ToolEvent: TypeAlias = Content | CallStart | CallArguments | CallEnd

_HEAD: Final = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "(arguments|parameters)": ')


@attrs.define
class ToolCallReader:
    """Splits released text into content and calls, as it streams.

    Text that could be the start of the format's trigger is held back until
    it is decided; a call's arguments are passed on as they come, short of
    the few characters that may yet turn out to close the call. Meant for
    constrained output (the grammar fixes the format); text that is not a
    well-formed call where one was begun is given back as content at
    :meth:`finish`.
    """

    fmt: ToolFormat
    calls: list[ToolCall] = attrs.field(factory=list)
    _buffer: str = ""
    _in_calls: bool = False
    _head: re.Match[str] | None = None
    _sent: int = 0
    _id: str = ""
    _name: str = ""
    _content_seen: bool = False

    def feed(self, text: str) -> list[ToolEvent]:
        self._buffer += text
        return list(self._drain(final=False))

    def finish(self) -> list[ToolEvent]:
        """The rest, at the end of the generation: held text as content, a
        call cut short (by ``max_tokens``) with the arguments it has."""
        events = list(self._drain(final=True))
        rest, self._buffer = self._buffer, ""
        if self._head is not None:
            arguments = rest[self._head.end() :]
            closing = "}" + self.fmt.end
            try:
                _, end = json.JSONDecoder().raw_decode(arguments)
            except ValueError:
                pass
            else:
                if closing.startswith(arguments[end:]):
                    # The value is whole; what follows is the call's cut closing.
                    arguments = arguments[:end]
            if len(arguments) > self._sent:
                events.append(CallArguments(len(self.calls), arguments[self._sent :]))
            call = ToolCall(self._id, self._name, arguments)
            events.append(CallEnd(len(self.calls), call))
            self.calls.append(call)
            self._head = None
        elif rest and not (self._in_calls and not rest.strip()):
            events.append(Content(rest))
        return events

    def _drain(self, *, final: bool) -> Iterator[ToolEvent]:
        fmt = self.fmt
        while self._buffer:
            if not self._in_calls:
                start = self._buffer.find(fmt.trigger)
                if start < 0:
                    keep = 0 if final else _partial_suffix(self._buffer, fmt.trigger)
                    text = self._buffer[: len(self._buffer) - keep]
                    if text:
                        yield Content(text)
                    self._buffer = self._buffer[len(text) :]
                    return
                if start:
                    yield Content(self._buffer[:start])
                self._buffer = self._buffer[start:]
                opening = fmt.open or fmt.begin
                if not self._buffer.startswith(opening):
                    if len(self._buffer) < len(opening) and opening.startswith(self._buffer):
                        return  # the rest of the opening is still to come
                    yield Content(self._buffer[: len(fmt.trigger)])
                    self._buffer = self._buffer[len(fmt.trigger) :]
                    continue
                self._buffer = self._buffer[len(fmt.open) :]
                self._in_calls = True
                continue
            if not (yield from self._call()):
                return

    def _call(self) -> Generator[ToolEvent, None, bool]:
        """Advance inside the calls; whether there may be more to do now."""
        fmt = self.fmt
        index = len(self.calls)
        if self._head is None:
            # Between calls: the separator, the close, or a call's begin.
            for piece in (fmt.separator, fmt.close):
                if piece and self._buffer.startswith(piece) and self.calls:
                    self._buffer = self._buffer[len(piece) :]
                    if piece == fmt.close:
                        self._in_calls = False
                    return True
            if fmt.begin and not self._buffer.startswith(fmt.begin):
                if fmt.begin.startswith(self._buffer):
                    return False
                if not self.calls:
                    return False
                self._in_calls = False  # text after the calls
                return True
            head = _HEAD.match(self._buffer, len(fmt.begin))
            if head is None:
                return False
            self._head = head
            self._id = ToolCall.new_id()
            self._name = json.loads(head.group(1))
            self._sent = 0
            yield CallStart(index, self._id, self._name)
        closing = "}" + fmt.end
        arguments = self._buffer[self._head.end() :]
        done = _call_end(arguments, closing)
        if done is None:
            ready = len(arguments) - len(closing)
            if ready > self._sent:
                yield CallArguments(index, arguments[self._sent : ready])
                self._sent = ready
            return False
        whole = arguments[:done]
        if len(whole) > self._sent:
            yield CallArguments(index, whole[self._sent :])
        call = ToolCall(self._id, self._name, whole)
        self.calls.append(call)
        yield CallEnd(index, call)
        self._buffer = arguments[done + len(closing) :]
        self._head = None
        return True


def _call_end(arguments: str, closing: str) -> int | None:
    """Where the arguments end, when the complete JSON value is followed by
    ``closing``; else None."""
    try:
        _, end = json.JSONDecoder().raw_decode(arguments)
    except ValueError:
        return None
    if arguments.startswith(closing, end):
        return end
    return None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
