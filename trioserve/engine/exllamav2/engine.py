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
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from trioserve.engine.base import EngineInfo, GenerationSpec
from trioserve.engine.exllamav2.build import BUILD_LOCK_WAIT, build_lock, wait_for_build_lock
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
from trioserve.engine.exllamav2.plan import PAGE_SIZE, LoadPlan, configure_attention, plan_load
from trioserve.engine.grammars import Grammars, JobMatcher
from trioserve.engine.tokenizer import Tokenizer
from trioserve.errors import ConfigError, EngineError, ModelError
from trioserve.vocabulary.constraint import CONSTRAINT_KINDS
from trioserve.vocabulary.results import Failed, Finished, TextUpdate, Update

__all__ = ["CACHE_CLASSES", "ExLlamaV2Engine", "probe_exllamav2"]

log = logging.getLogger("trioserve.engine")


# The first ExLlamaV2 release with every call this module makes (eos_reason in
# the result dicts, ExLlamaV2Cache_Q6/_Q8, load_tp with expect_cache_base).
_MIN_VERSION: Final = (0, 3, 2)

#: The ExLlamaV2 cache class of each cache type (``--cache-type``; and
#: ``--kv-cache-dtype int8`` is ``q8``): the FP16 cache, or the grouped RTN
#: quantized caches (exllamav2 0.3.2's cache.py: each takes ``model,
#: batch_size, max_seq_len, copy_from, lazy``; ``ExLlamaV2Cache_8bit`` is FP8,
#: which the dynamic generator refuses, so it is not offered).
CACHE_CLASSES: Final = {
    "fp16": "ExLlamaV2Cache",
    "q4": "ExLlamaV2Cache_Q4",
    "q6": "ExLlamaV2Cache_Q6",
    "q8": "ExLlamaV2Cache_Q8",
}


# -- probing -------------------------------------------------------------------------


def probe_exllamav2(*, lock_wait: float | None = None) -> tuple[bool, str]:
    """Whether the ExLlamaV2 engine can run here, and why (or why not).

    True only when torch sees a CUDA device and ``import exllamav2`` works. The
    import is not even tried without CUDA: it would try to build the C++/CUDA
    extension and fail (an OSError on CPU-only torch). Whatever the import
    raises is caught and reported, since a broken optional backend must not
    stop the server from starting on the CPU engine.

    Nor is it tried while torch's build lock of the extension stays in place
    for ``lock_wait`` seconds (default
    :data:`~trioserve.engine.exllamav2.build.BUILD_LOCK_WAIT`): torch's JIT
    build (``torch.utils.cpp_extension``, ``FileBaton.wait``) waits on that
    file with no timeout, and a build killed half-way leaves it behind, so
    the import would hang the server's start for ever. The probe says so
    (and logs a warning), and ``--engine auto`` falls back to the CPU engine.
    A lock that goes within the wait (another process finishing its build) is
    waited for. What it cannot see: a lock another process takes after the
    wait and then abandons while this import waits on it.

    ExLlamaV2's model module calls ``torch.set_num_threads(1)`` when imported;
    the thread count is put back, because the CPU engine and tokenization in
    the same process need the cores.
    """
    try:
        import torch
    except Exception as exc:
        return False, f"torch cannot be imported ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA device"
    if "exllamav2.generator" not in sys.modules:
        lock = build_lock()
        if lock is not None:
            held = wait_for_build_lock(lock, BUILD_LOCK_WAIT if lock_wait is None else lock_wait)
            if held is not None:
                log.warning("exllamav2 is not imported: %s", held)
                return False, held
    threads = torch.get_num_threads()
    try:
        import exllamav2

        # The dynamic generator's module loads more of the extension.
        import exllamav2.generator
    except Exception as exc:
        return False, f"exllamav2 cannot be imported ({type(exc).__name__}: {exc})"
    finally:
        torch.set_num_threads(threads)
    version = str(getattr(exllamav2, "__version__", "unknown"))
    if _version_tuple(version) < _MIN_VERSION:
        wanted = ".".join(map(str, _MIN_VERSION))
        return False, f"exllamav2 {version} is too old: trioserve needs >= {wanted}"
    return True, f"exllamav2 {version} on {torch.cuda.get_device_name(0)}"


def _version_tuple(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for part in version.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _load_failure(exc: BaseException, model_dir: Path, plan: LoadPlan) -> str | None:
    """The ModelError message for an error ExLlamaV2 raised while placing the
    model, or None for one that is not the model's fault (re-raised as is)."""
    import torch

    where = f"the model {str(model_dir)!r} with a {plan.cache_tokens}-token {plan.cache_type} cache"
    # load_autosplit raises a plain RuntimeError("Insufficient VRAM for model
    # and cache") once the last GPU is full (model.py, load_autosplit_gen);
    # load and load_tp let torch's OutOfMemoryError through.
    if isinstance(exc, torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "Insufficient VRAM" in str(exc)
    ):
        return f"{where} does not fit on the GPUs: {exc}"
    if isinstance(exc, AssertionError | ValueError | KeyError | OSError):
        return f"exllamav2 cannot load {where}: {type(exc).__name__}: {exc}"
    return None


def _cached_tokens(job: Any) -> int:
    """Prompt tokens of ``job`` served from the cache, as ExLlamaV2 counts them
    in its final result (dynamic.py, ``emit``), for a job it did not end."""
    pages = int(getattr(job, "cached_pages", 0))
    tokens = int(getattr(job, "cached_tokens", 0))
    page_size = int(getattr(job.generator, "page_size", PAGE_SIZE))
    return (pages * page_size + tokens) // max(1, len(getattr(job, "sequences", ())))


def _free(model: Any) -> None:
    """Unload what ExLlamaV2 placed of ``model`` and give the memory back."""
    import gc

    import torch

    try:
        model.unload()
    except Exception:
        # A model that failed half-way may not unload cleanly; the original
        # error is the one to report.
        log.warning("exllamav2 could not unload a model that failed to load", exc_info=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
        usable, reason = probe_exllamav2()
        if not usable:
            raise EngineError(f"the exllamav2 engine cannot run: {reason}")
        from exllamav2 import (
            ExLlamaV2,
            ExLlamaV2Cache,
            ExLlamaV2Cache_Q4,
            ExLlamaV2Cache_Q6,
            ExLlamaV2Cache_Q8,
            ExLlamaV2Cache_TP,
            ExLlamaV2Config,
            ExLlamaV2Tokenizer,
        )
        from exllamav2.attn import has_flash_attn, has_flash_attn_with_paged
        from exllamav2.generator import (
            ExLlamaV2DynamicGenerator,
            ExLlamaV2DynamicJob,
            ExLlamaV2Sampler,
        )

        model_dir = Path(model_dir)
        try:
            config = ExLlamaV2Config(str(model_dir))
        except (AssertionError, ValueError, KeyError, OSError, TypeError) as exc:
            raise ModelError(f"exllamav2 cannot read the model {str(model_dir)!r}: {exc}") from exc
        # Architectures with softcapping or sliding windows need some attention
        # backends off. quiet=True keeps ExLlamaV2 from printing why (it would
        # write to stdout, config.py); what it switched off is logged below.
        backends = (config.no_flash_attn, config.no_xformers, config.no_sdpa)
        config.arch_compat_overrides(quiet=True)
        if (config.no_flash_attn, config.no_xformers, config.no_sdpa) != backends:
            log.info(
                "exllamav2 turned attention backends off for %s: flash-attn %s, xformers %s, "
                "sdpa %s",
                config.architecture,
                "off" if config.no_flash_attn else "allowed",
                "off" if config.no_xformers else "allowed",
                "off" if config.no_sdpa else "allowed",
            )
        # Before the model is built: the attention switches decide what
        # load_autosplit's trial forward pass measures.
        paged = configure_attention(config, flash_attn_paged=bool(has_flash_attn_with_paged))
        plan = plan_load(
            int(config.max_seq_len),
            paged=paged,
            flash_attn=bool(has_flash_attn) and not config.no_flash_attn,
            max_attention_size=int(config.max_attention_size),
            cache_type=cache_type,
            cache_size=cache_size,
            max_batch=max_batch,
            context_length=context_length,
            gpu_split=gpu_split,
            tensor_parallel=tensor_parallel,
            max_chunk_size=max_chunk_size,
        )
        if tensor_parallel and not config.arch.lm.supports_tp:
            raise ConfigError(
                f"tensor_parallel is not supported by ExLlamaV2 for {config.architecture!r}"
            )
        config.max_seq_len = plan.context_length
        config.max_input_len = min(int(config.max_input_len), plan.context_length)
        tokenizer = Tokenizer.from_dir(model_dir)

        classes = {
            "ExLlamaV2Cache": ExLlamaV2Cache,
            "ExLlamaV2Cache_Q4": ExLlamaV2Cache_Q4,
            "ExLlamaV2Cache_Q6": ExLlamaV2Cache_Q6,
            "ExLlamaV2Cache_Q8": ExLlamaV2Cache_Q8,
        }
        cache_class = classes[CACHE_CLASSES[plan.cache_type]]
        started = time.monotonic()
        model = ExLlamaV2(config)
        cache: Any = None
        failure: str | None = None
        try:
            if plan.tensor_parallel:
                model.load_tp(
                    gpu_split=list(plan.gpu_split) if plan.gpu_split else None,
                    expect_cache_tokens=plan.cache_tokens,
                    expect_cache_base=cache_class,
                )
                cache = ExLlamaV2Cache_TP(model, base=cache_class, max_seq_len=plan.cache_tokens)
            elif plan.gpu_split is not None:
                model.load(gpu_split=list(plan.gpu_split))
                cache = cache_class(model, max_seq_len=plan.cache_tokens)
            else:
                cache = cache_class(model, max_seq_len=plan.cache_tokens, lazy=True)
                model.load_autosplit(cache)
            xtokenizer = ExLlamaV2Tokenizer(config)
            generator = ExLlamaV2DynamicGenerator(
                model=model,
                cache=cache,
                tokenizer=xtokenizer,
                max_batch_size=plan.max_batch,
                max_chunk_size=plan.max_chunk_size,
                paged=plan.paged,
            )
        except BaseException as exc:
            failure = _load_failure(exc, model_dir, plan)
            if failure is None:
                _free(model)
                raise
            # As text: a record holding the exception would keep its
            # frames, and with them the GPU memory, alive.
            log.debug("".join(traceback.format_exception(exc)))
        if failure is not None:
            # Raised here, outside the except block, so that no traceback
            # keeps the half-built cache's and the layers' tensors alive.
            cache = None
            _free(model)
            raise ModelError(failure)
        # These tables are built lazily on first use, possibly from the
        # generator's sampling threads at once; build them here instead.
        xtokenizer.get_id_to_piece_list(True)
        xtokenizer.get_id_to_piece_list(False)
        xtokenizer.get_prefix_id_to_ids_dict()

        eos = set(tokenizer.eos_token_ids)
        if config.eos_token_id is not None:
            eos.add(int(config.eos_token_id))
        generation_config = getattr(config, "generation_config", None) or {}
        eos.update(int(i) for i in generation_config.get("eos_token_id") or ())
        bos = tokenizer.bos_token_id
        if bos is None and config.bos_token_id is not None:
            bos = int(config.bos_token_id)
        info = EngineInfo(
            engine="exllamav2",
            model_name=model_dir.name,
            context_length=plan.context_length,
            vocab_size=int(config.vocab_size),
            bos_token_id=bos,
            eos_token_ids=frozenset(eos),
            max_batch=plan.max_batch,
            batching=plan.paged,
            max_token_chars=tokenizer.max_token_bytes,
            model_dir=str(model_dir),
            constraints=CONSTRAINT_KINDS,
        )
        engine = cls(
            info=info,
            plan=plan,
            tokenizer=tokenizer,
            model=model,
            cache=cache,
            xtokenizer=xtokenizer,
            generator=generator,
            job_class=ExLlamaV2DynamicJob,
            settings_class=ExLlamaV2Sampler.Settings,
            # The grammar's tokenizer is as wide as the model's vocabulary; the
            # sampler's logits are padded to a multiple of 32
            # (ExLlamaV2DynamicGenerator.padded_vocab_size), the bitmask's
            # width, and the filter forbids the padding.
            grammars=Grammars.for_model(model_dir, vocab_size=info.vocab_size, eos_ids=eos),
        )
        log.info(
            "exllamav2 loaded %s in %.1f s: context %d, %s cache of %d tokens, %s, "
            "max batch %d, placement %s",
            model_dir,
            time.monotonic() - started,
            plan.context_length,
            plan.cache_type,
            plan.cache_tokens,
            "paged attention"
            if plan.paged
            else (
                "no paged attention (flash-attn >= 2.5.7 missing): one job at a time, "
                f"torch matmul attention, prefill chunks of {plan.max_chunk_size} tokens"
            ),
            plan.max_batch,
            "tensor parallel"
            if plan.tensor_parallel
            else ("gpu split " + repr(plan.gpu_split) if plan.gpu_split else "autosplit"),
        )
        return engine

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
            job=job, state=JobState.for_spec(spec, self._tokenizer.decode), mask=mask
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
