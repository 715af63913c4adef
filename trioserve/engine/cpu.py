"""The embedded CPU engine: a compact torch Llama with continuous batching.

Each :meth:`CpuEngine.step` applies cancellations and new jobs, admits waiting
jobs into free slots in arrival order, runs prefill chunks for new jobs (about
:attr:`CpuEngine.prefill_chunk` prompt tokens per step, so that one long prompt
delays the running jobs' next token by one chunk, not by the whole prompt),
then one batched decode forward for every job that has a token to feed, and
samples all the step's tokens in one call. While jobs decode, prefill chunks
take at most :attr:`CpuEngine.prefill_share` of the engine's time: steps past
that share decode alone, so a prompt of the whole context slows the running
streams to about half their speed instead of a token per chunk.

A job's greedy text is the same alone and beside others in bfloat16: prefill
chunk boundaries do not depend on the other jobs, decode rows attend over
their own (block-rounded) length, and bfloat16 matmuls on CPU give each row
the same result whatever the batch size. (float32 matmuls do not, so float32
greedy text may differ in late tokens between batch sizes.)

Used slots are kept packed at the front of the KV cache (a finished job's slot
is refilled by moving the last one into it), so the batched decode attends to
a view of the cache instead of a gathered copy.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
from torch import Tensor

from trioserve.engine import llama
from trioserve.engine.base import (
    EngineInfo,
    Failed,
    Finished,
    FinishReason,
    GenerationSpec,
    TextUpdate,
    Update,
)
from trioserve.engine.models import DEFAULT_MODEL_NAME, default_model_dir
from trioserve.engine.prefix import PrefixCache, PrefixCacheStatistics
from trioserve.engine.samplers import (
    DryHistory,
    bias_row,
    sequence_breaker_ids,
    xtc_protected_ids,
)
from trioserve.engine.sampling import (
    RowState,
    SamplingError,
    make_generator,
    sample,
    settings_problem,
)
from trioserve.engine.text import TextStream
from trioserve.engine.tokenizer import Tokenizer
from trioserve.errors import ConfigError, EngineError

__all__ = [
    "DEFAULT_PREFIX_CACHE_BYTES",
    "DTYPES",
    "WEIGHT_MODES",
    "CpuEngine",
    "CpuEngineStatistics",
    "PrefixCacheStatistics",
]

log = logging.getLogger("trioserve.engine")

#: What ``CpuEngine.load(weights=...)`` accepts (see there).
WEIGHT_MODES = llama.WEIGHT_MODES

#: The prefix cache's default bound: 128 MiB holds about 5,800 positions of
#: the embedded model (23 KiB each), a few long conversations.
DEFAULT_PREFIX_CACHE_BYTES = 128 * 2**20
#: Tokens per prefix-cache block: a reused prefix is a multiple of this.
PREFIX_BLOCK_TOKENS = 64


@attrs.frozen
class CpuEngineStatistics:
    """A snapshot of the CPU engine, from :meth:`CpuEngine.statistics`."""

    running_jobs: int
    waiting_jobs: int
    #: Bytes the running jobs' KV cache holds.
    kv_cache_bytes: int
    #: Bytes the model's weights hold.
    weight_bytes: int
    prefix_cache: PrefixCacheStatistics
    #: Steps that ran only the decoding jobs although prompts were waiting for
    #: their prefill, because prefill had had its share (:attr:`CpuEngine.prefill_share`).
    prefill_deferrals: int = 0


#: Prompt tokens left to prefill at or under which a job is never deferred by
#: :attr:`CpuEngine.prefill_share` (a chat turn's new part costs about what a
#: few decode rows do).
_SHORT_PREFILL = 128

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@attrs.define(eq=False)
class _Job:
    """A job that holds a slot."""

    spec: GenerationSpec
    #: The prompt actually run (token healing drops the last id).
    prompt: tuple[int, ...]
    slot: int
    stream: TextStream
    generator: torch.Generator
    #: How often each id occurs in the job's context, for the penalties. [V]
    counts: Tensor
    banned: Tensor | None  # [V] bool
    #: Token healing's constraint on the first sample. [V] bool
    allowed: Tensor | None
    #: ``logit_bias`` as a row to add to the logits. [V] float32
    bias: Tensor | None = None
    #: The context as DRY reads it, when the job uses DRY.
    dry: DryHistory | None = None
    #: What the sampler keeps between steps (mirostat's mu).
    state: RowState = attrs.field(factory=RowState)
    #: Positions written to the KV cache so far.
    cached: int = 0
    #: The last sampled id, to be fed at the next decode step.
    pending: int | None = None
    generated: int = 0
    #: The prompt, then every sampled id: ``tokens[:cached]`` are the ids
    #: whose keys and values the slot holds.
    tokens: list[int] = attrs.field(factory=list)
    #: Prompt tokens served from the prefix cache.
    reused: int = 0
    #: The prefix cache's blocks still to be copied into the slot (at the
    #: job's first step, once the cache has room).
    restore: list[Tensor] = attrs.field(factory=list)


#: Prompt ids decoded before the healed token to give it its context.
_HEALING_CONTEXT = 8


def _text_in_context(tokenizer: Tokenizer, prompt: Sequence[int]) -> str:
    """The text the prompt's last token adds after the ids before it.

    Decoded alone, a token can lose what only its context gives it: a
    SentencePiece-style decoder drops the leading space of the first token it
    sees (``"▁lazy"`` alone is ``"lazy"``, after ``"▁the"`` it is ``" lazy"``).
    The healed token is decoded after the same context the text stream gives
    the generated ids, so that the prefix it drops is the one they produce.
    """
    context = list(prompt[-1 - _HEALING_CONTEXT : -1])
    before = tokenizer.decode(context)
    after = tokenizer.decode([*context, prompt[-1]])
    if context and after.startswith(before):
        return after[len(before) :]
    # The context ends inside a character that the last token completes:
    # there is no clean split, so fall back to the token alone.
    return tokenizer.decode(prompt[-1:])


@attrs.define(eq=False)
class CpuEngine:
    """The embedded torch engine; see the module docstring. Build it with :meth:`load`."""

    _tokenizer: Tokenizer
    _config: llama.LlamaConfig
    _weights: llama.LlamaWeights | None
    _cache: llama.KVCache
    _rope: tuple[Tensor, Tensor]
    _info: EngineInfo
    _device: torch.device
    _prefix_cache: PrefixCache
    #: Prompt tokens per prefill chunk, and the prefill budget of one step
    #: over all new jobs (a step runs at least one chunk, and never splits one).
    prefill_chunk: int = 512
    #: While some jobs decode and others wait for their prefill, the share of
    #: the engine's time that prefill chunks may take (0 < share <= 1; 1 runs
    #: a chunk every step). A prompt of the whole context costs seconds of
    #: prefill per chunk on a CPU: without a share, every decoding job would
    #: get one token per chunk for as long as it lasts.
    prefill_share: float = 0.5
    _waiting: deque[GenerationSpec] = attrs.field(factory=deque)
    _slots: list[_Job] = attrs.field(factory=list)
    #: Seconds of engine time that prefill may still take beside decoding
    #: jobs: each contended step adds ``prefill_share`` of its time and takes
    #: its prefill time; chunks wait while it is negative. Never above 0 (no
    #: credit is saved up), and kept between contentions, so that a stream
    #: that ends and starts again does not hand a long prompt a chunk each time.
    _prefill_balance: float = 0.0
    _prefill_deferrals: int = 0
    #: The weights' bytes, counted once at load (statistics() is read after
    #: every step; walking the weights costs about 0.1 ms).
    _weight_bytes: int = 0
    #: The ids XTC never removes, built when a job first uses XTC. [V] bool
    _xtc_protected: Tensor | None = None

    @classmethod
    def load(
        cls,
        model_dir: Path | None = None,
        *,
        dtype: str = "bfloat16",
        device: str = "cpu",
        context_length: int | None = None,
        max_batch: int = 8,
        offline: bool = False,
        threads: int | None = None,
        weights: str = "auto",
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        prefill_share: float = 0.5,
    ) -> CpuEngine:
        """Load a Llama-family Hugging Face directory (the embedded SmolLM2 when
        ``model_dir`` is None, obtained with :func:`default_model_dir`).

        ``context_length`` lowers the model's context; ``threads`` sets torch's
        (process-wide) thread count when given. ``weights`` (one of
        :data:`WEIGHT_MODES`) chooses what the linear layers run on: ``"auto"``
        (the default) the directory's own 4-bit weights where it has them (the
        embedded model does) and ``dtype`` is bfloat16 on a CPU, else the float
        weights; ``"float"`` the float weights in ``dtype``; ``"q4"`` 4-bit
        groups (the directory's, or quantized at load); ``"int8"`` 8 bits per
        weight, quantized at load. Layers whose shape the quantized kernel
        cannot run stay bfloat16.

        ``prefix_cache_bytes`` bounds the prefix cache (the keys and values of
        finished jobs, reused by later prompts that start with the same tokens;
        see :mod:`trioserve.engine.prefix`); 0 turns it off.

        ``prefill_share`` (0 < share <= 1) bounds the share of time that
        prompts' prefill takes while other jobs are decoding (see
        :attr:`prefill_share`).

        Raises:
            ConfigError: a bad dtype, device, context length, batch or thread count.
            ModelError: the model cannot be found, obtained or loaded.
            EngineError: the device is not available.
        """
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)!r}, got {dtype!r}")
        if weights not in WEIGHT_MODES:
            raise ConfigError(f"weights must be one of {list(WEIGHT_MODES)!r}, got {weights!r}")
        if weights in ("q4", "int8") and (dtype != "bfloat16" or device != "cpu"):
            raise ConfigError(
                f"weights {weights!r} need dtype 'bfloat16' on device 'cpu',"
                f" got dtype {dtype!r} on device {device!r}"
            )
        try:
            torch_device = torch.device(device)
        except RuntimeError as exc:
            raise ConfigError(f"device {device!r} is not a torch device: {exc}") from exc
        if torch_device.type == "cuda" and not torch.cuda.is_available():
            raise EngineError(f"device {device!r} was asked for but torch has no CUDA here")
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch!r}")
        if not 0.0 < prefill_share <= 1.0:
            raise ConfigError(f"prefill_share must be > 0 and <= 1, got {prefill_share!r}")
        if prefix_cache_bytes < 0:
            raise ConfigError(f"prefix_cache_bytes must be >= 0, got {prefix_cache_bytes!r}")
        if threads is not None:
            if threads < 1:
                raise ConfigError(f"threads must be >= 1, got {threads!r}")
            torch.set_num_threads(threads)
        name = DEFAULT_MODEL_NAME
        if model_dir is None:
            model_dir = default_model_dir(offline=offline)
        else:
            model_dir = Path(model_dir)
            name = model_dir.name
        config = llama.LlamaConfig.from_dir(model_dir)
        limit = config.max_position_embeddings
        if context_length is not None and not 2 <= context_length <= limit:
            raise ConfigError(
                f"context_length must be in [2, {limit}] for this model, got {context_length!r}"
            )
        context = limit if context_length is None else context_length
        tokenizer = Tokenizer.from_dir(model_dir)
        torch_dtype = DTYPES[dtype]
        model = llama.LlamaWeights.load(
            model_dir, config, dtype=torch_dtype, device=torch_device, weights=weights
        )
        cache = llama.KVCache(
            config.n_layers, config.n_kv_heads, config.head_dim, torch_dtype, torch_device
        )
        info = EngineInfo(
            engine="cpu",
            model_name=name,
            context_length=context,
            vocab_size=config.vocab_size,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
            max_batch=max_batch,
            batching=True,
            max_token_chars=tokenizer.max_token_bytes,
            model_dir=str(model_dir),
        )
        log.info(
            "cpu engine: %s, %s on %s (linear layers: %s; %.0f MiB of weights),"
            " context %d, max batch %d, torch threads %d",
            name,
            dtype,
            torch_device,
            ", ".join(f"{n} {kind}" for kind, n in model.kinds().items()),
            model.nbytes / 2**20,
            context,
            max_batch,
            torch.get_num_threads(),
        )
        return cls(
            tokenizer=tokenizer,
            config=config,
            weights=model,
            cache=cache,
            prefix_cache=PrefixCache(prefix_cache_bytes, PREFIX_BLOCK_TOKENS),
            rope=llama.rope_tables(config, context, torch_device),
            info=info,
            device=torch_device,
            prefill_share=prefill_share,
            weight_bytes=model.nbytes,
        )

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def cache_bytes(self) -> int:
        """Bytes the KV cache of running jobs holds now (it grows and shrinks
        with the jobs; the prefix cache is apart, see :meth:`statistics`)."""
        return self._cache.nbytes

    def statistics(self) -> CpuEngineStatistics:
        """Jobs, memory and prefix-cache counters now, for metrics. Read it
        from the thread that runs :meth:`step`, or between steps."""
        return CpuEngineStatistics(
            running_jobs=len(self._slots),
            waiting_jobs=len(self._waiting),
            kv_cache_bytes=self._cache.nbytes,
            weight_bytes=0 if self._weights is None else self._weight_bytes,
            prefix_cache=self._prefix_cache.statistics(),
            prefill_deferrals=self._prefill_deferrals,
        )

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids)

    def close(self) -> None:
        self._weights = None
        self._cache.release()
        self._prefix_cache.clear()
        self._waiting.clear()
        self._slots.clear()

    # --- the step -------------------------------------------------------------

    def step(self, submit: Sequence[GenerationSpec], cancel: Sequence[int]) -> list[Update]:
        if self._weights is None:
            raise EngineError("the cpu engine is closed")
        # inference_mode is thread-local: it must be entered in the worker
        # thread that runs the step, not where the engine was built.
        with torch.inference_mode():
            return self._step(self._weights, submit, cancel)

    def _step(
        self,
        weights: llama.LlamaWeights,
        submit: Sequence[GenerationSpec],
        cancel: Sequence[int],
    ) -> list[Update]:
        updates: list[Update] = []
        cancelled = set(cancel)
        if cancelled:
            self._cancel(cancelled)
        for spec in submit:
            if spec.job_id in cancelled:
                continue  # stopped before it was ever run: no update at all
            problem = self._spec_problem(spec)
            if problem is None:
                self._waiting.append(spec)
            else:
                updates.append(Failed(spec.job_id, problem))
        while self._waiting and len(self._slots) < self._info.max_batch:
            self._admit(self._waiting.popleft())
        if not self._slots:
            self._cache.release()
            return updates

        decoding = [job for job in self._slots if job.pending is not None]
        prefilling = [job for job in self._slots if job.pending is None]
        # Room for every slot's next writes; also gives memory back when the
        # longest jobs have left.
        need = max(
            job.cached
            + (
                1
                if job.pending is not None
                else min(self.prefill_chunk, len(job.prompt) - job.cached)
            )
            for job in self._slots
        )
        self._cache.fit(len(self._slots), need)
        for job in prefilling:
            if job.restore:
                self._cache.write(job.slot, 0, torch.cat(job.restore, dim=2))
                job.restore = []

        # Shortest remaining prompt first (arrival order among equals): a short
        # prompt that arrives while a long one is being prefilled gets its
        # first token after a step of its own size, not after the long one's
        # chunks. Which step runs a chunk changes no job's numbers: chunks
        # keep their boundaries and rows do not depend on each other.
        prefilling.sort(key=lambda job: len(job.prompt) - job.cached)
        step_started = time.perf_counter()
        contended = bool(decoding and prefilling)
        prefill_seconds = 0.0
        if contended and self.prefill_share < 1.0 and self._prefill_balance < 0.0:
            # Prefill has had its share of the time since the contention began:
            # this step serves the decoding jobs, and prompts short enough to
            # cost about what a few decode rows do.
            short = [job for job in prefilling if len(job.prompt) - job.cached <= _SHORT_PREFILL]
            if len(short) < len(prefilling):
                self._prefill_deferrals += 1
            prefilling = short

        rows: list[_Job] = []
        row_logits: list[Tensor] = []
        budget = self.prefill_chunk
        for job in prefilling:
            # Chunks end at multiples of prefill_chunk whatever else runs, so
            # that a job's numbers (hence its greedy text) do not depend on
            # which jobs arrived with it.
            start = job.cached
            end = min((start // self.prefill_chunk + 1) * self.prefill_chunk, len(job.prompt))
            chunk = job.prompt[start:end]
            if len(chunk) > budget and budget < self.prefill_chunk:
                break  # a step runs one chunk past its budget only when it is its first
            budget -= len(chunk)
            try:
                hidden = llama.forward(
                    weights,
                    self._config,
                    self._cache,
                    self._rope,
                    torch.tensor([chunk], device=self._device),
                    torch.arange(start, start + len(chunk), device=self._device)[None],
                    torch.tensor([job.slot], device=self._device),
                )
            except RuntimeError as exc:
                log.exception("prefill of job %s failed", job.spec.job_id)
                updates.append(self._fail(job, f"the engine failed during prefill: {exc}"))
                continue
            job.cached += len(chunk)
            if job.cached == len(job.prompt):
                rows.append(job)
                row_logits.append(llama.logits(weights, hidden))

        if contended:
            prefill_seconds = time.perf_counter() - step_started

        if decoding:
            try:
                out = llama.decode_logits(
                    weights,
                    self._config,
                    self._cache,
                    self._rope,
                    torch.tensor([job.pending for job in decoding], device=self._device),
                    torch.tensor([job.cached for job in decoding], device=self._device),
                    torch.tensor([job.slot for job in decoding], device=self._device),
                )
            except RuntimeError as exc:
                log.exception("decode step of %d jobs failed", len(decoding))
                for job in decoding:
                    updates.append(self._fail(job, f"the engine failed during decoding: {exc}"))
            else:
                for job in decoding:
                    job.cached += 1
                rows.extend(decoding)
                row_logits.append(out)

        if rows:
            updates.extend(self._sample_and_emit(rows, torch.cat(row_logits)))
        if contended:
            step_seconds = time.perf_counter() - step_started
            self._prefill_balance = min(
                0.0, self._prefill_balance + self.prefill_share * step_seconds - prefill_seconds
            )
        if not self._slots:
            self._cache.release()
        return updates

    def _spec_problem(self, spec: GenerationSpec) -> str | None:
        vocab = self._config.vocab_size
        context = self._info.context_length
        if any(job.spec.job_id == spec.job_id for job in self._slots) or any(
            waiting.job_id == spec.job_id for waiting in self._waiting
        ):
            return f"job_id {spec.job_id!r} is already in use"
        if not spec.prompt_ids:
            return "prompt_ids must not be empty"
        if spec.max_new_tokens < 1:
            return f"max_new_tokens must be >= 1, got {spec.max_new_tokens!r}"
        total = len(spec.prompt_ids) + spec.max_new_tokens
        if total > context:
            return (
                f"prompt tokens plus max_new_tokens must be <= the context length {context},"
                f" got {len(spec.prompt_ids)} + {spec.max_new_tokens} = {total}"
            )
        bad = [i for i in spec.prompt_ids if not 0 <= i < vocab]
        if bad:
            return f"prompt_ids must be in [0, {vocab}), got {bad[0]!r}"
        bad = [i for i in spec.banned_ids if not 0 <= i < vocab]
        if bad:
            return f"banned_ids must be in [0, {vocab}), got {bad[0]!r}"
        if any(not s for s in spec.stop_strings):
            return "stop_strings must not contain an empty string"
        problem = settings_problem(spec.sampling)
        if problem is not None:
            return problem
        bad = [i for i, _ in spec.sampling.logit_bias if i >= vocab]
        if bad:
            return f"logit_bias ids must be in [0, {vocab}), got {bad[0]!r}"
        return None

    def _admit(self, spec: GenerationSpec) -> None:
        prompt = spec.prompt_ids
        vocab = self._config.vocab_size
        allowed: Tensor | None = None
        skip_prefix = ""
        last = prompt[-1]
        if (
            spec.token_healing
            and len(prompt) >= 2
            and last not in self._tokenizer.special_ids
            and last < self._tokenizer.vocab_size
        ):
            ids = self._tokenizer.ids_with_prefix(self._tokenizer.token_bytes(last))
            allowed = torch.zeros(vocab, dtype=torch.bool, device=self._device)
            allowed[[i for i in ids if i < vocab]] = True
            prompt = prompt[:-1]
            skip_prefix = _text_in_context(self._tokenizer, spec.prompt_ids)
        banned: Tensor | None = None
        if spec.banned_ids:
            banned = torch.zeros(vocab, dtype=torch.bool, device=self._device)
            banned[sorted(spec.banned_ids)] = True
        counts = torch.bincount(torch.tensor(prompt), minlength=vocab).to(
            device=self._device, dtype=torch.int32
        )
        # At least the last prompt token is run: its logits give the first sample.
        restore = self._prefix_cache.lookup(prompt, len(prompt) - 1)
        reused = sum(int(block.shape[2]) for block in restore)
        stream = TextStream(
            self._tokenizer.decode,
            spec.stop_strings,
            context_ids=prompt,
            skip_prefix=skip_prefix,
        )
        sampling = spec.sampling
        bias = (
            bias_row(sampling.logit_bias, vocab).to(self._device) if sampling.logit_bias else None
        )
        dry = None
        if sampling.dry:
            # Breakers are token ids, computed from the strings once per job
            # (and cached across jobs that send the same strings).
            breakers = sequence_breaker_ids(self._tokenizer, sampling.dry_sequence_breakers)
            dry = DryHistory.start(prompt, len(prompt) + spec.max_new_tokens, breakers, vocab)
        self._slots.append(
            _Job(
                spec=spec,
                prompt=prompt,
                slot=len(self._slots),
                stream=stream,
                generator=make_generator(sampling.seed, self._device),
                counts=counts,
                banned=banned,
                allowed=allowed,
                bias=bias,
                dry=dry,
                cached=reused,
                tokens=list(prompt),
                reused=reused,
                restore=restore,
            )
        )

    def _biases(self, rows: list[_Job]) -> tuple[Tensor | None, dict[int, str]]:
        """The step's additive ``[B, V]`` bias (``logit_bias`` and DRY), or
        None when no row has one; and the rows whose DRY could not be
        computed, each with why (they fail alone)."""
        if all(job.bias is None and job.dry is None for job in rows):
            return None, {}
        vocab = self._config.vocab_size
        bias = torch.zeros((len(rows), vocab), dtype=torch.float32, device=self._device)
        failed: dict[int, str] = {}
        for row, job in enumerate(rows):
            if job.bias is not None:
                bias[row] += job.bias
            if job.dry is None:
                continue
            try:
                found = job.dry.penalties(job.spec.sampling)
            except Exception as exc:
                log.exception("dry penalties of job %s failed", job.spec.job_id)
                failed[row] = f"dry failed: {type(exc).__name__}: {exc}"[:200]
                continue
            if found is not None:
                ids, values = found
                bias[row].index_add_(0, ids.to(self._device), -values.to(self._device))
        return bias, failed

    def _xtc_mask(self, rows: list[_Job]) -> Tensor | None:
        if all(job.spec.sampling.xtc_probability == 0 for job in rows):
            return None
        if self._xtc_protected is None:
            mask = torch.zeros(self._config.vocab_size, dtype=torch.bool)
            ids = [i for i in xtc_protected_ids(self._tokenizer) if i < mask.numel()]
            mask[ids] = True
            self._xtc_protected = mask.to(self._device)
        return self._xtc_protected

    def _sample_and_emit(self, rows: list[_Job], logits: Tensor) -> list[Update]:
        updates: list[Update] = []
        bias, dry_failed = self._biases(rows)
        if dry_failed:
            for row in sorted(dry_failed):
                updates.append(self._fail(rows[row], f"sampling failed: {dry_failed[row]}"))
            keep = [row for row in range(len(rows)) if row not in dry_failed]
            rows = [rows[row] for row in keep]
            if not rows:
                return updates
            index = torch.tensor(keep, device=logits.device)
            logits = logits.index_select(0, index)
            assert bias is not None
            bias = bias.index_select(0, index.to(bias.device))
        return updates + self._sample_rows(rows, logits, bias)

    def _sample_rows(self, rows: list[_Job], logits: Tensor, bias: Tensor | None) -> list[Update]:
        vocab = self._config.vocab_size
        banned = allowed = None
        if any(job.banned is not None for job in rows):
            empty = torch.zeros(vocab, dtype=torch.bool, device=self._device)
            banned = torch.stack([empty if job.banned is None else job.banned for job in rows])
        if any(job.allowed is not None for job in rows):
            full = torch.ones(vocab, dtype=torch.bool, device=self._device)
            allowed = torch.stack([full if job.allowed is None else job.allowed for job in rows])
        failed: dict[int, str] = {}
        try:
            ids = sample(
                logits,
                [job.spec.sampling for job in rows],
                [job.generator for job in rows],
                counts=torch.stack([job.counts for job in rows]),
                banned=banned,
                allowed=allowed,
                bias=bias,
                states=[job.state for job in rows],
                xtc_protected=self._xtc_mask(rows),
            )
        except SamplingError as exc:
            failed = exc.reasons
            if exc.ids is None:
                # No row was sampled: every job of the step fails, each with
                # its own reason where the sampler gave one.
                return [
                    self._fail(job, f"sampling failed: {failed.get(row, str(exc))}")
                    for row, job in enumerate(rows)
                ]
            ids = exc.ids
        updates: list[Update] = []
        for row, (job, token) in enumerate(zip(rows, ids.tolist(), strict=True)):
            if row in failed:
                updates.append(self._fail(job, f"sampling failed: {failed[row]}"))
                continue
            job.allowed = None
            job.pending = token
            job.tokens.append(token)
            job.generated += 1
            job.counts[token] += 1
            if job.dry is not None:
                job.dry.append(token)
            updates.append(self._emit(job, token))
        return updates

    def _emit(self, job: _Job, token: int) -> Update:
        spec = job.spec
        if token in spec.stop_token_ids:
            # The stop token's own text is never emitted; held text was not a
            # stop string after all, so it is released.
            return self._finish(job, job.stream.flush(), "stop_token", stop_token=token)
        piece = job.stream.push([token])
        if piece.stop_string is not None:
            return self._finish(job, piece.text, "stop_string", stop_string=piece.stop_string)
        if job.generated >= spec.max_new_tokens:
            text = piece.text + job.stream.flush()
            if job.stream.stop_string is not None:
                # The flushed tail completed a stop string after all.
                return self._finish(job, text, "stop_string", stop_string=job.stream.stop_string)
            return self._finish(job, text, "max_new_tokens")
        return TextUpdate(spec.job_id, piece.text, job.stream.held, job.generated)

    def _finish(
        self,
        job: _Job,
        text: str,
        reason: FinishReason,
        *,
        stop_string: str | None = None,
        stop_token: int | None = None,
    ) -> Finished:
        self._keep_prefix(job)
        self._free(job)
        return Finished(
            job_id=job.spec.job_id,
            text=text,
            reason=reason,
            stop_string=stop_string,
            stop_token=stop_token,
            prompt_tokens=len(job.prompt),
            generated_tokens=job.generated,
            cached_tokens=job.reused,
        )

    def _fail(self, job: _Job, message: str) -> Failed:
        self._free(job)
        return Failed(job.spec.job_id, message)

    def _cancel(self, job_ids: set[int]) -> None:
        self._waiting = deque(spec for spec in self._waiting if spec.job_id not in job_ids)
        for job in [job for job in self._slots if job.spec.job_id in job_ids]:
            # What a stopped job computed is as good as a finished one's.
            self._keep_prefix(job)
            self._free(job)

    def _keep_prefix(self, job: _Job) -> None:
        """Offer the job's cached positions to the prefix cache (whole blocks)."""
        if job.restore:
            return  # its slot never received the blocks it was to start from
        slot = job.slot

        def read(start: int, end: int) -> Tensor:
            return self._cache.read(slot, start, end)

        self._prefix_cache.insert(job.tokens[: job.cached], read)

    def _free(self, job: _Job) -> None:
        """Give the job's slot back, moving the last slot into it so that the
        used slots stay packed at the front of the cache."""
        if job.slot >= len(self._slots) or self._slots[job.slot] is not job:
            return  # already freed
        last = self._slots.pop()
        if last is not job:
            self._cache.move(last.slot, job.slot)
            last.slot = job.slot
            self._slots[job.slot] = last
