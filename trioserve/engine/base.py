"""The Engine protocol: what the generation task needs from a backend.

Engines are synchronous and know nothing of trio, so they can be tested and
benchmarked alone. The generation task (``trioserve.generation.scheduler``) is the only
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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs

from trioserve.vocabulary.results import Update
from trioserve.vocabulary.sampling import SamplingSettings

if TYPE_CHECKING:
    from trioserve.engine.grammars import CompiledGrammar, Grammars

__all__ = [
    "ConstrainedEngine",
    "Engine",
    "EngineInfo",
    "GenerationSpec",
    "PausingEngine",
    "grammars_of",
]


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
    #: Which kernels run the model, in words: the CPU engine's ``"native
    #: avx512"``, ``"native avx2"`` or ``"torch (why)"``; ExLlamaV2's
    #: ``"exllamav2 cuda"``. Reported by ``info`` and ``/v1/models``.
    kernels: str | None = None
    #: Whether the engine can pause a running job and resume it later where
    #: it stopped, its state and its keys and values kept
    #: (:class:`PausingEngine`): the scheduler then lets a lone client use
    #: every slot and pauses its newest job when another client's arrives.
    pausing: bool = False


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
    #: The model's EOS ids are not in ``stop_token_ids``: the job runs to
    #: ``max_new_tokens`` or a stop of the request's own (``ignore_eos``).
    ignore_eos: bool = False
    #: Leave special tokens' text out of the job's text (and its entries'),
    #: except the tokens whose text occurs in one of ``kept_special`` (the
    #: markers a reply is parsed by, the stop strings).
    skip_special_tokens: bool = False
    kept_special: frozenset[str] = frozenset()
    #: The stop string that ends the job is part of the reply: the entries
    #: of its tokens are released with the rest.
    include_stop_str: bool = False


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


class PausingEngine(Engine, Protocol):
    """An engine whose :attr:`EngineInfo.pausing` is True."""

    def step(
        self, submit: Sequence[GenerationSpec], cancel: Sequence[int], pause: Sequence[int] = ()
    ) -> list[Update]:
        """As :meth:`Engine.step`, and ``pause``: running (or not yet started)
        jobs that give their slot back, applied after ``cancel`` and before
        ``submit``. A paused job produces no update and keeps everything it
        computed; submitting its spec again resumes it where it stopped, and
        cancelling it drops it. Unknown or finished ids are ignored."""
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
