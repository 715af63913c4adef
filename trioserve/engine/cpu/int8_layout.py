"""The 8-bit matmul's weights (trioserve's kernel, kernels_arith.h): their
layout, and the bound on what the kernel's 16-bit activations add to a
result.

The kernel reads the weights in blocks of 16 outputs: in a block, for each
pair of inputs (k, k + 1) in turn, 32 bytes, output j's q[k] and q[k + 1]
at bytes 2j and 2j + 1; so one load and one multiply-add of pairs serve 16
outputs and two inputs, and no output is summed across lanes.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["input_error", "pack_int8", "row_sums", "unpack_int8"]

#: Outputs of one block of the layout.
BLOCK = 16
#: Inputs whose integer sums the kernel converts to float32 at once (I8_CHUNK).
CHUNK = 512
#: Rows packed at a time (a multiple of BLOCK): no full padded copy at load.
_PACK_ROWS = 4096


def pack_int8(q: Tensor) -> Tensor:
    """q [N, K] int8 (K even) -> the kernel's layout, [ceil(N / 16), K / 2, 32]
    int8, the last block padded with zero rows; packed a few thousand rows at
    a time, so that the only full-size tensors are ``q`` and the result."""
    n, k = q.shape
    if q.dtype != torch.int8 or n < 1 or k < 2 or k % 2:
        raise ValueError(f"pack_int8: q must be [N, K] int8 with K even, got {q.dtype} {q.shape}")
    blocks = -(-n // BLOCK)
    out = torch.empty(blocks, k // 2, 2 * BLOCK, dtype=torch.int8)
    for start in range(0, n, _PACK_ROWS):
        part = q[start : start + _PACK_ROWS]
        rows = -(-part.shape[0] // BLOCK) * BLOCK
        if rows != part.shape[0]:
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], k)])
        first = start // BLOCK
        blocked = part.view(rows // BLOCK, BLOCK, k // 2, 2).transpose(1, 2)
        out[first : first + rows // BLOCK] = blocked.reshape(rows // BLOCK, k // 2, 2 * BLOCK)
    return out


def unpack_int8(data: Tensor, n: int) -> Tensor:
    """:func:`pack_int8`'s data -> q [N, K] int8."""
    blocks, pairs, _ = data.shape
    q = data.view(blocks, pairs, BLOCK, 2).transpose(1, 2)
    return q.reshape(blocks * BLOCK, pairs * 2)[:n]


def row_sums(data: Tensor, n: int) -> Tensor:
    """sum(|q|) of each of the N outputs of :func:`pack_int8`'s data, [N]
    int64, a few blocks at a time (no int64 copy of the whole)."""
    out = torch.empty(data.shape[0] * BLOCK, dtype=torch.int64)
    step = _PACK_ROWS // BLOCK
    for first in range(0, data.shape[0], step):
        part = data[first : first + step].to(torch.int64).abs_()  # [b, K / 2, 32]
        sums = part.view(part.shape[0], part.shape[1], BLOCK, 2).sum(dim=(1, 3))
        out[first * BLOCK : first * BLOCK + sums.numel()] = sums.reshape(-1)
    return out[:n]


def input_error(k: int) -> float:
    """A bound on what the kernel adds to a result of K inputs by writing its
    row in 16 bits and by its float32 roundings, per unit of the row's
    largest magnitude times the output's ``scale * sum(|q|)`` (B below).

    Each input is within half a step of 1 / 32767 of B's share (plus the
    two float32 roundings before it is rounded to an integer: 2^-24 of it
    each); then float32 roundings of at most B each: the conversion of each
    chunk's integer sum, the additions of the K / 512 chunks one after
    another, and the three products that scale the sum. So half a step, and
    ``(K / 512 + 8) * 2^-24`` of B with room to spare (a second-order term
    of the same roundings is far below that room)."""
    return 0.5 / 32767 + (k / CHUNK + 8) * 2.0**-24
