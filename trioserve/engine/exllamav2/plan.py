"""How the ExLlamaV2 engine is built: its options checked against the model, and
the attention mode chosen.

ExLlamaV2's dynamic generator asserts rather than explains, and one of its
attention paths prefills without a causal mask; :func:`plan_load` and
:func:`configure_attention` settle, before anything is loaded, what
:meth:`~trioserve.engine.exllamav2.engine.ExLlamaV2Engine.load` builds. Pure: the
``ExLlamaV2Config`` is taken duck-typed, and ``exllamav2`` is never imported
here (only :mod:`trioserve.engine.exllamav2.engine` imports it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final, Literal, TypeAlias

import attrs

from trioserve.errors import ConfigError

__all__ = [
    "CACHE_TYPES",
    "MAX_ATTENTION_SIZE",
    "PAGE_SIZE",
    "CacheType",
    "LoadPlan",
    "configure_attention",
    "plan_load",
    "unpaged_chunk_size",
]

#: The dynamic generator's page size in tokens (``PAGED_PAGE_SIZE`` in
#: exllamav2/generator/dynamic.py). The cache, and in paged mode the prefill
#: chunk, must be multiples of it.
PAGE_SIZE: Final = 256

CacheType: TypeAlias = Literal["fp16", "q4", "q6", "q8"]
#: Cache element types, each an ExLlamaV2 cache class. The FP8 cache
#: (``ExLlamaV2Cache_8bit``) is left out: the dynamic generator rejects it.
CACHE_TYPES: Final[tuple[CacheType, ...]] = ("fp16", "q4", "q6", "q8")


@attrs.frozen
class LoadPlan:
    """The validated numbers an engine is built with."""

    cache_type: CacheType
    #: Tokens the cache holds for all jobs together; a multiple of PAGE_SIZE.
    cache_tokens: int
    #: Tokens one job may hold (prompt plus generated).
    context_length: int
    #: Prompt tokens prefilled per job and step: a multiple of PAGE_SIZE in
    #: paged mode; unpaged, bounded by the matmul attention's size
    #: (:func:`unpaged_chunk_size`).
    max_chunk_size: int
    #: Jobs running at once: 1 without paged attention.
    max_batch: int
    paged: bool
    gpu_split: tuple[float, ...] | None
    tensor_parallel: bool


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


#: ExLlamaV2's default ``config.max_attention_size`` (exllamav2/config.py):
#: the attention-weight elements per head that its own ``model.forward``
#: keeps each chunk's ``(past + chunk) x chunk`` under when attention is not
#: flash-attn's or xformers'.
MAX_ATTENTION_SIZE: Final = 2048**2


def unpaged_chunk_size(context_length: int, max_attention_size: int = MAX_ATTENTION_SIZE) -> int:
    """The largest prefill chunk whose matmul attention stays within
    ``max_attention_size`` weights per head at any position of the context.

    Unpaged, attention runs as ``softmax(q @ k.T + mask) @ v`` in torch
    (``ExLlamaV2Attention._attn_torch``, matmul branch: see
    :func:`configure_attention`): a chunk of C tokens at the end of a
    context of T makes ``C x T x heads`` float16 weights, twice over at the
    mask's addition and the softmax. The dynamic generator calls
    ``forward_chunk``, which unlike ``model.forward`` does not shrink a chunk
    for that, so the chunk is sized here: ``C x T <= max_attention_size``, the
    bound ExLlamaV2's ``model.forward`` keeps, and no more than the
    ``max_input_len ** 2`` per head its ``load_autosplit`` measured with a
    real forward pass when it placed the model. That is
    ``max_attention_size x heads x 2`` bytes per copy (72 MiB for
    SmolLM2-135M's 9 heads, 256 MiB for Llama-3-8B's 32), and C is 512 at
    T = 8192, 2048 up to T = 2048.

    A multiple of PAGE_SIZE when it is at least that; smaller only for
    contexts past 16384 tokens (unpaged, the generator asks nothing of the
    chunk but ``<= max_input_len``, dynamic.py).
    """
    chunk = max(1, max_attention_size // max(1, context_length))
    return chunk - chunk % PAGE_SIZE if chunk >= PAGE_SIZE else chunk


def configure_attention(config: Any, *, flash_attn_paged: bool) -> bool:
    """Choose the generator's mode for the ``ExLlamaV2Config`` ``config`` and
    set its attention switches; returns whether the generator is paged.

    Call it after ``config.arch_compat_overrides()`` and before the model is
    built and loaded. ``flash_attn_paged`` is ``exllamav2.attn``'s
    ``has_flash_attn_with_paged`` (flash-attn >= 2.5.7 imported).

    Paged (batched) when flash-attn >= 2.5.7 is importable and the
    architecture allows flash-attn: the generator's paged attention is
    flash-attn's, always causal. Otherwise unpaged, and ``config.no_sdpa`` is
    set: unpaged attention without flash-attn or xformers is
    ``ExLlamaV2Attention._attn_torch``, whose SDPA branch in ExLlamaV2 0.3.2
    (exllamav2/attn.py, line 889 at tag v0.3.2, unchanged on master) reads
    ``if self.layer_idx in attn_params.block_diag_layers or causal:
    attn_mask_lr = attn_params.get_block_diag_mask(...)``. For a text model
    ``cu_seqlens`` is None, so that mask is None, and
    ``F.scaled_dot_product_attention`` runs unmasked (``is_causal`` False):
    every prefill chunk of more than one token attends to its future tokens,
    and the keys and values of every later layer go wrong in the cache
    (decoding one token at a time is unaffected). The matmul branch, which
    ``no_sdpa`` selects, adds ``Params.get_attn_mask``, the causal mask. Set
    before loading, so that ``load_autosplit``'s trial forward pass measures
    the matmul branch's memory. Harmless where flash-attn (< 2.5.7) or
    xformers is there: ExLlamaV2 takes those first for causal attention.
    """
    paged = bool(flash_attn_paged) and not config.no_flash_attn
    if not paged:
        config.no_sdpa = True
    return paged


def plan_load(
    model_context: int,
    *,
    paged: bool,
    cache_type: str = "fp16",
    cache_size: int | None = None,
    max_batch: int = 32,
    context_length: int | None = None,
    gpu_split: Sequence[float] | None = None,
    tensor_parallel: bool = False,
    max_chunk_size: int = 2048,
    flash_attn: bool | None = None,
    max_attention_size: int = MAX_ATTENTION_SIZE,
) -> LoadPlan:
    """Check the engine options against the model's context length
    ``model_context`` (its config.json) and settle the derived numbers.

    The dynamic generator asserts rather than explains (dynamic.py checks the
    cache size and chunk size with ``assert``), so every option it would
    reject is rejected here first, with a message that says what is allowed.

    ``flash_attn`` says whether ExLlamaV2 can use flash-attn at all (any
    version it accepts; default: as ``paged``). Unpaged, the prefill chunk is
    also bounded by the matmul attention's size (:func:`unpaged_chunk_size`,
    with the config's ``max_attention_size``).

    Raises:
        ConfigError: an option is out of range or options conflict.
    """
    if cache_type not in CACHE_TYPES:
        raise ConfigError(f"cache_type must be one of {', '.join(CACHE_TYPES)}, not {cache_type!r}")
    if max_batch < 1:
        raise ConfigError(f"max_batch must be at least 1, not {max_batch!r}")
    if model_context < PAGE_SIZE:
        raise ConfigError(
            f"the model's context length must be at least {PAGE_SIZE} for ExLlamaV2's "
            f"dynamic generator, not {model_context!r}"
        )
    if context_length is None:
        context = model_context
    elif not PAGE_SIZE <= context_length <= model_context:
        # Longer than the model's own length would run RoPE past what it was
        # trained on; ExLlamaV2 sizes its tables to config.max_seq_len.
        raise ConfigError(
            f"context_length must be between {PAGE_SIZE} and the model's {model_context}, "
            f"not {context_length!r}"
        )
    else:
        context = context_length
    min_cache = _round_up(context, PAGE_SIZE)
    if cache_size is None:
        cache_tokens = min_cache
    elif cache_size % PAGE_SIZE != 0 or cache_size < min_cache:
        raise ConfigError(
            f"cache_size must be a multiple of {PAGE_SIZE} and at least the context length "
            f"rounded up ({min_cache}), not {cache_size!r}"
        )
    else:
        cache_tokens = cache_size
    if max_chunk_size < PAGE_SIZE or max_chunk_size % PAGE_SIZE != 0:
        raise ConfigError(
            f"max_chunk_size must be a positive multiple of {PAGE_SIZE}, not {max_chunk_size!r}"
        )
    # The model's forward pass takes at most config.max_input_len (2048, capped
    # at max_seq_len) tokens; the chunk must fit in it and stay page-aligned.
    chunk = min(max_chunk_size, (min(2048, context) // PAGE_SIZE) * PAGE_SIZE)
    if not paged:
        chunk = min(chunk, unpaged_chunk_size(context, max_attention_size))
    # The generator's batch times max_q_size (8) must fit in max_input_len
    # (dynamic.py, ExLlamaV2DynamicGenerator.__init__).
    batch_limit = min(2048, context) // 8
    if paged and max_batch > batch_limit:
        raise ConfigError(
            f"max_batch must be at most {batch_limit} for a context length of {context}, "
            f"not {max_batch!r}"
        )
    if tensor_parallel and not (paged if flash_attn is None else flash_attn):
        # Without flash-attn, ExLlamaV2's tensor-parallel attention
        # (attn.py, forward_tp_old) asserts that torch SDPA is allowed and
        # then runs _attn_torch's SDPA branch, which at 0.3.2 prefills
        # without a causal mask (see configure_attention); no_sdpa, the cure
        # elsewhere, fails that assertion.
        raise ConfigError(
            "tensor_parallel needs flash-attn here: without it ExLlamaV2 0.3.2's "
            "tensor-parallel attention prefills without a causal mask"
        )
    split: tuple[float, ...] | None = None
    if gpu_split is not None:
        split = tuple(float(x) for x in gpu_split)
        if not split or any(not math.isfinite(x) or x <= 0 for x in split):
            raise ConfigError(f"gpu_split must be positive GiB per GPU, not {list(gpu_split)!r}")
    return LoadPlan(
        cache_type=cache_type,  # narrowed by the check against CACHE_TYPES
        cache_tokens=cache_tokens,
        context_length=context,
        max_chunk_size=chunk,
        max_batch=max_batch if paged else 1,
        paged=paged,
        gpu_split=split,
        tensor_parallel=tensor_parallel,
    )
