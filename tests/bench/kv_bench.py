"""The KV cache's options measured against each other (its 8-bit form, the prefix cache).

``python tests/bench/kv_bench.py speed`` steps two engines alternately, one
decode step of each in turn (which goes first alternating between rounds), so
that both see the same machine load step by step; it prints the median step
time of each and the median and quartiles of the per-pair ratios, for 1 and 8
streams at a short and a long context. ``python tests/bench/kv_bench.py rss``
runs 8 jobs of 900 prompt + 100 generated tokens in a fresh process per
setting and prints its peak RSS (``VmHWM``) and the KV cache's largest size.
Method and results: docs/performance.md, "The 8-bit KV cache".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:
    # Run as a script from a checkout: make the project importable uninstalled.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.engine_bench import (
    GREEDY,
    RSS_JOBS,
    RSS_NEW,
    RSS_PROMPT,
    _vm_hwm,
    prompt_of,
)
from trioserve.engine.base import GenerationSpec
from trioserve.engine.cpu.engine import CpuEngine
from trioserve.vocabulary.results import Failed, TextUpdate, Update

#: (streams, prompt tokens, decode steps timed) of each speed case.
CASES = ((1, 30, 96), (8, 30, 64), (1, 900, 64), (8, 900, 48))


def _specs(engine: CpuEngine, streams: int, prompt: int, new: int, first_id: int) -> list[Any]:
    return [
        GenerationSpec(
            job_id=first_id + i,
            prompt_ids=prompt_of(engine, prompt, salt=first_id + i),
            max_new_tokens=new,
            sampling=GREEDY,
        )
        for i in range(streams)
    ]


def interleaved(
    a: CpuEngine, b: CpuEngine, streams: int, prompt: int, steps: int, salt: int
) -> tuple[list[float], list[float]]:
    """Decode step times of ``a`` and ``b`` running the same jobs, stepped
    alternately; only steps where every job of both decodes are kept."""
    engines = (a, b) if salt % 2 == 0 else (b, a)
    specs = {e: _specs(e, streams, prompt, steps + 8, 1000 * salt) for e in engines}
    started: dict[CpuEngine, set[int]] = {e: set() for e in engines}
    times: dict[CpuEngine, list[float]] = {e: [] for e in engines}
    submit: dict[CpuEngine, Sequence[GenerationSpec]] = dict(specs)
    done = False
    while not done:
        decoding = all(len(started[e]) == streams for e in engines)
        for e in engines:
            t0 = time.perf_counter()
            updates: list[Update] = e.step(submit[e], [])
            dt = time.perf_counter() - t0
            submit[e] = []
            for u in updates:
                if isinstance(u, Failed):
                    raise RuntimeError(f"benchmark job failed: {u}")
                started[e].add(u.job_id)
                if not isinstance(u, TextUpdate):
                    done = True
            if decoding:
                times[e].append(dt)
    for e in engines:  # drain
        while e.statistics().running_jobs:
            e.step([], [spec.job_id for spec in specs[e]])
    n = min(len(times[a]), len(times[b]))
    return times[a][:n], times[b][:n]


def speed(
    kwargs_a: dict[str, Any],
    kwargs_b: dict[str, Any],
    rounds: int,
    cases: Sequence[tuple[int, int, int]] = CASES,
) -> None:
    a = CpuEngine.load(max_batch=8, prefix_cache_mib=0, **kwargs_a)
    b = CpuEngine.load(max_batch=8, prefix_cache_mib=0, **kwargs_b)
    print(f"A = {kwargs_a}, B = {kwargs_b}; load average {os.getloadavg()[0]:.1f}")
    for streams, prompt, steps in cases:
        ta: list[float] = []
        tb: list[float] = []
        for r in range(rounds):
            xa, xb = interleaved(a, b, streams, prompt, steps, r + 1)
            ta += xa
            tb += xb
        ratios = sorted(y / x for x, y in zip(ta, tb, strict=True))
        q = statistics.quantiles(ratios, n=4)
        print(
            f"{streams} streams, {prompt}-token prompts: A {statistics.median(ta) * 1e3:.2f} ms,"
            f" B {statistics.median(tb) * 1e3:.2f} ms; B/A per pair {statistics.median(ratios):.3f}"
            f" (quartiles {q[0]:.3f}-{q[2]:.3f}, {len(ratios)} pairs);"
            f" load {os.getloadavg()[0]:.1f}",
            flush=True,
        )


def rss_child(kwargs: dict[str, Any]) -> None:
    """In a fresh process: load, run 8 jobs of 900 + 100 tokens, print the
    peak RSS, the RSS after load and the KV cache's largest size."""
    engine = CpuEngine.load(max_batch=RSS_JOBS, **kwargs)
    loaded = _vm_rss()
    specs = [
        GenerationSpec(
            job_id=i + 1,
            prompt_ids=prompt_of(engine, RSS_PROMPT, salt=i),
            max_new_tokens=RSS_NEW,
            sampling=GREEDY,
        )
        for i in range(RSS_JOBS)
    ]
    largest = 0
    open_jobs = {spec.job_id for spec in specs}
    submit: Sequence[GenerationSpec] = specs
    while open_jobs:
        for update in engine.step(submit, []):
            if isinstance(update, Failed):
                raise RuntimeError(f"benchmark job failed: {update}")
            if not isinstance(update, TextUpdate):
                open_jobs.discard(update.job_id)
        submit = []
        largest = max(largest, engine.statistics().kv_cache_bytes)
    stats = engine.statistics()
    print(
        json.dumps(
            {
                "peak_rss_mib": _vm_hwm() / 2**20,
                "rss_after_load_mib": loaded / 2**20,
                "kv_cache_largest_mib": largest / 2**20,
                "prefix_cache_mib": stats.prefix_cache.bytes / 2**20,
            }
        )
    )


def _vm_rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def rss(settings: Sequence[dict[str, Any]], rounds: int) -> None:
    for r in range(rounds):
        for kwargs in settings if r % 2 == 0 else list(reversed(settings)):
            out = subprocess.run(
                [sys.executable, __file__, "rss-child", json.dumps(kwargs)],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
            )
            print(kwargs, out.stdout.strip().splitlines()[-1], flush=True)


def paged(rounds: int) -> None:
    """One layer's decode attention of the embedded model (K=3 key/value
    heads of 64, G=3 queries each), four ways, interleaved call by call:
    today's slot cache (a view of the slots), a pool of 64-position blocks
    gathered per step into a contiguous buffer (``pool[table]``, then the
    copy that puts the positions of a head together), a position-major pool
    (per layer [2K, positions, E]) gathered with one index per position, and
    that pool with each job's blocks contiguous, attended as one view per
    job (one attention call per job). Jobs' blocks are scattered at random
    in the pool for the gathers."""
    import torch

    print(f"load average {os.getloadavg()[0]:.1f}, torch threads {torch.get_num_threads()}")
    for n, length in ((1, 192), (8, 192), (1, 1024), (8, 1024)):
        times = _paged_case(n, length, rounds)
        base = times["slots"]
        parts = []
        for name, ts in times.items():
            ratio = statistics.median(y / x for x, y in zip(base, ts, strict=True))
            parts.append(f"{name} {statistics.median(ts) * 1e6:.1f} us ({ratio:.2f}x)")
        print(f"{n} streams, {length} positions: " + ", ".join(parts), flush=True)


def _paged_case(n: int, length: int, rounds: int) -> dict[str, list[float]]:
    import torch
    import torch.nn.functional as F

    k, g, e, block = 3, 3, 64, 64
    gen = torch.Generator().manual_seed(n * length)
    nb = length // block
    slots = torch.randn(8, 2 * k, length, e, generator=gen).to(torch.bfloat16)
    pool = torch.randn(8 * nb * 2, 2 * k, block, e, generator=gen).to(torch.bfloat16)
    table = torch.randperm(pool.shape[0], generator=gen)[: n * nb].view(n, nb)
    flat = pool.permute(1, 0, 2, 3).reshape(2 * k, -1, e)  # [2K, positions, E]
    positions = (table[:, :, None] * block + torch.arange(block)).view(n, length)
    q = torch.randn(n, k, g, e, generator=gen).to(torch.bfloat16)
    mask = torch.zeros(n, 1, g, length, dtype=torch.bfloat16)

    def slot_view() -> Any:
        rows = slots[:n]
        return F.scaled_dot_product_attention(q, rows[:, :k], rows[:, k:], attn_mask=mask)

    def block_gather() -> Any:
        rows = pool[table].permute(0, 2, 1, 3, 4).reshape(n, 2 * k, length, e)
        return F.scaled_dot_product_attention(q, rows[:, :k], rows[:, k:], attn_mask=mask)

    def position_gather() -> Any:
        rows = flat[:, positions].permute(1, 0, 2, 3)  # [n, 2K, T, E], one copy
        return F.scaled_dot_product_attention(q, rows[:, :k], rows[:, k:], attn_mask=mask)

    def per_job() -> Any:
        outs = []
        for j in range(n):
            rows = flat[:, j * 2 * length : j * 2 * length + length][None]
            outs.append(
                F.scaled_dot_product_attention(
                    q[j : j + 1], rows[:, :k], rows[:, k:], attn_mask=mask[j : j + 1]
                )
            )
        return outs[0] if n == 1 else torch.cat(outs)

    variants = {
        "slots": slot_view,
        "blocks": block_gather,
        "positions": position_gather,
        "per-job views": per_job,
    }
    assert torch.equal(block_gather(), position_gather())
    times: dict[str, list[float]] = {name: [] for name in variants}
    calls = max(200, 20_000 // (n * nb))
    with torch.inference_mode():
        for i in range(calls * rounds):
            order = list(variants.items())
            for name, f in order if i % 2 else reversed(order):
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
    return times


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=("speed", "rss", "rss-child", "paged"))
    parser.add_argument("settings", nargs="*", help="JSON CpuEngine.load keyword arguments")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cases",
        default=",".join(f"{s}x{p}" for s, p, _ in CASES),
        help="speed cases as STREAMSxPROMPT, comma-separated (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    settings = [json.loads(s) for s in args.settings]
    if args.what == "speed":
        a, b = settings if len(settings) == 2 else ({}, {"kv_cache_dtype": "int8"})
        steps = {(s, p): n for s, p, n in CASES}
        cases = []
        for case in args.cases.split(","):
            streams, prompt = (int(x) for x in case.split("x"))
            cases.append((streams, prompt, steps.get((streams, prompt), 48)))
        speed(a, b, args.rounds, cases)
    elif args.what == "paged":
        paged(args.rounds)
    elif args.what == "rss":
        rss(settings or [{}, {"kv_cache_dtype": "int8"}], args.rounds)
    else:
        rss_child(settings[0] if settings else {})


if __name__ == "__main__":
    main()
