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

    One tensor [L, S, 2K, T, E]: the K key heads, then the K value heads, of
    each layer and slot, so that one indexed copy per layer writes a step's
    keys and values. Nothing is reserved up front: the cache holds ``slots x
    length`` positions where both are the current needs rounded up (length to
    ``block``), so 8 short jobs cost 8 short rows, not 8 full contexts.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    block: int = 256
    kv: Tensor = attrs.field(init=False)  # [L, S, 2K, T, E]
    #: Per layer: its cache [S, 2K, T, E] and the same as [S * 2K * T, E] rows
    #: (made once per allocation, not by every layer of every step).
    layer_views: list[tuple[Tensor, Tensor]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._set(self._empty(0, 0))

    def _set(self, kv: Tensor) -> None:
        self.kv = kv
        self.layer_views = [(layer, layer.view(-1, self.head_dim)) for layer in kv]

    def _empty(self, slots: int, length: int) -> Tensor:
        shape = (self.n_layers, slots, 2 * self.n_kv_heads, length, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def k(self) -> Tensor:
        """Keys, [L, S, K, T, E] (a view)."""
        return self.kv[:, :, : self.n_kv_heads]

    @property
    def v(self) -> Tensor:
        """Values, [L, S, K, T, E] (a view)."""
        return self.kv[:, :, self.n_kv_heads :]

    @property
    def slots(self) -> int:
        return int(self.kv.shape[1])

    @property
    def length(self) -> int:
        return int(self.kv.shape[3])

    @property
    def bytes_per_position(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.kv.element_size()

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
        old = self.kv
        self._set(self._empty(0, 0))
        new = self._empty(new_slots, new_len)
        if keep_s and keep_t:
            new[:, :keep_s, :, :keep_t] = old[:, :keep_s, :, :keep_t]
        del old
        self._set(new)

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src`` into slot ``dst`` (to keep the used slots packed)."""
        self.kv[:, dst] = self.kv[:, src]

    def read(self, slot: int, start: int, end: int) -> Tensor:
        """A copy of positions [start, end) of ``slot``: [L, 2K, end - start, E]."""
        return self.kv[:, slot, :, start:end].clone()

    def write(self, slot: int, start: int, data: Tensor) -> None:
        """Put ``data`` [L, 2K, n, E] (from :meth:`read`) at positions [start, start + n)."""
        self.kv[:, slot, :, start : start + data.shape[2]] = data

    def release(self) -> None:
        self._set(self._empty(0, 0))

    @property
    def nbytes(self) -> int:
        return int(self.kv.numel() * self.kv.element_size())
