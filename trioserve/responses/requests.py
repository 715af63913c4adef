"""``POST /v1/responses`` bodies read into a typed :class:`ResponsesRequest`,
every field bounded before any work.

What each field becomes:

* ``input`` and ``instructions``: the chat (:mod:`.items`); with
  ``previous_response_id`` the stored conversation comes first (the route
  looks it up and hands its turns to :func:`parse_responses_request`).
* ``tools``: flat ``function`` tools are the model's functions (``strict``,
  as OpenAI's default, true unless false: schema keywords the constraint
  machinery does not implement are then refused, not ignored). OpenAI's
  built-in tools (``web_search``, ``file_search``, ``image_generation``,
  ...) and the tools whose calls are not functions (``custom``,
  ``namespace``, ``local_shell``, ...) are skipped with a log line
  (:attr:`ResponsesRequest.skipped_tools`): the model never calls them.
* ``tool_choice`` (``auto``, ``none``, ``required``, a named function,
  ``allowed_tools``) and ``parallel_tool_calls`` are enforced by the
  constraint machinery, as chat tools are.
* ``text.format`` (``text``, ``json_object``, ``json_schema``) is the
  answer's constraint.
* ``max_output_tokens`` is an upper bound; ``temperature``, ``top_p`` and
  every sampler setting of the server under its OpenAI name.
* ``store``, ``metadata``: kept with the stored response.
* ``reasoning``, ``include`` (but ``message.output_text.logprobs``),
  ``user``, ``service_tier``, prompt-cache hints and Codex CLI's
  ``client_metadata`` change nothing here (docs/responses.md);
  ``background``, ``conversation``, ``prompt``, ``top_logprobs`` and
  ``truncation: "auto"`` are refused unless they ask for nothing. Any other
  field is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

import attrs
from cattrs.errors import ClassValidationError, IterableValidationError

from trioserve.openai.errors import invalid as _invalid
from trioserve.openai.extensions import EXTENSION_NAMES, Extras, read_extras
from trioserve.openai.fields import (
    _SAMPLER_FIELDS,
    OPENAI_DEFAULTS,
    OPENAI_RANGES,
    SAMPLER_ALIASES,
    _rule,
    normalized,
    synonyms_note,
)
from trioserve.openai.params import UNSUPPORTED, is_text, show
from trioserve.vocabulary.constraint import Constraint
from trioserve.vocabulary.rules import BadValue, Rule
from trioserve.vocabulary.sampling import Range, SamplingSettings, api_settings
from trioserve.vocabulary.strict_json import JsonError, parse_json
from trioserve.vocabulary.tools import Tool, ToolUse

from .items import _NAME, DEFAULT_LIMITS, ResponsesLimits, Turns, _keys, _object, read_input

__all__ = [
    "FIELD_KINDS",
    "ResponsesRequest",
    "parse_responses_body",
    "parse_responses_request",
    "previous_id",
]

#: Tools OpenAI runs (or whose calls are not function calls): skipped.
_SKIPPED_TOOLS: Final = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "image_generation",
        "code_interpreter",
        "computer",
        "computer_use",
        "computer_use_preview",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "custom",
        "namespace",
        "tool_search",
    }
)


@attrs.frozen(kw_only=True)
class ResponsesRequest:
    """A Responses API request, read and bounded."""

    model: str
    #: The conversation without the instructions (what a stored response
    #: keeps, :func:`~.items.read_input`).
    turns: Turns
    instructions: str = ""
    #: An upper bound (None: what the context leaves).
    max_output_tokens: int | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: Mapping[str, str] = attrs.field(factory=dict, hash=False)
    #: Sampler settings the request gave, by engine name.
    sampler: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    tools: ToolUse | None = None
    #: The function tools as the response object echoes them.
    tool_objects: tuple[Mapping[str, Any], ...] = ()
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    skipped_tools: tuple[str, ...] = ()
    constraint: Constraint | None = None
    #: ``text`` as the response object echoes it.
    text: Mapping[str, Any] = attrs.field(factory=lambda: {"format": {"type": "text"}}, hash=False)
    reasoning: Mapping[str, Any] | None = attrs.field(default=None, hash=False)
    user: str | None = None
    #: vLLM's and SGLang's fields (:mod:`trioserve.openai.extensions`).
    extras: Extras = attrs.field(factory=Extras)

    def sampling_settings(self) -> SamplingSettings:
        return api_settings(OPENAI_DEFAULTS, self.sampler)

    @property
    def thinking(self) -> bool | None:
        """``reasoning.effort: "none"`` turns a thinking template's section
        off; otherwise the template's default."""
        if self.reasoning is not None and self.reasoning.get("effort") == "none":
            return False
        return None

    def template_messages(self) -> Turns:
        from .items import with_instructions

        return with_instructions(self.turns, self.instructions)


# --------------------------------------------------------------------------
# Fields

#: Fields that change nothing here: accepted and ignored (docs/responses.md).
_IGNORED: Final = frozenset(
    {
        "user",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "safety_identifier",
        "client_metadata",
        "max_tool_calls",
        "stream_options",
        "context_management",
        "background_options",
        "access_programs",
        "image",
    }
)


def _null_or(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: (
        value is None or any(type(value) is type(a) and value == a for a in allowed)
    )


#: Features this server does not have: refused unless they ask for nothing.
_REFUSED: Final[Mapping[str, tuple[Callable[[Any], bool], str]]] = {
    "background": (_null_or(False), "background responses are not supported: stream instead"),
    "conversation": (_null_or(), "conversations are not supported: use previous_response_id"),
    "prompt": (_null_or(), "stored prompt templates are not supported"),
    "top_logprobs": (
        _null_or(0),
        "logprobs are not supported on /v1/responses: use /v1/chat/completions",
    ),
    "truncation": (
        _null_or("disabled"),
        "'auto' truncation is not supported: a conversation that does not fit is refused"
        " (context_length_exceeded)",
    ),
    "moderation": (_null_or(), "moderation is not supported"),
}
_FIELDS: Final = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "stream",
        "store",
        "previous_response_id",
        "metadata",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "reasoning",
        "include",
    }
)
#: ``include`` values: what they would add comes from tools this server
#: does not run, or from reasoning this model does not write.
_INCLUDABLE: Final = frozenset(
    {
        "reasoning.encrypted_content",
        "web_search_call.action.sources",
        "web_search_call.results",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
    }
)
_EFFORTS: Final = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})
_SUMMARIES: Final = frozenset({"auto", "concise", "detailed"})


def parse_responses_body(body: bytes) -> dict[str, Any]:
    """A body as a JSON object (strict: no lone surrogates, bounded depth)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise _invalid("the request body is not valid utf-8", None) from None
    try:
        obj = parse_json(text)
    except JsonError as exc:
        raise _invalid(f"the request body is not valid json: {exc}", None) from None
    if not isinstance(obj, dict):
        raise _invalid("the request body must be a json object", None)
    return obj


def _read(param: str, rule: Rule, value: Any, narrow: Range | None = None, note: str = "") -> Any:
    try:
        result = rule.read(value)
    except BadValue as exc:
        raise _invalid(f"{param} {exc}{note}", param) from None
    except (IterableValidationError, ClassValidationError) as exc:
        leaf = exc.exceptions[0] if exc.exceptions else exc
        raise _invalid(f"{param}: {leaf}", param) from None
    if narrow is not None and not narrow.contains(result):
        raise _invalid(f"{param} must be {narrow.describe()}, got {show(value)}", param)
    return result


def _bool(param: str, value: Any, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _invalid(f"{param} must be true or false, got {show(value)}", param)
    return value


def _string(param: str, value: Any, limit: int | None) -> str | None:
    if value is None:
        return None
    if not is_text(value) or (limit is not None and len(value) > limit):
        bound = "" if limit is None else f" of at most {limit} characters"
        raise _invalid(f"{param} must be a string{bound}, got {show(value)}", param)
    return value


def _tools(
    value: Any, limits: ResponsesLimits
) -> tuple[tuple[Tool, ...], tuple[dict[str, Any], ...], tuple[str, ...]]:
    if value is None:
        return (), (), ()
    if not isinstance(value, list):
        raise _invalid(f"tools must be a list of tools, got {show(value)}", "tools")
    if len(value) > limits.max_tools:
        raise _invalid(
            f"tools may hold at most {limits.max_tools} tools, got {len(value)}", "tools"
        )
    tools: list[Tool] = []
    objects: list[dict[str, Any]] = []
    skipped: list[str] = []
    for index, item in enumerate(value):
        where = f"tools[{index}]"
        tool = _object(where, item)
        kind = tool.get("type")
        if kind != "function":
            if isinstance(kind, str) and kind in _SKIPPED_TOOLS:
                name = tool.get("name")
                skipped.append(name if isinstance(name, str) and len(name) <= 128 else kind)
                continue
            raise _invalid(
                f"{where}.type must be 'function' (or one of OpenAI's built-in tools, which are"
                f" skipped), got {show(kind)}",
                f"{where}.type",
            )
        _keys(
            where,
            tool,
            frozenset({"type", "name", "description", "parameters", "strict", "defer_loading"}),
        )
        name = tool.get("name")
        if not isinstance(name, str) or _NAME.fullmatch(name) is None or len(name) > 64:
            raise _invalid(
                f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {show(name)}",
                f"{where}.name",
            )
        if any(t.name == name for t in tools):
            raise _invalid(f"{where}.name {show(name)} is given twice", f"{where}.name")
        description = _string(
            f"{where}.description", tool.get("description"), limits.max_description_chars
        )
        strict = _bool(f"{where}.strict", tool.get("strict"), True)
        parameters = tool.get("parameters")
        if parameters is not None:
            parameters = _read(f"{where}.parameters", _rule("json_schema"), parameters)
        tools.append(
            Tool(name=name, description=description, parameters=parameters or None, strict=strict)
        )
        objects.append(
            {
                "type": "function",
                "name": name,
                "description": description,
                "parameters": parameters,
                "strict": strict,
            }
        )
    return tuple(tools), tuple(objects), tuple(skipped)


def _tool_choice(value: Any, tools: tuple[Tool, ...], parallel: bool) -> tuple[ToolUse | None, Any]:
    """The tools the model may call and how, and ``tool_choice`` as the
    response echoes it."""
    if value is None:
        value = "auto"
    allowed = tools
    named: str | None = None
    if value in ("auto", "none", "required"):
        mode = value
    elif isinstance(value, dict):
        kind = value.get("type")
        if kind == "function":
            _keys("tool_choice", value, frozenset({"type", "name"}))
            named = value.get("name")
            if not isinstance(named, str) or named not in {t.name for t in tools}:
                raise _invalid(
                    f"tool_choice.name {show(named)} is not one of the request's function tools",
                    "tool_choice.name",
                )
            mode = "required"
        elif kind == "allowed_tools":
            _keys("tool_choice", value, frozenset({"type", "mode", "tools"}))
            mode = value.get("mode")
            if mode not in ("auto", "required"):
                raise _invalid(
                    f"tool_choice.mode must be 'auto' or 'required', got {show(mode)}",
                    "tool_choice.mode",
                )
            listed = value.get("tools")
            if not isinstance(listed, list) or len(listed) > len(tools) + 16:
                raise _invalid(
                    "tool_choice.tools must be a list of the request's tools", "tool_choice.tools"
                )
            names = set()
            for index, entry in enumerate(listed):
                at = f"tool_choice.tools[{index}]"
                entry = _object(at, entry)
                if entry.get("type") != "function" or not isinstance(entry.get("name"), str):
                    raise _invalid(f"{at} must be {{'type': 'function', 'name': ...}}", at)
                names.add(entry["name"])
            allowed = tuple(t for t in tools if t.name in names)
            unknown = names - {t.name for t in tools}
            if unknown:
                raise _invalid(
                    f"tool_choice.tools names {show(sorted(unknown)[0])}, which is not one of"
                    " the request's function tools",
                    "tool_choice.tools",
                )
        else:
            raise _invalid(
                f"tool_choice.type must be 'function' or 'allowed_tools' (OpenAI's built-in"
                f" tools do not run here), got {show(kind)}",
                "tool_choice.type",
                UNSUPPORTED if isinstance(kind, str) else None,
            )
    else:
        raise _invalid(
            f"tool_choice must be 'none', 'auto', 'required' or an object, got {show(value)}",
            "tool_choice",
        )
    if not allowed:
        if mode == "required":
            raise _invalid(
                "tool_choice requires a function tool, and the request has none", "tool_choice"
            )
        return None, value
    choice: Literal["auto", "required", "none"] = mode
    return ToolUse(tools=allowed, choice=choice, named=named, parallel=parallel), value


_OBJECT: Final = Constraint.json_schema({"type": "object"})


def _text_format(value: Any) -> tuple[Constraint | None, dict[str, Any]]:
    if value is None:
        return None, {"format": {"type": "text"}}
    text = _object("text", value)
    _keys("text", text, frozenset({"format", "verbosity"}))
    verbosity = text.get("verbosity")
    if verbosity not in (None, "low", "medium", "high"):
        raise _invalid(
            f"text.verbosity must be 'low', 'medium' or 'high', got {show(verbosity)}",
            "text.verbosity",
        )
    fmt = text.get("format")
    echo: dict[str, Any] = {"format": {"type": "text"}}
    if verbosity is not None:
        echo["verbosity"] = verbosity
    if fmt is None:
        return None, echo
    fmt = _object("text.format", fmt)
    kind = fmt.get("type")
    if kind == "text":
        _keys("text.format", fmt, frozenset({"type"}))
        return None, echo
    if kind == "json_object":
        _keys("text.format", fmt, frozenset({"type"}))
        echo["format"] = {"type": "json_object"}
        return _OBJECT, echo
    if kind != "json_schema":
        raise _invalid(
            f"text.format.type must be 'text', 'json_object' or 'json_schema', got {show(kind)}",
            "text.format.type",
        )
    _keys("text.format", fmt, frozenset({"type", "name", "schema", "strict", "description"}))
    name = fmt.get("name")
    if not isinstance(name, str) or _NAME.fullmatch(name) is None or len(name) > 64:
        raise _invalid(
            f"text.format.name must be 1 to 64 letters, digits, '_' or '-', got {show(name)}",
            "text.format.name",
        )
    if "schema" not in fmt:
        raise _invalid("text.format.schema is required", "text.format.schema")
    schema = _read("text.format.schema", _rule("json_schema"), fmt["schema"])
    strict = _bool("text.format.strict", fmt.get("strict"), False)
    description = _string("text.format.description", fmt.get("description"), 4096)
    echo["format"] = {
        "type": "json_schema",
        "name": name,
        "schema": schema,
        "strict": strict,
        "description": description,
    }
    if schema == {}:
        return _OBJECT, echo
    return Constraint.json_schema(schema, "text.format.schema"), echo


def _metadata(value: Any, limits: ResponsesLimits) -> dict[str, str]:
    if value is None:
        return {}
    meta = _object("metadata", value)
    if len(meta) > limits.max_metadata_keys:
        raise _invalid(
            f"metadata may hold at most {limits.max_metadata_keys} keys, got {len(meta)}",
            "metadata",
        )
    for key, item in meta.items():
        if not is_text(key) or len(key) > limits.max_metadata_key_chars:
            raise _invalid(
                f"metadata keys must be strings of at most {limits.max_metadata_key_chars}"
                f" characters, got {show(key)}",
                "metadata",
            )
        if not is_text(item) or len(item) > limits.max_metadata_value_chars:
            raise _invalid(
                f"metadata[{key!r}] must be a string of at most"
                f" {limits.max_metadata_value_chars} characters, got {show(item)}",
                "metadata",
            )
    return dict(meta)


def _reasoning(value: Any) -> dict[str, Any] | None:
    """Accepted and checked; this model writes no reasoning."""
    if value is None:
        return None
    reasoning = _object("reasoning", value)
    _keys("reasoning", reasoning, frozenset({"effort", "summary", "generate_summary"}))
    effort = reasoning.get("effort")
    if effort is not None and (not isinstance(effort, str) or effort not in _EFFORTS):
        raise _invalid(
            f"reasoning.effort must be one of {', '.join(sorted(_EFFORTS))}, got {show(effort)}",
            "reasoning.effort",
        )
    for key in ("summary", "generate_summary"):
        summary = reasoning.get(key)
        if summary is not None and (not isinstance(summary, str) or summary not in _SUMMARIES):
            raise _invalid(
                f"reasoning.{key} must be one of {', '.join(sorted(_SUMMARIES))},"
                f" got {show(summary)}",
                f"reasoning.{key}",
            )
    return {
        "effort": effort,
        "summary": reasoning.get("summary", reasoning.get("generate_summary")),
    }


def _include(value: Any, limits: ResponsesLimits) -> None:
    if value is None:
        return
    if not isinstance(value, list) or len(value) > limits.max_include:
        raise _invalid(
            f"include must be a list of at most {limits.max_include} strings, got {show(value)}",
            "include",
        )
    for index, entry in enumerate(value):
        if entry == "message.output_text.logprobs":
            raise _invalid(
                "include: logprobs are not supported on /v1/responses: use /v1/chat/completions",
                f"include[{index}]",
                UNSUPPORTED,
            )
        if not isinstance(entry, str) or entry not in _INCLUDABLE:
            raise _invalid(
                f"include[{index}] must be one of {', '.join(sorted(_INCLUDABLE))},"
                f" got {show(entry)}",
                f"include[{index}]",
            )


def _sampler(obj: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for param in _SAMPLER_FIELDS.keys() & obj.keys():
        if obj[param] is None:
            continue
        name = _SAMPLER_FIELDS[param]
        value = normalized(name, obj[param])
        out[name] = _read(param, _rule(name), value, OPENAI_RANGES.get(name), synonyms_note(name))
    for alias in SAMPLER_ALIASES.keys() & obj.keys():
        name = SAMPLER_ALIASES[alias]
        value = obj[alias]
        if value is None:
            continue
        value = _read(alias, _rule(name), value, OPENAI_RANGES.get(name))
        if name in out and out[name] != value:
            raise _invalid(f"give {_name_of(name)} or {alias}, not both", alias)
        out[name] = value
    return out


def _name_of(name: str) -> str:
    """The OpenAI name of the engine's setting ``name``."""
    return next(param for param, engine in _SAMPLER_FIELDS.items() if engine == name)


def previous_id(obj: Mapping[str, Any], limits: ResponsesLimits = DEFAULT_LIMITS) -> str | None:
    """The ``previous_response_id`` of a body read by :func:`parse_responses_body`."""
    return _string("previous_response_id", obj.get("previous_response_id"), limits.max_id_chars)


def parse_responses_request(
    obj: Mapping[str, Any], history: Turns = (), limits: ResponsesLimits = DEFAULT_LIMITS
) -> ResponsesRequest:
    """A ``POST /v1/responses`` body (read by :func:`parse_responses_body`),
    continuing ``history`` (the previous response's conversation); raises
    :class:`~trioserve.openai.OpenAIError` (400) naming the field."""
    for key, value in obj.items():
        if key in _REFUSED:
            accepted, why = _REFUSED[key]
            if not accepted(value):
                raise _invalid(f"{key}: {why}", key, UNSUPPORTED)
        elif (
            key not in _FIELDS
            and key not in _IGNORED
            and key not in _SAMPLER_FIELDS
            and key not in SAMPLER_ALIASES
            and key not in EXTENSION_NAMES
        ):
            raise _invalid(
                f"unrecognized request argument supplied: {show(key)}",
                key if isinstance(key, str) and len(key) <= 64 else None,
                "unknown_parameter",
            )
    model = obj.get("model")
    if not is_text(model) or not 0 < len(model) <= 256:
        raise _invalid(f"model must be a string of 1 to 256 characters, got {show(model)}", "model")
    max_output = obj.get("max_output_tokens")
    if max_output is not None:
        max_output = _read("max_output_tokens", _rule("max_new_tokens"), max_output)
        if max_output < 1:
            raise _invalid(
                f"max_output_tokens must be at least 1, got {show(obj['max_output_tokens'])}",
                "max_output_tokens",
            )
    instructions = _string("instructions", obj.get("instructions"), None) or ""
    if "input" not in obj or obj["input"] is None:
        raise _invalid("input is required", "input")
    turns = read_input(obj["input"], history, limits)
    tools, objects, skipped = _tools(obj.get("tools"), limits)
    parallel = _bool("parallel_tool_calls", obj.get("parallel_tool_calls"), True)
    tool_use, choice_echo = _tool_choice(obj.get("tool_choice"), tools, parallel)
    constraint, text_echo = _text_format(obj.get("text"))
    sampler = _sampler(obj)
    if max_output is not None and sampler.get("min_tokens", 0) > max_output:
        raise _invalid(
            f"min_tokens must be at most max_output_tokens ({max_output}),"
            f" got {sampler['min_tokens']}",
            "min_tokens",
        )
    _include(obj.get("include"), limits)
    user = _string("user", obj.get("user"), 256)
    extras = read_extras({k: v for k, v in obj.items() if k in EXTENSION_NAMES}, "responses")
    return ResponsesRequest(
        model=model,
        turns=turns,
        instructions=instructions,
        max_output_tokens=max_output,
        stream=_bool("stream", obj.get("stream"), False),
        store=_bool("store", obj.get("store"), True),
        previous_response_id=previous_id(obj, limits),
        metadata=_metadata(obj.get("metadata"), limits),
        sampler=sampler,
        tools=tool_use,
        tool_objects=objects,
        tool_choice=choice_echo,
        parallel_tool_calls=parallel,
        skipped_tools=skipped,
        constraint=constraint,
        text=text_echo,
        reasoning=_reasoning(obj.get("reasoning")),
        user=user,
        extras=extras,
    )


#: Each accepted field and what it does, for docs/responses.md's table.
FIELD_KINDS: Final[Mapping[str, Callable[[], frozenset[str]]]] = {
    "supported": lambda: (
        _FIELDS | frozenset(_SAMPLER_FIELDS) | frozenset(SAMPLER_ALIASES) | EXTENSION_NAMES
    ),
    "ignored": lambda: _IGNORED,
    "refused": lambda: frozenset(_REFUSED),
}
