"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` bodies read into a
typed :class:`MessagesRequest`, every field bounded before any work.

What each field becomes:

* ``system`` (a string or text blocks) is the chat's system message. Claude
  Code writes a billing line into it that changes on every request
  (``x-anthropic-billing-header: ...; cch=...;``): it is taken out, or no
  two requests would share a prefix in the cache.
* ``messages``: ``user`` and ``assistant`` turns, content as a string or
  blocks. ``text`` blocks are joined by newlines; an assistant's
  ``tool_use`` blocks are its tool calls, a user's ``tool_result`` blocks
  answer them (a result of an error is read as ``Error: ...``);
  ``thinking`` and ``redacted_thinking`` blocks of earlier turns are
  accepted and not shown to the model (templates drop past reasoning);
  ``image``, ``document`` and the other media blocks are refused by name. A
  final assistant turn is a prefill: the reply continues it.
* ``tools`` with ``input_schema`` are the model's functions; Anthropic's
  server tools (``web_search_...``, ``bash_...``, ...) run on Anthropic's
  side and are skipped (:attr:`MessagesRequest.skipped_tools`, logged).
  ``tool_choice`` ``auto``, ``any``, ``none`` and ``{"type": "tool",
  "name"}`` are enforced by the constraint machinery, as chat tools are.
* ``output_config.format`` (and the older ``output_format``) is a JSON
  schema the answer must match.
* ``temperature``, ``top_p``, ``top_k`` and every other sampler setting of
  the server under its engine name; ``stop_sequences``.
* ``thinking``, ``output_config.effort``, ``metadata``, ``cache_control``,
  ``service_tier`` and the like are accepted and change nothing here
  (docs/anthropic.md); ``container``, ``mcp_servers`` and
  ``context_management`` are refused unless null. Any other field is a 400
  naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

import attrs
from cattrs.errors import ClassValidationError, IterableValidationError

from trioserve import protocol as p
from trioserve.vocabulary.constraint import Constraint
from trioserve.vocabulary.rules import BadValue, Rule, StopStrings, as_int
from trioserve.vocabulary.sampling import Range, SamplingSettings, api_settings
from trioserve.vocabulary.strict_json import JsonError, parse_json, show
from trioserve.vocabulary.tools import Tool, ToolUse

from .content import (
    _NAME,
    DEFAULT_LIMITS,
    MessagesLimits,
    _keys,
    _object,
    read_messages,
    read_system,
)
from .errors import invalid

__all__ = [
    "MESSAGES_DEFAULTS",
    "MessagesLimits",
    "MessagesRequest",
    "parse_count_request",
    "parse_messages_request",
]

_INFER: Final = p.request_fields("infer")


def _rule(name: str) -> Rule:
    rule: Rule = _INFER[name].rule
    return rule


#: The sampler's defaults on this door: Anthropic's (temperature 1, no
#: top_p, no top_k), and no ExLlamaV2 filter unless asked for.
MESSAGES_DEFAULTS: Final[Mapping[str, Any]] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "rep_pen": 1.0,
}
#: Where Anthropic documents a narrower range than the engines take.
MESSAGES_RANGES: Final[Mapping[str, Range]] = {"temperature": Range(0.0, 1.0)}
_SAMPLER_NAMES: Final = frozenset(a.name for a in attrs.fields(SamplingSettings))


@attrs.frozen(kw_only=True)
class MessagesRequest:
    """A Messages API request, read and bounded."""

    #: The model the client named (any name is served by this server's model).
    model: str
    #: None only in a ``count_tokens`` request.
    max_tokens: int | None
    #: The chat as the template reads it (``role``, ``content``, and a
    #: turn's ``tool_calls`` or a result's ``tool_call_id`` and ``name``).
    messages: tuple[Mapping[str, Any], ...]
    #: A final assistant turn's text: the reply continues it.
    prefix: str = ""
    stop_sequences: tuple[str, ...] = ()
    stream: bool = False
    #: Sampler settings the request gave, by engine name.
    sampler: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    tools: ToolUse | None = None
    #: The names of Anthropic's server tools the request listed (skipped).
    skipped_tools: tuple[str, ...] = ()
    constraint: Constraint | None = None
    #: ``thinking``: enabled (True, with its ``budget_tokens``), disabled
    #: (False), adaptive or absent (None: the template's default).
    thinking: bool | None = None
    thinking_budget: int | None = None

    def sampling_settings(self) -> SamplingSettings:
        return api_settings(MESSAGES_DEFAULTS, self.sampler)


# --------------------------------------------------------------------------
# Fields


#: Fields that change nothing here: accepted and ignored (docs/anthropic.md).
_IGNORED: Final = frozenset(
    {
        "metadata",
        "cache_control",
        "service_tier",
        "speed",
        "inference_geo",
        "diagnostics",
        "user_profile_id",
        "workspace_id",
        "anthropic_version",
        # Claude Code sends {"edits": [{"type": "clear_thinking_..."}]}:
        # edits Anthropic makes to a long context. Nothing is edited here
        # (no thinking is kept); a prompt too long is refused by name.
        "context_management",
    }
)
#: Features of Anthropic's platform this server does not have: refused
#: unless null.
_REFUSED: Final[Mapping[str, str]] = {
    "container": "code execution containers are Anthropic's",
    "mcp_servers": "connecting to MCP servers is not supported: run the tools in the client",
}
_MESSAGES_FIELDS: Final = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "stop_sequences",
        "stream",
        "tools",
        "tool_choice",
        "output_config",
        "output_format",
        "thinking",
    }
)
_COUNT_FIELDS: Final = frozenset(
    {
        "model",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "output_config",
        "output_format",
        "thinking",
    }
)

_EFFORTS: Final = frozenset({"low", "medium", "high", "xhigh", "max"})
_THINKING: Final = frozenset({"enabled", "disabled", "adaptive"})
#: The type prefixes of Anthropic's own tools (skipped, with a log line).
_SERVER_TOOLS: Final = (
    "web_search_",
    "web_fetch_",
    "bash_",
    "text_editor_",
    "code_execution_",
    "computer_",
    "memory_",
    "tool_search_",
    "mcp_toolset",
)
_TOOL_EXTRAS: Final = frozenset(
    {
        "cache_control",
        "strict",
        "defer_loading",
        "eager_input_streaming",
        "input_examples",
        "allowed_callers",
        "type",
    }
)


def _parse_body(body: bytes) -> dict[str, Any]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid("the request body is not valid utf-8") from None
    try:
        obj = parse_json(text)
    except JsonError as exc:
        raise invalid(f"the request body is not valid json: {exc}") from None
    if not isinstance(obj, dict):
        raise invalid(f"the request body must be a json object, got {show(obj)}")
    return obj


def _read(where: str, rule: Rule, value: Any, narrow: Range | None = None) -> Any:
    try:
        result = rule.read(value)
    except BadValue as exc:
        raise invalid(f"{where}: {exc}") from None
    except (IterableValidationError, ClassValidationError) as exc:
        leaf = exc.exceptions[0] if exc.exceptions else exc
        raise invalid(f"{where}: {leaf}") from None
    if narrow is not None and not narrow.contains(result):
        raise invalid(f"{where}: must be {narrow.describe()}, got {show(value)}")
    return result


def _tools(value: Any, limits: MessagesLimits) -> tuple[tuple[Tool, ...], tuple[str, ...]]:
    if value is None:
        return (), ()
    if not isinstance(value, list):
        raise invalid(f"tools: must be a list of tools, got {show(value)}")
    if len(value) > limits.max_tools:
        raise invalid(f"tools: at most {limits.max_tools} tools, got {len(value)}")
    tools: list[Tool] = []
    skipped: list[str] = []
    names: set[str] = set()
    for index, item in enumerate(value):
        where = f"tools[{index}]"
        tool = _object(where, item)
        kind = tool.get("type")
        name = tool.get("name")
        if kind not in (None, "custom"):
            # One of Anthropic's own tools (web_search_..., bash_...,
            # text_editor_...): Anthropic runs or defines them, this model
            # was not trained on them. Any other type is a mistake.
            if not isinstance(kind, str) or not kind.startswith(_SERVER_TOOLS) or len(kind) > 64:
                raise invalid(
                    f"{where}.type: must be 'custom' (or one of Anthropic's own tool types),"
                    f" got {show(kind)}"
                )
            skipped.append(name if isinstance(name, str) and len(name) <= 128 else kind)
            continue
        _keys(where, tool, frozenset({"name", "description", "input_schema"}) | _TOOL_EXTRAS)
        if not isinstance(name, str) or _NAME.fullmatch(name) is None:
            raise invalid(
                f"{where}.name: must be 1 to 128 letters, digits, '_' or '-', got {show(name)}"
            )
        if name in names:
            raise invalid(f"{where}.name: {show(name)} is given twice")
        names.add(name)
        description = tool.get("description")
        if description is not None and (
            not isinstance(description, str) or len(description) > limits.max_description_chars
        ):
            raise invalid(
                f"{where}.description: must be a string of at most"
                f" {limits.max_description_chars} characters"
            )
        if "input_schema" not in tool:
            raise invalid(f"{where}.input_schema: is required")
        schema = _read(f"{where}.input_schema", _rule("json_schema"), tool["input_schema"])
        strict = tool.get("strict", False)
        if not isinstance(strict, bool):
            raise invalid(f"{where}.strict: must be true or false, got {show(strict)}")
        tools.append(
            Tool(name=name, description=description, parameters=schema or None, strict=strict)
        )
    return tuple(tools), tuple(skipped)


def _tool_use(value: Any, tools: tuple[Tool, ...]) -> ToolUse | None:
    choice: dict[str, Any] = {"type": "auto"}
    if value is not None:
        choice = _object("tool_choice", value)
        _keys("tool_choice", choice, frozenset({"type", "name", "disable_parallel_tool_use"}))
    kind = choice.get("type")
    if kind not in ("auto", "any", "none", "tool"):
        raise invalid(
            f"tool_choice.type: must be 'auto', 'any', 'tool' or 'none', got {show(kind)}"
        )
    disable = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise invalid(
            f"tool_choice.disable_parallel_tool_use: must be true or false, got {show(disable)}"
        )
    named = choice.get("name")
    if kind == "tool":
        if not isinstance(named, str) or named not in {t.name for t in tools}:
            raise invalid(f"tool_choice.name: {show(named)} is not one of the request's tools")
    elif named is not None:
        raise invalid("tool_choice.name: only a tool_choice of type 'tool' names a tool")
    if not tools:
        if kind in ("any", "tool"):
            raise invalid(f"tool_choice: {kind!r} needs tools, and the request has none")
        return None
    mode: Literal["auto", "required", "none"] = {
        "auto": "auto",
        "any": "required",
        "tool": "required",
        "none": "none",
    }[kind]  # type: ignore[assignment]
    return ToolUse(tools=tools, choice=mode, named=named, parallel=not disable)


def _format(where: str, value: Any) -> Constraint | None:
    if value is None:
        return None
    fmt = _object(where, value)
    _keys(where, fmt, frozenset({"type", "schema"}))
    if fmt.get("type") != "json_schema":
        raise invalid(f"{where}.type: must be 'json_schema', got {show(fmt.get('type'))}")
    if "schema" not in fmt:
        raise invalid(f"{where}.schema: is required")
    schema = _read(f"{where}.schema", _rule("json_schema"), fmt["schema"])
    return Constraint.json_schema(schema, f"{where}.schema")


def _output(obj: Mapping[str, Any]) -> Constraint | None:
    constraints = []
    config = obj.get("output_config")
    if config is not None:
        config = _object("output_config", config)
        _keys("output_config", config, frozenset({"format", "effort"}))
        effort = config.get("effort")
        if effort is not None and (not isinstance(effort, str) or effort not in _EFFORTS):
            raise invalid(
                f"output_config.effort: must be one of {', '.join(sorted(_EFFORTS))},"
                f" got {show(effort)}"
            )
        constraints.append(_format("output_config.format", config.get("format")))
    constraints.append(_format("output_format", obj.get("output_format")))
    given = [c for c in constraints if c is not None]
    if len(given) > 1:
        raise invalid("give output_config.format or output_format, not both")
    return given[0] if given else None


def _thinking(value: Any) -> tuple[bool | None, int | None]:
    """On or off, and a budget: a thinking template's section (others
    ignore it)."""
    if value is None:
        return None, None
    thinking = _object("thinking", value)
    _keys("thinking", thinking, frozenset({"type", "budget_tokens", "display"}))
    kind = thinking.get("type")
    if not isinstance(kind, str) or kind not in _THINKING:
        raise invalid(
            f"thinking.type: must be one of {', '.join(sorted(_THINKING))}, got {show(kind)}"
        )
    budget = as_int(thinking.get("budget_tokens"))
    if kind == "enabled" and (budget is None or budget < 1):
        raise invalid(
            "thinking.budget_tokens: must be a positive integer,"
            f" got {show(thinking.get('budget_tokens'))}"
        )
    if kind == "enabled":
        return True, budget
    return (False if kind == "disabled" else None), None


def _sampler(obj: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for name in _SAMPLER_NAMES & obj.keys():
        if obj[name] is not None:
            out[name] = _read(name, _rule(name), obj[name], MESSAGES_RANGES.get(name))
    return out


def _parse(
    body: bytes, limits: MessagesLimits, fields: frozenset[str], *, count: bool
) -> MessagesRequest:
    obj = _parse_body(body)
    for key, value in obj.items():
        if key in _REFUSED:
            if value is not None:
                raise invalid(f"{key}: {_REFUSED[key]}")
        elif key not in fields and key not in _IGNORED and key not in _SAMPLER_NAMES:
            raise invalid(f"{show(key)}: unknown field")
    model = obj.get("model")
    if not isinstance(model, str) or not 0 < len(model) <= 256:
        raise invalid(f"model: must be a string of 1 to 256 characters, got {show(model)}")
    max_tokens = None
    if not count:
        if obj.get("max_tokens") is None:
            raise invalid("max_tokens: is required")
        max_tokens = _read("max_tokens", _rule("max_new_tokens"), obj["max_tokens"])
        if max_tokens < 1:
            raise invalid(f"max_tokens: must be at least 1, got {show(obj['max_tokens'])}")
    thinking, budget = _thinking(obj.get("thinking"))
    system = read_system(obj.get("system"), limits)
    messages, prefix = read_messages(obj.get("messages"), system, limits)
    tools, skipped = _tools(obj.get("tools"), limits)
    stream = obj.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid(f"stream: must be true or false, got {show(stream)}")
    stops = obj.get("stop_sequences")
    rule = StopStrings(limits.max_stop_sequences, limits.max_stop_sequence_chars)
    sampler = _sampler(obj)
    if max_tokens is not None and sampler.get("min_tokens", 0) > max_tokens:
        raise invalid(
            f"min_tokens: must be at most max_tokens ({max_tokens}), got {sampler['min_tokens']}"
        )
    tool_use = _tool_use(obj.get("tool_choice"), tools)
    constraint = _output(obj)
    constrained = constraint is not None or (tool_use is not None and tool_use.choice == "required")
    if prefix and constrained:
        raise invalid(
            "messages: a final assistant turn (a prefill) cannot be continued under an output"
            " format or a required tool: the answer must start where the constraint does"
        )
    return MessagesRequest(
        model=model,
        max_tokens=max_tokens,
        messages=messages,
        prefix=prefix,
        stop_sequences=() if stops is None else _read("stop_sequences", rule, stops),
        stream=stream,
        sampler=sampler,
        tools=tool_use,
        skipped_tools=skipped,
        constraint=constraint,
        thinking=thinking,
        thinking_budget=budget,
    )


def parse_messages_request(body: bytes, limits: MessagesLimits = DEFAULT_LIMITS) -> MessagesRequest:
    """A ``POST /v1/messages`` body; raises :class:`AnthropicError` (400)."""
    return _parse(body, limits, _MESSAGES_FIELDS, count=False)


def parse_count_request(body: bytes, limits: MessagesLimits = DEFAULT_LIMITS) -> MessagesRequest:
    """A ``POST /v1/messages/count_tokens`` body (no ``max_tokens``)."""
    return _parse(body, limits, _COUNT_FIELDS, count=True)


#: Each accepted field and what it does, for docs/anthropic.md's table.
FIELD_KINDS: Final[Mapping[str, Callable[[], frozenset[str]]]] = {
    "supported": lambda: _MESSAGES_FIELDS | _SAMPLER_NAMES,
    "ignored": lambda: _IGNORED,
    "refused": lambda: frozenset(_REFUSED),
}
