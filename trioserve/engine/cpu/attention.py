"""One layer's attention for :func:`trioserve.engine.cpu.llama.forward`: torch's
``scaled_dot_product_attention`` over spans of rows that attend over one
bucketed length (the masks and buckets that keep it batch-invariant), or
trioserve's own kernel (:func:`trioserve.engine.cpu.native.attention`: rope, the
KV cache write and causal attention in one call, each row over exactly its
own positions)."""

from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import Protocol

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from trioserve.engine.cpu import native
from trioserve.engine.cpu.kvcache import KVCache
from trioserve.engine.cpu.quant import Linear, linear

logger = logging.getLogger(__name__)


# What this module reads of trioserve.engine.cpu.llama's classes (which import it).
class LlamaConfig(Protocol):
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class LayerWeights(Protocol):
    @property
    def wqkv(self) -> Linear: ...
    @property
    def wo(self) -> Linear: ...


class LlamaWeights(Protocol):
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def native_norm(self) -> bool: ...


__all__ = [
    "ATTENTION_BUCKET",
    "apply_rope",
    "attention",
    "native_attention",
    "native_attention_for",
    "prepare",
]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, C, heads, E]; cos, sin [B, C, heads or 1, E] from :func:`rope_tables`.
    The two halves of each head rotate as pairs (Hugging Face's layout):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). In float32, returned in x's dtype."""
    xf = x.float()
    swapped = xf.view(*xf.shape[:-1], 2, -1).flip(-2).view(xf.shape)  # (x2, x1)
    return torch.addcmul(xf * cos, swapped, sin).type_as(x)


@attrs.frozen
class _Piece:
    """Positions of a span's rows that one attention call serves, each as a
    batch entry of its G query rows (as a decode step's rows are)."""

    #: Columns of the pass's [B, C] positions (all of them in a decode step).
    cols: slice
    #: The keys attended over: the positions' common bucket end.
    length: int
    #: [entries, 1, G, length] in the model dtype: 0 where a query sees a
    #: key, -inf elsewhere (built once per forward, not by each layer).
    mask: Tensor


@attrs.frozen
class _Span:
    """Consecutive rows of a forward pass whose keys and values are read
    together: up to ``length``, in one or more pieces of their positions."""

    rows: slice
    #: The rows' first cache slot when their slots are consecutive (a view of
    #: the cache then serves them), else None and ``slots`` is gathered.
    first_slot: int | None
    slots: Tensor  # [n]
    length: int
    pieces: list[_Piece]
    #: Per layer, the keys and values [n, K, length, E] the rows attend to, as
    #: views of the cache (which see this pass's writes); None when the slots
    #: are not consecutive and each layer gathers them after its write.
    views: list[tuple[Tensor, Tensor]] | None


#: Every position attends over its own position rounded up to this, whatever
#: else runs beside it (see :func:`_spans`).
ATTENTION_BUCKET = 64


def _bucket_end(position: int, cache: KVCache) -> int:
    step = ATTENTION_BUCKET
    return min(-(-(position + 1) // step) * step, cache.length)


def _spans(
    positions: Tensor,
    slots: list[int],
    g: int,
    cache: KVCache,
    dtype: torch.dtype,
) -> list[_Span]:
    """Split the rows into spans, and a span's positions into the pieces one
    attention call each serves.

    Every position attends over its own position rounded up to
    :data:`ATTENTION_BUCKET` (masked beyond it), never over the batch's
    longest or its chunk's end, and goes to torch's kernel as a decode
    step's row does: a batch entry of its G query rows, beside entries of
    the same bucket (a prefill chunk's positions attend to one slot's keys,
    a view repeated per entry). So each query row is computed by the same
    code over the same keys at the same places, whether it runs alone or
    beside others, in a decode step or in a prefill chunk of any size, cold
    or resumed after a cached prefix. How torch's kernel sums depends on the
    length attended over and on how many query rows it blocks together:
    with MKL's AVX2 code, rows blocked by 256, by 32 or alone gave different
    bits, and a prompt resumed after a cached prefix changed its greedy text
    (where a chunk's positions were blocked together). So a job's greedy text
    does not depend on its companions, nor on whether its prefix came from
    the prefix cache (given matmul kernels whose rows do not depend on the
    other rows: checked at load, see :func:`~trioserve.engine.cpu.quant.packer`
    and :mod:`trioserve.engine.cpu.quant`)."""
    b, c = positions.shape
    if c > 1:
        # A prefill chunk (rows of their own slots): each row alone, its
        # positions in pieces.
        return [
            _span(slice(r, r + 1), [slots[r]], positions[r : r + 1], g, cache, dtype, shared=False)
            for r in range(b)
        ]
    ends = [_bucket_end(n, cache) for n in positions[:, 0].tolist()]
    # Rows that share a slot (a job's draft positions, see
    # trioserve.engine.cpu.speculative) are kept together in spans of their own,
    # each attending to a view of that one slot.
    counts = Counter(slots)
    keys = [(end, slot if counts[slot] > 1 else -1) for end, slot in zip(ends, slots, strict=True)]
    spans: list[_Span] = []
    r0 = 0
    for r1 in range(1, b + 1):
        if r1 < b and keys[r1] == keys[r0]:
            continue
        shared = keys[r0][1] >= 0
        spans.append(
            _span(slice(r0, r1), slots[r0:r1], positions[r0:r1], g, cache, dtype, shared=shared)
        )
        r0 = r1
    return spans


def _mask(positions: Tensor, length: int, g: int, dtype: torch.dtype) -> Tensor:
    """[P, 1, G, length]: for each of ``positions`` [P], 0 where its G query
    rows see a key (at or before the position), -inf elsewhere."""
    visible = torch.arange(length, device=positions.device) <= positions[:, None, None]
    bias = torch.zeros(visible.shape, dtype=dtype, device=positions.device).masked_fill_(
        ~visible, float("-inf")
    )  # [P, 1, T]
    return bias[:, None].expand(-1, g, 1, length).reshape(-1, 1, g, length)


def _span(
    rows: slice,
    run: list[int],
    positions: Tensor,
    g: int,
    cache: KVCache,
    dtype: torch.dtype,
    *,
    shared: bool,
) -> _Span:
    """The span of ``rows`` (slots ``run``, ``positions`` [n, C]): decode rows
    of one bucket (C = 1), or one row's prefill chunk cut into pieces."""
    device = positions.device
    n, c = positions.shape
    if c == 1:
        # Decode rows of one bucket: an entry each.
        end = _bucket_end(int(positions.amax()), cache)
        pieces = [_Piece(slice(0, 1), end, _mask(positions[:, 0], end, g, dtype))]
    else:
        # One row's prefill chunk: its positions of each bucket, an entry each.
        listed = positions[0].tolist()
        pieces = []
        c0 = 0
        for c1 in range(1, c + 1):
            end = _bucket_end(listed[c0], cache)
            if c1 == c or _bucket_end(listed[c1], cache) != end:
                end = max(_bucket_end(p, cache) for p in listed[c0:c1])
                pieces.append(_Piece(slice(c0, c1), end, _mask(positions[0, c0:c1], end, g, dtype)))
                c0 = c1
    length = max(piece.length for piece in pieces)
    consecutive = shared or run == list(range(run[0], run[0] + len(run)))
    views = None
    if shared and not cache.quantized:
        views = [
            (k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1))
            for k, v in cache.window(run[0], 1, length)
        ]
    elif consecutive and not shared and not cache.quantized:
        # Made once per pass instead of by every layer.
        views = cache.window(run[0], n, length)
    return _Span(
        rows=rows,
        # An 8-bit cache gathers a shared slot's rows by ``slots``.
        first_slot=run[0] if consecutive and not shared else None,
        slots=torch.tensor(run, device=device),
        length=length,
        pieces=pieces,
        views=views,
    )


def _span_rows(cache: KVCache, layer: int, span: _Span) -> tuple[Tensor, Tensor]:
    """The keys and values [n, K, span.length, E] of the span's slots in one layer."""
    if span.views is not None:
        return span.views[layer]
    # Gathered (or dequantized) after this layer's write.
    return cache.attended(layer, span.first_slot, span.slots, span.length)


@attrs.frozen
class _Step:
    """What every layer of one forward pass shares, computed once per pass."""

    spans: list[_Span]
    #: Rope tables for every head of the fused qkv output, [B, C, H + 2K, E]:
    #: the value heads get cos 1 and sin 0, so one rope call passes them through.
    cos: Tensor
    sin: Tensor
    #: Where each row's keys and values go in a layer's cache viewed as
    #: [S * 2K * T, E]: [B * C * 2K], in (row, position, head) order.
    write_index: Tensor
    #: (B, C): the pass runs B * C rows of hidden states, [B * C, D].
    rows: tuple[int, int]


def prepare(
    weights: LlamaWeights,
    config: LlamaConfig,
    cache: KVCache,
    rope: tuple[Tensor, Tensor],
    positions: Tensor,
    slots: Tensor,
) -> _Step:
    b, c = positions.shape
    h, k = config.n_heads, config.n_kv_heads
    spans = _spans(positions, slots.tolist(), h // k, cache, weights.dtype)
    cos, sin = (table[positions][:, :, None, :] for table in rope)  # [B, C, 1, E]
    shape = (b, c, k, config.head_dim)
    cos = torch.cat([cos.expand(b, c, h + k, -1), cos.new_ones(shape)], dim=2)
    sin = torch.cat([sin.expand(b, c, h + k, -1), sin.new_zeros(shape)], dim=2)
    heads = torch.arange(2 * k, device=positions.device)
    t = cache.length
    index = slots[:, None, None] * (2 * k * t) + heads * t + positions[:, :, None]
    return _Step(spans, cos, sin, index.reshape(-1), (b, c))


def attention(
    x: Tensor,
    layer: LayerWeights,
    config: LlamaConfig,
    layer_index: int,
    cache: KVCache,
    step: _Step,
) -> Tensor:
    b, c = step.rows  # x [B * C, D]
    h, k, e = config.n_heads, config.n_kv_heads, config.head_dim
    g = h // k
    qkv = linear(x, layer.wqkv).view(b, c, h + 2 * k, e)
    qkv = apply_rope(qkv, step.cos, step.sin)  # [B, C, H + 2K, E]
    # Write this step's keys and values at (slot, position) of every row.
    cache.write_rows(layer_index, step.write_index, qkv[:, :, h:].reshape(-1, e))
    if c == 1:
        # [B, 1, H, E] -> [B, K, G, E]: the G query heads of a KV head become rows.
        q = qkv[:, 0, :h].view(b, k, g, e)
        outs = []
        for span in step.spans:
            keys, values = _span_rows(cache, layer_index, span)
            (piece,) = span.pieces
            outs.append(
                F.scaled_dot_product_attention(
                    q if len(step.spans) == 1 else q[span.rows], keys, values, attn_mask=piece.mask
                )
            )
        out = (outs[0] if len(outs) == 1 else torch.cat(outs)).view(b, h * e)
        return linear(out, layer.wo)
    # A prefill chunk (one row): each piece's positions as entries of their G
    # query rows, [C', H, E] -> [C', K, G, E], over the row's keys repeated.
    out = qkv.new_empty(b, c, h, e)
    for span in step.spans:
        keys, values = _span_rows(cache, layer_index, span)  # [1, K, length, E]
        r = span.rows.start
        for piece in span.pieces:
            entries = piece.cols.stop - piece.cols.start
            attended = F.scaled_dot_product_attention(
                qkv[r, piece.cols, :h].view(entries, k, g, e),
                keys[:, :, : piece.length].expand(entries, -1, -1, -1),
                values[:, :, : piece.length].expand(entries, -1, -1, -1),
                attn_mask=piece.mask,
            )
            out[r, piece.cols] = attended.view(entries, h, e)
    out = out.view(b * c, h * e)
    return linear(out, layer.wo)


def native_attention_for(weights: LlamaWeights, config: LlamaConfig, cache: KVCache) -> bool:
    """Whether :func:`forward` runs attention on trioserve's kernel: with the
    native kernels, a bfloat16 (not 8-bit) cache, heads of a multiple of 32
    and at most :func:`trioserve.engine.cpu.native.max_group_heads` query
    heads per KV head (a model with more says so in the log, once)."""
    if not (
        weights.native_norm
        and not cache.quantized
        and cache.dtype == torch.bfloat16
        and config.head_dim % 32 == 0
        and config.n_heads % config.n_kv_heads == 0
    ):
        return False
    group, limit = config.n_heads // config.n_kv_heads, native.max_group_heads()
    if group > limit:
        _say_over_the_group_limit(group, limit)
        return False
    return True


@functools.cache
def _say_over_the_group_limit(group: int, limit: int) -> None:
    logger.warning(
        "attention runs on torch, not trioserve's kernel: this model has %d query heads per "
        "KV head, the kernel at most %d",
        group,
        limit,
    )


def native_attention(
    x: Tensor,
    layer: LayerWeights,
    config: LlamaConfig,
    cache: KVCache,
    layer_index: int,
    rope: tuple[Tensor, Tensor],
    rows: tuple[Tensor, Tensor],
) -> Tensor:
    """:func:`attention` on trioserve's kernel (:func:`trioserve.engine.cpu.native.attention`):
    rope, the cache write and causal attention in one call; ``rows`` are each
    row's (slot, position) [B * C] int64."""
    qkv = linear(x, layer.wqkv)
    cache_layer = cache.layer_views[layer_index][0]
    out = native.attention(qkv, rope, cache_layer, *rows, config.n_heads, config.n_kv_heads)
    return linear(out, layer.wo)
