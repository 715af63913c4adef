"""Each native kernel's time on every instruction-set path this CPU runs, at
the embedded model's shapes and 8 rows (a decode step of 8 streams), in one
process, the paths alternated: ``python -m tests.bench.kernel_paths``.
docs/performance.md ("The instruction-set paths") has a run's table."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from trioserve.engine.cpu import int8_layout, native

ROWS = 8


def _median_us(fn: Callable[[], object], reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def cases(module: ModuleType) -> dict[str, tuple[Callable[[], object], int]]:
    """Each kernel's call at SmolLM2-135M's shapes, and how many a step makes."""
    g = torch.Generator().manual_seed(1)
    out: dict[str, tuple[Callable[[], object], int]] = {}
    for name, (n, k) in {
        "4-bit qkv 960 x 576": (960, 576),
        "4-bit o 576 x 576": (576, 576),
        "4-bit gate_up 3072 x 576": (3072, 576),
        "4-bit down 576 x 1536": (576, 1536),
    }.items():
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        d = torch.rand(n, k // 32, generator=g) * 0.02
        data, scales = native.pack(q, d, -8 * d)
        x = torch.randn(ROWS, k, generator=g).bfloat16()
        out[name] = (partial(native._call, module, x, data, scales, n), 30)
    q8 = int8_layout.pack_int8(
        torch.randint(-127, 128, (49152, 576), generator=g, dtype=torch.int8)
    )
    scale = torch.rand(49152, generator=g).bfloat16()
    x8 = torch.randn(ROWS, 576, generator=g).bfloat16()
    out["8-bit projection 49152 x 576"] = (
        partial(native._int8, module, x8, q8, scale, torch.float32),
        1,
    )
    e, heads, kv_heads, length = 64, 9, 3, 1024
    rope = (torch.randn(length, e, generator=g), torch.randn(length, e, generator=g))
    cache = torch.randn(ROWS, 2 * kv_heads, length, e, generator=g).bfloat16()
    qkv = torch.randn(ROWS, (heads + 2 * kv_heads) * e, generator=g).bfloat16()
    slots, positions = torch.arange(ROWS), torch.full((ROWS,), 300)
    out["attention at 300 positions"] = (
        partial(native._attend, module, qkv, rope, cache, slots, positions, heads, kv_heads),
        30,
    )
    x = torch.randn(ROWS, 576, generator=g)
    y = torch.randn(ROWS, 576, generator=g).bfloat16()
    w = torch.rand(576, generator=g)
    out["add + RMS norm"] = (partial(native._norm, module, x, y, w, 1e-5), 61)
    gate_up = torch.randn(ROWS, 3072, generator=g).bfloat16()
    out["silu * up"] = (partial(native._silu, module, gate_up), 30)
    return out


def main() -> None:
    module = native.kernel()
    if module is None:
        sys.exit(f"native kernels unavailable: {native.unavailable_reason()}")
    paths = list(module.isas())
    chosen = module.isa()
    print(f"| kernel (calls per step) | {' | '.join(paths)} | per step on {paths[-1]} |")
    print("|---|" + "---|" * (len(paths) + 1))
    try:
        for name, (fn, per_step) in cases(module).items():
            times: dict[str, list[float]] = {p: [] for p in paths}
            for _ in range(2):
                for path in paths:
                    module.use(path)
                    times[path].append(_median_us(fn))
            best = {p: min(t) for p, t in times.items()}
            cells = " | ".join(f"{best[p]:.0f} us" for p in paths)
            print(f"| {name} ({per_step}) | {cells} | {best[paths[-1]] * per_step / 1000:.1f} ms |")
    finally:
        module.use(chosen)


if __name__ == "__main__":
    main()
