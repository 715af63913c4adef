"""Linear-layer weights in the forms torch's CPU kernels run fastest: quantized
(4-bit groups, or 8 bits per output row) or bfloat16 in oneDNN's packed layout.

:func:`linear` multiplies by any of them. Each form is used only where a
probe finds its kernel present, right, and batch-invariant: a row's result
must not depend on the other rows of the batch, so that a job's greedy text
does not depend on its companions nor on the prefix cache (see
:func:`trioserve.engine.cpu.llama.forward`). Where a probe fails, a weight stays
in (or goes back to) plain bfloat16, or
:meth:`~trioserve.engine.cpu.llama.LlamaWeights.load` says why it cannot give the
form asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeAlias

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from trioserve.engine.cpu import native
from trioserve.engine.cpu.int8_layout import pack_int8, unpack_int8
from trioserve.errors import ModelError

__all__ = [
    "Q4_FILE",
    "Q4_GROUP",
    "Linear",
    "QuantizedWeight",
    "dequantize",
    "int8_available",
    "int8_weight",
    "linear",
    "packer",
    "q4_available",
    "q4_parts",
    "q4_weight",
    "quantize_q4",
    "use_native",
    "weight_kind",
]


@attrs.frozen(eq=False)
class QuantizedWeight:
    """A linear layer's weight [N, K] for one of torch's weight-only quantized
    CPU kernels (bfloat16 activations, float32 accumulation, bfloat16 output).

    ``"q4"``: 4-bit groups of ``group_size`` consecutive inputs, for
    ``_weight_int4pack_mm_for_cpu``; ``data`` is in the layout of
    ``_convert_weight_to_int4pack_for_cpu``, ``scales`` is [K / group, N, 2]
    bfloat16 (scale, zero) and a weight is ``(q - 8) * scale + zero`` for its
    4-bit ``q`` in [0, 15]: a GGUF Q4_1 group (``d * q + m``) is scale ``d``
    and zero ``m + 8 d``. ``"int8"``: one scale per output row, for
    ``_weight_int8pack_mm``; ``data`` [N, K] int8, ``scales`` [N] bfloat16.

    ``native``: for trioserve's own kernels (:mod:`trioserve.engine.cpu.native`)
    instead. ``"q4"``: the same 4-bit groups (GGUF's Q4_1: ``d * q + m``), the
    activations quantized to 8 bits per group of 32 and integers dotted, as
    llama.cpp does; ``data`` [N, K / 2] uint8 and ``scales`` [2, N, K / 32]
    float16 (d, m) in :func:`trioserve.engine.cpu.native.pack`'s layout.
    ``"int8"``: ``data`` in :func:`trioserve.engine.cpu.int8_layout.pack_int8`'s
    blocks of 16 rows, ``scales`` as torch's; the activations written in 16
    bits per row and integers dotted.
    """

    kind: Literal["q4", "int8"]
    data: Tensor
    scales: Tensor
    out_features: int
    in_features: int
    group_size: int = 0
    native: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.data.numel() * self.data.element_size()) + int(
            self.scales.numel() * self.scales.element_size()
        )


#: A linear layer's weight: a plain or oneDNN-packed tensor, or quantized.
Linear: TypeAlias = Tensor | QuantizedWeight

#: Inputs per 4-bit group (the GGUF's Q4_1 blocks, and what quantizing at
#: load uses).
Q4_GROUP = 32
#: The 4-bit file of a converted directory (trioserve.engine.models writes it).
Q4_FILE = "trioserve/q4_1.safetensors"


def linear(x: Tensor, w: Linear) -> Tensor:
    """x [..., in] @ w[out, in].T, for plain, packed (:func:`packer`) or
    quantized weights.

    With plain weights a single row goes through ``torch.mv``: on CPUs its
    bfloat16 kernel streams the weight about twice as fast as the
    matrix-matrix path does for one row, and decoding one job is exactly that.
    """
    if isinstance(w, QuantizedWeight):
        rows = x if x.dim() == 2 else x.reshape(-1, w.in_features)
        if w.native:
            if w.kind == "q4":
                out: Tensor = native.q4_mm(rows, w.data, w.scales, w.out_features)
            else:
                out = native.int8_mm(rows, w.data, w.scales)
        elif w.kind == "q4":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, w.data, w.group_size, w.scales)
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows, w.data, w.scales)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], w.out_features)
    if w.is_mkldnn:
        return _mkldnn_linear(x.contiguous(), w)
    if x.numel() == x.shape[-1]:
        return torch.mv(w, x.reshape(-1)).view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w)


def weight_kind(w: Linear) -> str:
    """How ``w`` is held: ``"q4"``, ``"int8"`` (``"q4 native"``, ``"int8 native"``
    for trioserve's kernels), or its dtype (``"bfloat16 packed"``)."""
    if isinstance(w, QuantizedWeight):
        return f"{w.kind} native" if w.native else w.kind
    return f"{str(w.dtype).removeprefix('torch.')}{' packed' if w.is_mkldnn else ''}"


# --- quantized weights --------------------------------------------------------


def q4_parts(handle: Any, name: str, path: Path) -> tuple[Tensor, Tensor, Tensor]:
    """The 4-bit file's (q [N, K] uint8 in [0, 15], d, m [N, K / group] float32) of ``name``."""
    try:
        packed = handle.get_tensor(name + ".qweight")
        d = handle.get_tensor(name + ".scales").float()
        m = handle.get_tensor(name + ".mins").float()
    except Exception as exc:  # safetensors raises its own error types
        raise ModelError(f"4-bit tensor {name!r} is missing from {str(path / Q4_FILE)!r}") from exc
    q = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    if q.shape[1] != d.shape[1] * Q4_GROUP or d.shape != m.shape:
        raise ModelError(f"4-bit tensor {name!r} in {str(path / Q4_FILE)!r} has bad shapes")
    return q, d, m


def quantize_q4(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Float [N, K] -> 4-bit groups (q, d, m) with ``w ~ d * q + m`` (Q4_1's form:
    the group's minimum and 15 equal steps to its maximum)."""
    n, k = w.shape
    if k % Q4_GROUP:
        raise ModelError(f"cannot quantize a weight of {k} inputs to groups of {Q4_GROUP}")
    groups = w.view(n, k // Q4_GROUP, Q4_GROUP)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    d = (hi - lo) / 15
    step = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((groups - lo[..., None]) / step[..., None]).clamp_(0, 15)
    return q.to(torch.uint8).view(n, k), d, lo


def use_native(choice: str) -> bool:
    """Whether trioserve's kernels (:mod:`trioserve.engine.cpu.native`) run for
    ``choice``, one of :data:`~trioserve.engine.cpu.options.CPU_KERNELS`:
    ``"auto"`` where they build and pass their probe here; raises
    :class:`ModelError` where ``"native"`` is asked for and they cannot run,
    with the reason."""
    if choice == "torch":
        return False
    if native.kernel() is not None:
        return True
    if choice == "native":
        raise ModelError(
            f"trioserve's native kernels cannot run here: {native.unavailable_reason()}"
        )
    return False


def q4_weight(
    q: Tensor,
    d: Tensor,
    m: Tensor,
    pack: Callable[[Tensor], Tensor],
    kernel: Literal["native", "torch"] = "torch",
) -> Linear:
    """The 4-bit weight of (q, d, m) for ``kernel`` (see :func:`use_native`), or
    its bfloat16 dequantization (packed when that is exact) where torch's
    kernel does not work for this shape."""
    n, k = q.shape
    if kernel == "native":
        data, scales = native.pack(q, d, m)
        return QuantizedWeight("q4", data, scales, n, k, Q4_GROUP, native=True)
    if not _q4_works(n, k, Q4_GROUP):
        w = (q.view(n, -1, Q4_GROUP).float() * d[..., None] + m[..., None]).view(n, k)
        return pack(w.to(torch.bfloat16))
    data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    scales = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return QuantizedWeight("q4", data, scales, n, k, Q4_GROUP)


#: Rows quantized at a time by :func:`int8_weight`: its float32 temporaries
#: stay a few MiB instead of several copies of the whole weight (a 49,152-row
#: vocabulary projection would otherwise add ~450 MB to the load's peak).
_INT8_ROWS = 2048  # a multiple of 16: the native layout's blocks


def int8_weight(
    w: Tensor, pack: Callable[[Tensor], Tensor], *, native_kernel: bool = False
) -> Linear:
    """Float [N, K] (any float dtype) -> 8 bits per weight, one scale per
    output row (rounded to bfloat16 first, so that the kernel's scale is the
    one the weights were rounded with); quantized in blocks of rows. With
    ``native_kernel`` (where :func:`trioserve.engine.cpu.native.kernel` loaded and
    K is a multiple of 16) the weight runs on trioserve's kernel."""
    n, k = w.shape
    native_kernel = native_kernel and k % 16 == 0
    if not native_kernel and not _int8_works(n, k):
        return pack(w.to(torch.bfloat16))
    # The native kernel's layout block by block (no second full-size copy).
    q = (
        torch.empty(-(-n // 16), k // 2, 32, dtype=torch.int8)
        if native_kernel
        else torch.empty(n, k, dtype=torch.int8, device=w.device)
    )
    scale = torch.empty(n, dtype=torch.bfloat16, device=w.device)
    for start in range(0, n, _INT8_ROWS):
        rows = w[start : start + _INT8_ROWS].to(torch.float32, copy=True)
        s = (rows.abs().amax(dim=1) / 127).clamp_(min=1e-30).to(torch.bfloat16)
        scale[start : start + _INT8_ROWS] = s
        block = rows.div_(s.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        if native_kernel:
            packed = pack_int8(block)
            q[start // 16 : start // 16 + packed.shape[0]] = packed
        else:
            q[start : start + _INT8_ROWS] = block
    return QuantizedWeight("int8", q, scale, n, k, native=native_kernel)


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The [N, K] weights that ``w`` stands for, as the kernel computes them
    (in float32), in ``dtype``."""
    if w.kind == "int8":
        q = unpack_int8(w.data, w.out_features) if w.native else w.data
        return (q.float() * w.scales.float()[:, None]).to(dtype)
    n, k = w.out_features, w.in_features
    if w.native:
        d, m = w.scales.float()[..., None]  # [N, K / group, 1] each
        q = native.unpack(w.data, k).view(n, k // w.group_size, w.group_size)
        return q.float().mul_(d).add_(m).view(n, k).to(dtype)
    q = _q4_unpack(w.data, n, k).view(n, k // w.group_size, w.group_size)
    scale, zero = w.scales.float().permute(2, 1, 0)[..., None]  # [N, K / group, 1] each
    # (q - 8) * scale is exact in float32 (4 bits times bfloat16's 8), so the
    # sum rounds once, as the kernel's fused multiply-add does.
    return q.float().sub_(8).mul_(scale).add_(zero).view(n, k).to(dtype)


def _q4_unpack(packed: Tensor, n: int, k: int) -> Tensor:
    """uint8 [N, K] in [0, 15] from ``_convert_weight_to_int4pack_for_cpu``'s layout.

    That layout is torch's internal one and depends on the instruction set
    torch dispatches to at run time (``torch.backends.cpu.get_cpu_capability()``):
    blocks of 64 output rows with AVX-512, 32 with AVX2, neighbouring rows
    paired without vectorization or in a last, narrower block. Instead of
    transcribing each, :func:`_q4_nibble_sources` asks the packing function
    where each weight goes.
    """
    nibbles = torch.stack([packed.reshape(-1) & 15, packed.reshape(-1) >> 4], dim=1).view(-1)
    q = torch.empty(n * k, dtype=torch.uint8)
    q[_q4_nibble_sources(n, k)] = nibbles
    return q.view(n, k)


@functools.lru_cache(maxsize=16)
def _q4_nibble_sources(n: int, k: int) -> Tensor:
    """For each nibble of the packed [n, k] weight (byte by byte, low nibble
    first), the flat index of the weight it holds.

    Packing is a permutation of nibbles, so the index of every weight can be
    packed through it one hexadecimal digit at a time. Raises
    :class:`ModelError` where the packed form is not such a permutation (a
    torch whose kernel packs differently), so :func:`dequantize` fails
    loudly instead of reading weights from the wrong places.
    """
    index = torch.arange(n * k, dtype=torch.int64)
    sources = torch.zeros(n * k, dtype=torch.int64)
    for shift in range(0, max(n * k - 1, 1).bit_length(), 4):
        digit = ((index >> shift) & 15).to(torch.int32).view(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(digit, 1).reshape(-1)
        if packed.dtype != torch.uint8 or packed.numel() * 2 != n * k:
            raise ModelError(f"this torch packs 4-bit weights as {packed.dtype} x {packed.numel()}")
        nibbles = torch.stack([packed & 15, packed >> 4], dim=1).view(-1)
        sources |= nibbles.to(torch.int64) << shift
    if not torch.equal(torch.sort(sources).values, index):
        raise ModelError("this torch's 4-bit packing is not a permutation of the weights")
    return sources


def q4_available() -> bool:
    return _q4_works(128, 256, Q4_GROUP)


def int8_available() -> bool:
    return _int8_works(64, 128)


#: Row counts at which a kernel's rows are compared: a row must come out the
#: same whatever else is in the batch (decode batches, prefill chunks).
_PROBE_ROWS = (1, 3, 8, 37)


@functools.cache
def _q4_works(n: int, k: int, group: int) -> bool:
    """Whether the 4-bit kernel works for [n, k] weights here: it exists, it
    computes what its documented formula says (within bfloat16 rounding), and a
    row's result does not depend on the other rows."""
    if n % 16 or k % group or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return False
    g = torch.Generator().manual_seed(n * 31 + k)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    d = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    m = -8 * d + torch.randn(n, k // group, generator=g) * 0.01
    x = torch.randn(max(_PROBE_ROWS), k, generator=g).to(torch.bfloat16)
    try:
        data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        scales = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous().bfloat16()
        with torch.inference_mode():
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, data, group, scales)
            rows_agree = all(
                torch.equal(
                    torch.ops.aten._weight_int4pack_mm_for_cpu(x[:r], data, group, scales), out[:r]
                )
                for r in _PROBE_ROWS
            )
    except (RuntimeError, NotImplementedError):
        return False
    s, z = scales.float().permute(2, 1, 0)
    ref = x.float() @ ((q.view(n, -1, group) - 8) * s[..., None] + z[..., None]).view(n, k).T
    close = bool(((out.float() - ref).abs() <= 0.01 * ref.abs().amax() + 1e-3).all())
    return close and rows_agree


_INT8_PROBE_ROWS = 4096


@functools.cache
def _int8_works(n: int, k: int) -> bool:
    """As :func:`_q4_works`, for the 8-bit kernel. Output rows past a few
    thousand run the same code as the first ones: a taller weight (a
    vocabulary projection) is probed at 4,096 rows plus its tail, not whole
    (its float32 reference alone would add about 500 MB to the load's peak)."""
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return False
    if n > _INT8_PROBE_ROWS:
        return _int8_works(_INT8_PROBE_ROWS + n % 64, k)
    g = torch.Generator().manual_seed(n * 37 + k)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) * 0.01 + 0.001).bfloat16()
    x = torch.randn(max(_PROBE_ROWS), k, generator=g).to(torch.bfloat16)
    try:
        with torch.inference_mode():
            out = torch.ops.aten._weight_int8pack_mm(x, q, scale)
            rows_agree = all(
                torch.equal(torch.ops.aten._weight_int8pack_mm(x[:r], q, scale), out[:r])
                for r in _PROBE_ROWS
            )
    except (RuntimeError, NotImplementedError):
        return False
    ref = x.float() @ (q.float() * scale.float()[:, None]).T
    close = bool(((out.float() - ref).abs() <= 0.01 * ref.abs().amax() + 1e-3).all())
    return close and rows_agree


# --- bfloat16 packing -----------------------------------------------------------

#: Rows the packed layout is tuned for; any row count works.
_PACK_ROWS_HINT = 8


def packer(dtype: torch.dtype, device: torch.device, width: int) -> Callable[[Tensor], Tensor]:
    """A function that puts weights into oneDNN's packed layout where that is
    exact, else leaves them as they are.

    On CPU, bfloat16 matmuls against packed weights run 1.5 to 2 times faster
    at the few rows of a batched decode step than ``F.linear`` does. The probe
    checks that the packed kernel gives bit for bit what ``F.linear`` and
    ``torch.mv`` give at every row count, so that batch-invariant greedy text
    (see :func:`_spans`) survives; on builds without oneDNN, on other devices
    or dtypes, weights stay plain.
    """

    def plain(w: Tensor) -> Tensor:
        return w

    if device.type != "cpu" or dtype != torch.bfloat16:
        return plain
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return plain
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(96, width, generator=generator).to(dtype)
    x = torch.randn(max(_PROBE_ROWS), width, generator=generator).to(dtype)
    try:
        packed = _mkldnn_pack(w)
        same = all(
            torch.equal(_mkldnn_linear(x[:n], packed), F.linear(x[:n], w)) for n in _PROBE_ROWS
        ) and torch.equal(_mkldnn_linear(x[:1], packed)[0], torch.mv(w, x[0]))
    except (RuntimeError, AttributeError):
        return plain
    return _mkldnn_pack if same else plain


def _mkldnn_pack(w: Tensor) -> Tensor:
    packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _PACK_ROWS_HINT)
    return packed


def _mkldnn_linear(x: Tensor, packed: Tensor) -> Tensor:
    out: Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return out
