"""Loading the CPU engine: the model found and read
(tokenizer and weights, in the form the options and the CPU allow: see
:meth:`~trioserve.engine.cpu.llama.LlamaWeights.load`), the KV cache, the
sampler's tables and the engine's facts made, and the load logged.
:meth:`CpuEngine.load <trioserve.engine.cpu.engine.CpuEngine.load>` builds
the engine from the :class:`LoadedParts`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import torch
from torch import Tensor

from trioserve.engine.base import EngineInfo
from trioserve.engine.cpu import contention, llama, native
from trioserve.engine.cpu.logprobs import TokenTexts
from trioserve.engine.cpu.options import CpuOptions
from trioserve.engine.cpu.prefix import PrefixCache
from trioserve.engine.cpu.quant import weight_kind
from trioserve.engine.cpu.step import StepSampler, XtcProtected
from trioserve.engine.grammars import Grammars, MaskRows
from trioserve.engine.heap import give_back_freed_memory
from trioserve.engine.models import DEFAULT_MODEL_NAME, default_model_dir
from trioserve.engine.progress import span
from trioserve.engine.tokenizer import Tokenizer
from trioserve.errors import ConfigError, EngineError
from trioserve.vocabulary.constraint import CONSTRAINT_KINDS

__all__ = ["PREFIX_BLOCK_TOKENS", "ROPE_START", "LoadedParts", "load_parts"]

log = logging.getLogger("trioserve.engine")

#: Positions the rope tables cover at load; they grow with the KV cache.
ROPE_START = 512
#: Tokens per prefix-cache block: a reused prefix is a multiple of this.
PREFIX_BLOCK_TOKENS = 64


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


def load_parts(model_dir: Path | None, options: CpuOptions) -> LoadedParts:
    """Load what :meth:`CpuEngine.load
    <trioserve.engine.cpu.engine.CpuEngine.load>` documents (the same
    arguments and errors)."""
    torch_device = _device(options)
    name = DEFAULT_MODEL_NAME
    if model_dir is None:
        model_dir = default_model_dir(offline=options.offline)
    else:
        model_dir = Path(model_dir)
        name = model_dir.name
    config = llama.LlamaConfig.from_dir(model_dir)
    limit = config.max_position_embeddings
    context_length, max_batch = options.context_length, options.max_batch
    if context_length is not None and context_length > limit:
        raise ConfigError(
            f"context_length must be in [2, {limit}] for this model, got {context_length!r}"
        )
    context = limit if context_length is None else context_length
    with contention.measure() as loading:
        with span(0.0, 0.05):
            tokenizer = Tokenizer.from_dir(model_dir)
        with span(0.05, 0.95):
            model = llama.LlamaWeights.load(model_dir, config, options)
    cache = _kv_cache(config, llama.DTYPES[options.dtype], torch_device, options.kv_cache_dtype)
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
        kernels=kernels_in_use(model, options),
        pausing=True,
    )
    _log_loaded(name, options.dtype, torch_device, model, cache, context, max_batch, info.kernels)
    for measured in loading if torch_device.type == "cpu" else []:
        hint = contention.advice(measured, torch.get_num_threads())
        if hint is not None:
            log.warning("%s", hint)
    give_back_freed_memory()
    texts = TokenTexts(tokenizer)
    return LoadedParts(
        tokenizer=tokenizer,
        config=config,
        weights=model,
        cache=cache,
        prefix_cache=PrefixCache(options.prefix_cache_bytes, PREFIX_BLOCK_TOKENS),
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


def kernels_in_use(model: llama.LlamaWeights, options: CpuOptions) -> str:
    """Which kernels the linear layers run on, for the log, ``info`` and
    ``/v1/models``: ``"native avx512"`` or ``"native avx2"`` (trioserve's, and
    the instruction-set path they run), else ``"torch (why)"``."""
    if any(kind.endswith(" native") for kind in model.kinds()):
        return f"native {native.path()}"
    if options.device != "cpu" or options.cpu_kernels == "torch":
        why = f"device {options.device}" if options.device != "cpu" else "cpu_kernels 'torch'"
    elif not any(kind in ("q4", "int8") for kind in model.kinds()):
        why = "the linear layers are not quantized"
    else:
        why = native.unavailable_reason() or "not chosen"
    return f"torch ({why})"


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
    kernels: str | None,
) -> None:
    log.info(
        "cpu engine: %s, %s on %s (linear layers: %s; vocabulary projection: %s;"
        " %.0f MiB of weights in memory%s), kernels: %s, KV cache %s,"
        " context %d, max batch %d, torch threads %d",
        name,
        dtype,
        device,
        ", ".join(f"{n} {kind}" for kind, n in model.kinds().items()),
        weight_kind(model.lm_head if model.projection is None else model.projection),
        model.nbytes / 2**20,
        ", the embedding table mapped from its file" if model.embed_mapped else "",
        kernels,
        "int8" if cache.quantized else dtype,
        context,
        max_batch,
        torch.get_num_threads(),
    )


def _device(options: CpuOptions) -> torch.device:
    """The torch device of ``options.device``, where this machine has it; sets
    torch's thread count when ``options.threads`` is given."""
    try:
        device = torch.device(options.device)
    except RuntimeError as exc:
        raise ConfigError(f"device {options.device!r} is not a torch device: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {options.device!r} was asked for but torch has no CUDA here")
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    return device
