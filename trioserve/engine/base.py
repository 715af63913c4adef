"""The Engine protocol: what the generation task needs from a backend.

Engines are synchronous and know nothing of trio, so they can be tested and
benchmarked alone. The generation task (``trioserve.scheduler``) is the only
caller of :meth:`Engine.step`, always from one worker thread at a time;
:meth:`Engine.encode` and :meth:`Engine.decode` are thread-safe and may be
called from any thread at any time.

One ``step`` call applies new jobs and cancellations, runs one scheduler
iteration (prefill chunks for new jobs, one batched decode step for running
jobs) and reports what happened as a list of typed updates:

* :class:`TextUpdate` -- tokens were generated for a job; ``text`` is the newly
  *released* text (possibly empty while text is held back because it could be
  the start of a stop string or an incomplete UTF-8 character) and ``held`` is
  the text currently held back.
* :class:`Finished` -- the job ended; ``text`` is the last released text
  (including any held text flushed at ``max_new_tokens``), and the fields say
  which stop fired.
* :class:`Failed` -- the job failed alone (bad spec, NaN logits, ...); other
  jobs go on.

A cancelled job produces no further update: the caller has already answered
its client. Its slot and cache pages are freed before the step's model work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, TypeAlias, runtime_checkable

import attrs

if TYPE_CHECKING:
    from trioserve.engine.grammars import CompiledGrammar, Grammars

__all__ = [
    "DRY_SEQUENCE_BREAKERS",
    "KV_CACHE_DTYPES",
    "MAX_TOP_LOGPROBS",
    "RANGE",
    "WEIGHT_MODES",
    "Bound",
    "ConstrainedEngine",
    "Engine",
    "EngineInfo",
    "Failed",
    "FinishReason",
    "Finished",
    "Flag",
    "GenerationSpec",
    "Range",
    "SamplingSettings",
    "Strings",
    "TextUpdate",
    "TokenBias",
    "TokenLogprob",
    "Update",
    "grammars_of",
    "setting_bounds",
    "setting_ranges",
]


#: What the CPU engine's linear layers may run on (``EngineOptions.weights``):
#: ``auto`` (the model's own 4-bit weights where a probe finds the kernel
#: exact enough, else the dtype), ``float`` (the dtype), ``q4`` or ``int8``.
WEIGHT_MODES: Final = ("auto", "float", "q4", "int8")
#: What the CPU engine's KV cache may store: ``"auto"`` the model's dtype,
#: ``"int8"`` 8 bits per value with one bfloat16 scale per head and position
#: (see :mod:`trioserve.engine.cpu.kvcache`).
KV_CACHE_DTYPES: Final = ("auto", "int8")
#: Which kernel the CPU engine's 4-bit layers run on: ``"auto"`` trioserve's
#: own (trioserve.engine.cpu.native) where it builds and passes its probe, else
#: torch's; ``"native"`` trioserve's only; ``"torch"`` torch's
#: ``_weight_int4pack_mm_for_cpu`` only.
CPU_KERNELS: Final = ("auto", "native", "torch")


@attrs.frozen
class EngineInfo:
    """What an engine and its model are; reported by the ``info`` action."""

    #: Backend name: ``"cpu"`` or ``"exllamav2"``.
    engine: str
    #: Model name (the model directory's name, or the embedded model's name).
    model_name: str
    #: Tokens a job may hold in all: prompt plus generated tokens.
    context_length: int
    vocab_size: int
    bos_token_id: int | None
    #: Every end-of-sequence id of the model (config.json, generation_config.json
    #: and the tokenizer), each of which ends generation.
    eos_token_ids: frozenset[int]
    #: Jobs that run at the same time; more wait in arrival order.
    max_batch: int
    #: False when the backend runs one job at a time (ExLlamaV2 without
    #: paged attention); the server is still correct then, just slower.
    batching: bool = True
    #: The most characters one token can stand for (its bytes, at most), or
    #: None when unknown: lets the server tokenize only the tail of a prompt
    #: far longer than the context.
    max_token_chars: int | None = None
    #: The model's Hugging Face directory, when it has one: the server reads
    #: its chat template from there.
    model_dir: str | None = None
    #: The constraint kinds the engine enforces (``json_schema``, ``regex``,
    #: ``choice``, ``grammar``); empty when it enforces none.
    constraints: tuple[str, ...] = ()
    #: Whether the engine reports log probabilities
    #: (:attr:`GenerationSpec.logprobs`, :attr:`GenerationSpec.prompt_logprobs`).
    logprobs: bool = False


#: The most alternatives a token's log-probability entry may list.
MAX_TOP_LOGPROBS: Final = 20


@attrs.frozen
class TokenLogprob:
    """One token's log probability under the model (docs/sampling.md,
    "Log probabilities", says which distribution), and, for a generated or
    prompt token, its likeliest alternatives (each with ``top`` empty)."""

    token: int
    #: The token's text on its own: its bytes decoded as UTF-8, a partial
    #: character written as U+FFFD (``bytes`` is exact).
    text: str
    bytes: bytes
    #: None only for a prompt's first token: nothing comes before it.
    logprob: float | None
    #: The likeliest tokens, most likely first (ties: lower id first).
    top: tuple[TokenLogprob, ...] = ()


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def dry(self) -> bool:
        """Whether DRY is on."""
        return self.dry_multiplier > 0.0

    @property
    def dynamic_temperature(self) -> bool:
        """Whether the dynamic temperature is on."""
        return self.max_temp > self.min_temp


def setting_bounds() -> dict[str, Bound]:
    """Name -> :class:`Bound` of every :class:`SamplingSettings` field."""
    return {a.name: a.metadata[RANGE] for a in attrs.fields(SamplingSettings)}


def setting_ranges() -> dict[str, Range]:
    """Name -> :class:`Range` of every numeric :class:`SamplingSettings` field."""
    return {name: b for name, b in setting_bounds().items() if isinstance(b, Range)}


@attrs.frozen
class GenerationSpec:
    """One job for an engine: everything needed to generate, nothing of I/O."""

    #: Unique among the jobs the engine has seen; chosen by the caller.
    job_id: int
    #: Prompt token ids, already trimmed so that
    #: ``len(prompt_ids) + max_new_tokens <= context_length``. Engines refuse
    #: (with :class:`Failed`) a spec that breaks this.
    prompt_ids: tuple[int, ...]
    #: At most this many generated tokens; a stop token counts.
    max_new_tokens: int
    sampling: SamplingSettings = SamplingSettings()
    #: Every id that ends the job: the model's EOS ids plus the request's own.
    stop_token_ids: frozenset[int] = frozenset()
    #: Case-sensitive stop strings; none is empty.
    stop_strings: tuple[str, ...] = ()
    #: Ids that may never be sampled.
    banned_ids: frozenset[int] = frozenset()
    #: Drop the prompt's last token and constrain the first sample to extend
    #: its text; only the new part is emitted.
    token_healing: bool = False
    #: The output must match this grammar (a JSON schema, a regex, a choice,
    #: a grammar), compiled by the engine's :class:`Grammars`; each job gets
    #: its own matcher. Never together with ``token_healing``.
    constraint: CompiledGrammar | None = attrs.field(default=None, eq=False)
    #: Report each generated token's log probability with this many
    #: alternatives (0 to :data:`MAX_TOP_LOGPROBS`); None reports none.
    logprobs: int | None = None
    #: Report each prompt token's log probability (the first one's is None)
    #: with this many alternatives, on :class:`Finished`; None reports none.
    #: With it, ``max_new_tokens`` may be 0: the prompt is only scored.
    prompt_logprobs: int | None = None
    #: Jobs with the same prompt are about to follow (the choices of one
    #: request): offer the prompt's keys and values to the prefix cache as
    #: soon as it is prefilled, not only when the job ends. An engine that
    #: shares a prompt among running jobs by other means may ignore it.
    share_prompt: bool = False


@attrs.frozen
class TextUpdate:
    """Tokens were generated for a job during one step."""

    job_id: int
    #: Newly released text; may be empty while text is held back.
    text: str
    #: Text held back now (a possible stop-string prefix, or an incomplete
    #: UTF-8 character written as U+FFFD); on interruption the caller appends
    #: it to the completion so that nothing generated is lost.
    held: str
    #: Tokens generated for this job so far (including this step's).
    generated_tokens: int
    #: With :attr:`GenerationSpec.logprobs`: the entries of the tokens whose
    #: text is released with ``text`` (docs/sampling.md says the rule).
    logprobs: tuple[TokenLogprob, ...] = ()


#: Why a job ended: a stop token, a stop string, ``max_new_tokens``, or its
#: constraint is complete (its grammar allows nothing more but the end).
FinishReason: TypeAlias = Literal["stop_token", "stop_string", "max_new_tokens", "constraint"]


@attrs.frozen
class Finished:
    """A job ended. Its slot is already free."""

    job_id: int
    #: Last released text: everything not sent in an earlier TextUpdate,
    #: including held text flushed at ``max_new_tokens``; never the stop
    #: string or the stop token's own text.
    text: str
    reason: FinishReason
    #: The stop string that matched, when ``reason == "stop_string"``.
    stop_string: str | None
    #: The stop token id sampled, when ``reason == "stop_token"``.
    stop_token: int | None
    #: Prompt tokens actually run (after token healing removed one, if it did).
    prompt_tokens: int
    #: Tokens generated, the stop token included.
    generated_tokens: int
    #: Of ``prompt_tokens``, those whose keys and values came from the
    #: engine's prefix cache instead of being computed (0 without one).
    cached_tokens: int = 0
    #: With :attr:`GenerationSpec.logprobs`: the entries released with ``text``.
    logprobs: tuple[TokenLogprob, ...] = ()
    #: With :attr:`GenerationSpec.prompt_logprobs`: one entry per prompt
    #: token run, the first one's ``logprob`` None (nothing comes before it).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    #: With :attr:`GenerationSpec.logprobs`, when ``reason == "stop_token"``:
    #: the stop token's entry, which is in no ``logprobs`` above (its text is
    #: never released). The legacy completions list it last, as OpenAI's list
    #: ``<|endoftext|>``: a client scoring ``prompt + 1 token`` counts on it.
    stop_logprob: TokenLogprob | None = None


@attrs.frozen
class Failed:
    """A job failed alone; other jobs go on. Its slot is already free."""

    job_id: int
    #: What went wrong, for the client (lowercase, no traceback).
    message: str


Update: TypeAlias = TextUpdate | Finished | Failed


@runtime_checkable
class Engine(Protocol):
    """A text-generation backend driven by one generation task."""

    @property
    def info(self) -> EngineInfo: ...

    def encode(self, text: str) -> list[int]:
        """Encode as protocol section 3.2 says: no BOS added, special-token
        strings become their ids. Thread-safe."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids, writing special tokens as their text. Thread-safe."""
        ...

    def step(self, submit: Sequence[GenerationSpec], cancel: Sequence[int]) -> list[Update]:
        """Add ``submit``, drop the jobs in ``cancel`` (unknown ids are
        ignored), run one iteration and return its updates. Blocking; called
        from one thread at a time. With no job to run it returns at once."""
        ...

    def close(self) -> None:
        """Free the model and caches. Idempotent."""
        ...


class ConstrainedEngine(Engine, Protocol):
    """An engine that can enforce constraints (:attr:`GenerationSpec.constraint`):
    its :class:`Grammars` compiles them for its model, off its own thread, and
    is None when this engine was built without them. Ask :func:`grammars_of`,
    which any engine answers, rather than ``isinstance``."""

    @property
    def grammars(self) -> Grammars | None: ...


def grammars_of(engine: Engine) -> Grammars | None:
    """The constraint compiler of ``engine``, or None when it enforces none.

    An engine that has no ``grammars`` attribute, or whose ``grammars`` is
    None, enforces no constraint. A plain attribute read, not ``isinstance``
    against a runtime-checkable protocol: that check only asks whether the
    attribute exists, and from Python 3.12 on it does not even read it (a
    property is found on the class), so an engine built without grammars would
    pass it and fail at the first constraint.
    """
    grammars: Grammars | None = getattr(engine, "grammars", None)
    return grammars
