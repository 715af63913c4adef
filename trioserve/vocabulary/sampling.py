"""The sampler settings a request may carry, each declared once with its
bounds: the engines' samplers, the WebSocket protocol's ``infer`` fields and
the OpenAI parameters all read them here (:func:`setting_bounds`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final, TypeAlias

import attrs

__all__ = [
    "DRY_SEQUENCE_BREAKERS",
    "RANGE",
    "Bound",
    "Flag",
    "Range",
    "SamplingSettings",
    "Strings",
    "TokenBias",
    "api_settings",
    "setting_bounds",
    "setting_ranges",
]


@attrs.frozen
class Range:
    """The values a numeric setting may take: ``lo <= value <= hi``, finite,
    and an int (not a bool) when ``integer``; or exactly ``off``, when the
    setting has an "off" value outside the range (``dry_range`` 0).

    Bounds are inclusive. Each sampler setting's range is declared once, on
    its :class:`SamplingSettings` field, and both the sampler's own guard
    (``engine.sampling.settings_problem``) and the protocol's validation of
    ``infer`` read it there.
    """

    lo: float
    hi: float
    integer: bool = False
    off: int | None = None

    def contains(self, value: object) -> bool:
        if isinstance(value, bool):
            return False
        if isinstance(value, int):
            # Compared as ints: a huge int must not overflow a float first.
            return value == self.off or self.lo <= value <= self.hi
        return (
            not self.integer
            and isinstance(value, float)
            and math.isfinite(value)
            and self.lo <= value <= self.hi
        )

    def describe(self) -> str:
        """What the range allows, in words: ``an integer from 0 to 10``,
        ``a number in [0, 1]``, ``0 or an integer from 21 to 2^31-1``."""
        if self.integer:
            words = f"an integer from {_number(self.lo)} to {_number(self.hi)}"
            return words if self.off is None else f"{self.off} or {words}"
        return f"a number in [{_number(self.lo)}, {_number(self.hi)}]"


@attrs.frozen
class Flag:
    """A setting that is true or false (never 0 or 1)."""

    def contains(self, value: object) -> bool:
        return isinstance(value, bool)

    def describe(self) -> str:
        return "true or false"


@attrs.frozen
class Strings:
    """A tuple of at most ``max_count`` strings of 1 to ``max_chars``
    characters each."""

    max_count: int
    max_chars: int

    def contains(self, value: object) -> bool:
        return (
            isinstance(value, tuple)
            and len(value) <= self.max_count
            and all(isinstance(s, str) and 1 <= len(s) <= self.max_chars for s in value)
        )

    def describe(self) -> str:
        return f"a list of at most {self.max_count} strings of 1 to {self.max_chars} characters"


@attrs.frozen
class TokenBias:
    """Additive biases of token ids: a tuple of ``(id, bias)`` pairs in
    ascending order of id (so each id once), at most ``max_count`` of them,
    each id from 0 to ``max_id`` (the model's vocabulary bounds it further,
    at the server and in the engines) and each bias a finite number in
    ``[lo, hi]``."""

    max_count: int
    lo: float
    hi: float
    max_id: int = 2**31 - 1

    def contains(self, value: object) -> bool:
        if not isinstance(value, tuple) or len(value) > self.max_count:
            return False
        last = -1
        allowed = Range(self.lo, self.hi)
        for pair in value:
            if not isinstance(pair, tuple) or len(pair) != 2:
                return False
            token, bias = pair
            if isinstance(token, bool) or not isinstance(token, int):
                return False
            if not last < token <= self.max_id or not allowed.contains(bias):
                return False
            last = token
        return True

    def describe(self) -> str:
        return (
            f"an object of at most {self.max_count} entries from a token id from 0 to "
            f"{_number(self.max_id)} (a key of decimal digits without leading zeros) to a "
            f"number in [{_number(self.lo)}, {_number(self.hi)}]"
        )


#: What a sampler setting may hold; each has ``contains(value)`` and
#: ``describe()`` (the allowed values in words, with their article).
Bound: TypeAlias = Range | Flag | Strings | TokenBias


def _number(value: float) -> str:
    if isinstance(value, int):
        # Powers of two read better as such: -2^63, 2^31-1.
        for exponent in (31, 32, 53, 63, 64):
            if value == 2**exponent - 1:
                return f"2^{exponent}-1"
            if value == -(2**exponent):
                return f"-2^{exponent}"
        return str(value)
    return f"{value:g}"


#: Metadata key of a :class:`SamplingSettings` field's :class:`Bound` (a
#: :class:`Range` for the numeric ones).
RANGE = "trioserve.range"


def _setting(
    default: Any, lo: float, hi: float, *, integer: bool = False, off: int | None = None
) -> Any:
    return attrs.field(default=default, metadata={RANGE: Range(lo, hi, integer, off)})


def _bounded(default: Any, bound: Flag | Strings | TokenBias) -> Any:
    return attrs.field(default=default, metadata={RANGE: bound})


#: ExLlamaV2's default DRY sequence breakers: its sampler takes every token
#: whose text holds one of these characters (``dry_default_sequence_breaker_chars``
#: in exllamav2/generator/sampler.py, 0.3.2).
DRY_SEQUENCE_BREAKERS: Final[tuple[str, ...]] = tuple('.,!?<>[](){}\n\t"')


@attrs.frozen
class SamplingSettings:
    """Sampler settings of one job, with the ExLlamaV2 server's defaults
    (the fields that server does not have take ExLlamaV2 0.3.2's
    ``ExLlamaV2Sampler.Settings`` defaults, every one of which is off).

    Applied in ExLlamaV2's order: repetition / frequency / presence penalties,
    logit_bias and banned ids, DRY, then (unless greedy) temperature (with
    smoothing_factor), top_k, top_p, top_a, min_p, typical, mirostat, the
    temperature after the filters (temperature_last, or the dynamic one
    between min_temp and max_temp), XTC, and skew on the final draw.
    ``temperature == 0`` is greedy (penalties, biases and DRY still apply).
    ``min_tokens`` holds the job's stops back (the stop tokens are banned).
    docs/sampling.md defines each.

    Each field declares its default and its :class:`Bound` here, once; the
    protocol's ``infer`` fields take both from these declarations. The ranges
    keep every value finite in the float32 arithmetic of both engines, and
    each upper bound lies far beyond the point where the setting stops
    changing the distribution (docs/protocol.md, "Limits", says why each).
    """

    temperature: float = _setting(0.9, 0.0, 1000.0)
    top_k: int = _setting(100, 0, 2**31 - 1, integer=True)
    top_p: float = _setting(0.8, 0.0, 1.0)
    top_a: float = _setting(0.0, 0.0, 1000.0)
    min_p: float = _setting(0.0, 0.0, 1.0)
    typical: float = _setting(0.0, 0.0, 1.0)
    skew: float = _setting(0.0, -100.0, 100.0)
    rep_pen: float = _setting(1.05, 0.01, 100.0)
    freq_pen: float = _setting(0.0, -100.0, 100.0)
    pres_pen: float = _setting(0.0, -100.0, 100.0)
    #: Seed of the job's own random generator; None draws a fresh seed. Any
    #: int of 64 bits, signed or not (reduced modulo 2^64).
    seed: int | None = _setting(None, -(2**63), 2**64 - 1, integer=True)
    #: DRY ("don't repeat yourself"): a token that would extend a repeat of
    #: at least dry_allowed_length tokens loses dry_multiplier *
    #: dry_base ** (length - dry_allowed_length) per earlier occurrence.
    #: A penalty of up to 100 * 10**18 per occurrence stays finite in float32.
    dry_multiplier: float = _setting(0.0, 0.0, 100.0)
    dry_base: float = _setting(1.75, 1.0, 10.0)
    #: Repeats longer than 19 tokens are never measured (ExLlamaV2's n-grams
    #: hold at most 20 tokens), so 20 turns DRY off in effect.
    dry_allowed_length: int = _setting(2, 1, 20, integer=True)
    #: How many of the last tokens DRY looks at; 0 looks at the whole
    #: context. ExLlamaV2 asserts that a window is longer than its 20-token
    #: n-grams, hence 0 or at least 21.
    dry_range: int = _setting(0, 21, 2**31 - 1, integer=True, off=0)
    #: Tokens whose text contains one of these strings break a repeat (and
    #: so do special tokens). 64 strings of 64 characters: text frontends
    #: send a handful of single characters; the bound keeps turning them
    #: into token ids a few milliseconds of work.
    dry_sequence_breakers: tuple[str, ...] = _bounded(
        DRY_SEQUENCE_BREAKERS, Strings(max_count=64, max_chars=64)
    )
    #: XTC ("exclude top choices"): with probability xtc_probability, every
    #: token with p >= xtc_threshold but the least likely of them is removed.
    xtc_probability: float = _setting(0.0, 0.0, 1.0)
    xtc_threshold: float = _setting(0.1, 0.0, 1.0)
    #: Mirostat v2: keeps the surprise (-log2 p) of the sampled tokens near
    #: mirostat_tau bits, adjusting its cut-off by mirostat_eta per token.
    mirostat: bool = _bounded(False, Flag())
    mirostat_tau: float = _setting(1.5, 0.0, 100.0)
    mirostat_eta: float = _setting(0.1, 0.0, 10.0)
    #: Dynamic temperature: after the filters, a temperature from min_temp
    #: (no entropy) to max_temp (uniform), by the normalised entropy to the
    #: power temp_exponent; on when max_temp > min_temp.
    min_temp: float = _setting(0.0, 0.0, 1000.0)
    max_temp: float = _setting(0.0, 0.0, 1000.0)
    temp_exponent: float = _setting(1.0, 0.0, 100.0)
    #: Quadratic sampling: logits become -smoothing_factor * (max - logit)**2.
    smoothing_factor: float = _setting(0.0, 0.0, 100.0)
    #: Apply temperature after the filters instead of before.
    temperature_last: bool = _bounded(False, Flag())
    #: OpenAI's logit_bias: (id, bias) pairs, ascending by id, each bias
    #: added to its logit; -100 bans in effect, +100 forces. 1024 entries
    #: hold any real use (bann_bann is the field for long bans).
    logit_bias: tuple[tuple[int, float], ...] = _bounded(
        (), TokenBias(max_count=1024, lo=-100.0, hi=100.0)
    )
    #: vLLM's ``min_tokens`` (ExLlamaV2's ``min_new_tokens``): the first
    #: this many generated tokens are never a stop token (the model's EOS
    #: ids and the request's stop ids are banned until then), and no stop
    #: string is looked for in their text. It never makes a job longer than
    #: its ``max_new_tokens``.
    min_tokens: int = _setting(0, 0, 2**31 - 1, integer=True)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def dry(self) -> bool:
        """Whether DRY is on."""
        return self.dry_multiplier > 0.0

    @property
    def penalised(self) -> bool:
        """Whether a repetition, frequency or presence penalty is on."""
        return self.rep_pen != 1 or self.freq_pen != 0 or self.pres_pen != 0

    @property
    def dynamic_temperature(self) -> bool:
        """Whether the dynamic temperature is on."""
        return self.max_temp > self.min_temp


def api_settings(defaults: Mapping[str, Any], given: Mapping[str, Any]) -> SamplingSettings:
    """The settings of an HTTP API's request: its ``defaults`` (OpenAI's and
    Anthropic's: temperature 1, no top_p, no top_k), then what it ``given``.
    There ``top_p`` 0 keeps the single most likely token; the engine's 0
    means "off", and ``top_k`` 1 is the same distribution."""
    values = {**defaults, **given}
    if values.get("top_p") == 0.0:
        values["top_p"], values["top_k"] = 1.0, 1
    return SamplingSettings(**values)


def setting_bounds() -> dict[str, Bound]:
    """Name -> :class:`Bound` of every :class:`SamplingSettings` field."""
    return {a.name: a.metadata[RANGE] for a in attrs.fields(SamplingSettings)}


def setting_ranges() -> dict[str, Range]:
    """Name -> :class:`Range` of every numeric :class:`SamplingSettings` field."""
    return {name: b for name, b in setting_bounds().items() if isinstance(b, Range)}
