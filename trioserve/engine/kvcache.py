"""The CPU engine's KV cache: keys and values of every slot, grown and shrunk in
blocks as the running jobs need.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

__all__ = ["KVCache"]


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
    #: Per layer: its cache [S, 2K, T, E] and the same as [S * 2K * T, E] rows
    #: (made once per allocation, not by every layer of every step).
    layer_views: list[tuple[Tensor, Tensor]] = attrs.field(init=False)
    _slots: int = 0
    _length: int = 0

    def __attrs_post_init__(self) -> None:
        self.release()

    def _empty(self, slots: int, length: int) -> Tensor:
        shape = (slots, 2 * self.n_kv_heads, length, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _view(self, layer: Tensor) -> tuple[Tensor, Tensor]:
        return layer, layer.view(-1, self.head_dim)

    @property
    def kv(self) -> Tensor:
        """Keys and values of every layer, [L, S, 2K, T, E]: a copy (for
        inspection; the model reads :attr:`layer_views`)."""
        return torch.stack([layer for layer, _ in self.layer_views])

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
        ``first`` to ``first + n`` (they see later writes)."""
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
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * element

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
        """A copy of positions [start, end) of ``slot``: [L, 2K, end - start, E]."""
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
