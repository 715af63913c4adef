"""The embedded CPU engine: a compact torch Llama with continuous batching.

Each :meth:`CpuEngine.step` applies cancellations and new jobs, admits
waiting jobs into free slots in arrival order (:mod:`trioserve.engine.cpu.jobs`),
asks :func:`~trioserve.engine.cpu.plan.plan_step` what the step runs -- a pure
plan; its module states every rule of the schedule -- and runs it: prefill
chunks for new jobs (about :attr:`CpuEngine.prefill_chunk` prompt tokens per
step, so that one long prompt delays the running jobs' next token by one
chunk, not by the whole prompt), then one batched decode forward for every
job that has a token to feed, and samples all the step's tokens in one call
(:mod:`trioserve.engine.cpu.step`).
While jobs decode, prefill chunks take at most :attr:`CpuEngine.prefill_share`
of the engine's time: steps past that share decode alone, so a prompt of the
whole context slows the running streams to about half their speed instead of
a token per chunk.

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
from typing import Any

import attrs
import torch
from torch import Tensor

from trioserve.engine.base import EngineInfo, GenerationSpec
from trioserve.engine.cpu import llama
from trioserve.engine.cpu.jobs import (
    CpuJob,
    decode_rows,
    draft_rows,
    prefill_chunk,
    spec_problem,
    start_job,
)
from trioserve.engine.cpu.loading import load_parts
from trioserve.engine.cpu.logprobs import TokenTexts
from trioserve.engine.cpu.options import CpuOptions
from trioserve.engine.cpu.plan import Chunk, PrefillRules, plan_step
from trioserve.engine.cpu.prefix import PrefixCache, PrefixCacheStatistics
from trioserve.engine.cpu.step import StepSampler
from trioserve.engine.grammars import Grammars
from trioserve.engine.tokenizer import Tokenizer
from trioserve.errors import EngineError
from trioserve.vocabulary.results import Failed, Update

__all__ = [
    "CpuEngine",
    "CpuEngineStatistics",
    "PrefixCacheStatistics",
]

log = logging.getLogger("trioserve.engine")


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
    #: Draft tokens fed after decoding jobs' pending tokens, and those of
    #: them sampled as they were (:attr:`CpuEngine.draft_tokens`).
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    #: Jobs paused for another client's, and the bytes of keys and values
    #: they keep outside the KV cache until they resume.
    paused_jobs: int = 0
    paused_bytes: int = 0
    #: Bytes the KV cache holds with ``max_batch`` jobs of a full context
    #: each: ``kv_cache_bytes`` over it is the cache's use, 0 to 1.
    kv_cache_capacity_bytes: int = 0


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
    _texts: TokenTexts
    #: Samples each step's rows and settles their jobs.
    _sampler: StepSampler
    #: Prompt tokens per prefill chunk, and the prefill budget of one step
    #: over all new jobs (a step runs at least one chunk, and never splits one).
    prefill_chunk: int = 512
    #: While some jobs decode and others wait for their prefill, the share of
    #: the engine's time that prefill chunks may take (0 < share <= 1; 1 runs
    #: a chunk every step). A prompt of the whole context costs seconds of
    #: prefill per chunk on a CPU: without a share, every decoding job would
    #: get one token per chunk for as long as it lasts.
    prefill_share: float = 0.5
    #: Draft tokens fed after each decoding job's pending token, at most
    #: (speculative decoding by prompt lookup, :mod:`trioserve.engine.cpu.speculative`);
    #: 0 turns speculation off. Outputs are the same either way.
    draft_tokens: int = 0
    #: Jobs for the next free slots, in order: new ones (specs) and resumed
    #: ones (jobs, their keys and values in ``restore``).
    _waiting: deque[GenerationSpec | CpuJob] = attrs.field(factory=deque)
    _slots: list[CpuJob] = attrs.field(factory=list)
    #: Jobs paused by the scheduler (``step``'s ``pause``), by id, until
    #: they are submitted again (resumed) or cancelled: a started one keeps
    #: its keys and values (moved out of its slot into ``restore``) and its
    #: sampler, text and constraint state; one never started is its spec.
    _paused: dict[int, GenerationSpec | CpuJob] = attrs.field(factory=dict)
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
    #: Compiles the requests' constraints for this model (off this thread).
    _grammars: Grammars | None = None

    @classmethod
    def load(
        cls, model_dir: Path | None = None, options: CpuOptions | None = None, **changes: Any
    ) -> CpuEngine:
        """Load a Llama-family Hugging Face directory (the embedded SmolLM2 when
        ``model_dir`` is None, obtained with :func:`default_model_dir`) as
        ``options`` say (:class:`~trioserve.engine.cpu.options.CpuOptions`,
        which documents each; its defaults when None), with ``changes`` to
        its fields: ``CpuEngine.load(path, max_batch=4)``.

        Raises:
            ConfigError: an option is invalid, alone or with the others (a
                context length beyond the model's, too).
            ModelError: the model cannot be found, obtained or loaded.
            EngineError: the device is not available.
        """
        options = attrs.evolve(options or CpuOptions(), **changes)
        parts = load_parts(model_dir, options)
        return cls(
            tokenizer=parts.tokenizer,
            config=parts.config,
            weights=parts.weights,
            cache=parts.cache,
            prefix_cache=parts.prefix_cache,
            texts=parts.texts,
            sampler=parts.sampler,
            rope=parts.rope,
            info=parts.info,
            device=parts.device,
            prefill_share=options.prefill_share,
            draft_tokens=options.drafts,
            weight_bytes=parts.weights.nbytes,
            grammars=parts.grammars,
        )

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def grammars(self) -> Grammars | None:
        """Compiles constraints for this model (:mod:`trioserve.engine.grammars`);
        None when the engine was built without them."""
        return self._grammars

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
            kv_cache_capacity_bytes=self._cache.bytes_for(
                self._info.max_batch, self._info.context_length
            ),
            weight_bytes=0 if self._weights is None else self._weight_bytes,
            prefix_cache=self._prefix_cache.statistics(),
            prefill_deferrals=self._prefill_deferrals,
            drafted_tokens=self._sampler.drafts.drafted,
            accepted_tokens=self._sampler.drafts.accepted,
            paused_jobs=len(self._paused),
            paused_bytes=sum(
                block.numel() * block.element_size()
                for job in self._paused.values()
                if isinstance(job, CpuJob)
                for block in job.restore
            ),
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
        self._paused.clear()

    # --- the step -------------------------------------------------------------

    def step(
        self, submit: Sequence[GenerationSpec], cancel: Sequence[int], pause: Sequence[int] = ()
    ) -> list[Update]:
        """One step (:meth:`trioserve.engine.base.PausingEngine.step`)."""
        if self._weights is None:
            raise EngineError("the cpu engine is closed")
        # inference_mode is thread-local: it must be entered in the worker
        # thread that runs the step, not where the engine was built.
        with torch.inference_mode():
            return self._step(self._weights, submit, cancel, pause)

    def _step(
        self,
        weights: llama.LlamaWeights,
        submit: Sequence[GenerationSpec],
        cancel: Sequence[int],
        pause: Sequence[int],
    ) -> list[Update]:
        updates = self._take(submit, cancel, pause)
        if not self._slots:
            self._cache.release()
            return updates
        jobs = list(self._slots)
        rules = PrefillRules(self.prefill_chunk, self.prefill_share)
        plan = plan_step([job.state_for_plan() for job in jobs], rules, self._prefill_balance)
        drafted = draft_rows([jobs[i] for i in plan.decode], self.draft_tokens)
        # Room for every slot's next writes (drafts included); also gives
        # memory back when the longest jobs have left.
        self._cache.fit(
            len(jobs), max([plan.positions, *(j.cached + len(d) + 1 for d, j in drafted)])
        )
        if self._rope[0].shape[0] < self._cache.length:
            # Each position's angles do not depend on the table's length.
            length = max(self._cache.length, 2 * self._rope[0].shape[0])
            self._rope = llama.rope_tables(self._config, length, self._device)
        for job in jobs:
            if job.restore:
                self._cache.write(job.slot, 0, torch.cat(job.restore, dim=2))
                job.restore = []
        if plan.deferred:
            self._prefill_deferrals += 1

        step_started = time.perf_counter()
        rows, row_hidden = self._prefill(weights, jobs, plan.chunks, updates)
        prefill_seconds = time.perf_counter() - step_started
        drafts: list[tuple[int, ...]] = [() for _ in rows]
        if drafted and (out := self._decode(weights, drafted, updates)) is not None:
            rows.extend(job for _, job in drafted)
            drafts.extend(draft for draft, _ in drafted)
            row_hidden.append(out)
        if rows:
            hidden = torch.cat(row_hidden)
            settle = (self._finish, self._fail)
            updates.extend(self._sampler.sample(weights, rows, drafts, hidden, *settle))
        self._prefill_balance = plan.balance_after(
            self._prefill_balance,
            self.prefill_share,
            time.perf_counter() - step_started,
            prefill_seconds,
        )
        if not self._slots:
            self._cache.release()
        return updates

    def _take(
        self, submit: Sequence[GenerationSpec], cancel: Sequence[int], pause: Sequence[int]
    ) -> list[Update]:
        """Apply the cancellations and the pauses, queue the new and resumed
        jobs (failing those that cannot run), and admit waiting jobs into
        free slots in arrival order."""
        updates: list[Update] = []
        cancelled = set(cancel)
        if cancelled:
            self._cancel(cancelled)
        for job_id in pause:
            self._pause(job_id)
        for spec in submit:
            if spec.job_id in cancelled:
                continue  # stopped before it was ever run: no update at all
            paused = self._paused.pop(spec.job_id, None)
            if paused is not None:
                self._waiting.append(paused)  # resumed where it stopped
                continue
            if any(job.spec.job_id == spec.job_id for job in self._slots) or any(
                _job_id(waiting) == spec.job_id for waiting in self._waiting
            ):
                problem: str | None = f"job_id {spec.job_id!r} is already in use"
            else:
                problem = spec_problem(
                    spec, vocab=self._config.vocab_size, context=self._info.context_length
                )
            if problem is None:
                self._waiting.append(spec)
            else:
                updates.append(Failed(spec.job_id, problem))
        while self._waiting and len(self._slots) < self._info.max_batch:
            waiting = self._waiting.popleft()
            if isinstance(waiting, CpuJob):
                # Its keys and values go back into the new slot at the step's
                # start, as the prefix cache's blocks do.
                waiting.slot = len(self._slots)
                self._slots.append(waiting)
                continue
            job = start_job(
                waiting,
                len(self._slots),
                tokenizer=self._tokenizer,
                vocab=self._config.vocab_size,
                device=self._device,
                prefix_cache=self._prefix_cache,
                texts=self._texts,
            )
            self._slots.append(job)
        return updates

    def _prefill(
        self,
        weights: llama.LlamaWeights,
        jobs: list[CpuJob],
        chunks: Sequence[Chunk],
        updates: list[Update],
    ) -> tuple[list[CpuJob], list[Tensor]]:
        """Run the plan's prefill chunks; the jobs whose prompt is done, with
        the hidden state of their last position. A chunk that fails fails its job."""
        rows, row_hidden = list[CpuJob](), list[Tensor]()
        for chunk in chunks:
            job = jobs[chunk.job]
            try:
                where = (self._config, self._cache, self._rope, self._device)
                hidden = prefill_chunk(weights, *where, job, chunk.start, chunk.end, self._texts)
            except RuntimeError as exc:
                log.exception("prefill of job %s failed", job.spec.job_id)
                updates.append(self._fail(job, f"the engine failed during prefill: {exc}"))
                continue
            job.cached = chunk.end
            if chunk.completes and job.spec.share_prompt:
                self._keep_prefix(job)  # the choices that follow start from it
            if chunk.completes and job.spec.max_new_tokens == 0:
                updates.append(job.finish_scored())  # only scored: no token to sample
                self._finish(job)
            elif chunk.completes:
                rows.append(job)
                row_hidden.append(hidden)
        return rows, row_hidden

    def _decode(
        self,
        weights: llama.LlamaWeights,
        drafted: list[tuple[tuple[int, ...], CpuJob]],
        updates: list[Update],
    ) -> Tensor | None:
        """Feed each decoding job its pending token, then its drafts, a row
        each, in one batched forward; the rows' hidden states, or None when
        the forward failed (and failed them)."""
        try:
            where = (self._config, self._cache, self._rope, self._device)
            out = decode_rows(weights, *where, drafted)
        except RuntimeError as exc:
            log.exception("decode step of %d jobs failed", len(drafted))
            for _, job in drafted:
                updates.append(self._fail(job, f"the engine failed during decoding: {exc}"))
            return None
        for _, job in drafted:
            job.cached += 1
        return out

    def _fail(self, job: CpuJob, message: str) -> Failed:
        self._free(job)
        return Failed(job.spec.job_id, message)

    def _cancel(self, job_ids: set[int]) -> None:
        self._waiting = deque(item for item in self._waiting if _job_id(item) not in job_ids)
        for job_id in job_ids:
            self._paused.pop(job_id, None)
        for job in [job for job in self._slots if job.spec.job_id in job_ids]:
            # What a stopped job computed is as good as a finished one's.
            self._finish(job)

    def _pause(self, job_id: int) -> None:
        """Take a running or waiting job out of the batch, keeping all it
        computed: a slot's keys and values move into the job's ``restore``
        (the KV cache's rows as stored, 8-bit ones too), to be written back
        into whatever slot it resumes in, so nothing is recomputed."""
        for item in self._waiting:
            if _job_id(item) == job_id:
                self._waiting.remove(item)
                self._paused[job_id] = item
                return
        for job in self._slots:
            if job.spec.job_id == job_id:
                if not job.restore and job.cached:
                    job.restore = [self._cache.read(job.slot, 0, job.cached)]
                self._free(job)
                self._paused[job_id] = job
                return

    def _finish(self, job: CpuJob) -> None:
        self._keep_prefix(job)
        self._free(job)

    def _keep_prefix(self, job: CpuJob) -> None:
        """Offer the job's cached positions to the prefix cache (whole blocks)."""
        if job.restore:
            return  # its slot never received the blocks it was to start from
        slot = job.slot

        def read(start: int, end: int) -> Tensor:
            return self._cache.read(slot, start, end)

        self._prefix_cache.insert(job.tokens[: job.cached], read)

    def _free(self, job: CpuJob) -> None:
        """Give the job's slot back, moving the last slot into it so that the
        used slots stay packed at the front of the cache."""
        if job.slot >= len(self._slots) or self._slots[job.slot] is not job:
            return  # already freed
        last = self._slots.pop()
        if last is not job:
            self._cache.move(last.slot, job.slot)
            last.slot = job.slot
            self._slots[job.slot] = last


def _job_id(item: GenerationSpec | CpuJob) -> int:
    return item.spec.job_id if isinstance(item, CpuJob) else item.job_id
