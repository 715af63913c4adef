"""trioserve's native CPU kernels (kernels.c), built at install time or on
first use: the 4-bit matmul, the 8-bit vocabulary projection, the
residual add with RMS norm, a layer's attention (rope, the KV cache write and
causal attention), and the MLP's silu(gate) * up.

torch's ``_weight_int4pack_mm_for_cpu`` multiplies bfloat16 activations by
dequantized weights; llama.cpp, on the same CPUs, quantizes each row of
activations to 8 bits per group of 32 and dots integers (``vpdpbusd``: 64
multiply-adds an instruction). :func:`q4_mm` dots integers too, with the GGUF's
Q4_1 groups, but writes each activation in 15 bits (8 bits and an 8-bit
residual: kernels.c), so that its answers are torch's bfloat16 path's
where 8 bits moved near-ties, and asks for the weights ahead of its reads
(one core alone keeps too few misses in flight to use the memory's
bandwidth; docs/performance.md has its timings). :func:`int8_mm` is the
vocabulary projection's 8-bit weights times activations written in 16 bits
(their error bound is a small part of the weights'), integers dotted 16
outputs a multiply-add, with the same prefetching. :func:`add_rms_norm`
adds a layer's output to the float32 residual stream and normalises it in
one pass per row, where torch runs a chain of about ten small operators.
:func:`attention` replaces rope's seven operators, the cache write and
``scaled_dot_product_attention`` (with its masks and length buckets, which
kept torch's kernel batch-invariant) by one call: each row attends to
exactly its own positions, so nothing else can change its sums.

Every kernel computes a row from that row alone, in an order that depends on
nothing else: a job's logits do not depend on its companions, nor on whether
its positions came from a prefill chunk or a decode step (the exactness that
trioserve.engine.cpu.llama relies on; the probe and tests/test_native.py check
it).

Nothing here is needed: :func:`kernel` returns ``None``, with the reason in
:func:`unavailable_reason`, where the CPU lacks AVX2, FMA or F16C, where there is
no C compiler or no Python headers, where the build fails, where the cached
library is refused (not the one recorded at its build, or a directory others
may write), or where the built kernels fail their probe (:func:`_probe`: each
must compute what its formula says, and a row's result must not depend on the
other rows); the engine then runs torch's operators, as before, and the log
says why (a warning, with what is lost and how to get them, where the user can
fix the reason). ``TRIOSERVE_NATIVE=0`` turns them off.

Where the library comes from (the installed extension or trioserve's cache),
the build and the checks before loading are in
:mod:`trioserve.engine.cpu.native_build`.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trioserve.engine.cpu.int8_layout import input_error, pack_int8
from trioserve.engine.cpu.native_build import LOST, SOURCE, Unavailable, cache_dir, load

__all__ = [
    "SOURCE",
    "add_rms_norm",
    "attention",
    "cache_dir",
    "forward_layers",
    "int8_mm",
    "kernel",
    "layer_table",
    "max_group_heads",
    "pack",
    "path",
    "q4_mm",
    "quantize_rows",
    "reference",
    "silu_mul",
    "unavailable_reason",
    "unpack",
]

logger = logging.getLogger(__name__)

_reason: str | None = None


def unavailable_reason() -> str | None:
    """Why :func:`kernel` is ``None`` (after it was called), else ``None``."""
    kernel()
    return _reason


@functools.cache
def kernel() -> ModuleType | None:
    """The built, loaded and probed kernel module, or ``None`` (see
    :func:`unavailable_reason`)."""
    global _reason
    try:
        module = load()
        failed = _probe(module)
        if failed:
            raise Unavailable(f"the built kernels failed their probe: {failed}")
    except Unavailable as exc:
        _reason = str(exc)
        if exc.remedy is None:
            # Off by choice, or a CPU they cannot run on: nothing to fix.
            logger.info("native CPU kernels not used: %s", _reason)
        else:
            logger.warning(
                "native CPU kernels not used: %s; %s. To get them: %s", _reason, LOST, exc.remedy
            )
        return None
    # The engine's line says "kernels: native <path>"; this one adds the choice.
    logger.debug(
        "native CPU kernels: the %s path (this CPU runs %s)", module.isa(), ", ".join(module.isas())
    )
    return module


def path() -> str | None:
    """The instruction-set path the kernels run (``"avx512"``, ``"avx2-vnni"``, ``"avx2"``), or
    ``None`` where they do not (:func:`unavailable_reason` says why)."""
    module = kernel()
    return None if module is None else str(module.isa())


def max_group_heads() -> int:
    """The most query heads per KV head the attention kernel takes (kernels.h's
    ``MAX_GROUP_HEADS``); 0 where the kernels do not run."""
    module = kernel()
    return 0 if module is None else int(module.max_group_heads())


def q4_mm(rows: Tensor, data: Tensor, scales: Tensor, out_features: int) -> Tensor:
    """rows [M, K] bfloat16 @ W.T for W in the kernel's layout (``data`` [N, K/2]
    uint8, ``scales`` [2, N, K/32] float16: d and m); [M, N] bfloat16."""
    return _call(_module(), rows, data, scales, out_features)


def int8_mm(rows: Tensor, q: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """rows [M, K] bfloat16 @ (Q [N, K] int8 * scale [N] bfloat16).T -> [M, N]
    ``dtype`` (float32 or bfloat16), for Q in
    :func:`~trioserve.engine.cpu.int8_layout.pack_int8`'s layout (``q``);
    each row of ``rows`` is written in 16 bits against its largest magnitude
    and the sums are integers (kernels_arith.h): within
    :func:`~trioserve.engine.cpu.int8_layout.input_error` of the products of
    ``rows`` as they are."""
    return _int8(_module(), rows, q, scale, dtype)


def add_rms_norm(x: Tensor, y: Tensor | None, weight: Tensor, eps: float) -> Tensor:
    """x [M, D] float32, contiguous: ``x += y`` (y [M, D] bfloat16, when given;
    in place), then ``x * (1 / sqrt(mean(x^2) + eps)) * weight`` (float32
    [D]) rounded to bfloat16, [M, D]."""
    return _norm(_module(), x, y, weight, eps)


def attention(
    qkv: Tensor,
    rope: tuple[Tensor, Tensor],
    cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    heads: int,
    kv_heads: int,
) -> Tensor:
    """One layer's attention for the rows of a forward pass, in one call.

    ``qkv`` [R, (H + 2K) * E] bfloat16 (the fused projection's output, before
    rope); ``rope`` the (cos, sin) tables [length, E] float32 of
    :func:`trioserve.engine.cpu.llama.rope_tables`; ``cache`` the layer's
    [S, 2K, T, E] bfloat16 KV cache; ``slots``, ``positions`` [R] int64, each
    row's, no two rows at the same (slot, position). Each row's query and key
    heads are rotated (float32, then bfloat16), its keys and values written at
    (slot, position), and then each row's query heads attend to its slot's
    positions 0 to its own (causal; rows of one slot see each other's
    writes): [R, H * E] bfloat16. A row's result depends on its query and the
    keys and values it attends to alone, in an order set by its position,
    whatever other rows the pass holds.
    """
    return _attend(_module(), qkv, rope, cache, slots, positions, heads, kv_heads)


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [R, 2F] bfloat16 (gate, then up) -> silu(gate) * up [R, F]
    bfloat16, each product of bfloat16 roundings as torch's ``F.silu(gate) *
    up`` does, in one pass."""
    return _silu(_module(), gate_up)


def layer_table(layers: Sequence[Any]) -> Tensor | None:
    """The int64 table of addresses :func:`forward_layers` reads, one row per
    layer (its norms' weights and its four 4-bit matmuls' data, d and m), or
    ``None`` unless every layer's matmuls are 4-bit on this module's kernel
    and its norms float32. The table does not own what it points to: the
    layers must outlive it (the engine keeps both in its weights)."""
    fields = _module().layer_fields()
    rows = []
    for layer in layers:
        row: dict[str, int] = {}
        for norm, prefix, weights in (
            (layer.attn_norm, "attn_", (("qkv", layer.wqkv), ("o", layer.wo))),
            (layer.mlp_norm, "mlp_", (("gate_up", layer.w_gate_up), ("down", layer.w_down))),
        ):
            if norm.dtype != torch.float32 or not norm.is_contiguous():
                return None
            row[prefix + "norm"] = norm.data_ptr()
            for name, w in weights:
                if getattr(w, "kind", None) != "q4" or not getattr(w, "native", False):
                    return None
                row[name] = w.data.data_ptr()
                row[name + "_d"] = w.scales[0].data_ptr()
                row[name + "_m"] = w.scales[1].data_ptr()
        if set(row) != set(fields):  # kernels.h's LAYER_FIELDS and this disagree
            raise RuntimeError(f"layer table: kernels.c reads {fields}, this builds {sorted(row)}")
        rows.append([row[f] for f in fields])
    return torch.tensor(rows, dtype=torch.int64) if rows else None


def forward_layers(
    x: Tensor,
    table: Tensor,
    caches: Tensor,
    rope: tuple[Tensor, Tensor],
    slots: Tensor,
    positions: Tensor,
    *,
    heads: int,
    kv_heads: int,
    intermediate: int,
    cache_shape: tuple[int, int],
    eps: float,
) -> None:
    """Every layer of a forward pass on ``x`` [R, D] float32 (the residual
    stream, in place) in one call, without the GIL: the same kernels, in the
    same order, as :func:`trioserve.engine.cpu.llama.forward`'s per-operator
    path (so the same bits). ``table`` from :func:`layer_table`; ``caches``
    int64 [L], each layer's bfloat16 KV cache [S, 2K, T, E] address;
    ``cache_shape`` (S, T); ``slots``, ``positions`` [R] int64, each row's."""
    _need(x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous(), "x: [R, D] float32")
    rows, width = x.shape
    columns = len(_module().layer_fields())
    _need(
        table.dtype == torch.int64 and table.dim() == 2 and table.shape[1] == columns,
        f"table: [L, {columns}] int64 (layer_table)",
    )
    table, caches = table.contiguous(), caches.contiguous()
    _need(caches.dtype == torch.int64 and caches.shape == (table.shape[0],), "caches: [L] int64")
    cos, sin = _rope_tables(rope)
    slots, positions = _rows(slots, positions, rows, cache_shape[1])
    head_dim = cos.shape[1]
    _need(heads >= 1 and kv_heads >= 1 and heads % kv_heads == 0, "heads: a multiple of kv_heads")
    given = {
        "x": x.data_ptr(),
        "table": table.data_ptr(),
        "caches": caches.data_ptr(),
        "cos": cos.data_ptr(),
        "sin": sin.data_ptr(),
        "slots": slots.data_ptr(),
        "pos": positions.data_ptr(),
        "R": rows,
        "D": width,
        "H": heads,
        "K": kv_heads,
        "E": head_dim,
        "F": intermediate,
        "n_layers": table.shape[0],
        "T": cache_shape[1],
        "S": cache_shape[0],
        "rope_length": cos.shape[0],
        "threads": torch.get_num_threads(),
        "eps": eps,
        "scale": 1.0 / math.sqrt(head_dim),
    }
    assert given.keys() == FORWARD_ARGS, "forward_layers: FORWARD_ARGS names what it passes"
    module = _module()
    module.forward_layers(*[given[name] for name in module.forward_args()])


def _module() -> ModuleType:
    module = kernel()
    if module is None:  # pragma: no cover - callers use it only when it loaded
        raise RuntimeError(f"trioserve's native kernels are unavailable: {_reason}")
    return module


# --- the layout and its reference ----------------------------------------------


def pack(q: Tensor, d: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    """(q [N, K] in [0, 15], d, m [N, K/32]) -> the kernel's (data, scales).

    A group's byte j holds its q[j] in the low nibble and q[j + 16] in the
    high one (GGUF Q4_1's order). The first groups come in wide blocks of 16,
    their bytes interleaved four at a time (bytes 4t .. 4t + 3 of each group
    in turn, t = 0 .. 3), the last K/32 % 16 groups one after another
    (kernels.c says why). ``scales`` are d and m in float16, [2, N, K/32].
    """
    n, k = q.shape
    groups = k // 32
    wide = groups // 16 * 16
    g = q.to(torch.uint8).view(n, groups, 2, 16)
    nibbles = g[:, :, 0] | (g[:, :, 1] << 4)  # [N, G, 16]
    main = nibbles[:, :wide].reshape(n, wide // 16, 16, 4, 4).transpose(2, 3)
    data = torch.cat([main.reshape(n, -1), nibbles[:, wide:].reshape(n, -1)], dim=1)
    scales = torch.stack([d, m]).to(torch.float16).contiguous()
    return data.contiguous(), scales


def unpack(data: Tensor, k: int) -> Tensor:
    """:func:`pack`'s data -> q [N, K] uint8 in [0, 15]."""
    n = data.shape[0]
    groups = k // 32
    wide = groups // 16 * 16
    main = data[:, : wide * 16].reshape(n, wide // 16, 4, 16, 4).transpose(2, 3)
    nibbles = torch.cat([main.reshape(n, wide, 16), data[:, wide * 16 :].reshape(n, -1, 16)], 1)
    return torch.stack([nibbles & 15, nibbles >> 4], dim=2).view(n, k)


def quantize_rows(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's integers for rows [M, K] (bfloat16), per group of 32:
    (x8, r8 [M, K / 32, 32] as float64 integers, dx [M, K / 32] float64 of a
    float32 value), x ~ dx * (x8 + r8 / 128), computed as the kernel does in
    float32 (numpy divides float32 by float32 correctly rounded, as the
    kernel does; torch may multiply by a reciprocal instead, which moves ties;
    rounding is to nearest even, as cvtps2dq's)."""
    m, k = rows.shape
    x = rows.float().view(m, k // 32, 32).numpy()
    amax = np.abs(x).max(axis=-1)
    with np.errstate(divide="ignore"):
        dx = amax / np.float32(127)
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    v = (x * inv[..., None]).astype(np.float32)
    x8 = np.rint(v)
    r8 = np.rint(((v - x8) * np.float32(128)).astype(np.float32))
    as64 = [torch.from_numpy(a.astype(np.float64)) for a in (x8, r8, dx)]
    return as64[0], as64[1], as64[2]


def reference(rows: Tensor, data: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """What the kernel computes, in float64 from its integers
    (:func:`quantize_rows`) and the weights ``d * q + m`` (d and m as their
    float16 values); and a bound on the kernel's float32 rounding for each
    result (its sums' magnitudes times 2^-22)."""
    k = rows.shape[1]
    n = data.shape[0]
    x8, r8, dx = quantize_rows(rows)
    q = unpack(data, k).double().view(n, k // 32, 32)
    d, m = scales.double()  # [N, K / 32] each
    ints = 128 * x8 + r8  # [M, G, 32]
    dots = torch.einsum("mgj,ngj->mng", ints, q)  # exact integers
    step = (dx / 128)[:, None, :]  # [M, 1, G]
    terms = dots * d[None] * step + m[None] * (step * ints.sum(-1)[:, None, :])
    size = (dots.abs() * d[None] * step + (m[None] * step * ints.sum(-1)[:, None, :]).abs()).sum(-1)
    return terms.sum(-1), size * 2.0**-22


#: Row counts at which the probe checks that a row's result does not depend on
#: the others (decode batches, prefill chunks, a ragged block of four).
_PROBE_ROWS = (1, 2, 3, 5, 8, 37)


#: The arguments :func:`forward_layers` passes by name (kernels.h's
#: ``FORWARD_ARGS`` gives their order; the probe checks the names agree).
FORWARD_ARGS: frozenset[str] = frozenset(
    {"x", "table", "caches", "cos", "sin", "slots", "pos", "R", "D", "H", "K", "E", "F"}
    | {"n_layers", "T", "S", "rope_length", "threads", "eps", "scale"}
)


def _probe(module: ModuleType) -> str | None:
    """What the built kernels get wrong here, or ``None``: the arguments of
    ``forward_layers`` must be the ones this module passes, and each kernel (the
    matmuls, the norm, attention and silu; the layer stack is these same calls)
    must compute its formula (within its output's bfloat16 rounding) and give a
    row the same result whatever other rows it is computed with."""
    taken = module.forward_args()
    if len(taken) != len(set(taken)) or set(taken) != FORWARD_ARGS:
        return (
            f"forward_layers takes {', '.join(taken)}; this trioserve passes "
            f"{', '.join(sorted(FORWARD_ARGS))} (the kernels were built from other sources)"
        )
    g = torch.Generator().manual_seed(23)
    for n, k in ((80, 576), (48, 1536), (16, 96)):
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        d = torch.rand(n, k // 32, generator=g) * 0.02 + 0.001
        mins = -8 * d + torch.randn(n, k // 32, generator=g) * 0.01
        data, scales = pack(q, d, mins)
        x = (torch.randn(max(_PROBE_ROWS), k, generator=g) * 3).to(torch.bfloat16)
        x[0, :32] = 0  # an all-zero group
        out = _call(module, x, data, scales, n)
        ref, rounding = reference(x, data, scales)
        # The bfloat16 output: within half a step (at most 2^-8 of a value).
        if not bool(((out.double() - ref).abs() <= ref.abs() * 2**-8 + rounding).all()):
            return f"the 4-bit matmul's results ({n} x {k})"
        if not _rows_agree(functools.partial(_q4_rows, module, data, scales, n), x, out):
            return f"the 4-bit matmul's batch invariance ({n} x {k})"
        w8 = torch.randint(-127, 128, (n - 3, k), generator=g, dtype=torch.int8)
        s8 = (torch.rand(n - 3, generator=g) * 0.01 + 0.001).to(torch.bfloat16)
        packed = pack_int8(w8)
        out8 = _int8(module, x, packed, s8, torch.float32)
        ref8 = x.double() @ (w8.double() * s8.double()[:, None]).T
        bound = _int8_bound(x, w8, s8)
        if not bool(((out8.double() - ref8).abs() <= bound).all()):
            return f"the 8-bit matmul's results ({n - 3} x {k})"
        if not torch.equal(_int8(module, x, packed, s8), out8.bfloat16()):
            return f"the 8-bit matmul's bfloat16 results ({n - 3} x {k})"
        if not _rows_agree(functools.partial(_int8_rows, module, packed, s8), x, out8):
            return f"the 8-bit matmul's batch invariance ({n - 3} x {k})"
    failed = _probe_attention(module) or _probe_silu(module)
    if failed:
        return failed
    for d_model in (576, 48):
        x = torch.randn(max(_PROBE_ROWS), d_model, generator=g) * 4
        y = torch.randn(x.shape, generator=g).to(torch.bfloat16)
        w = torch.rand(d_model, generator=g) + 0.5
        summed = x + y.float()
        ref = summed.double() * (summed.double().pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt()
        ref = ref * w.double()
        for rows in _PROBE_ROWS:
            xr = x[:rows].clone()
            out = _norm(module, xr, y[:rows], w, 1e-5)
            if not torch.equal(xr, summed[:rows]):
                return "the residual add"
            if not bool(((out.double() - ref[:rows]).abs() <= ref[:rows].abs() / 256 + 1e-5).all()):
                return "the RMS norm's results"
            if rows > 1 and not torch.equal(
                out, _norm(module, summed[:rows].clone(), None, w, 1e-5)
            ):
                return "the RMS norm without an add"
            if rows == max(_PROBE_ROWS) and not torch.equal(
                out[3:8], _norm(module, summed[3:8].clone(), None, w, 1e-5)
            ):
                return "the RMS norm's batch invariance"
    return None


def _probe_attention(module: ModuleType) -> str | None:
    """Rope, the cache write and causal attention against float64, and a row
    alone against the same row beside others."""
    g = torch.Generator().manual_seed(29)
    heads, kv_heads, e, length = 6, 2, 64, 40
    rope = (torch.randn(length, e, generator=g), torch.randn(length, e, generator=g))
    cache = torch.randn(2, 2 * kv_heads, length, e, generator=g).bfloat16()
    qkv = torch.randn(5, (heads + 2 * kv_heads) * e, generator=g).bfloat16()
    slots, positions = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([7, 8, 9, 0, 33])
    written = cache.clone()
    out = _attend(module, qkv, rope, written, slots, positions, heads, kv_heads).double()
    x = qkv.view(5, heads + 2 * kv_heads, e).float()
    cos, sin = (t[positions][:, None] for t in rope)
    rotated = (x * cos + x.view(5, -1, 2, e // 2).flip(2).view(x.shape) * sin).bfloat16()
    group = heads // kv_heads
    for r in range(5):
        s, p = int(slots[r]), int(positions[r])
        if not torch.equal(written[s, :kv_heads, p], rotated[r, heads : heads + kv_heads]):
            return "attention's key write"
        for h in range(heads):
            k = written[s, h // group, : p + 1].double()
            v = written[s, kv_heads + h // group, : p + 1].double()
            want = torch.softmax(k @ rotated[r, h].double() / math.sqrt(e), 0) @ v
            if float((out[r, h * e : (h + 1) * e] - want).abs().max()) > 2**-7 * (
                float(want.abs().max()) + 1e-3
            ):
                return "attention's results"
    again = written.clone()
    alone = _attend(module, qkv[4:], rope, again, slots[4:], positions[4:], heads, kv_heads)
    return None if torch.equal(alone.double(), out[4:]) else "attention's batch invariance"


def _probe_silu(module: ModuleType) -> str | None:
    g = torch.Generator().manual_seed(31)
    gate_up = (torch.randn(9, 2 * 64, generator=g) * 4).bfloat16()
    out = _silu(module, gate_up).float()
    want = (torch.nn.functional.silu(gate_up[:, :64]) * gate_up[:, 64:]).float()
    if not torch.allclose(out, want, rtol=2**-7, atol=1e-6):
        return "silu(gate) * up"
    same = torch.equal(_silu(module, gate_up[4:5]).float(), out[4:5])
    return None if same else "silu's batch invariance"


def _rows_agree(run: Callable[[Tensor], Tensor], x: Tensor, out: Tensor) -> bool:
    return all(torch.equal(run(x[:rows]), out[:rows]) for rows in _PROBE_ROWS) and torch.equal(
        run(x[3:8]), out[3:8]
    )


def _q4_rows(module: ModuleType, data: Tensor, scales: Tensor, n: int, x: Tensor) -> Tensor:
    return _call(module, x, data, scales, n)


def _int8_rows(module: ModuleType, q: Tensor, scale: Tensor, x: Tensor) -> Tensor:
    return _int8(module, x, q, scale, torch.float32)


def _int8_bound(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """[M, N] float64: how far :func:`int8_mm` may be from the exact products
    of ``x`` and ``q * scale`` ([N, K] int8, [N])."""
    l1 = q.double().abs().sum(dim=1) * scale.double()  # [N]
    return x.double().abs().amax(dim=1, keepdim=True) * l1 * input_error(x.shape[1])


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"native kernel: {message}")


def _bf16_matrix(x: Tensor, name: str) -> Tensor:
    _need(x.dim() == 2 and x.is_floating_point(), f"{name}: a 2-D float tensor")
    return x.to(torch.bfloat16).contiguous()


def _int8(
    module: ModuleType, x: Tensor, q: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    x = _bf16_matrix(x, "rows")
    m, k = x.shape
    n = scale.shape[0] if scale.dim() == 1 else 0
    _need(
        scale.dtype == torch.bfloat16 and n >= 1 and scale.is_contiguous(),
        "scale: [N] bfloat16, contiguous",
    )
    _need(k >= 16 and k % 16 == 0, "rows: K a positive multiple of 16")
    _need(
        q.dtype == torch.int8 and q.shape == (-(-n // 16), k // 2, 32) and q.is_contiguous(),
        "q: [ceil(N / 16), K / 2, 32] int8 (int8_layout.pack_int8's), contiguous",
    )
    _need(dtype in (torch.float32, torch.bfloat16), "dtype: float32 or bfloat16")
    out = torch.empty(m, n, dtype=dtype)
    module.int8_mm(
        x.data_ptr(),
        q.data_ptr(),
        scale.data_ptr(),
        out.data_ptr(),
        m,
        n,
        k,
        int(dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


def _norm(module: ModuleType, x: Tensor, y: Tensor | None, w: Tensor, eps: float) -> Tensor:
    _need(
        x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous(),
        "x: [M, D] float32, contiguous (added to in place)",
    )
    m, d = x.shape
    _need(m >= 1 and d >= 16 and d % 16 == 0, "x: D a positive multiple of 16")
    if y is not None:
        y = _bf16_matrix(y, "y")
        _need(y.shape == x.shape, "y: the shape of x")
    _need(w.dtype == torch.float32 and w.shape == (d,) and w.is_contiguous(), "weight: [D] float32")
    out = torch.empty(m, d, dtype=torch.bfloat16)
    module.add_rms_norm(
        x.data_ptr(),
        None if y is None else y.data_ptr(),
        w.data_ptr(),
        out.data_ptr(),
        m,
        d,
        eps,
        torch.get_num_threads(),
    )
    return out


def _call(module: ModuleType, x: Tensor, data: Tensor, scales: Tensor, n: int) -> Tensor:
    x = _bf16_matrix(x, "rows")
    m, k = x.shape
    _need(k >= 32 and k % 32 == 0, "rows: K a positive multiple of 32")
    _need(
        data.dtype == torch.uint8 and data.shape == (n, k // 2) and data.is_contiguous(),
        "data: [N, K / 2] uint8, contiguous",
    )
    _need(
        scales.dtype == torch.float16
        and scales.shape == (2, n, k // 32)
        and scales.is_contiguous(),
        "scales: [2, N, K / 32] float16, contiguous",
    )
    out = torch.empty(m, n, dtype=torch.bfloat16)
    module.q4_mm(
        x.data_ptr(),
        data.data_ptr(),
        scales[0].data_ptr(),
        scales[1].data_ptr(),
        out.data_ptr(),
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    return out


def _rope_tables(rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    cos, sin = rope
    _need(
        cos.dtype == sin.dtype == torch.float32 and cos.dim() == 2 and cos.shape == sin.shape,
        "rope: (cos, sin) [length, E] float32",
    )
    return cos.contiguous(), sin.contiguous()


def _rows(slots: Tensor, positions: Tensor, rows: int, length: int) -> tuple[Tensor, Tensor]:
    """Each row's (slot, position), int64 and contiguous, one row per place."""
    _need(
        slots.dtype == positions.dtype == torch.int64 and slots.shape == positions.shape == (rows,),
        "slots, positions: [R] int64",
    )
    slots, positions = slots.contiguous(), positions.contiguous()
    # Two rows at one place would race on its cache row.
    places = slots * max(length, 1) + positions
    _need(torch.unique(places).numel() == rows, "two rows at the same (slot, position)")
    return slots, positions


def _attend(
    module: ModuleType,
    qkv: Tensor,
    rope: tuple[Tensor, Tensor],
    cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    heads: int,
    kv_heads: int,
) -> Tensor:
    _need(heads >= 1 and kv_heads >= 1 and heads % kv_heads == 0, "heads: a multiple of kv_heads")
    _need(
        cache.dtype == torch.bfloat16 and cache.dim() == 4 and cache.is_contiguous(),
        "cache: [S, 2K, T, E] bfloat16, contiguous (written in place)",
    )
    slots_n, two_k, length, e = cache.shape
    _need(two_k == 2 * kv_heads, "cache: 2 * kv_heads heads")
    qkv = _bf16_matrix(qkv, "qkv")
    rows = qkv.shape[0]
    _need(qkv.shape[1] == (heads + 2 * kv_heads) * e, "qkv: [R, (H + 2K) * E]")
    cos, sin = _rope_tables(rope)
    _need(cos.shape[1] == e, "rope: E columns")
    slots, positions = _rows(slots, positions, rows, length)
    out = torch.empty(rows, heads * e, dtype=torch.bfloat16)
    module.attention(
        qkv.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        cache.data_ptr(),
        slots.data_ptr(),
        positions.data_ptr(),
        out.data_ptr(),
        rows,
        heads,
        kv_heads,
        e,
        length,
        slots_n,
        cos.shape[0],
        1.0 / math.sqrt(e),
        torch.get_num_threads(),
    )
    return out


def _silu(module: ModuleType, gate_up: Tensor) -> Tensor:
    gate_up = _bf16_matrix(gate_up, "gate_up")
    rows, width = gate_up.shape
    _need(width % 32 == 0 and width >= 32, "gate_up: 2F columns, F a multiple of 16")
    out = torch.empty(rows, width // 2, dtype=torch.bfloat16)
    module.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out
