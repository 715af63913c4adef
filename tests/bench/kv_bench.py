"""The KV cache's options measured against each other (issue 23, levers 3 and 4).

``python tests/bench/kv_bench.py speed`` steps two engines alternately, one
decode step of each in turn (which goes first alternating between rounds), so
that both see the same machine load step by step; it prints the median step
time of each and the median and quartiles of the per-pair ratios, for 1 and 8
streams at a short and a long context. ``python tests/bench/kv_bench.py rss``
runs 8 jobs of 900 prompt + 100 generated tokens in a fresh process per
setting and prints its peak RSS (``VmHWM``) and the KV cache's largest size.
Method and results: docs/performance.md, "Issue 23's levers".
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
    _drive,
    _vm_hwm,
    prompt_of,
)
from trioserve.engine.base import Failed, GenerationSpec, TextUpdate, Update
from trioserve.engine.cpu import CpuEngine

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


def speed(kwargs_a: dict[str, Any], kwargs_b: dict[str, Any], rounds: int) -> None:
    a = CpuEngine.load(max_batch=8, prefix_cache_bytes=0, **kwargs_a)
    b = CpuEngine.load(max_batch=8, prefix_cache_bytes=0, **kwargs_b)
    print(f"A = {kwargs_a}, B = {kwargs_b}; load average {os.getloadavg()[0]:.1f}")
    for streams, prompt, steps in CASES:
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
    step = engine.step

    def counting(submit: Sequence[GenerationSpec], cancel: Sequence[int]) -> list[Update]:
        nonlocal largest
        out = step(submit, cancel)
        largest = max(largest, engine.statistics().kv_cache_bytes)
        return out

    engine.step = counting  # type: ignore[method-assign]
    _drive(engine, specs)
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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=("speed", "rss", "rss-child"))
    parser.add_argument("settings", nargs="*", help="JSON CpuEngine.load keyword arguments")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    settings = [json.loads(s) for s in args.settings]
    if args.what == "speed":
        a, b = settings if len(settings) == 2 else ({}, {"kv_cache_dtype": "int8"})
        speed(a, b, args.rounds)
    elif args.what == "rss":
        rss(settings or [{}, {"kv_cache_dtype": "int8"}], args.rounds)
    else:
        rss_child(settings[0] if settings else {})


if __name__ == "__main__":
    main()
