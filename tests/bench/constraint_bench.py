"""What structured output costs on the CPU engine (issue 18).

The engine alone (no server), the embedded model, greedy:

* decode tokens per second of a job constrained by a JSON schema against the
  same prompt unconstrained, for 1 stream and 8 streams, the two sides
  alternating within each round (which goes first alternating between rounds),
  ratios per round and their median;
* the same comparison step by step: two engines, one running the constrained
  jobs and one the plain ones, stepped alternately (which first alternating),
  and the median of the per-step time ratios (robust to a machine whose load
  changes from second to second);
* the mask's CPU time per step (p50, p99), replayed over the constrained
  outputs' own tokens, so the figure is the work the engine did;
* compile times of schemas, a regex and a grammar (cache misses).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from trioserve.engine.base import GenerationSpec
from trioserve.engine.cpu.engine import CpuEngine
from trioserve.engine.grammars import Grammars, MaskRows
from trioserve.vocabulary.constraint import Constraint
from trioserve.vocabulary.results import Finished, TextUpdate, Update
from trioserve.vocabulary.sampling import SamplingSettings

ROUNDS = 5
NEW_TOKENS = 128
STREAMS = (1, 8)
GREEDY = SamplingSettings(temperature=0.0, rep_pen=1.0)

#: Long enough output: a list of cities, each an object of three fields.
CITIES = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "minItems": 30,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "country": {"type": "string", "maxLength": 24},
                    "population": {"type": "integer", "minimum": 0},
                },
                "required": ["name", "country", "population"],
            },
        }
    },
    "required": ["cities"],
}


def _prompt(engine: CpuEngine, salt: int) -> tuple[int, ...]:
    question = f"List thirty large cities (set {salt}) with their country and population as JSON."
    return tuple(engine.encode(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"))


def _decode_rate(
    engine: CpuEngine, specs: Sequence[GenerationSpec]
) -> tuple[float, dict[int, list[int]]]:
    """Aggregate decode tokens per second (each job's first token, its
    prefill, excluded) and each job's generated text as ids."""
    firsts: dict[int, float] = {}
    lasts: dict[int, float] = {}
    counts = {s.job_id: 0 for s in specs}
    texts: dict[int, str] = {s.job_id: "" for s in specs}
    open_jobs = set(counts)
    submit: Sequence[GenerationSpec] = specs
    while open_jobs:
        updates: list[Update] = engine.step(submit, [])
        submit = []
        now = time.perf_counter()
        for update in updates:
            if isinstance(update, TextUpdate | Finished):
                job = update.job_id
                firsts.setdefault(job, now)
                lasts[job] = now
                counts[job] = update.generated_tokens
                texts[job] += update.text
            if not isinstance(update, TextUpdate):
                if not isinstance(update, Finished):
                    raise RuntimeError(f"benchmark job failed: {update}")
                open_jobs.discard(update.job_id)
    span = max(lasts.values()) - min(firsts.values())
    tokens = sum(n - 1 for n in counts.values())
    return tokens / span, {job: engine.encode(text) for job, text in texts.items()}


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(results: list[dict[str, Any]], *, say: Callable[[str], None] = print) -> None:
    engine = CpuEngine.load(max_batch=max(STREAMS), prefix_cache_mib=0)
    grammars = engine.grammars
    assert grammars is not None, "the embedded model's engine has grammars"
    compiled = grammars.compile(Constraint.json_schema(CITIES))
    eos = frozenset(engine.info.eos_token_ids)
    job = 0
    outputs: list[list[int]] = []
    for streams in STREAMS:
        ratios, plain_rates, constrained_rates = [], [], []
        for r in range(ROUNDS):
            rates = {}
            for side in ("plain", "constrained") if r % 2 == 0 else ("constrained", "plain"):
                specs = []
                for i in range(streams):
                    job += 1
                    prompt = _prompt(engine, r * 100 + i)
                    if side == "plain":
                        # No stop token: exactly NEW_TOKENS tokens, as the
                        # constrained job (whose schema asks for 30 objects).
                        spec = GenerationSpec(job, prompt, NEW_TOKENS, sampling=GREEDY)
                    else:
                        spec = GenerationSpec(
                            job,
                            prompt,
                            NEW_TOKENS,
                            sampling=GREEDY,
                            stop_token_ids=eos,
                            constraint=compiled,
                        )
                    specs.append(spec)
                rates[side], produced = _decode_rate(engine, specs)
                if side == "constrained":
                    outputs.extend(produced.values())
            ratios.append(rates["constrained"] / rates["plain"])
            plain_rates.append(rates["plain"])
            constrained_rates.append(rates["constrained"])
            say(
                f"constraint bench: {streams} stream(s) round {r}: plain {rates['plain']:.1f},"
                f" constrained {rates['constrained']:.1f} tok/s"
            )
        results.append(
            {
                "metric": f"constrained / unconstrained decode, {streams} stream(s)",
                "value": f"{_median(ratios):.2f}x ({min(ratios):.2f} to {max(ratios):.2f});"
                f" {_median(constrained_rates):.1f} vs {_median(plain_rates):.1f} tok/s",
                "goal": ">= 0.9",
            }
        )
    for streams in STREAMS:
        ratio, low, high, steps = _interleaved(engine, compiled, streams)
        results.append(
            {
                "metric": f"the same, step by step (interleaved engines), {streams} stream(s)",
                "value": f"{ratio:.3f}x (quartiles {low:.3f} to {high:.3f}) over {steps} steps",
                "goal": ">= 0.9",
            }
        )
    # The masks the constrained jobs needed, replayed over their own tokens.
    masks = MaskRows(engine.info.vocab_size, 1)
    times: list[float] = []
    for output in outputs:
        matcher = compiled.matcher()
        for token in output:
            started = time.thread_time()
            masks.fill([matcher])
            times.append(time.thread_time() - started)
            if not matcher.consume_token(token):
                break
    results.append(
        {
            "metric": "mask per step, JSON schema (CPU time, with the expansion to a bool mask)",
            "value": f"p50 {_percentile(times, 0.5) * 1e6:.0f} us, p99"
            f" {_percentile(times, 0.99) * 1e6:.0f} us, max {max(times) * 1e3:.1f} ms"
            f" over {len(times)} steps",
            "goal": "",
        }
    )
    # Compile times: distinct schemas (cache misses), a regex, a grammar.
    compile_times = []
    for n in range(40):
        schema = {**CITIES, "title": f"cities {n}"}
        started = time.perf_counter()
        grammars.compile(Constraint.json_schema(schema))
        compile_times.append(time.perf_counter() - started)
    regex = _timed(grammars, Constraint("regex", r"[A-Z][a-z]+, [A-Z][a-z]+ \(pop\. [0-9]{1,8}\)"))
    gbnf = _timed(
        grammars,
        Constraint("grammar", 'root ::= item (", " item)*\nitem ::= [A-Z] [a-z]+ " " [0-9]+'),
    )
    results.append(
        {
            "metric": "compile: JSON schema (40 distinct) / regex / GBNF grammar",
            "value": f"schema p50 {_percentile(compile_times, 0.5) * 1e3:.1f} ms, p99"
            f" {_percentile(compile_times, 0.99) * 1e3:.1f} ms; regex {regex * 1e3:.1f} ms;"
            f" grammar {gbnf * 1e3:.1f} ms",
            "goal": "",
        }
    )
    engine.close()


def _interleaved(
    constrained: CpuEngine, compiled: Any, streams: int, steps: int = 120
) -> tuple[float, float, float, int]:
    """Plain step time / constrained step time, per pair of steps taken one
    after the other (the order alternating), over the steps where every job
    of both engines decodes: the median and the quartiles."""
    plain = CpuEngine.load(max_batch=max(STREAMS), prefix_cache_mib=0)
    eos = frozenset(constrained.info.eos_token_ids)
    new = steps + 8
    a_specs = [
        GenerationSpec(
            10_000 + i,
            _prompt(constrained, 900 + i),
            new,
            sampling=GREEDY,
            stop_token_ids=eos,
            constraint=compiled,
        )
        for i in range(streams)
    ]
    b_specs = [
        GenerationSpec(20_000 + i, _prompt(plain, 900 + i), new, sampling=GREEDY)
        for i in range(streams)
    ]
    # Prefill both, outside the timing.
    for engine, specs in ((constrained, a_specs), (plain, b_specs)):
        engine.step(specs, [])
        engine.step([], [])
    ratios: list[float] = []
    for i in range(steps):
        order = (
            [(constrained, "a"), (plain, "b")] if i % 2 == 0 else [(plain, "b"), (constrained, "a")]
        )
        took: dict[str, float] = {}
        ended = False
        for engine, side in order:
            started = time.perf_counter()
            updates = engine.step([], [])
            took[side] = time.perf_counter() - started
            ended = ended or any(not isinstance(u, TextUpdate) for u in updates)
        if ended:
            break
        ratios.append(took["b"] / took["a"])
    for engine, specs in ((constrained, a_specs), (plain, b_specs)):
        engine.step([], [s.job_id for s in specs])
    plain.close()
    quartiles = statistics.quantiles(ratios, n=4)
    return _median(ratios), quartiles[0], quartiles[2], len(ratios)


def _timed(grammars: Grammars, constraint: Constraint) -> float:
    started = time.perf_counter()
    grammars.compile(constraint)
    return time.perf_counter() - started


def markdown(results: Sequence[dict[str, Any]]) -> str:
    lines = ["| metric | measured (median, rounds' range) | goal |", "|---|---|---|"]
    lines += [f"| {r['metric']} | {r['value']} | {r['goal']} |" for r in results]
    return "\n".join(lines)
