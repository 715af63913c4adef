"""The protocol's requests as typed messages, and its errors.

Request classes declare their wire fields once (with the rule kit of
:mod:`trioserve.vocabulary.rules`): the codec, the error paths, the per-field
limits of ``info`` and the docs' field table are derived from these
declarations. The replies are in :mod:`._replies`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, TypeAlias

import attrs

from trioserve.vocabulary.constraint import CONSTRAINT_LIMITS, Constraint
from trioserve.vocabulary.results import MAX_TOP_LOGPROBS
from trioserve.vocabulary.rules import (
    WIRE,
    AnyJson,
    Bool,
    Int,
    JsonObject,
    Messages,
    Rule,
    StopConditions,
    Str,
    StrList,
    TokenIds,
    Wire,
    sampler_field,
    wire_field,
)
from trioserve.vocabulary.sampling import SamplingSettings, Strings
from trioserve.vocabulary.strict_json import MAX_JSON_DEPTH, json_equal

__all__ = [
    "ACTIONS",
    "ENVELOPE",
    "ERROR_TYPES",
    "FIELD_LIMITS",
    "ChatMessage",
    "EchoRequest",
    "ErrorType",
    "EstimateTokenRequest",
    "InferRequest",
    "InfoRequest",
    "LefttrimTokenRequest",
    "Request",
    "StopRequest",
]

#: The six actions, in the order the protocol document lists them.
ACTIONS: Final[tuple[str, ...]] = (
    "echo",
    "estimate_token",
    "lefttrim_token",
    "infer",
    "stop",
    "info",
)

ErrorType: TypeAlias = Literal[
    "invalid_json", "invalid_request", "unknown_action", "overloaded", "internal"
]

#: Every ``error.type`` an error frame may carry (protocol section 5).
ERROR_TYPES: Final[tuple[ErrorType, ...]] = (
    "invalid_json",
    "invalid_request",
    "unknown_action",
    "overloaded",
    "internal",
)


def _echoed_field() -> Any:
    # Echoed ids may hold lists and objects, which do not hash; equality still
    # compares them.
    return attrs.field(factory=dict, hash=False)


# --------------------------------------------------------------------------
# The envelope and the limits of free-form values

#: Echoed ids (and a ``stop`` target, which is compared with them) are short
#: in real clients: a counter, a UUID (38 bytes as JSON), a small object.
_ID = AnyJson(1024, "max_id_bytes")
#: ``tag`` is client state echoed in *every* frame of the request, chunks
#: included; the seed gave it no limit. 16 KiB holds any real bookkeeping
#: object and keeps a streamed answer's frames small.
_TAG = AnyJson(16384, "max_tag_bytes")

#: Envelope keys: copied into every frame answering the request. ``tag``
#: belongs to ``infer`` only (the seed echoed it there and nowhere else).
ENVELOPE: Final[Mapping[str, Wire]] = {
    "request_id": Wire("request_id", _ID, "any json value, echoed in every frame of the answer"),
    "response_id": Wire("response_id", _ID, "any json value, echoed in every frame of the answer"),
    "tag": Wire("tag", _TAG, "echoed in every frame of the request"),
}


# --------------------------------------------------------------------------
# Requests


@attrs.frozen
class ChatMessage:
    """One message of a chat (``infer``'s ``messages``)."""

    role: str
    content: str


@attrs.frozen
class EchoRequest:
    """``echo``: a ping / health check."""

    echoed: Mapping[str, Any] = _echoed_field()


def _model_field() -> Any:
    """``model``, the same on every action that runs on a model."""
    return wire_field(
        Str(256, min_chars=1),
        "the model that serves it, by id or alias, on a server of several (`info`: `models`; "
        "absent: the first); a server of one model takes any name",
        default=None,
        extension=True,
        default_doc="absent",
    )


@attrs.frozen
class EstimateTokenRequest:
    """``estimate_token``: how many tokens ``text`` encodes to."""

    text: str = wire_field(Str(), "the text to count")
    model: str | None = _model_field()
    echoed: Mapping[str, Any] = _echoed_field()


@attrs.frozen
class LefttrimTokenRequest:
    """``lefttrim_token``: the last ``trimmed_length`` tokens of ``text``."""

    text: str = wire_field(Str(), "the text to trim")
    trimmed_length: int = wire_field(Int(0), "tokens to keep, counted from the end")
    model: str | None = _model_field()
    echoed: Mapping[str, Any] = _echoed_field()


#: ``stop_conditions``: real clients send a few end markers ("\n\nUser:",
#: "<|eot_id|>", "###"); 64 strings of 256 characters leave room for any of
#: them and bound the per-job stop-string automaton (about 16 k states, built
#: in tens of milliseconds).
_STOP_CONDITIONS = StopConditions(max_count=64, max_chars=256)
#: ``bann_bann``: lists of a few to a few hundred ids are usual; 65,536 is half
#: of a 128 k vocabulary, enough to ban a whole script (English-only output),
#: and still a frame of 0.5 MB whose check takes about a millisecond.
_BANNED = TokenIds(max_count=65536, limit_name="max_banned_ids")
#: ``messages``: OpenAI's API takes at most 2,048 messages; roles are short
#: names ("system", "user", "assistant", "tool", "ipython").
_MESSAGES = Messages(ChatMessage, max_count=2048, max_role_chars=64)
#: Constraints: their bounds are declared once, with the engine's
#: (:data:`~trioserve.vocabulary.constraints.CONSTRAINT_LIMITS`), and the OpenAI
#: door reads the same.
_SCHEMA = JsonObject(CONSTRAINT_LIMITS.max_schema_bytes, "max_schema_bytes")
_REGEX = Str(CONSTRAINT_LIMITS.max_regex_chars, min_chars=1)
_REGEX.limits = {"max_regex_chars": CONSTRAINT_LIMITS.max_regex_chars}
_GRAMMAR = Str(CONSTRAINT_LIMITS.max_grammar_chars, min_chars=1)
_GRAMMAR.limits = {"max_grammar_chars": CONSTRAINT_LIMITS.max_grammar_chars}
_CHOICE = StrList(
    Strings(CONSTRAINT_LIMITS.max_choices, CONSTRAINT_LIMITS.max_choice_chars),
    ("max_choices", "max_choice_chars"),
    min_count=1,
)


@attrs.frozen(kw_only=True)
class InferRequest:
    """``infer``: generate a completion of ``text`` (or of ``messages``).

    Each attribute is one wire field, declared here once: its wire name,
    rule (type and range), default and doc line. Sampler settings take their
    defaults and ranges from :class:`~trioserve.vocabulary.sampling.SamplingSettings`.
    Attribute names are the wire names except ``custom_bos`` (``customBos``).
    ``echoed`` holds ``request_id``, ``response_id`` and ``tag`` as the
    client sent them.
    """

    text: str | None = wire_field(
        Str(),
        "the prompt",
        default=None,
        group="prompt",
        default_doc="required, unless `messages` is given",
    )
    max_new_tokens: int = wire_field(
        Int(1),
        "at most this many new tokens (a stop token counts); at most the context length "
        "minus 1 (`info`: `limits.max_new_tokens`)",
    )
    stream: bool = wire_field(Bool(), "send `chunk` frames while generating", default=False)
    stream_full: bool = wire_field(
        Bool(), "every chunk frame also carries `response`, the completion so far", default=False
    )
    top_k: int = sampler_field("top_k", "0 turns it off")
    top_p: float = sampler_field("top_p", "0 or 1 turn it off")
    top_a: float = sampler_field("top_a", "0 turns it off")
    min_p: float = sampler_field("min_p", "0 turns it off")
    typical: float = sampler_field("typical", "0 or 1 turn it off")
    temperature: float = sampler_field("temperature", "0 is greedy")
    skew: float = sampler_field("skew", "skews the final draw")
    rep_pen: float = sampler_field(
        "rep_pen", "repetition penalty over the whole context; 1 turns it off"
    )
    freq_pen: float = sampler_field("freq_pen", "frequency penalty")
    pres_pen: float = sampler_field("pres_pen", "presence penalty")
    model: str | None = _model_field()
    custom_bos: str = wire_field(
        Str(),
        "put before `text`; its first token survives trimming",
        default="",
        name="customBos",
    )
    stop_conditions: tuple[str | int, ...] = wire_field(
        _STOP_CONDITIONS,
        "stop strings and stop token ids, besides the model's own end-of-sequence ids",
        default=(),
    )
    bann_bann: tuple[int, ...] = wire_field(_BANNED, "token ids never sampled", default=())
    token_healing: bool = wire_field(
        Bool(), "regenerate the prompt's last token, constrained to extend its text", default=False
    )
    seed: int | None = sampler_field(
        "seed", "makes sampling repeatable for one engine, model and batch", extension=True
    )
    compact_chunks: bool = wire_field(
        Bool(),
        "leave `util_text` (the whole prompt) out of chunk frames",
        default=False,
        extension=True,
    )
    dry_multiplier: float = sampler_field(
        "dry_multiplier",
        "DRY: penalty on a token that would extend a repeat of the context; 0 turns it off",
        extension=True,
    )
    dry_base: float = sampler_field(
        "dry_base", "DRY: the penalty grows by this factor per repeated token", extension=True
    )
    dry_allowed_length: int = sampler_field(
        "dry_allowed_length", "DRY: repeats this long go unpenalised", extension=True
    )
    dry_range: int = sampler_field(
        "dry_range", "DRY: look at the last this many tokens; 0 looks at all", extension=True
    )
    dry_sequence_breakers: tuple[str, ...] = sampler_field(
        "dry_sequence_breakers",
        "DRY: a token whose text contains one of these (or a special token) ends a repeat",
        extension=True,
    )
    xtc_probability: float = sampler_field(
        "xtc_probability",
        "XTC: how often the likeliest tokens are excluded; 0 turns it off",
        extension=True,
    )
    xtc_threshold: float = sampler_field(
        "xtc_threshold",
        "XTC: tokens at least this likely are excluded, all but the least likely of them",
        extension=True,
    )
    mirostat: bool = sampler_field(
        "mirostat",
        "mirostat v2: keep the surprise of each token near `mirostat_tau`",
        extension=True,
    )
    mirostat_tau: float = sampler_field(
        "mirostat_tau", "mirostat: the target surprise, in bits", extension=True
    )
    mirostat_eta: float = sampler_field(
        "mirostat_eta", "mirostat: how fast the cut-off follows the surprise", extension=True
    )
    min_temp: float = sampler_field(
        "min_temp", "dynamic temperature: the temperature at zero entropy", extension=True
    )
    max_temp: float = sampler_field(
        "max_temp",
        "dynamic temperature: the temperature at the most entropy; on when above `min_temp`",
        extension=True,
    )
    temp_exponent: float = sampler_field(
        "temp_exponent",
        "dynamic temperature: the normalised entropy is raised to this power",
        extension=True,
    )
    smoothing_factor: float = sampler_field(
        "smoothing_factor",
        "quadratic sampling: logits become -factor * (max - logit)^2; 0 turns it off",
        extension=True,
    )
    temperature_last: bool = sampler_field(
        "temperature_last", "apply `temperature` after the filters, not before", extension=True
    )
    logit_bias: tuple[tuple[int, float], ...] = sampler_field(
        "logit_bias",
        "added to the logits of those token ids, as OpenAI's `logit_bias`: -100 bans, 100 forces",
        extension=True,
        default_doc="`{}`",
    )
    min_tokens: int = sampler_field(
        "min_tokens",
        "the first this many new tokens are never a stop token, and no stop string is looked for "
        "in their text (vLLM's name)",
        extension=True,
    )
    json_schema: Mapping[str, Any] | None = wire_field(
        _SCHEMA,
        "the output is JSON valid against this schema (`{}` is no constraint); "
        '`{"type": "object"}` is any JSON object',
        default=None,
        extension=True,
        exclusive="constraint",
        default_doc="absent",
    )
    regex: str | None = wire_field(
        _REGEX,
        "the whole output matches this regular expression (Rust `regex` syntax)",
        default=None,
        extension=True,
        exclusive="constraint",
        default_doc="absent",
    )
    choice: tuple[str, ...] | None = wire_field(
        _CHOICE,
        "the output is exactly one of these strings",
        default=None,
        extension=True,
        exclusive="constraint",
        default_doc="absent",
    )
    grammar: str | None = wire_field(
        _GRAMMAR,
        "the output follows this grammar: GBNF (llama.cpp's) when it holds `::=`, else Lark",
        default=None,
        extension=True,
        exclusive="constraint",
        default_doc="absent",
    )
    messages: tuple[ChatMessage, ...] | None = wire_field(
        _MESSAGES,
        "a chat instead of `text`, rendered with the model's chat template (a model without "
        "one answers `invalid_request`); `customBos` is not used with it",
        default=None,
        extension=True,
        group="prompt",
        default_doc="absent",
    )
    logprobs: int | None = wire_field(
        Int(0, MAX_TOP_LOGPROBS),
        "chunk frames and the final frame carry `logprobs`: each generated token's log "
        "probability with this many likeliest alternatives (docs/sampling.md says which "
        "distribution); an engine without them answers `invalid_request`",
        default=None,
        extension=True,
        default_doc="absent",
    )
    echoed: Mapping[str, Any] = _echoed_field()

    def __attrs_post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError("an infer request has exactly one of text and messages")

    @property
    def request_id(self) -> tuple[bool, Any]:
        """``(present, value)`` of the client's ``request_id``; what a scoped
        ``stop`` compares its ``target`` with."""
        return ("request_id" in self.echoed, self.echoed.get("request_id"))

    def matches_stop(self, stop: StopRequest) -> bool:
        """Whether ``stop`` targets this request (protocol section 3.5).

        A stop without ``target`` matches every request; with one, only
        requests whose ``request_id`` equals it as JSON values (``true`` is not
        ``1``, ``1`` is ``1.0``).
        """
        if not stop.has_target:
            return True
        present, value = self.request_id
        return present and json_equal(value, stop.target)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The string entries of ``stop_conditions``, in order."""
        return tuple(c for c in self.stop_conditions if isinstance(c, str))

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The int entries of ``stop_conditions`` (the model's EOS ids are
        added by the server, not here)."""
        return frozenset(c for c in self.stop_conditions if isinstance(c, int))

    def constraint(self) -> Constraint | None:
        """The request's constraint (at most one is given), or None; an
        empty schema ``{}`` is none."""
        if self.json_schema is not None and self.json_schema != {}:
            return Constraint.json_schema(self.json_schema, "$.json_schema")
        if self.regex is not None:
            return Constraint("regex", self.regex, "$.regex")
        if self.choice is not None:
            return Constraint.choice(self.choice, "$.choice")
        if self.grammar is not None:
            return Constraint("grammar", self.grammar, "$.grammar")
        return None

    def sampling_settings(self) -> SamplingSettings:
        """The sampler part of the request, for the engine."""
        return SamplingSettings(**{name: getattr(self, name) for name in _SAMPLER_NAMES})


_SAMPLER_NAMES: Final = tuple(a.name for a in attrs.fields(SamplingSettings))
# Every sampler setting is a wire field of infer (a new setting needs its line).
assert {a.name for a in attrs.fields(InferRequest)} >= set(_SAMPLER_NAMES)


@attrs.frozen
class StopRequest:
    """``stop``: interrupt this connection's infers, all or those whose
    ``request_id`` equals ``target``. ``has_target`` tells an absent target
    from an explicit ``null`` one."""

    has_target: bool = False
    # wire_field is attrs.field with metadata (ruff cannot tell).
    target: Any = wire_field(  # noqa: RUF009
        AnyJson(1024, "max_id_bytes"),
        "stop only the infers whose `request_id` equals it",
        default=None,
        default_doc="absent",
    )
    echoed: Mapping[str, Any] = _echoed_field()


@attrs.frozen
class InfoRequest:
    """``info``: what server, model and limits answer this connection."""

    echoed: Mapping[str, Any] = _echoed_field()


Request: TypeAlias = (
    EchoRequest
    | EstimateTokenRequest
    | LefttrimTokenRequest
    | InferRequest
    | StopRequest
    | InfoRequest
)

#: Action -> request class.
REQUEST_CLASSES: Final[Mapping[str, type[Any]]] = {
    "echo": EchoRequest,
    "estimate_token": EstimateTokenRequest,
    "lefttrim_token": LefttrimTokenRequest,
    "infer": InferRequest,
    "stop": StopRequest,
    "info": InfoRequest,
}


def _rules() -> list[Rule]:
    rules = [wire.rule for wire in ENVELOPE.values()]
    for cls in REQUEST_CLASSES.values():
        rules.extend(a.metadata[WIRE].rule for a in attrs.fields(cls) if WIRE in a.metadata)
    return rules


def _field_limits() -> dict[str, int]:
    limits = {"max_json_depth": MAX_JSON_DEPTH}
    for rule in _rules():
        for name, value in rule.limits.items():
            if limits.setdefault(name, value) != value:  # pragma: no cover - a declaration bug
                raise AssertionError(f"two values for the limit {name}")
    return limits


#: Per-field limits of the protocol (the same for every server), from the
#: field declarations; ``info`` reports them beside the server's own limits.
FIELD_LIMITS: Final[Mapping[str, int]] = _field_limits()
