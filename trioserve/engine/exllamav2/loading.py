"""Loading the ExLlamaV2 engine: whether ExLlamaV2 can run here
(:func:`probe_exllamav2`), the model's config read, the load planned
(:func:`~trioserve.engine.exllamav2.plan.plan_load`, pure) and carried out
(the model placed, its cache and generator made), the engine's facts, and
the load logged. :meth:`ExLlamaV2Engine.load
<trioserve.engine.exllamav2.engine.ExLlamaV2Engine.load>` builds the engine
from the :class:`LoadedParts`.
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

from trioserve.engine.base import EngineInfo
from trioserve.engine.exllamav2.build import BUILD_LOCK_WAIT, build_lock, wait_for_build_lock
from trioserve.engine.exllamav2.plan import LoadPlan, configure_attention, plan_load
from trioserve.engine.grammars import Grammars
from trioserve.engine.progress import report
from trioserve.engine.tokenizer import Tokenizer
from trioserve.errors import ConfigError, EngineError, ModelError
from trioserve.vocabulary.constraint import CONSTRAINT_KINDS

__all__ = ["CACHE_CLASSES", "LoadedParts", "free_model", "load_parts", "probe_exllamav2"]

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


@attrs.frozen
class LoadedParts:
    """What a loaded ExLlamaV2 engine is made of (ExLlamaV2's objects untyped)."""

    info: EngineInfo
    plan: LoadPlan
    tokenizer: Tokenizer
    model: Any
    cache: Any
    xtokenizer: Any
    generator: Any
    job_class: Any
    settings_class: Any
    grammars: Grammars


def load_parts(
    model_dir: Path,
    *,
    cache_type: str,
    cache_size: int | None,
    max_batch: int,
    context_length: int | None,
    gpu_split: Sequence[float] | None,
    tensor_parallel: bool,
    max_chunk_size: int,
) -> LoadedParts:
    """Load what :meth:`ExLlamaV2Engine.load
    <trioserve.engine.exllamav2.engine.ExLlamaV2Engine.load>` documents (the
    same arguments and errors)."""
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
            "exllamav2 turned attention backends off for %s: flash-attn %s, xformers %s, sdpa %s",
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
                callback=report,
                expect_cache_tokens=plan.cache_tokens,
                expect_cache_base=cache_class,
            )
            cache = ExLlamaV2Cache_TP(model, base=cache_class, max_seq_len=plan.cache_tokens)
        elif plan.gpu_split is not None:
            model.load(gpu_split=list(plan.gpu_split), callback=report)
            cache = cache_class(model, max_seq_len=plan.cache_tokens)
        else:
            cache = cache_class(model, max_seq_len=plan.cache_tokens, lazy=True)
            model.load_autosplit(cache, callback=report)
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
            free_model(model)
            raise
        # As text: a record holding the exception would keep its
        # frames, and with them the GPU memory, alive.
        log.debug("".join(traceback.format_exception(exc)))
    if failure is not None:
        # Raised here, outside the except block, so that no traceback
        # keeps the half-built cache's and the layers' tensors alive.
        cache = None
        free_model(model)
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
        kernels="exllamav2 cuda",
    )
    parts = LoadedParts(
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
    return parts


def free_model(model: Any) -> None:
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
