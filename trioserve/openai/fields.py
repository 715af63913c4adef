"""The OpenAI API's fields as declarations: every field it shares with the
WebSocket ``infer`` takes its rule from there; OpenAI's own names, defaults
and narrower ranges are declared here once. :func:`field_table` renders them
for ``docs/openai.md``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

import attrs

from trioserve import protocol as p
from trioserve.vocabulary.rules import Rule
from trioserve.vocabulary.sampling import Range, SamplingSettings, setting_ranges

__all__ = [
    "OPENAI_DEFAULTS",
    "OPENAI_NAMES",
    "OPENAI_RANGES",
    "SAMPLER_ALIASES",
    "SHARED_FIELDS",
    "OpenAILimits",
    "field_table",
    "normalized",
]


#: ``infer``'s declared fields: every field this API shares with it takes its
#: rule (type, range, list and string bounds) from there.
_INFER: Final = p.request_fields("infer")
_SAMPLER_NAMES: Final = tuple(a.name for a in attrs.fields(SamplingSettings))

#: This API's names for sampler settings that OpenAI names differently.
OPENAI_NAMES: Final[Mapping[str, str]] = {
    "freq_pen": "frequency_penalty",
    "pres_pen": "presence_penalty",
}
#: Sampler settings whose default differs here: OpenAI's (temperature 1,
#: top_p 1) and no ExLlamaV2 filter unless asked for (top_k 0, rep_pen 1).
#: Every other setting's default is :class:`SamplingSettings`'.
OPENAI_DEFAULTS: Final[Mapping[str, Any]] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "rep_pen": 1.0,
}
#: Where OpenAI documents a narrower range than the engines take, by engine
#: name. Checked at import to lie within the declared range.
OPENAI_RANGES: Final[Mapping[str, Range]] = {
    "temperature": Range(0.0, 2.0),
    "freq_pen": Range(-2.0, 2.0),
    "pres_pen": Range(-2.0, 2.0),
}


def _check_overrides() -> None:
    ranges = setting_ranges()
    for name, narrow in OPENAI_RANGES.items():
        wide = ranges[name]
        assert wide.lo <= narrow.lo <= narrow.hi <= wide.hi, (name, narrow, wide)
    for name, default in OPENAI_DEFAULTS.items():
        assert ranges[name].contains(default), (name, default)


_check_overrides()


def _rule(name: str) -> Rule:
    """The rule ``infer``'s field ``name`` is read by."""
    rule: Rule = _INFER[name].rule
    return rule


def _limit(name: str, limit: str) -> int:
    """One of the bounds ``infer``'s field ``name`` declares (its rule's
    ``limits``, as the ``info`` action reports them)."""
    return _INFER[name].rule.limits[limit]


@attrs.frozen(kw_only=True)
class OpenAILimits:
    """Bounds on a request's fields, checked before any work: the WebSocket
    protocol's declared bounds, so that both doors take the same."""

    max_stop_strings: int = _limit("stop_conditions", "max_stop_conditions")
    max_stop_string_chars: int = _limit("stop_conditions", "max_stop_string_chars")
    max_stop_token_ids: int = _limit("stop_conditions", "max_stop_conditions")
    max_banned_ids: int = _limit("bann_bann", "max_banned_ids")
    max_messages: int = _limit("messages", "max_messages")
    max_name_chars: int = 256
    max_content_parts: int = 1024
    #: Choices one request may ask for (``n``): each is a generation of
    #: the client, counted against its request limit.
    max_n: int = 8


#: This API's name -> the engine's, for every sampler setting.
_SAMPLER_FIELDS: Final[Mapping[str, str]] = {
    OPENAI_NAMES.get(name, name): name for name in _SAMPLER_NAMES
}


#: Other servers' names for sampler settings (vLLM's and transformers'),
#: by engine name.
SAMPLER_ALIASES: Final[Mapping[str, str]] = {"repetition_penalty": "rep_pen"}


#: Values this API takes for a sampler setting (by engine name) that the
#: WebSocket does not, and what they mean there: vLLM's and SGLang's
#: ``top_k: -1`` ("off", which SGLang's gateway sends by default) is 0.
OPENAI_SYNONYMS: Final[Mapping[str, Mapping[int, int]]] = {"top_k": {-1: 0}}


def synonyms_note(name: str) -> str:
    """What an error for ``name`` adds about its synonyms ("; -1 is taken
    for 0"), or nothing."""
    synonyms = OPENAI_SYNONYMS.get(name, {})
    return "".join(f"; {given} is taken for {meant}" for given, meant in synonyms.items())


def normalized(name: str, value: Any) -> Any:
    """A sampler setting's value in this server's terms (``OPENAI_SYNONYMS``)."""
    synonyms = OPENAI_SYNONYMS.get(name)
    if synonyms is not None and type(value) is int and value in synonyms:
        return synonyms[value]
    return value


#: Where a setting means something else here than on the WebSocket.
OPENAI_MEANINGS: Final[Mapping[str, str]] = {
    "top_p": "1 turns it off; 0 keeps only the most likely token (as OpenAI reads it)",
}

#: Fields this API takes under the WebSocket ``infer``'s name and rule,
#: besides the sampler settings.
SHARED_FIELDS: Final = ("token_healing", "bann_bann")


def field_table() -> str:
    """The Markdown table of the fields this API shares with ``infer``: the
    sampler settings (OpenAI's name, range and default where they differ)
    and the extensions, as ``docs/openai.md`` shows it."""
    defaults = {a.name: a.default for a in attrs.fields(SamplingSettings)}
    lines = [
        "| field | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for name in _SAMPLER_NAMES:
        wire = _INFER[name]
        param = OPENAI_NAMES.get(name, name)
        narrow = OPENAI_RANGES.get(name)
        allowed = _doc(narrow.describe()) if narrow is not None else wire.rule.doc
        default = OPENAI_DEFAULTS.get(name, defaults[name])
        if name == "logit_bias":  # (id, bias) pairs inside, an object on the wire
            default = {str(token): bias for token, bias in default}
        meaning = OPENAI_MEANINGS.get(name, wire.meaning)
        lines.append(f"| `{param}` | {allowed} | {_show_default(default)} | {meaning} |")
    for name in SHARED_FIELDS:
        wire = _INFER[name]
        default = _show_default(_INFER_DEFAULTS[name])
        lines.append(f"| `{name}` | {wire.rule.doc} | {default} | {wire.meaning} |")
    return "\n".join(lines)


_INFER_DEFAULTS: Final = p.INFER_DEFAULTS


def _doc(allowed: str) -> str:
    for article in ("a ", "an "):
        if allowed.startswith(article):
            return allowed[len(article) :]
    return allowed


def _show_default(value: Any) -> str:
    if value is None:
        return "absent"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value)}`"
