"""The CPU engine's KV cache: keys and values of every slot, grown and shrunk in
blocks as the running jobs need, in the model's dtype or in 8 bits.

An 8-bit cache (``KVCache(..., quantized=True)``, ``--kv-cache-dtype int8``)
stores each head's key or value vector of a position as E int8 values with
one bfloat16 scale, its bytes packed after the values in the same int8 row: a
position of a head is one row of ``E + 2`` bytes, so that writing a step,
moving a slot, growing and the prefix cache's blocks handle one tensor, as in
the float cache. (llama.cpp's ``q8_0`` scales blocks of 32 values: one scale
per head vector dequantizes in one plain broadcast, twice as fast here, for
the same perplexity; see docs/performance.md.) Attention reads the rows it
needs dequantized to the model's dtype, after the layer's write: every
position is read back through the same rounding whether it was written by a
decode step, a prefill chunk or the prefix cache, so the engine's exactness
(batch invariance, prefix cache identity) holds in 8 bits too.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from trioserve.engine.cpu.options import KV_CACHE_DTYPES

__all__ = ["KV_CACHE_DTYPES", "KVCache", "dequantize", "quantize"]


def quantize(x: Tensor) -> Tensor:
    """x [N, E] -> int8 [N, E + 2]: each row rounded to the nearest multiple
    of its scale (its largest magnitude / 127, a bfloat16), then the scale's
    two bytes."""
    amax = x.abs().amax(-1, keepdim=True).float()  # [N, 1]
    # An all-zero row gets a tiny scale instead of 0: its values stay 0.
    scale = amax.clamp_min_(2.0**-100).mul_(1 / 127).to(torch.bfloat16)
    q = (x.float() / scale.float()).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=1)


def dequantize(rows: Tensor, head_dim: int, dtype: torch.dtype) -> Tensor:
    """int8 rows [..., E + 2] from :func:`quantize` -> [..., E] in ``dtype``:
    one elementwise pass, the int8 values times their row's scale."""
    out = rows[..., :head_dim] * rows[..., head_dim:].view(torch.bfloat16)  # -> bfloat16
    return out if dtype == torch.bfloat16 else out.to(dtype)


@attrs.define(eq=False)
class KVCache:
    """Keys and values of every slot, grown in blocks as sequences grow.

    One tensor per layer, [S, 2K, T, E]: the K key heads, then the K value
    heads, of each slot, so that one indexed copy per layer writes a step's
    keys and values. Nothing is reserved up front: the cache holds ``slots x
    length`` positions where both are the current needs rounded up (length to
    ``block``), so 8 short jobs cost 8 short rows, not 8 full contexts.

    Growing copies the old contents into new tensors one layer at a time, so
    that the old and the new cache are never held whole together: the
    transient is one layer's old tensor (1/L of the cache), not the whole
    cache (8 jobs growing from 768 to 1,024 positions held 141 MB more at
    that moment).
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    block: int = 256
    #: Store 8 bits per value (see the module docstring) instead of ``dtype``.
    quantized: bool = False
    #: Per layer: its cache [S, 2K, T, E] and the same as [S * 2K * T, E] rows
    #: (made once per allocation, not by every layer of every step).
    layer_views: list[tuple[Tensor, Tensor]] = attrs.field(init=False)
    _slots: int = 0
    _length: int = 0

    def __attrs_post_init__(self) -> None:
        self.release()

    @property
    def row(self) -> int:
        """Elements a head's vector of one position takes: E, or in 8 bits E
        values and the scale's two bytes."""
        return self.head_dim + 2 if self.quantized else self.head_dim

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.int8 if self.quantized else self.dtype

    def _empty(self, slots: int, length: int) -> Tensor:
        shape = (slots, 2 * self.n_kv_heads, length, self.row)
        return torch.zeros(shape, dtype=self.storage_dtype, device=self.device)

    def _view(self, layer: Tensor) -> tuple[Tensor, Tensor]:
        return layer, layer.view(-1, self.row)

    @property
    def kv(self) -> Tensor:
        """Keys and values of every layer, [L, S, 2K, T, E], in ``dtype``
        (dequantized from 8 bits): a copy, for inspection."""
        return torch.stack([self._values(layer) for layer, _ in self.layer_views])

    def _values(self, rows: Tensor) -> Tensor:
        return dequantize(rows, self.head_dim, self.dtype) if self.quantized else rows

    def write_rows(self, layer: int, index: Tensor, rows: Tensor) -> None:
        """Put a step's keys and values ``rows`` [N, E] (model dtype) at rows
        ``index`` [N] of the layer's cache viewed as [S * 2K * T, row]."""
        if self.quantized:
            rows = quantize(rows)
        self.layer_views[layer][1].index_copy_(0, index, rows)

    def attended(
        self, layer: int, first: int | None, slots: Tensor, length: int
    ) -> tuple[Tensor, Tensor]:
        """The keys and values [n, K, length, E] (model dtype) of consecutive
        slots from ``first`` (a view of a float cache), or else of ``slots``
        (gathered); read after the layer's write."""
        cache = self.layer_views[layer][0]
        if first is not None:
            rows = cache[first : first + slots.numel(), :, :length]
        else:
            rows = cache[slots, :, :length]
        rows = self._values(rows)
        return rows[:, : self.n_kv_heads], rows[:, self.n_kv_heads :]

    @property
    def k(self) -> Tensor:
        """Keys, [L, S, K, T, E] (a copy)."""
        return self.kv[:, :, : self.n_kv_heads]

    @property
    def v(self) -> Tensor:
        """Values, [L, S, K, T, E] (a copy)."""
        return self.kv[:, :, self.n_kv_heads :]

    def window(self, first: int, n: int, length: int) -> list[tuple[Tensor, Tensor]]:
        """Per layer, views of the keys and values [n, K, length, E] of slots
        ``first`` to ``first + n`` (they see later writes). Float caches only:
        an 8-bit one is read with :meth:`attended` after each write."""
        k = self.n_kv_heads
        out = []
        for layer, _ in self.layer_views:
            rows = layer[first : first + n, :, :length]
            out.append((rows[:, :k], rows[:, k:]))
        return out

    @property
    def slots(self) -> int:
        return self._slots

    @property
    def length(self) -> int:
        return self._length

    @property
    def bytes_per_position(self) -> int:
        element = torch.empty((), dtype=self.storage_dtype).element_size()
        return 2 * self.n_layers * self.n_kv_heads * self.row * element

    def fit(self, slots: int, length: int) -> None:
        """Make room for ``slots`` slots of ``length`` positions; give memory back
        when the needs fell to half of what is held. Slots keep their contents."""
        want_len = -(-length // self.block) * self.block if length else 0
        grow = slots > self.slots or want_len > self.length
        shrink = self.slots > 2 * slots or self.length > 2 * max(want_len, self.block)
        if not (grow or shrink):
            return
        new_slots = slots if shrink and slots < self.slots else max(slots, self.slots)
        new_len = want_len if shrink and want_len < self.length else max(want_len, self.length)
        keep_s, keep_t = min(new_slots, self.slots), min(new_len, self.length)
        for i, (old, _) in enumerate(self.layer_views):
            new = self._empty(new_slots, new_len)
            if keep_s and keep_t:
                new[:keep_s, :, :keep_t] = old[:keep_s, :, :keep_t]
            # The old layer is freed here, before the next one is allocated.
            self.layer_views[i] = self._view(new)
            del old
        self._slots, self._length = new_slots, new_len

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src`` into slot ``dst`` (to keep the used slots packed)."""
        for layer, _ in self.layer_views:
            layer[dst] = layer[src]

    def read(self, slot: int, start: int, end: int) -> Tensor:
        """A copy of positions [start, end) of ``slot`` as stored: [L, 2K, end -
        start, row] (8-bit rows stay 8-bit: the prefix cache keeps them so)."""
        return torch.stack([layer[slot, :, start:end] for layer, _ in self.layer_views])

    def write(self, slot: int, start: int, data: Tensor) -> None:
        """Put ``data`` [L, 2K, n, E] (from :meth:`read`) at positions [start, start + n)."""
        for (layer, _), part in zip(self.layer_views, data, strict=True):
            layer[slot, :, start : start + part.shape[1]] = part

    def release(self) -> None:
        self.layer_views = [self._view(self._empty(0, 0)) for _ in range(self.n_layers)]
        self._slots = self._length = 0

    @property
    def nbytes(self) -> int:
        return sum(int(layer.numel() * layer.element_size()) for layer, _ in self.layer_views)

    def bytes_for(self, slots: int, length: int) -> int:
        """Bytes the cache would hold with ``slots`` slots of ``length``
        positions (rounded up to blocks, as it grows): its size with the
        engine's ``max_batch`` full contexts is its capacity."""
        length = -(-length // self.block) * self.block
        element = torch.empty((), dtype=self.storage_dtype).element_size()
        return self.n_layers * slots * 2 * self.n_kv_heads * length * self.row * element
