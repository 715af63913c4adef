"""OpenAI requests: bodies in, typed requests out. No I/O, no trio, no torch.

A route hands its body to :func:`parse_completion_request` or
:func:`parse_chat_request` and gets a typed request or an :class:`OpenAIError`
(400, naming the field) that already knows its status and body. Every field
this API shares with the WebSocket ``infer`` is read by the rule declared
there (:mod:`trioserve.protocol`): the same types, ranges and bounds; where
OpenAI documents a narrower range or another default, the override is
declared here once (:data:`OPENAI_RANGES`, :data:`OPENAI_DEFAULTS`) and
checked at import to lie within the declared range.

What is accepted (``docs/openai.md`` has the table):

* OpenAI's own sampling fields map onto the engine's sampler with OpenAI's
  defaults, not the WebSocket protocol's: ``temperature`` 1, ``top_p`` 1, and
  no top_k, min_p, typical, top_a, skew or repetition penalty unless the
  request sets one of those ExLlamaV2 extension fields.
* Structured output (``response_format``, ``json_schema``, ``grammar``,
  vLLM's ``structured_outputs`` and ``guided_*``, TabbyAPI's
  ``regex_pattern`` and ``grammar_string``) becomes one constraint
  (:mod:`trioserve.openai.constraints`).
* ``logprobs`` and ``top_logprobs`` (and a completion's ``echo`` with
  ``max_tokens: 0``) are read by :mod:`trioserve.openai.logprobs`.
* Fields that would change the output in a way this server cannot honour
  (``tools``, ``n`` > 1, ``suffix``, audio ...) are refused with a 400 naming
  the field, unless their value asks for nothing (``n: 1``, ``tools: []``,
  ``tool_choice: "none"`` ...).
* Fields that do not change the output (``user``, ``metadata``, ``store``,
  ``service_tier``, ``parallel_tool_calls``, prompt-cache hints,
  ``reasoning_effort``, ``verbosity``, ``safety_identifier``) are accepted and
  ignored.
* Any other field is refused with a 400 naming it, as OpenAI does: a
  misspelt field is a mistake the client should hear about.
* ``model`` may name anything: the server has one model and serves it; the
  responses carry its real name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeAlias

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, override

from trioserve.vocabulary.constraint import Constraint
from trioserve.vocabulary.rules import MAX_TOKEN_ID, BadValue, Rule, StopStrings, TokenIds, as_int
from trioserve.vocabulary.sampling import Range, SamplingSettings, api_settings
from trioserve.vocabulary.strict_json import STRICT_DECODER
from trioserve.vocabulary.tools import ToolUse

from .constraints import CONSTRAINT_PARAMS, read_constraint
from .errors import OpenAIError
from .errors import invalid as _invalid
from .extensions import EXTENSION_NAMES, Extras, read_extras
from .fields import (
    _SAMPLER_FIELDS,
    OPENAI_DEFAULTS,
    OPENAI_NAMES,
    OPENAI_RANGES,
    OpenAILimits,
    _rule,
    normalized,
    synonyms_note,
)
from .logprobs import LogprobsAsked, read_chat_logprobs, read_completion_logprobs
from .messages import ChatMessage, messages_rule
from .params import UNSUPPORTED
from .params import BadParam as _BadParam
from .params import is_text as _text
from .params import show as _show
from .tools import TOOL_PARAMS, read_tools

DEFAULT_LIMITS: Final = OpenAILimits()

__all__ = [
    "COMPLETIONS_MAX_TOKENS",
    "OPENAI_DEFAULTS",
    "OPENAI_NAMES",
    "OPENAI_RANGES",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "OpenAILimits",
    "parse_chat_request",
    "parse_completion_request",
]

#: A completion without ``max_tokens`` generates up to this many tokens (as
#: OpenAI's do), fewer when the context leaves less room.
COMPLETIONS_MAX_TOKENS: Final = 16

# --------------------------------------------------------------------------
# Requests


@attrs.frozen(kw_only=True)
class _Generation:
    """Fields both generation routes take."""

    model: str | None = None
    #: None: as many as the context leaves (chat), up to
    #: :data:`COMPLETIONS_MAX_TOKENS` (completions).
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    token_healing: bool = False
    bann_bann: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    #: The sampler settings the request gave, by engine name (each read by
    #: its declared rule); the rest take :data:`OPENAI_DEFAULTS` or
    #: :class:`SamplingSettings`' defaults.
    sampler: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    #: Structured output: the one constraint of ``response_format``,
    #: ``json_schema``, ``grammar``, ``structured_outputs``, ``guided_*`` ...
    #: (:mod:`trioserve.openai.constraints`).
    constraint: Constraint | None = None
    #: ``logprobs`` / ``top_logprobs`` (:mod:`trioserve.openai.logprobs`).
    logprobs: LogprobsAsked = attrs.field(factory=LogprobsAsked)
    #: How many choices to generate (at most ``OpenAILimits.max_n``).
    n: int = 1
    #: OpenAI's ``best_of``: only ``n`` (or absent) is served; ranking more
    #: candidates than are returned is not implemented.
    best_of: int | None = None
    #: vLLM's and SGLang's fields (:mod:`trioserve.openai.extensions`).
    extras: Extras = attrs.field(factory=Extras)

    def sampling_settings(self) -> SamplingSettings:
        return api_settings(OPENAI_DEFAULTS, self.sampler)

    @property
    def temperature(self) -> float:
        return float(self.sampling_settings().temperature)


@attrs.frozen(kw_only=True)
class CompletionRequest(_Generation):
    """``POST /v1/completions``: a prompt as text, or as token ids."""

    prompt: str | tuple[int, ...]
    #: None when not given: up to :data:`COMPLETIONS_MAX_TOKENS`, as many as
    #: the context leaves.
    max_tokens: int | None = None
    #: Prepend the prompt text to the completion (OpenAI's ``echo``).
    echo: bool = False


@attrs.frozen(kw_only=True)
class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``: messages for the model's chat template."""

    messages: tuple[ChatMessage, ...]
    #: The tools the model may call, and how (:mod:`trioserve.openai.tools`).
    tools: ToolUse | None = None
    #: A thinking template's section: off with ``reasoning_effort: "none"``
    #: or ``chat_template_kwargs: {"enable_thinking": false}``, on with the
    #: latter true, else the template's default (None).
    thinking: bool | None = None
    #: ``continue_final_message``: the final assistant message, taken out of
    #: ``messages``; the reply goes on from it.
    prefix: str = ""

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_input() for m in self.messages]


# --------------------------------------------------------------------------
# Parsing: strict JSON, then fields


#: Where :func:`_preprocess` puts a body's constraint and tool fields (not
#: field names).
_CONSTRAINTS: Final = " constraints"
_TOOLS: Final = " tools"
_EXTRAS: Final = " extras"


def _parse_body(body: bytes) -> dict[str, Any]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise _invalid("the request body is not valid utf-8", None) from None
    try:
        obj = STRICT_DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise _invalid(
            f"the request body is not valid json: {exc.msg[:1].lower()}{exc.msg[1:]} "
            f"at line {exc.lineno} column {exc.colno}",
            None,
        ) from None
    except ValueError as exc:
        raise _invalid(f"the request body is not valid json: {exc}", None) from None
    except RecursionError:
        raise _invalid("the request body is not valid json: nested too deeply", None) from None
    if not isinstance(obj, dict):
        raise _invalid("the request body must be a json object", None)
    return obj


_Hook: TypeAlias = Callable[[Any, Any], Any]


def _bool_rule(name: str) -> _Hook:
    def hook(value: Any, _: Any) -> bool:
        if value is None:
            return False
        if not isinstance(value, bool):
            raise _BadParam(name, f"{name} must be true or false, got {_show(value)}")
        return value

    return hook


def _model_hook(value: Any, _: Any) -> str | None:
    if value is None:
        return None
    if not _text(value) or len(value) > 256:
        raise _BadParam(
            "model", f"model must be a string of at most 256 characters, got {_show(value)}"
        )
    return str(value)


def _count_rule(name: str, cap: int, *, default: int | None) -> _Hook:
    def hook(value: Any, _: Any) -> int | None:
        if value is None:
            return default
        number = as_int(value)
        if number is None or not 1 <= number <= cap:
            raise _BadParam(
                name, f"{name} must be an integer in 1..{cap} on this server, got {_show(value)}"
            )
        return number

    return hook


def _prompt_hook(value: Any, _: Any) -> str | tuple[int, ...]:
    # A prompt is a string, a list of one string, or token ids (a list of
    # ints, or a list of one such list). Several prompts are a batch, which
    # this server answers one request at a time: refused like n > 1.
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if not _text(value):
            raise _BadParam("prompt", "prompt is not valid unicode (it holds a lone surrogate)")
        return value
    if isinstance(value, list) and value and all(as_int(v) is not None for v in value):
        ids = tuple(as_int(v) for v in value)
        if any(i is None or i < 0 or i > MAX_TOKEN_ID for i in ids):
            raise _BadParam("prompt", "prompt token ids must be integers >= 0")
        return tuple(i for i in ids if i is not None)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, str | list) for v in value):
        raise _BadParam(
            "prompt",
            f"prompt holds {len(value)} prompts; this server takes one prompt per request",
            UNSUPPORTED,
        )
    raise _BadParam(
        "prompt",
        f"prompt must be a string or a non-empty list of token ids, got {_show(value)}",
    )


def _harmless(accepted: Callable[[Any], bool], why: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if not accepted(value):
            raise _invalid(f"{name} {why}; got {_show(value)}", name, UNSUPPORTED)

    return check


def _none_or(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(type(value) is type(v) and value == v for v in values)


#: Fields accepted only with a value that asks for nothing; anything else
#: would change the output in a way this server cannot honour.
_REFUSED: Final[Mapping[str, Callable[[str, Any], None]]] = {
    "suffix": _harmless(_none_or(""), "is not supported: insertion is not implemented"),
    "modalities": _harmless(
        _none_or(["text"]), "must be ['text']: this model reads and writes text only"
    ),
    "audio": _harmless(_none_or(), "is not supported: this model writes text only"),
    "prediction": _harmless(_none_or(), "is not supported"),
    "web_search_options": _harmless(_none_or(), "is not supported"),
    "moderation": _harmless(_none_or(), "is not supported"),
}

#: Fields that do not change what is generated: accepted and ignored.
_IGNORED: Final = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "safety_identifier",
        "reasoning_effort",
        "verbosity",
    }
)

_FIELDS_COMMON: Final = frozenset(
    {
        "model",
        "max_tokens",
        "stop",
        "stream",
        "token_healing",
        "bann_bann",
        "stop_token_ids",
        "n",
        "best_of",
    }
)


def _declared_rule(
    param: str, rule: Rule, value: Any, narrow: Range | None = None, note: str = ""
) -> Any:
    """``value`` read by a declared rule (and OpenAI's narrower range), its
    errors named by this API's ``param`` (and ending with ``note``)."""
    try:
        result = rule.read(value)
    except BadValue as exc:
        raise _BadParam(param, f"{param} {exc}{note}") from None
    except (IterableValidationError, ClassValidationError) as exc:
        suffix, leaf = _element_of(exc)
        where = param + suffix
        raise _BadParam(where, f"{where} {leaf}") from None
    if narrow is not None and not narrow.contains(result):
        raise _BadParam(param, f"{param} must be {narrow.describe()}, got {_show(value)}{note}")
    return result


def _element_of(exc: BaseException) -> tuple[str, str]:
    """The path suffix (``[3]`` of a list, ``["42"]`` of an object) and the
    message of the first bad element."""
    for error in getattr(exc, "exceptions", ()):
        for note in getattr(error, "__notes__", ()):
            if isinstance(note, IterableValidationNote):
                return f"[{note.index}]", str(error)
            if isinstance(note, AttributeValidationNote):
                return f"[{json.dumps(str(note.name))}]", str(error)
    return "", str(exc)


def _sampler_hook(value: Any, _: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for param, given in value.items():
        name = _SAMPLER_FIELDS.get(param) or _SAMPLER_FIELDS[_ALIASES[param]]
        if given is None:
            continue  # null is "the default", as OpenAI reads it
        out[name] = _declared_rule(
            param,
            _rule(name),
            normalized(name, given),
            OPENAI_RANGES.get(name),
            note=synonyms_note(name),
        )
    return out


def _rule_hook(param: str, rule: Rule) -> _Hook:
    """A list field read by a rule of the vocabulary's kit (absent or null: empty)."""

    def hook(value: Any, _: Any) -> Any:
        return () if value is None else _declared_rule(param, rule, value)

    return hook


def _declared_hook(param: str, name: str, *, default: Any) -> _Hook:
    def hook(value: Any, _: Any) -> Any:
        if value is None:
            return default
        return _declared_rule(param, _rule(name), value)

    return hook


def _common_hooks(limits: OpenAILimits) -> dict[str, Any]:
    return {
        "model": override(struct_hook=_model_hook),
        "max_tokens": override(
            struct_hook=_declared_hook("max_tokens", "max_new_tokens", default=None)
        ),
        "stop": override(
            struct_hook=_rule_hook(
                "stop", StopStrings(limits.max_stop_strings, limits.max_stop_string_chars)
            )
        ),
        "stream": override(struct_hook=_bool_rule("stream")),
        "include_usage": override(struct_hook=_bool_rule("stream_options.include_usage")),
        "token_healing": override(
            struct_hook=_declared_hook("token_healing", "token_healing", default=False)
        ),
        "bann_bann": override(
            struct_hook=_rule_hook("bann_bann", TokenIds(limits.max_banned_ids, "max_banned_ids"))
        ),
        "stop_token_ids": override(
            struct_hook=_rule_hook(
                "stop_token_ids", TokenIds(limits.max_stop_token_ids, "max_stop_token_ids")
            )
        ),
        "sampler": override(struct_hook=_sampler_hook),
        "n": override(struct_hook=_count_rule("n", limits.max_n, default=1)),
        "best_of": override(struct_hook=_count_rule("best_of", limits.max_n, default=None)),
    }


#: Other servers' names for fields of this API: vLLM's and transformers'
#: repetition_penalty, OpenAI's newer max_completion_tokens (chat).
_ALIASES: Final[Mapping[str, str]] = {
    "repetition_penalty": "rep_pen",
    "max_completion_tokens": "max_tokens",
}


def _alias(obj: Mapping[str, Any], key: str) -> str | None:
    """The field an alias stands for, or None when it adds nothing (null, or
    the same value as the field). Both given with different values is an error."""
    target = _ALIASES[key]
    value, other = obj[key], obj.get(target)
    if value is None:
        return None
    if other is not None:
        if other != value:
            raise _invalid(f"give {target} or {key}, not both", key)
        return None
    return target


def _preprocess(obj: dict[str, Any], fields: frozenset[str]) -> dict[str, Any]:
    """Sort a body's keys: ignored ones go, refused ones are checked, aliases
    are renamed, ``stream_options`` is flattened, unknown ones are refused."""
    payload: dict[str, Any] = {}
    for key, value in obj.items():
        if key in _IGNORED:
            continue
        if key in _REFUSED:
            _REFUSED[key](key, value)
            continue
        if key in CONSTRAINT_PARAMS:
            payload.setdefault(_CONSTRAINTS, {})[key] = value
            continue
        if key in TOOL_PARAMS:
            payload.setdefault(_TOOLS, {})[key] = value
            continue
        if key in EXTENSION_NAMES:
            payload.setdefault(_EXTRAS, {})[key] = value
            continue
        if key in _ALIASES:
            target = _alias(obj, key)
            if target is None:
                continue
            if target in _SAMPLER_FIELDS:
                # Read as the setting, named as the client sent it in errors.
                payload.setdefault("sampler", {})[key] = value
                continue
            key = target
        if key == "stream_options":
            continue
        if key in _SAMPLER_FIELDS:
            payload.setdefault("sampler", {})[key] = value
            continue
        if key not in fields:
            raise _invalid(
                f"unrecognized request argument supplied: {_show(key)}",
                key if _text(key) and len(key) <= 256 else None,
                "unknown_parameter",
            )
        payload[key] = value
    options = obj.get("stream_options")
    if options is not None:
        if obj.get("stream") is not True:
            raise _invalid("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict):
            raise _invalid(
                f"stream_options must be an object, got {_show(options)}", "stream_options"
            )
        for key, value in options.items():
            if key == "include_usage":
                payload["include_usage"] = value
            elif key != "include_obfuscation":  # padding against side channels: moot here
                raise _invalid(
                    f"unrecognized stream option {_show(key)}",
                    f"stream_options.{key}",
                    "unknown_parameter",
                )
    return payload


_converter: Final = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)


def _structure_fn(
    cls: type[Any], limits: OpenAILimits, extra: Mapping[str, Any]
) -> Callable[[dict[str, Any]], Any]:
    fn = make_dict_structure_fn(cls, _converter, **{**_common_hooks(limits), **extra})
    return lambda payload: fn(payload, cls)


@attrs.frozen
class _Parsers:
    completion: Callable[[dict[str, Any]], CompletionRequest]
    chat: Callable[[dict[str, Any]], ChatCompletionRequest]


_parsers_cache: dict[OpenAILimits, _Parsers] = {}


def _parsers(limits: OpenAILimits) -> _Parsers:
    """Structure functions are generated once per set of limits (the server
    has one), not per request."""
    parsers = _parsers_cache.get(limits)
    if parsers is None:
        parsers = _Parsers(
            completion=_structure_fn(
                CompletionRequest,
                limits,
                {
                    "prompt": override(struct_hook=_prompt_hook),
                    "echo": override(struct_hook=_bool_rule("echo")),
                },
            ),
            chat=_structure_fn(
                ChatCompletionRequest,
                limits,
                {"messages": override(struct_hook=messages_rule(limits))},
            ),
        )
        if len(_parsers_cache) < 16:
            _parsers_cache[limits] = parsers
    return parsers


def _structure(payload: dict[str, Any], fn: Callable[[dict[str, Any]], Any], required: str) -> Any:
    if required not in payload or payload[required] is None:
        raise _invalid(f"{required} is required", required)
    try:
        return fn(payload)
    except ClassValidationError as exc:
        raise _first_error(exc) from None


def _first_error(exc: BaseException) -> OpenAIError:
    """The first field error inside a cattrs validation group."""
    stack = [exc]
    while stack:
        error = stack.pop(0)
        if isinstance(error, _BadParam):
            return _invalid(error.message, error.param, error.code)
        if isinstance(error, BaseExceptionGroup):
            stack.extend(error.exceptions)
    message = cattrs.transform_error(exc)[0] if isinstance(exc, ClassValidationError) else str(exc)
    return _invalid(message, None)


def parse_completion_request(
    body: bytes, limits: OpenAILimits = DEFAULT_LIMITS
) -> CompletionRequest:
    """The body of ``POST /v1/completions`` as a typed request; raises
    :class:`OpenAIError` (400, naming the field) for anything wrong."""
    obj = _parse_body(body)
    asked = read_completion_logprobs(obj)
    payload = _preprocess(obj, _FIELDS_COMMON | {"prompt", "echo"})
    extras = read_extras(payload.pop(_EXTRAS, {}), "completions")
    constraint = read_constraint(payload.pop(_CONSTRAINTS, {}))
    if _read_tools(payload.pop(_TOOLS, {})) is not None:
        raise _invalid("tools are for /v1/chat/completions", "tools", UNSUPPORTED)
    request: CompletionRequest = _structure(payload, _parsers(limits).completion, "prompt")
    _check_best_of(request)
    max_tokens = 0 if asked.score_only else request.max_tokens
    return attrs.evolve(
        request, constraint=constraint, logprobs=asked, max_tokens=max_tokens, extras=extras
    )


#: OpenAI's reasoning efforts; ``none`` turns a thinking template's section off.
_EFFORTS: Final = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})


def _read_thinking(obj: dict[str, Any]) -> bool | None:
    """``reasoning_effort`` and vLLM's ``chat_template_kwargs`` (only its
    ``enable_thinking``), taken out of the body."""
    thinking = None
    effort = obj.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in _EFFORTS:
            raise _invalid(
                f"reasoning_effort must be one of {', '.join(sorted(_EFFORTS))}, got"
                f" {_show(effort)}",
                "reasoning_effort",
            )
        if effort == "none":
            thinking = False
    kwargs = obj.pop("chat_template_kwargs", None)
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise _invalid(
                f"chat_template_kwargs must be an object, got {_show(kwargs)}",
                "chat_template_kwargs",
            )
        for key, value in kwargs.items():
            if key != "enable_thinking":
                raise _invalid(
                    f"chat_template_kwargs: only enable_thinking is taken here, got {_show(key)}",
                    "chat_template_kwargs",
                    UNSUPPORTED,
                )
            if not isinstance(value, bool):
                raise _invalid(
                    f"chat_template_kwargs.enable_thinking must be true or false, got"
                    f" {_show(value)}",
                    "chat_template_kwargs.enable_thinking",
                )
            if thinking is not None and thinking != value:
                raise _invalid(
                    "give reasoning_effort none or enable_thinking true, not both",
                    "chat_template_kwargs.enable_thinking",
                )
            thinking = value
    return thinking


def parse_chat_request(body: bytes, limits: OpenAILimits = DEFAULT_LIMITS) -> ChatCompletionRequest:
    """The body of ``POST /v1/chat/completions`` as a typed request; raises
    :class:`OpenAIError` (400, naming the field) for anything wrong."""
    obj = _parse_body(body)
    asked = read_chat_logprobs(obj)
    thinking = _read_thinking(obj)
    payload = _preprocess(obj, _FIELDS_COMMON | {"messages"})
    extras = read_extras(payload.pop(_EXTRAS, {}), "chat")
    constraint = read_constraint(payload.pop(_CONSTRAINTS, {}))
    tools = _read_tools(payload.pop(_TOOLS, {}))
    request: ChatCompletionRequest = _structure(payload, _parsers(limits).chat, "messages")
    _check_best_of(request)
    request = attrs.evolve(
        request,
        constraint=constraint,
        tools=tools,
        logprobs=asked,
        thinking=thinking,
        extras=extras,
    )
    if extras.continue_final_message:
        request = _continued(request)
    return request


def _continued(request: ChatCompletionRequest) -> ChatCompletionRequest:
    """``continue_final_message``: the final assistant message becomes the
    start of the reply (the prompt ends with it, unclosed)."""
    *before, last = request.messages
    if last.role != "assistant" or last.tool_calls:
        raise _invalid(
            "continue_final_message needs the final message to be the assistant's, with text"
            f" and no tool calls; messages[{len(before)}] is a {last.role!r} message",
            f"messages[{len(before)}]",
        )
    tools = request.tools
    if request.constraint is not None or (tools is not None and tools.choice == "required"):
        raise _invalid(
            "continue_final_message cannot continue a message under an output format or a"
            " required tool: the answer must start where the constraint does",
            "continue_final_message",
        )
    return attrs.evolve(request, messages=tuple(before), prefix=last.content)


def _check_best_of(request: _Generation) -> None:
    if request.best_of is not None and request.best_of != request.n:
        raise _invalid(
            f"best_of must equal n ({request.n}) on this server: returning the best of more"
            f" candidates than are returned is not implemented; got {request.best_of}",
            "best_of",
            UNSUPPORTED,
        )


def _read_tools(fields: dict[str, Any]) -> ToolUse | None:
    try:
        return read_tools(fields)
    except _BadParam as exc:
        raise _invalid(exc.message, exc.param, exc.code) from None
