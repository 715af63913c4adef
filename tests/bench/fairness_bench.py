"""Work-conserving fairness, measured against the caps it replaces.

Three ``python -m trioserve`` processes on loopback (the embedded model,
``--max-batch 8``, torch's thread count, ``--trusted-proxy 127.0.0.1`` so
that the bench's connections are told apart by ``X-Forwarded-For``), driven
by the same client code as ``tests.bench.server_vs_llama`` (streaming
``/v1/completions``, greedy, the end of text banned, every token timed as its
event arrives):

* **default**: no fairness flag. On the CPU engine a lone client may hold
  every slot, and a second client's request that finds none free takes one
  at once, by pausing the first client's newest job (kept, not recomputed).
* ``--max-running-per-client 8``: every slot, and no one ever waits for one
  (what the benches passed before the default used every slot).
* ``--max-running-per-client 7``: all but one slot, the default before the
  engine could pause: a newcomer always finds the free slot.

Measured, in rounds (the servers' order rotating between rounds; ratios
within a round, medians and the rounds' range):

* **8 streams, one client**: 8 requests of 128 tokens sent together by one
  client; all tokens over the time from sending to the last (default against
  ``--max-running-per-client 8``: the cost of the fairness machinery when
  no one else is there).
* **a second client's time to first token while the first floods**: client
  1 sends 16 requests of 128 tokens (8 run, 8 wait); once its tokens flow,
  client 2 sends 8 requests of 8 tokens, one after another, each timed from
  sending to its first token (default against ``--max-running-per-client
  7``: must not grow). The flood's tokens per second over the same window
  are reported beside it.

    python -m tests.bench.fairness_bench [--rounds N]
    python tests/bench/run.py --only fairness
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from tests.bench.server_vs_llama import (
    EOS_ID,
    STREAMS,
    TOKENS,
    Trioserve,
    _has_text,
    _prose,
    _sse,
    together,
)
from trioserve.engine.models import default_model_dir
from trioserve.engine.tokenizer import Tokenizer

ROUNDS = 5
FLOOD = 2 * STREAMS
PROBES = 8
PROBE_TOKENS = 8
CONFIGS: dict[str, list[str]] = {
    "default": [],
    "cap 8": ["--max-running-per-client", str(STREAMS)],
    "cap 7": ["--max-running-per-client", str(STREAMS - 1)],
}


def _client(n: int) -> dict[str, str]:
    return {"X-Forwarded-For": f"192.0.2.{n}"}


def _stream(
    server: Trioserve,
    prompt: Sequence[int],
    tokens: int,
    client: int,
    on_token: Callable[[], None] | None = None,
) -> list[float]:
    body: dict[str, Any] = {
        "model": "default",
        "prompt": list(prompt),
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
        "bann_bann": [EOS_ID],
    }

    def counts(event: Any) -> bool:
        has = _has_text(event)
        if has and on_token is not None:
            on_token()
        return has

    return _sse(server.port, "/v1/completions", body, counts, _client(client))


def newcomer(
    server: Trioserve, flood: Sequence[Sequence[int]], probes: Sequence[Sequence[int]]
) -> tuple[float, float]:
    """Client 2's median time to first token (s) while client 1 floods, and
    the flood's tokens per second from its first token to the last probe's end."""
    flowing = threading.Event()
    stamps: list[list[float]] = [[] for _ in flood]

    def one(i: int) -> None:
        stamps[i] = _stream(server, flood[i], TOKENS, 1, flowing.set)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(flood))]
    for t in threads:
        t.start()
    if not flowing.wait(600):
        raise RuntimeError("the flood produced no token")
    time.sleep(0.5)  # every slot busy, the rest queued
    window_start = time.perf_counter()
    firsts: list[float] = []
    for prompt in probes:
        sent = time.perf_counter()
        got = _stream(server, prompt, PROBE_TOKENS, 2)
        if not got:
            raise RuntimeError("a probe produced no token")
        firsts.append(got[0] - sent)
        time.sleep(0.2)
    window_end = time.perf_counter()
    for t in threads:
        t.join()
    flooded = sum(1 for s in stamps for x in s if window_start <= x <= window_end)
    return statistics.median(firsts), flooded / (window_end - window_start)


def run(results: list[dict[str, Any]], *, say: Callable[[str], None], rounds: int = ROUNDS) -> None:
    """Measure the three configurations; append rows (section ``"fairness"``)."""
    tokenizer = Tokenizer.from_dir(default_model_dir())
    threads = torch.get_num_threads()
    base = ["--max-batch", str(STREAMS), "--trusted-proxy", "127.0.0.1"]
    servers = {name: Trioserve(threads, [*base, *args]) for name, args in CONFIGS.items()}
    series: dict[str, list[float]] = {}

    def note(key: str, value: float) -> None:
        series.setdefault(key, []).append(value)

    try:
        names = list(servers)
        for round_ in range(rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                server = servers[name]
                salt = 1000 * round_
                prompts = [_prose(tokenizer, 20, salt + i) for i in range(STREAMS)]
                if name != "cap 7":
                    note(f"{name} streams", together(server, prompts, TOKENS))
                if name != "cap 8":
                    flood = [_prose(tokenizer, 20, salt + 100 + i) for i in range(FLOOD)]
                    probes = [_prose(tokenizer, 20, salt + 200 + i) for i in range(PROBES)]
                    first, rate = newcomer(server, flood, probes)
                    note(f"{name} first", first)
                    note(f"{name} flood", rate)
            say(
                f"round {round_ + 1}/{rounds}: 8 streams default"
                f" {series['default streams'][-1]:.1f} vs cap 8 {series['cap 8 streams'][-1]:.1f}"
                f" tok/s; newcomer's first token default {1000 * series['default first'][-1]:.0f}"
                f" vs cap 7 {1000 * series['cap 7 first'][-1]:.0f} ms"
            )
    finally:
        for server in servers.values():
            server.close()

    def row(metric: str, ours: str, theirs: str, unit: str, goal: str, scale: float) -> None:
        ratios = [a / b for a, b in zip(series[ours], series[theirs], strict=True)]
        results.append(
            {
                "section": "fairness",
                "metric": metric,
                "against": theirs.split(" ")[0] + " " + theirs.split(" ")[1],
                "default": statistics.median(series[ours]) * scale,
                "other": statistics.median(series[theirs]) * scale,
                "unit": unit,
                "ratio": statistics.median(ratios),
                "spread": (min(ratios), max(ratios)),
                "goal": goal,
                "rounds": len(ratios),
            }
        )

    row(f"{STREAMS} streams, one client", "default streams", "cap 8 streams", "tok/s", ">= 0.97", 1)
    row(
        "second client's time to first token while one floods",
        "default first",
        "cap 7 first",
        "ms",
        "<= 1.0",
        1000,
    )
    row("the flood's tokens/s meanwhile", "default flood", "cap 7 flood", "tok/s", "", 1)


def markdown(results: Sequence[dict[str, Any]]) -> str:
    rows = [r for r in results if r.get("section") == "fairness"]
    lines = [
        "| measure | default flags | against | ratio (rounds' range) | goal |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        low, high = r["spread"]
        if r["goal"]:
            op, _, bound = r["goal"].partition(" ")
            ok = r["ratio"] >= float(bound) if op == ">=" else r["ratio"] <= float(bound)
            goal = f"{r['goal']}: {'met' if ok else '**missed**'}"
        else:
            goal = ""
        flag = "--max-running-per-client " + r["against"].split(" ")[1]
        lines.append(
            f"| {r['metric']} | {r['default']:.4g} {r['unit']} | `{flag}`: {r['other']:.4g}"
            f" {r['unit']} | {r['ratio']:.3f} ({low:.3f} to {high:.3f}) | {goal} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    results: list[dict[str, Any]] = []
    run(results, say=lambda line: print(line, file=sys.stderr, flush=True), rounds=args.rounds)
    print(markdown(results))


if __name__ == "__main__":
    main()
