"""Replicas behind nginx's least_conn against replicas behind SGLang's Model Gateway
(cache_aware), on a multi-tenant trace (docs/scale-out.md, "The gateway").

Each side is three ``python -m trioserve`` replicas on the embedded model, started
fresh for every run of the trace (empty prefix caches, memory peaks of that run
alone), and nginx as a first hop on both:

* **nginx**: deploy/nginx/ as shipped (``least_conn`` over the replicas);
* **gateway**: deploy/gateway/ as shipped: ``run-replicas`` (the replicas and
  sglang-router, cache_aware) and nginx's front (the OpenAI routes to the gateway).

The trace: six tenants, each with its own system prompt (500 to 1,500 tokens of prose,
different from the first words), several users per tenant, each user a first turn and
a follow-up turn that carries the first turn's question and answer; every request a
streamed chat completion, greedy, ``max_tokens`` 16 (the end of text allowed). Users
are taken in tenant-interleaved order by a fixed number of concurrent clients, each
running one user's two turns in order. The same trace runs on both sides, in rounds,
the side that goes first alternating.

Per side, over all its runs: the prefix cache's hit rate (cached prompt tokens over
prompt tokens, the replicas' own ``trioserve_cached_prompt_tokens_total`` and
``trioserve_prompt_tokens_total``), the time to the first streamed token (p50, p99),
the throughput (generated tokens and requests over the runs' wall time), how the
requests spread over the replicas, and each replica's peak RSS (``VmHWM``). Then the
ratios, gateway over nginx, with their goals: hit rate >= 2, TTFT p50 < 1, throughput
>= 1.

    python tests/bench/run.py --only gateway [--quick]
    python -m tests.bench.gateway_bench [--quick] [--rounds N] [--users N]

It needs nginx (installed with apt as root when missing) and sglang-router (this
Python's, or the one ``SGLANG_ROUTER_PYTHON`` names); without either it says so and
measures nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import attrs
import pytest

from tests.deploy.cluster import (
    AUTH,
    Balancer,
    Instance,
    Metrics,
    cleared_proxy_environment,
    ensure_nginx,
    enterable_directory,
    free_ports,
    make_certificate,
)
from tests.deploy.gateway import (
    Front,
    Pool,
    consecutive_free_ports,
    http_get,
    router_python_or_skip,
)
from trioserve.engine.models import default_model_dir
from trioserve.engine.tokenizer import Tokenizer

__all__ = ["FULL", "QUICK", "GatewayResult", "Scale", "format_gateway_table", "run"]

REPLICAS = 3
SIDES = ("nginx", "gateway")
#: The six tenants' system prompts, in tokens.
PROMPT_TOKENS = (500, 700, 900, 1100, 1300, 1500)
TENANTS = (
    "Harbour Ferries",
    "Northwind Bakery",
    "Alder Street Clinic",
    "Quarry Hill School",
    "Riverside Library",
    "Copperleaf Insurance",
)
#: What the tenants' house rules are made of.
WORDS = tuple(
    " ".join(
        (
            "account answer appointment arrival balance booking branch budget calendar change",
            "claim clerk client contract counter customer date deadline delivery deposit desk",
            "detail document draft due email entry estimate fee file form guide holiday hour",
            "invoice item ledger letter limit list manager meeting member message method",
            "notice number office order owner page payment period phone plan policy price",
            "record refund register reminder report request route rule schedule season",
            "service shift signature slot staff statement step summary supply table term",
            "ticket timetable total transfer update visit voucher week window",
        )
    ).split(" ")
)


@attrs.frozen
class Scale:
    users: int  # per tenant
    rounds: int
    concurrency: int
    max_tokens: int = 16


QUICK = Scale(users=2, rounds=1, concurrency=4)
FULL = Scale(users=3, rounds=3, concurrency=6)


@attrs.frozen
class Session:
    """One user of one tenant: two turns."""

    tenant: int
    user: int
    system: str
    questions: tuple[str, str]


def _prose(tokenizer: Tokenizer, tenant: str, tokens: int, seed: int) -> str:
    """About ``tokens`` tokens of rule-like prose for ``tenant``."""
    rng = random.Random(seed)
    sentences = [f"You are the assistant of {tenant}. Follow these house rules."]
    n = 1
    while len(tokenizer.encode(" ".join(sentences))) < tokens:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14)))
        sentences.append(f"Rule {n}: every {words} stays with {tenant}.")
        n += 1
    return tokenizer.decode(tokenizer.encode(" ".join(sentences))[:tokens])


def build_trace(tokenizer: Tokenizer, users: int) -> list[Session]:
    """The sessions in the order clients take them: the first user of every tenant,
    then the second of every tenant, ..."""
    systems = [
        _prose(tokenizer, name, tokens, seed)
        for seed, (name, tokens) in enumerate(zip(TENANTS, PROMPT_TOKENS, strict=True))
    ]
    return [
        Session(
            tenant=t,
            user=u,
            system=systems[t],
            questions=(
                f"I am customer {u + 1}. Which rule covers my {WORDS[(7 * u + t) % len(WORDS)]}?",
                "Thank you. And what should I do next?",
            ),
        )
        for u in range(users)
        for t in range(len(TENANTS))
    ]


# --- One request --------------------------------------------------------------------------


@attrs.frozen
class Answer:
    ttft: float
    text: str
    generated: int


def stream_chat(port: int, messages: list[dict[str, str]], max_tokens: int) -> Answer:
    """A streamed chat completion through the balancer on ``port``, read event by event."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    generated = 0
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body).encode(),
            headers={**AUTH, "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"answered {response.status}: {response.read()[:300]!r}")
        for line in response:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                break
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            content = choices[0].get("delta", {}).get("content") if choices else None
            if content:
                if first is None:
                    first = time.perf_counter()
                parts.append(content)
            if event.get("usage"):
                generated = int(event["usage"]["completion_tokens"])
    finally:
        conn.close()
    if first is None:
        # An answer may be empty (the end of text first): its first token is its end.
        first = time.perf_counter()
    return Answer(ttft=first - started, text="".join(parts), generated=generated)


@attrs.define
class TraceRun:
    ttfts: list[float] = attrs.Factory(list)
    generated: int = 0
    requests: int = 0
    errors: list[str] = attrs.Factory(list)
    wall: float = 0.0


def run_trace(port: int, sessions: Sequence[Session], scale: Scale) -> TraceRun:
    """Every session through the balancer on ``port``, ``scale.concurrency`` at a time."""
    run = TraceRun()
    lock = threading.Lock()

    def one(session: Session) -> None:
        history = [{"role": "system", "content": session.system}]
        for question in session.questions:
            history.append({"role": "user", "content": question})
            try:
                answer = stream_chat(port, history, scale.max_tokens)
            except Exception as error:
                with lock:
                    run.errors.append(f"tenant {session.tenant} user {session.user}: {error}")
                return
            history.append({"role": "assistant", "content": answer.text})
            with lock:
                run.ttfts.append(answer.ttft)
                run.generated += answer.generated
                run.requests += 1

    started = time.perf_counter()
    with ThreadPoolExecutor(scale.concurrency) as pool:
        list(pool.map(one, sessions))
    run.wall = time.perf_counter() - started
    return run


# --- The two sides -------------------------------------------------------------------------


@attrs.frozen
class Deployed:
    """A side, running: where clients send, and each replica's port and pid."""

    port: int
    replicas: tuple[tuple[int, int], ...]


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


@contextlib.contextmanager
def nginx_side(nginx: str, replica_args: Sequence[str]) -> Iterator[Deployed]:
    """Three replicas behind deploy/nginx/ as shipped (least_conn)."""
    directory = enterable_directory("trioserve-bench-nginx-")
    ports = free_ports(REPLICAS + 2)
    instances = [Instance(f"r{n}", ports[n], tuple(replica_args)) for n in range(REPLICAS)]
    balancer = Balancer(
        nginx,
        directory,
        upstreams=ports[:REPLICAS],
        http_port=ports[REPLICAS],
        tls_port=ports[REPLICAS + 1],
        certificate=make_certificate(directory),
    )
    try:
        for instance in instances:
            instance.start()
        balancer.start()
        for instance in instances:
            instance.wait_listening()
        assert all(i.process is not None for i in instances)
        yield Deployed(
            port=balancer.http_port,
            replicas=tuple((i.port, i.process.pid) for i in instances if i.process is not None),
        )
    finally:
        balancer.stop()
        for instance in instances:
            instance.stop()
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def gateway_side(
    nginx: str, router_python: str, replica_args: Sequence[str], gateway_args: Sequence[str]
) -> Iterator[Deployed]:
    """deploy/gateway/ as shipped: run-replicas (three replicas and the gateway) and
    nginx's front."""
    directory = enterable_directory("trioserve-bench-gateway-")
    base = consecutive_free_ports(REPLICAS)
    gateway_port, metrics_port, http_port, tls_port = free_ports(4)
    pool = Pool(
        replicas=REPLICAS,
        base_port=base,
        gateway_port=gateway_port,
        metrics_port=metrics_port,
        router_python=router_python,
        trioserve_args=replica_args,
        gateway_args=gateway_args,
    )
    front = Front(
        nginx,
        directory,
        upstreams=pool.ports,
        gateway_port=gateway_port,
        http_port=http_port,
        tls_port=tls_port,
        certificate=make_certificate(directory),
    )
    try:
        pool.start()
        front.start()
        pool.wait_ready()
        yield Deployed(port=http_port, replicas=tuple((p, pool.pid(p)) for p in pool.ports))
    finally:
        front.stop()
        pool.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _replica_counts(replicas: Sequence[tuple[int, int]]) -> list[dict[str, float]]:
    """Each replica's prompt, cached and request counters (OpenAI door)."""
    counts = []
    for port, _ in replicas:
        status, body = http_get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200, (port, status)
        metrics = Metrics(body.decode())
        counts.append(
            {
                name: metrics.value(f"trioserve_{name}", api="openai")
                for name in ("prompt_tokens_total", "cached_prompt_tokens_total", "requests_total")
            }
        )
    return counts


@attrs.frozen
class SideRun:
    side: str
    round: int
    run: TraceRun
    prompt: int
    cached: int
    served: tuple[int, ...]
    peak_rss: tuple[int, ...]


def _warm(deployed: Deployed) -> None:
    """One short request to each replica, straight to it: the first request's one-time
    costs stay out of the trace, and nothing of the trace's is cached."""
    for port, _ in deployed.replicas:
        stream_chat(port, [{"role": "user", "content": "Hello"}], 1)


def run_side(
    side: str,
    round_: int,
    deploy: Callable[[], contextlib.AbstractContextManager[Deployed]],
    sessions: Sequence[Session],
    scale: Scale,
) -> SideRun:
    with deploy() as deployed:
        _warm(deployed)
        before = _replica_counts(deployed.replicas)
        run = run_trace(deployed.port, sessions, scale)
        after = _replica_counts(deployed.replicas)
        peaks = tuple(_peak_rss(pid) for _, pid in deployed.replicas)

    def grew(name: str) -> list[int]:
        return [int(a[name] - b[name]) for a, b in zip(after, before, strict=True)]

    return SideRun(
        side=side,
        round=round_,
        run=run,
        prompt=sum(grew("prompt_tokens_total")),
        cached=sum(grew("cached_prompt_tokens_total")),
        served=tuple(grew("requests_total")),
        peak_rss=peaks,
    )


# --- The bench ------------------------------------------------------------------------------


@attrs.frozen
class GatewayResult:
    scale: Scale
    runs: tuple[SideRun, ...] = ()
    skipped: str | None = None


def replica_args(threads: int, prefix_cache_mib: int | None) -> list[str]:
    args = ["--context-length", "2048", "--threads", str(threads)]
    if prefix_cache_mib is not None:
        args += ["--prefix-cache-mib", str(prefix_cache_mib)]
    return args


def run(
    scale: Scale,
    *,
    say: Callable[[str], None],
    threads: int | None = None,
    prefix_cache_mib: int | None = None,
    gateway_args: Sequence[str] = (),
) -> GatewayResult:
    """Both sides, ``scale.rounds`` times each, the first side alternating."""
    try:
        nginx = ensure_nginx()
        router_python = router_python_or_skip()
    except pytest.skip.Exception as skipped:
        say(f"gateway bench skipped: {skipped}")
        return GatewayResult(scale=scale, skipped=str(skipped))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = threads or max(1, (cores or 1) // REPLICAS)
    args = replica_args(threads, prefix_cache_mib)
    sessions = build_trace(Tokenizer.from_dir(default_model_dir()), scale.users)
    say(
        f"gateway bench: {len(sessions)} users x 2 turns per run, {scale.concurrency} clients, "
        f"{scale.rounds} round(s); replicas: {' '.join(args)}"
    )
    deployers: dict[str, Callable[[], contextlib.AbstractContextManager[Deployed]]] = {
        "nginx": lambda: nginx_side(nginx, args),
        "gateway": lambda: gateway_side(nginx, router_python, args, gateway_args),
    }
    runs: list[SideRun] = []
    with cleared_proxy_environment():
        for round_ in range(scale.rounds):
            order = SIDES if round_ % 2 == 0 else SIDES[::-1]
            for side in order:
                done = run_side(side, round_, deployers[side], sessions, scale)
                runs.append(done)
                say(
                    f"  round {round_ + 1}/{scale.rounds} {side}: hit rate "
                    f"{done.cached / max(done.prompt, 1):.2f}, TTFT p50 "
                    f"{statistics.median(done.run.ttfts or [0]) * 1000:.0f} ms, "
                    f"{done.run.wall:.0f} s, served {list(done.served)}, "
                    f"errors {len(done.run.errors)}"
                )
    return GatewayResult(scale=scale, runs=tuple(runs))


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@attrs.frozen
class SideSummary:
    hit_rate: float
    ttft_p50: float
    ttft_p99: float
    generated_tps: float
    requests_ps: float
    wall: float
    served: tuple[int, ...]
    peak_rss_mib: tuple[float, ...]
    errors: int


def summarize(runs: Sequence[SideRun]) -> SideSummary:
    ttfts = [t for r in runs for t in r.run.ttfts]
    wall = sum(r.run.wall for r in runs)
    return SideSummary(
        hit_rate=sum(r.cached for r in runs) / max(sum(r.prompt for r in runs), 1),
        ttft_p50=statistics.median(ttfts) if ttfts else float("nan"),
        ttft_p99=_quantile(ttfts, 0.99),
        generated_tps=sum(r.run.generated for r in runs) / wall,
        requests_ps=sum(r.run.requests for r in runs) / wall,
        wall=wall,
        served=tuple(sum(col) for col in zip(*(r.served for r in runs), strict=True)),
        peak_rss_mib=tuple(
            max(col) / 2**20 for col in zip(*(r.peak_rss for r in runs), strict=True)
        ),
        errors=sum(len(r.run.errors) for r in runs),
    )


def format_gateway_table(result: GatewayResult) -> str:
    if result.skipped is not None:
        return f"gateway bench skipped: {result.skipped}"
    sides = {side: summarize([r for r in result.runs if r.side == side]) for side in SIDES}
    s = result.scale
    requests = len(TENANTS) * s.users * 2
    lines = [
        f"#### {REPLICAS} replicas: nginx least_conn against the gateway's cache_aware",
        "",
        f"{len(TENANTS)} tenants (system prompts of {PROMPT_TOKENS[0]} to {PROMPT_TOKENS[-1]} "
        f"tokens), {s.users} users each, 2 turns: {requests} streamed chat completions per run, "
        f"max_tokens {s.max_tokens}, greedy, {s.concurrency} clients; {s.rounds} run(s) per side, "
        "fresh replicas for each.",
        "",
        "| side | prefix-cache hits / prompt tokens | TTFT p50 | TTFT p99 | generated tok/s "
        "| requests/s | requests per replica | peak RSS per replica | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for side, m in sides.items():
        lines.append(
            f"| {side} | {m.hit_rate:.3f} | {m.ttft_p50 * 1000:.0f} ms "
            f"| {m.ttft_p99 * 1000:.0f} ms | {m.generated_tps:.1f} | {m.requests_ps:.2f} "
            f"| {', '.join(map(str, m.served))} "
            f"| {', '.join(f'{r:.0f}' for r in m.peak_rss_mib)} MiB | {m.errors} |"
        )
    n, g = sides["nginx"], sides["gateway"]
    per_round = [
        (a, b)
        for a in result.runs
        for b in result.runs
        if a.side == "gateway" and b.side == "nginx" and a.round == b.round
    ]

    def spread(values: Sequence[float]) -> str:
        return f" (runs {min(values):.2f} to {max(values):.2f})" if len(values) > 1 else ""

    hit = [
        (a.cached / max(a.prompt, 1)) / max(b.cached / max(b.prompt, 1), 1e-9) for a, b in per_round
    ]
    ttft = [
        statistics.median(a.run.ttfts) / statistics.median(b.run.ttfts)
        for a, b in per_round
        if a.run.ttfts and b.run.ttfts
    ]
    tps = [
        (a.run.generated / a.run.wall) / (b.run.generated / b.run.wall)
        for a, b in per_round
        if b.run.generated
    ]

    def verdict(ok: bool) -> str:
        return "met" if ok else "**missed**"

    hit_ratio = g.hit_rate / max(n.hit_rate, 1e-9)
    ttft_ratio = g.ttft_p50 / n.ttft_p50
    tps_ratio = g.generated_tps / n.generated_tps
    lines += [
        "",
        f"gateway / nginx: hit rate {hit_ratio:.2f}{spread(hit)}, goal >= 2: "
        f"{verdict(hit_ratio >= 2)}; TTFT p50 {ttft_ratio:.2f}{spread(ttft)}, goal < 1: "
        f"{verdict(ttft_ratio < 1)}; throughput {tps_ratio:.2f}{spread(tps)}, goal >= 1: "
        f"{verdict(tps_ratio >= 1)}.",
    ]
    errors = [e for r in result.runs for e in r.run.errors]
    if errors:
        lines.append(f"\nErrors ({len(errors)}): " + "; ".join(errors[:5]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 2 users per tenant")
    parser.add_argument("--rounds", type=int, help="runs per side")
    parser.add_argument("--users", type=int, help="users per tenant")
    parser.add_argument("--concurrency", type=int, help="clients at once")
    parser.add_argument("--threads", type=int, help="torch threads per replica")
    parser.add_argument("--prefix-cache-mib", type=int, help="each replica's prefix cache")
    parser.add_argument(
        "--gateway-arg", action="append", default=[], help="one more sglang-router option"
    )
    args = parser.parse_args(argv)
    scale = QUICK if args.quick else FULL
    scale = attrs.evolve(
        scale,
        **{
            k: v
            for k, v in (
                ("rounds", args.rounds),
                ("users", args.users),
                ("concurrency", args.concurrency),
            )
            if v is not None
        },
    )
    result = run(
        scale,
        say=lambda line: print(line, file=sys.stderr, flush=True),
        threads=args.threads,
        prefix_cache_mib=args.prefix_cache_mib,
        gateway_args=args.gateway_arg,
    )
    print(format_gateway_table(result))


if __name__ == "__main__":
    main()
