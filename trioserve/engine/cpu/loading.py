"""Loading the CPU engine: its options checked, the model found and read
(tokenizer and weights, in the form the options and the CPU allow: see
:meth:`~trioserve.engine.cpu.llama.LlamaWeights.load`), the KV cache, the
sampler's tables and the engine's facts made, and the load logged.
:meth:`CpuEngine.load <trioserve.engine.cpu.engine.CpuEngine.load>` builds
the engine from the :class:`LoadedParts`.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import attrs
import torch
from torch import Tensor

from trioserve.engine.base import EngineInfo
from trioserve.engine.cpu import contention, llama
from trioserve.engine.cpu.kvcache import KV_CACHE_DTYPES
from trioserve.engine.cpu.logprobs import TokenTexts
from trioserve.engine.cpu.prefix import PrefixCache
from trioserve.engine.cpu.quant import CPU_KERNELS, weight_kind
from trioserve.engine.cpu.speculative import SPECULATIVE_MODES
from trioserve.engine.cpu.step import StepSampler, XtcProtected
from trioserve.engine.grammars import Grammars, MaskRows
from trioserve.engine.models import DEFAULT_MODEL_NAME, default_model_dir
from trioserve.engine.tokenizer import Tokenizer
from trioserve.errors import ConfigError, EngineError
from trioserve.vocabulary.constraint import CONSTRAINT_KINDS

__all__ = ["DTYPES", "PREFIX_BLOCK_TOKENS", "ROPE_START", "LoadedParts", "load_parts"]

log = logging.getLogger("trioserve.engine")

#: Positions the rope tables cover at load; they grow with the KV cache.
ROPE_START = 512
#: Tokens per prefix-cache block: a reused prefix is a multiple of this.
PREFIX_BLOCK_TOKENS = 64

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@attrs.frozen
class LoadedParts:
    """What a loaded CPU engine is made of."""

    tokenizer: Tokenizer
    config: llama.LlamaConfig
    weights: llama.LlamaWeights
    cache: llama.KVCache
    prefix_cache: PrefixCache
    texts: TokenTexts
    sampler: StepSampler
    rope: tuple[Tensor, Tensor]
    info: EngineInfo
    device: torch.device
    grammars: Grammars


def load_parts(
    model_dir: Path | None,
    *,
    dtype: str,
    device: str,
    context_length: int | None,
    max_batch: int,
    offline: bool,
    threads: int | None,
    weights: str,
    prefix_cache_bytes: int,
    prefill_share: float,
    projection: str,
    speculative: str,
    draft_tokens: int,
    kv_cache_dtype: str,
    cpu_kernels: str,
) -> LoadedParts:
    """Check the options and load what :meth:`CpuEngine.load
    <trioserve.engine.cpu.engine.CpuEngine.load>` documents (the same
    arguments and errors)."""
    torch_device = _checked_device(
        dtype=dtype,
        device=device,
        max_batch=max_batch,
        threads=threads,
        weights=weights,
        prefix_cache_bytes=prefix_cache_bytes,
        prefill_share=prefill_share,
        speculative=speculative,
        draft_tokens=draft_tokens,
        kv_cache_dtype=kv_cache_dtype,
    )
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
    with contention.measure() as loading:
        tokenizer, model = _load_model(
            model_dir,
            config,
            torch_dtype=DTYPES[dtype],
            device=torch_device,
            weights=weights,
            projection=projection,
            cpu_kernels=cpu_kernels,
        )
    torch_dtype = DTYPES[dtype]
    cache = _kv_cache(config, torch_dtype, torch_device, kv_cache_dtype)
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
        constraints=CONSTRAINT_KINDS,
        logprobs=True,
    )
    _log_loaded(name, dtype, torch_device, model, cache, context, max_batch)
    for measured in loading if torch_device.type == "cpu" else []:
        hint = contention.advice(measured, torch.get_num_threads())
        if hint is not None:
            log.warning("%s", hint)
    _give_back_freed_memory()
    texts = TokenTexts(tokenizer)
    return LoadedParts(
        tokenizer=tokenizer,
        config=config,
        weights=model,
        cache=cache,
        prefix_cache=PrefixCache(prefix_cache_bytes, PREFIX_BLOCK_TOKENS),
        texts=texts,
        sampler=StepSampler(
            config.vocab_size,
            torch_device,
            texts,
            XtcProtected(tokenizer, config.vocab_size, torch_device),
            MaskRows(config.vocab_size, max_batch),
        ),
        # Grown with the KV cache (step), not made for the whole context
        # at load: 7 MiB less resident for the embedded model's 8,192.
        rope=llama.rope_tables(config, min(context, ROPE_START), torch_device),
        info=info,
        device=torch_device,
        grammars=Grammars.for_model(
            model_dir, vocab_size=config.vocab_size, eos_ids=tokenizer.eos_token_ids
        ),
    )


def _kv_cache(
    config: llama.LlamaConfig, dtype: torch.dtype, device: torch.device, kv_cache_dtype: str
) -> llama.KVCache:
    """The engine's (empty) KV cache: keys and values in ``dtype``, or 8 bits."""
    quantized = kv_cache_dtype == "int8"
    return llama.KVCache(
        config.n_layers, config.n_kv_heads, config.head_dim, dtype, device, quantized=quantized
    )


def _log_loaded(
    name: str,
    dtype: str,
    device: torch.device,
    model: llama.LlamaWeights,
    cache: llama.KVCache,
    context: int,
    max_batch: int,
) -> None:
    log.info(
        "cpu engine: %s, %s on %s (linear layers: %s; vocabulary projection: %s;"
        " %.0f MiB of weights in memory%s), KV cache %s,"
        " context %d, max batch %d, torch threads %d",
        name,
        dtype,
        device,
        ", ".join(f"{n} {kind}" for kind, n in model.kinds().items()),
        weight_kind(model.lm_head if model.projection is None else model.projection),
        model.nbytes / 2**20,
        ", the embedding table mapped from its file" if model.embed_mapped else "",
        "int8" if cache.quantized else dtype,
        context,
        max_batch,
        torch.get_num_threads(),
    )


def _give_back_freed_memory() -> None:
    """Return the heap that loading freed to the OS (glibc's ``malloc_trim``).

    Reading, quantizing and packing the weights frees hundreds of MB of
    temporaries; glibc keeps much of it, as much as 140 MiB from one load to
    the next (measured: 470 and 613 MiB resident after two identical loads),
    and the process's RSS with it. Elsewhere than glibc this does nothing.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _load_model(
    model_dir: Path,
    config: llama.LlamaConfig,
    *,
    torch_dtype: torch.dtype,
    device: torch.device,
    weights: str,
    projection: str,
    cpu_kernels: str,
) -> tuple[Tokenizer, llama.LlamaWeights]:
    """:func:`load_parts`'s reading of the tokenizer and the weights."""
    if projection not in llama.PROJECTIONS:
        raise ConfigError(
            f"projection must be one of {list(llama.PROJECTIONS)!r}, got {projection!r}"
        )
    if cpu_kernels not in CPU_KERNELS:
        raise ConfigError(f"cpu_kernels must be one of {list(CPU_KERNELS)!r}, got {cpu_kernels!r}")
    tokenizer = Tokenizer.from_dir(model_dir)
    model = llama.LlamaWeights.load(
        model_dir,
        config,
        dtype=torch_dtype,
        device=device,
        weights=weights,
        projection=projection,
        cpu_kernels=cpu_kernels,
    )
    return tokenizer, model


def _checked_device(
    *,
    dtype: str,
    device: str,
    max_batch: int,
    threads: int | None,
    weights: str,
    prefix_cache_bytes: int,
    prefill_share: float,
    speculative: str,
    draft_tokens: int,
    kv_cache_dtype: str,
) -> torch.device:
    """:func:`load_parts`'s checks of its arguments; the torch device.
    Sets torch's thread count when ``threads`` is given."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)!r}, got {dtype!r}")
    if weights not in llama.WEIGHT_MODES:
        raise ConfigError(f"weights must be one of {list(llama.WEIGHT_MODES)!r}, got {weights!r}")
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
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)!r}, got {kv_cache_dtype!r}"
        )
    if not 0.0 < prefill_share <= 1.0:
        raise ConfigError(f"prefill_share must be > 0 and <= 1, got {prefill_share!r}")
    if speculative not in SPECULATIVE_MODES:
        raise ConfigError(
            f"speculative must be one of {list(SPECULATIVE_MODES)!r}, got {speculative!r}"
        )
    if draft_tokens < 1:
        raise ConfigError(f"draft_tokens must be >= 1, got {draft_tokens!r}")
    if prefix_cache_bytes < 0:
        raise ConfigError(f"prefix_cache_bytes must be >= 0, got {prefix_cache_bytes!r}")
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads!r}")
        torch.set_num_threads(threads)
    return torch_device
