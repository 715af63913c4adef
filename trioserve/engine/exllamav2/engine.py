"""The ExLlamaV2 engine: trioserve's Engine protocol over ExLlamaV2's dynamic generator.

ExLlamaV2 (0.3.2, ``turboderp-org/exllamav2``) runs EXL2, GPTQ and FP16/BF16
safetensors models on NVIDIA GPUs. Its :class:`ExLlamaV2DynamicGenerator` does
continuous batching over a paged KV cache, prefix reuse, sampling, stop
tokens and token healing; this module translates:

* each :class:`~trioserve.engine.base.GenerationSpec` becomes one
  ``ExLlamaV2DynamicJob`` with a fresh ``ExLlamaV2Sampler.Settings``
  (:func:`~trioserve.engine.exllamav2.jobs.sampler_fields`,
  :func:`~trioserve.engine.exllamav2.jobs.stop_conditions`), after the checks
  ExLlamaV2 does not make (:func:`~trioserve.engine.exllamav2.jobs.refusal`);
* the untyped result dicts of ``generator.iterate()`` become typed updates at
  once (:func:`~trioserve.engine.exllamav2.jobs.updates_from_result`). The
  text comes from the sampled tokens, decoded and cut at stop strings by the
  CPU engine's own rules (:class:`~trioserve.engine.text.TextStream`), not
  from ExLlamaV2's text: the same tokens give the same text on both engines;
* a job with a constraint gets its own ``ExLlamaV2Filter`` over llguidance
  (:mod:`~trioserve.engine.exllamav2.filter`, on ExLlamaV2's mask path), and
  the CPU engine's rules for it (:func:`~trioserve.engine.exllamav2.jobs.constrained_update`):
  a complete value ends the job with reason ``constraint``, a failed matcher
  fails that job alone. docs/gpu.md says what a constrained job costs the batch.

The generator is not thread-safe and its asyncio wrapper blocks the event
loop, so neither is used from trio: ``enqueue``, ``cancel`` and ``iterate`` are
called only from :meth:`ExLlamaV2Engine.step`.

Threads: every call that touches the GPU (:meth:`ExLlamaV2Engine.load`,
:meth:`~ExLlamaV2Engine.warm_up`, :meth:`~ExLlamaV2Engine.step`,
:meth:`~ExLlamaV2Engine.close`) may run on any thread, but on one at a time,
and the server runs them all on its one engine thread. Nothing here assumes
which thread that is, or that it is the thread that loaded the model:

* torch's current CUDA device and stream are per thread; ExLlamaV2 sets both
  for the calling thread at every forward pass and load
  (``set_device_streams`` in exllamav2/device.py, called by
  ``ExLlamaV2.forward_chunk`` and the ``load*`` methods), so the thread that
  loaded the model need not be the one that steps it;
* ExLlamaV2's CUDA graphs (quantized attention and MLP layers, decode
  shapes without cuBLAS) are captured the first times a layer runs a shape,
  in ``cudaStreamCaptureModeThreadLocal`` (exllamav2_ext/cuda/graph.cu), on
  the calling thread's stream: CUDA work on other threads does not break a
  capture, but replaying a graph from another thread than the one that
  captured it is a path ExLlamaV2's own loops never take; hence one engine
  thread (``EXLLAMA_NO_GRAPHS=1`` turns graphs off should one misbehave);
* ``torch.inference_mode`` and the grad mode are per thread: :meth:`step`
  and :meth:`warm_up` enter inference mode themselves;
* ExLlamaV2 samples in its own thread pool (``max_sampling_threads``); those
  threads are the generator's and end with :meth:`close`;
* ``encode`` and ``decode`` use trioserve's tokenizer, not ExLlamaV2's or
  torch, and are safe from any thread at any time.

``exllamav2`` is imported only by :func:`probe_exllamav2` and
:meth:`ExLlamaV2Engine.load` (and, after a load, by
:func:`~trioserve.engine.exllamav2.filter.filter_class` for the first
constrained job), never when this module is imported: on a machine
without CUDA the import fails (its C++/CUDA extension cannot be built), and
where it works it compiles that extension on first use, which takes minutes.
Everything else is pure, tested on a CPU, and lives in modules of its own that
never import exllamav2: :mod:`~trioserve.engine.exllamav2.plan` (the options
and attention mode a load builds), :mod:`~trioserve.engine.exllamav2.jobs`
(jobs in, typed updates out), :mod:`~trioserve.engine.exllamav2.filter`
(the constraint's mask) and :mod:`~trioserve.engine.exllamav2.build`
(the bounded wait for torch's build lock of the extension).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from trioserve.engine.base import EngineInfo, GenerationSpec
from trioserve.engine.exllamav2.filter import GrammarMask, filter_class
from trioserve.engine.exllamav2.jobs import (
    JobState,
    constrained_update,
    refusal,
    sampled_token,
    sampler_fields,
    stop_conditions,
    updates_from_result,
)
from trioserve.engine.exllamav2.loading import (
    CACHE_CLASSES,
    load_parts,
    probe_exllamav2,
)
from trioserve.engine.exllamav2.plan import PAGE_SIZE, LoadPlan
from trioserve.engine.grammars import Grammars, JobMatcher
from trioserve.engine.tokenizer import Tokenizer
from trioserve.errors import EngineError
from trioserve.vocabulary.results import Failed, Finished, TextUpdate, Update

__all__ = ["CACHE_CLASSES", "ExLlamaV2Engine", "probe_exllamav2"]

log = logging.getLogger("trioserve.engine")


def _cached_tokens(job: Any) -> int:
    """Prompt tokens of ``job`` served from the cache, as ExLlamaV2 counts them
    in its final result (dynamic.py, ``emit``), for a job it did not end."""
    pages = int(getattr(job, "cached_pages", 0))
    tokens = int(getattr(job, "cached_tokens", 0))
    page_size = int(getattr(job.generator, "page_size", PAGE_SIZE))
    return (pages * page_size + tokens) // max(1, len(getattr(job, "sequences", ())))


# -- the engine ----------------------------------------------------------------------


@attrs.define(eq=False)
class _Running:
    job: Any  # ExLlamaV2DynamicJob
    state: JobState
    #: The job's constraint filter (an ExLlamaV2Filter), when it has one.
    mask: GrammarMask | None = None


@attrs.define(eq=False)
class ExLlamaV2Engine:
    """An Engine over one ``ExLlamaV2DynamicGenerator``; see the module docstring.

    Build it with :meth:`load`. Not thread-safe beyond what the Engine
    protocol promises: :meth:`load`, :meth:`warm_up`, :meth:`step` and
    :meth:`close` from one thread at a time (the server's engine thread),
    :meth:`encode` and :meth:`decode` from any.
    """

    _info: EngineInfo
    _plan: LoadPlan
    _tokenizer: Tokenizer
    # ExLlamaV2 objects (untyped): model, cache, ExLlamaV2Tokenizer, generator,
    # and the classes a job needs.
    _model: Any
    _cache: Any
    _xtokenizer: Any
    _generator: Any
    _job_class: Any
    _settings_class: Any
    #: Compiles constraints for this model; None for an engine built by hand.
    _grammars: Grammars | None = None
    _jobs: dict[int, _Running] = attrs.Factory(dict)
    _closed: bool = False

    @classmethod
    def load(
        cls,
        model_dir: Path,
        *,
        cache_type: str = "fp16",
        cache_size: int | None = None,
        max_batch: int = 32,
        context_length: int | None = None,
        gpu_split: Sequence[float] | None = None,
        tensor_parallel: bool = False,
        max_chunk_size: int = 2048,
    ) -> ExLlamaV2Engine:
        """Load the model directory ``model_dir`` (EXL2, GPTQ, or FP16/BF16/FP32
        safetensors with ``config.json`` and ``tokenizer.json``) onto the GPUs.

        Placement: ``tensor_parallel`` splits every layer over all GPUs
        (``load_tp`` with the TP cache), ``gpu_split`` (GiB per GPU) places
        whole layers by that split (``load``), and otherwise layers and cache
        fill the GPUs in turn (``load_autosplit``).

        Blocking (seconds to minutes: the first import of exllamav2 compiles
        its extension); run it in a worker thread from async code.

        Raises:
            EngineError: exllamav2 cannot be used here (no CUDA, import fails).
            ModelError: the directory is not a model ExLlamaV2 can load.
            ConfigError: an option is invalid (see
                :func:`~trioserve.engine.exllamav2.plan.plan_load`).
        """
        parts = load_parts(
            model_dir,
            cache_type=cache_type,
            cache_size=cache_size,
            max_batch=max_batch,
            context_length=context_length,
            gpu_split=gpu_split,
            tensor_parallel=tensor_parallel,
            max_chunk_size=max_chunk_size,
        )
        return cls(
            info=parts.info,
            plan=parts.plan,
            tokenizer=parts.tokenizer,
            model=parts.model,
            cache=parts.cache,
            xtokenizer=parts.xtokenizer,
            generator=parts.generator,
            job_class=parts.job_class,
            settings_class=parts.settings_class,
            grammars=parts.grammars,
        )

    # -- Engine protocol -----------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def grammars(self) -> Grammars | None:
        """Compiles constraints for this model (:mod:`trioserve.engine.grammars`);
        None when the engine was built without them."""
        return self._grammars

    @property
    def plan(self) -> LoadPlan:
        """The options the engine was built with, after validation."""
        return self._plan

    def encode(self, text: str) -> list[int]:
        # trioserve's own tokenizer over the same tokenizer.json: the CPU and
        # ExLlamaV2 engines count and trim prompts identically.
        return self._tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        # Not ExLlamaV2Tokenizer.decode: with decode_special_tokens=True it
        # still drops the pad id (tokenizer.py, decode_), which for many models
        # is the EOS id, and the protocol writes every special token as text.
        return self._tokenizer.decode(ids)

    def warm_up(self) -> None:
        """Run one short generation, so that the first request does not pay for
        cuBLAS's start, kernel selection and CUDA graph capture.

        Call it on the thread that will step the engine (see the module
        docstring), before the first :meth:`step`, with no job running. It
        empties the prefix cache (``ExLlamaV2DynamicGenerator.warmup``
        resets the page table afterwards).
        """
        if self._closed:
            raise EngineError("the exllamav2 engine is closed")
        if self._jobs:
            raise EngineError("warm_up needs an idle engine: jobs are running")
        import torch

        started = time.monotonic()
        with torch.inference_mode():
            self._generator.warmup()
        log.info("exllamav2 warmed up in %.2f s", time.monotonic() - started)

    def step(self, submit: Sequence[GenerationSpec], cancel: Sequence[int]) -> list[Update]:
        if self._closed:
            raise EngineError("the exllamav2 engine is closed")
        import torch

        updates: list[Update] = []
        generator = self._generator
        for job_id in cancel:
            running = self._jobs.pop(job_id, None)
            if running is not None:
                # Pending or active, the generator forgets it and frees its
                # pages; it reports nothing (dynamic.py, cancel).
                generator.cancel(running.job)
                self._drop_filter(running)
        for spec in submit:
            failure = self._enqueue(spec)
            if failure is not None:
                updates.append(failure)
        if not generator.num_remaining_jobs():
            return updates
        try:
            with torch.inference_mode():
                results = generator.iterate()
        except Exception as exc:
            # A failed forward pass leaves every job's cache pages in an
            # unknown state: drop them all and let the caller fail them.
            for running in self._jobs.values():
                self._drop_filter(running)
            self._jobs.clear()
            generator.clear_queue()
            raise EngineError(f"exllamav2 failed during a step: {exc}") from exc
        for result in results:
            running = self._jobs.get(result.get("identifier", -1))
            if running is None:
                continue
            update = updates_from_result(result, running.state, sampled_token(running.job))
            if update is None:
                continue
            if running.mask is not None:
                update = constrained_update(update, result, running.state, running.mask)
            if not isinstance(update, TextUpdate):
                del self._jobs[running.state.job_id]
                self._drop_filter(running)
                if not result.get("eos", False):
                    # Ended by the rules (a stop string ExLlamaV2 held or
                    # did not see, a complete value, a failed constraint);
                    # ExLlamaV2 would go on generating for it.
                    generator.cancel(running.job)
                    if isinstance(update, Finished):
                        update = attrs.evolve(update, cached_tokens=_cached_tokens(running.job))
            updates.append(update)
        return updates

    def _enqueue(self, spec: GenerationSpec) -> Failed | None:
        if spec.job_id in self._jobs:
            return Failed(job_id=spec.job_id, message=f"job id {spec.job_id!r} is already running")
        generator = self._generator
        reason = refusal(
            spec,
            context_length=self._info.context_length,
            vocab_size=self._info.vocab_size,
            page_size=int(generator.page_size),
            max_pages=int(generator.max_pages),
        )
        if reason is not None:
            return Failed(job_id=spec.job_id, message=reason)
        import torch

        settings = self._settings_class()
        for name, value in sampler_fields(
            spec.sampling, self._tokenizer, self._info.vocab_size
        ).items():
            setattr(settings, name, value)
        if spec.banned_ids:
            settings.disallow_tokens(self._xtokenizer, sorted(spec.banned_ids))
        mask: GrammarMask | None = None
        constrained: dict[str, Any] = {}
        if spec.constraint is not None:
            # The job's own filter over its own matcher (see exllamav2_filter).
            # filter_prefer_eos as ExLlamaV2 documents it for grammars; in
            # 0.3.2 the sampler reads it only on the token-list path
            # (ExLlamaV2Sampler.sample), and on the mask path llguidance's
            # mask of a complete value allows only the EOS ids anyway.
            mask = filter_class()(
                self._model,
                self._xtokenizer,
                JobMatcher.start(spec.constraint),
                self._info.vocab_size,
            )
            constrained = {"filters": [mask], "filter_prefer_eos": True}
        try:
            job = self._job_class(
                input_ids=torch.tensor([spec.prompt_ids], dtype=torch.long),
                max_new_tokens=spec.max_new_tokens,
                # The stop tokens are blocked until then (dynamic.py,
                # ExLlamaV2DynamicJob.receive_logits), the healed token not counted.
                min_new_tokens=spec.sampling.min_tokens,
                gen_settings=settings,
                seed=spec.sampling.seed,
                stop_conditions=stop_conditions(spec, self._info.eos_token_ids),
                decode_special_tokens=True,
                token_healing=spec.token_healing,
                identifier=spec.job_id,
                **constrained,
            )
            generator.enqueue(job)
        except (AssertionError, ValueError) as exc:
            return Failed(job_id=spec.job_id, message=f"exllamav2 refused the job: {exc}")
        self._jobs[spec.job_id] = _Running(
            job=job,
            state=JobState.for_spec(
                spec,
                self._tokenizer.decoder(
                    self._tokenizer.skipped_special(spec.kept_special)
                    if spec.skip_special_tokens
                    else frozenset()
                ),
            ),
            mask=mask,
        )
        return None

    def _drop_filter(self, running: _Running) -> None:
        """Forget the filter of a job that is gone. Its receive_sample queued
        it for the next step's mask (dynamic.py, "Feed filters": before the
        job's end is decided), and iterate_gen would compute that mask in its
        filter_pool for nobody; the entry is taken off ExLlamaV2's
        ``filter_queue`` and the filter closed, so that nothing runs."""
        mask = running.mask
        if mask is None:
            return
        queue = getattr(self._generator, "filter_queue", None)
        if queue:
            queue[:] = [entry for entry in queue if entry[0] is not mask]
        mask.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for running in self._jobs.values():
            self._drop_filter(running)
        self._jobs.clear()
        generator = self._generator
        try:
            generator.clear_queue()
        finally:
            for pool in ("sampling_pool", "filter_pool"):
                executor = getattr(generator, pool, None)
                if executor is not None:
                    executor.shutdown(wait=True)
            self._model.unload()
            self._generator = self._cache = self._model = None
            import torch

            torch.cuda.empty_cache()
