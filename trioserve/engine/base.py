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
from typing import Any, Final, Literal, Protocol, TypeAlias, runtime_checkable

import attrs

__all__ = [
    "RANGE",
    "WEIGHT_MODES",
    "Engine",
    "EngineInfo",
    "Failed",
    "FinishReason",
    "Finished",
    "GenerationSpec",
    "Range",
    "SamplingSettings",
    "TextUpdate",
    "Update",
    "setting_ranges",
]


#: What the CPU engine's linear layers may run on (``EngineOptions.weights``):
#: ``auto`` (the model's own 4-bit weights where a probe finds the kernel
#: exact enough, else the dtype), ``float`` (the dtype), ``q4`` or ``int8``.
WEIGHT_MODES: Final = ("auto", "float", "q4", "int8")


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


@attrs.frozen
class Range:
    """The values a numeric setting may take: ``lo <= value <= hi``, finite,
    and an int (not a bool) when ``integer``.

    Bounds are inclusive. Each sampler setting's range is declared once, on
    its :class:`SamplingSettings` field, and both the sampler's own guard
    (``engine.sampling.settings_problem``) and the protocol's validation of
    ``infer`` read it there.
    """

    lo: float
    hi: float
    integer: bool = False

    def contains(self, value: object) -> bool:
        if isinstance(value, bool):
            return False
        if isinstance(value, int):
            # Compared as ints: a huge int must not overflow a float first.
            return self.lo <= value <= self.hi
        return (
            not self.integer
            and isinstance(value, float)
            and math.isfinite(value)
            and self.lo <= value <= self.hi
        )

    def describe(self) -> str:
        """What the range allows, in words: ``an integer from 0 to 10``,
        ``a number in [0, 1]``."""
        if self.integer:
            return f"an integer from {_number(self.lo)} to {_number(self.hi)}"
        return f"a number in [{_number(self.lo)}, {_number(self.hi)}]"


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


#: Metadata key of a :class:`SamplingSettings` field's :class:`Range`.
RANGE = "trioserve.range"


def _setting(default: Any, lo: float, hi: float, *, integer: bool = False) -> Any:
    return attrs.field(default=default, metadata={RANGE: Range(lo, hi, integer)})


@attrs.frozen
class SamplingSettings:
    """Sampler settings of one job, with the ExLlamaV2 server's defaults.

    Applied in ExLlamaV2's order: repetition / frequency / presence penalties,
    banned ids, then temperature, top_k, top_p, top_a, min_p, typical, and skew
    on the final draw. ``temperature == 0`` is greedy.

    Each field declares its default and its :class:`Range` here, once; the
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def setting_ranges() -> dict[str, Range]:
    """Name -> :class:`Range` of every :class:`SamplingSettings` field."""
    return {a.name: a.metadata[RANGE] for a in attrs.fields(SamplingSettings)}


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


#: Why a job ended: a stop token, a stop string, or ``max_new_tokens``.
FinishReason: TypeAlias = Literal["stop_token", "stop_string", "max_new_tokens"]


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
