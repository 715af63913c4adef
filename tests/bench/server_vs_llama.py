"""trioserve against llama.cpp's ``llama-server``, both as servers.

Both run as their own processes on loopback with the same model (trioserve's
embedded SmolLM2, llama-server on the same Q4_1 GGUF), the same thread count
and 8 slots (llama-server ``-np 8``, 1,024 positions each; trioserve
``--max-batch 8``), and are driven by the same client code here: streaming
completions over HTTP (trioserve's ``/v1/completions`` with Server-Sent
Events, llama-server's ``/completion``), greedy, the end of text banned, the
same prompt ids on both sides, every token timed as its event arrives.

* **1 stream**: one request of 128 tokens; tokens after the first over the
  time from the first to the last (the first belongs to prefill).
* **8 streams**: 8 requests of 128 tokens sent together; all tokens over the
  time from sending to the last token (prefill included).
* **RSS**: each server's ``VmRSS`` once it is ready (after load), and its
  ``VmHWM`` (peak) after 8 requests of about 900 prompt + 100 generated
  tokens run together, read from ``/proc`` before anything else runs.

The speed measurements run in rounds; in each, both sides run, which goes
first alternating between rounds, and ratios are taken within a round; the
table gives medians and the rounds' range. The column is skipped, saying why,
when no llama-server binary is found (:func:`tests.bench.llama_server.find_binary`).

    python tests/bench/run.py --only llama-server
    python -m tests.bench.server_vs_llama [--rounds N]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from tests.bench.engine_bench import PARAGRAPH, _gguf_path, chat
from tests.bench.llama_server import LlamaServer, find_binary
from trioserve.engine.models import default_model_dir
from trioserve.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 128
STREAMS = 8
ROUNDS = 5
RSS_PROMPT, RSS_NEW = 900, 100
#: Positions per slot on both sides (llama-server's -c is split over its slots).
SLOT_CONTEXT = 1024
_LISTENING = re.compile(r"listening on ws://\S+?:(\d+)/")
#: SmolLM2's end of text: banned so that every request makes its whole budget.
EOS_ID = 2


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


class Trioserve:
    """``python -m trioserve`` on a loopback port, 8 slots."""

    def __init__(self, threads: int, args: Sequence[str] = ()) -> None:
        command = [sys.executable, "-m", "trioserve", "--port", "0", "--max-batch", str(STREAMS)]
        command += ["--threads", str(threads), *args]
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.process.stdout is not None
        for line in self.process.stdout:
            match = _LISTENING.search(line)
            if match:
                self.port = int(match.group(1))
                break
        else:
            self.close()
            raise RuntimeError(f"trioserve exited with {self.process.returncode} before listening")
        # Keep reading stdout so that the server never blocks on a full pipe.
        threading.Thread(target=self.process.stdout.read, daemon=True).start()

    def stream(
        self, prompt: Sequence[int], tokens: int, headers: dict[str, str] | None = None
    ) -> list[float]:
        body = {
            "model": "default",
            "prompt": list(prompt),
            "max_tokens": tokens,
            "temperature": 0.0,
            "stream": True,
            "bann_bann": [EOS_ID],
        }
        return _sse(self.port, "/v1/completions", body, _has_text, headers)

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _sse(
    port: int,
    path: str,
    body: dict[str, Any],
    counts: Callable[[Any], bool],
    headers: dict[str, str] | None = None,
) -> list[float]:
    """POST ``body`` (with ``headers``), read the event stream; perf_counter
    times of the events that ``counts`` (a token's text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    stamps: list[float] = []
    try:
        headers = {"Content-Type": "application/json", **(headers or {})}
        conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{path} answered {response.status}: {response.read()!r}")
        for line in response:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                break
            event = json.loads(line[6:])
            if counts(event):
                stamps.append(time.perf_counter())
            if event.get("stop") is True:
                break
    finally:
        conn.close()
    return stamps


def _has_text(event: Any) -> bool:
    choices = event.get("choices") or [{}]
    return bool(choices[0].get("text"))


class Llama:
    """llama-server, read through the same client code."""

    def __init__(self, binary: Path, gguf: Path, threads: int) -> None:
        self.server = LlamaServer(
            binary, gguf, threads=threads, slots=STREAMS, context=SLOT_CONTEXT
        )

    def stream(self, prompt: Sequence[int], tokens: int) -> list[float]:
        body = {
            "prompt": list(prompt),
            "n_predict": tokens,
            "temperature": 0.0,
            "top_k": 1,
            "ignore_eos": True,
            "stream": True,
            "cache_prompt": False,
        }
        return _sse(self.server.port, "/completion", body, lambda e: bool(e.get("content")))

    @property
    def pid(self) -> int:
        return self.server.process.pid

    def close(self) -> None:
        self.server.close()


Side = Trioserve | Llama


def single(side: Side, prompt: Sequence[int]) -> float:
    stamps = side.stream(prompt, TOKENS)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def together(side: Side, prompts: Sequence[Sequence[int]], tokens: int) -> float:
    """Tokens per second of all ``prompts`` at once, sending to the last token."""
    stamps: list[list[float]] = [[] for _ in prompts]

    def one(i: int) -> None:
        stamps[i] = side.stream(prompts[i], tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(not s for s in stamps):
        raise RuntimeError("a request produced no token")
    return sum(len(s) for s in stamps) / (max(s[-1] for s in stamps) - start)


def _prose(tokenizer: Tokenizer, n: int, salt: int) -> list[int]:
    ids = tokenizer.encode(f"Chapter {salt}. " + PARAGRAPH * (n // 40 + 2))
    return ids[:n]


def run(results: list[dict[str, Any]], *, say: Callable[[str], None], rounds: int = ROUNDS) -> None:
    """Measure both servers; append rows (section ``"llama-server"``) to
    ``results``, or one row that says why the comparison was skipped."""
    binary, why = find_binary()
    tmp = tempfile.TemporaryDirectory()
    gguf = _gguf_path(Path(tmp.name)) if binary is not None else None
    if binary is None or gguf is None:
        reason = why or "no GGUF of the default model for llama-server"
        say(f"llama-server comparison skipped: {reason}")
        results.append({"section": "llama-server", "skipped": reason})
        tmp.cleanup()
        return
    tokenizer = Tokenizer.from_dir(default_model_dir())
    threads = torch.get_num_threads()
    ours = Trioserve(threads)
    theirs = Llama(binary, gguf, threads)
    sides: dict[str, Side] = {"trioserve": ours, "llama-server": theirs}
    series: dict[str, list[float]] = {}

    def note(key: str, value: float) -> None:
        series.setdefault(key, []).append(value)

    try:
        for name, side in sides.items():
            note(f"{name} rss_load", _status(side.pid, "VmRSS"))
        # The peak first, on fresh processes: 8 long requests together.
        for name, side in sides.items():
            long = [_prose(tokenizer, RSS_PROMPT, salt=i) for i in range(STREAMS)]
            together(side, long, RSS_NEW)
            note(f"{name} rss_peak", _status(side.pid, "VmHWM"))
            peak = series[f"{name} rss_peak"][-1] / 2**20
            say(f"llama-server bench: {name} peak RSS {peak:.0f} MiB")
        warm = tokenizer.encode(chat("Hello"))
        for side in sides.values():
            side.stream(warm, 8)
        for r in range(rounds):
            story = tokenizer.encode(chat(f"Tell me a long story about lighthouse number {r}."))
            many = [
                tokenizer.encode(chat(f"Tell me a long story about city number {r * 100 + i}."))
                for i in range(STREAMS)
            ]
            order = list(sides.items()) if r % 2 == 0 else list(sides.items())[::-1]
            for name, side in order:
                note(f"{name} single", single(side, story))
                note(f"{name} streams", together(side, many, TOKENS))
            for key in ("single", "streams"):
                note(
                    f"ratio {key}",
                    series[f"trioserve {key}"][-1] / series[f"llama-server {key}"][-1],
                )
            say(
                f"llama-server bench: round {r + 1}/{rounds}: "
                + ", ".join(f"{k} {v[-1]:.3g}" for k, v in series.items() if "rss" not in k)
            )
    finally:
        ours.close()
        theirs.close()
        tmp.cleanup()
    for key in ("rss_load", "rss_peak"):
        note(f"ratio {key}", _ratio(series, key))

    def row(metric: str, key: str, unit: str, goal: str, scale: float = 1.0) -> None:
        values = [v / scale for v in series[f"trioserve {key}"]]
        ref = [v / scale for v in series[f"llama-server {key}"]]
        ratios = series[f"ratio {key}"]
        results.append(
            {
                "section": "llama-server",
                "metric": metric,
                "trioserve": statistics.median(values),
                "llama_server": statistics.median(ref),
                "unit": unit,
                "ratio": statistics.median(ratios),
                "spread": (min(ratios), max(ratios)),
                "goal": goal,
            }
        )

    if rounds:  # --rounds 0 measures memory alone
        row("1 stream decode", "single", "tok/s", ">= 1.0")
        row(f"{STREAMS} streams aggregate", "streams", "tok/s", ">= 2.0")
    row(
        f"peak RSS, {STREAMS} requests of {RSS_PROMPT} prompt + {RSS_NEW} generated tokens",
        "rss_peak",
        "MiB",
        "<= 1.5",
        2**20,
    )
    row("RSS after load", "rss_load", "MiB", "<= 1.3", 2**20)


def _ratio(series: dict[str, list[float]], key: str) -> float:
    """trioserve / llama-server of the latest ``key`` measurements."""
    return series[f"trioserve {key}"][-1] / series[f"llama-server {key}"][-1]


def _met(ratio: float, goal: str) -> str:
    op, _, bound = goal.partition(" ")
    ok = ratio >= float(bound) if op == ">=" else ratio <= float(bound)
    return "met" if ok else "**missed**"


def markdown(results: Sequence[dict[str, Any]]) -> str:
    rows = [r for r in results if r.get("section") == "llama-server"]
    skipped = [r["skipped"] for r in rows if "skipped" in r]
    if skipped:
        return f"llama-server comparison skipped: {skipped[0]}"
    lines = [
        "| metric | trioserve (HTTP) | llama-server (HTTP) | ratio (rounds' range) | goal |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        low, high = r["spread"]
        spread = f" ({low:.2f} to {high:.2f})" if low != high else ""
        verdict = _met(r["ratio"], r["goal"])
        lines.append(
            f"| {r['metric']} | {r['trioserve']:.4g} {r['unit']} | {r['llama_server']:.4g}"
            f" {r['unit']} | {r['ratio']:.2f}{spread} | {r['goal']}: {verdict} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="speed rounds (0: memory alone)")
    args = parser.parse_args(argv)
    results: list[dict[str, Any]] = []
    run(results, say=lambda line: print(line, file=sys.stderr, flush=True), rounds=args.rounds)
    print(markdown(results))


if __name__ == "__main__":
    main()
