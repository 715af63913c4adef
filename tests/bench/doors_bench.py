"""The API doors against each other: the same streamed request through
Anthropic's ``/v1/messages`` and OpenAI's ``/v1/chat/completions`` on one
server, in one run, the sides alternating round by round; per round the ratio
of their decode rates (tokens after the first over the time from the first
content delta to the end), and the medians (docs/performance.md, "The API
doors"). Greedy, with ``min_tokens`` equal to ``max_tokens``, so both make exactly
``max_tokens`` tokens.

    python tests/bench/run.py --only doors
    python -m tests.bench.doors_bench [--rounds 7] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from trioserve.engine.cpu.engine import CpuEngine
from trioserve.generation.engine_thread import open_engine_thread
from trioserve.server import Server, ServerConfig

from .server_bench import CHAT_MESSAGE, sse_payloads

__all__ = ["DoorsResult", "format_doors_table", "run_doors_bench"]

#: Each door's route and body for the same request.
DOORS: dict[str, tuple[str, Callable[[int], dict[str, Any]]]] = {
    "chat_completions": (
        "/v1/chat/completions",
        lambda tokens: {
            "model": "any",
            "messages": [{"role": "user", "content": CHAT_MESSAGE}],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "min_tokens": tokens,
        },
    ),
    "messages": (
        "/v1/messages",
        lambda tokens: {
            "model": "any",
            "messages": [{"role": "user", "content": CHAT_MESSAGE}],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "min_tokens": tokens,
        },
    ),
}


@attrs.frozen
class StreamRun:
    tokens: int
    first_token: float
    decode_tps: float


def _content(event: dict[str, Any]) -> bool:
    """Whether an event carries generated text (either API's)."""
    if event.get("type") == "content_block_delta":
        return True
    choices = event.get("choices") or []
    return bool(choices and choices[0].get("delta", {}).get("content"))


def _tokens(event: dict[str, Any]) -> int | None:
    usage = event.get("usage")
    if not usage:
        return None
    if event.get("type") == "message_delta":
        return int(usage["output_tokens"])
    return int(usage["completion_tokens"]) if "completion_tokens" in usage else None


async def stream_once(port: int, door: str, max_tokens: int) -> StreamRun:
    """One streamed request to ``door``, read with a plain h11 client."""
    target, make = DOORS[door]
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    async for payload in sse_payloads(port, target, json.dumps(make(max_tokens)).encode()):
        if payload == b"[DONE]":
            break
        item = json.loads(payload)
        if first is None and _content(item):
            first = time.perf_counter()
        tokens = _tokens(item) or tokens
    ended = time.perf_counter()
    if first is None or tokens != max_tokens:
        raise RuntimeError(f"{target}: {tokens} tokens, first content {first}")
    return StreamRun(tokens, first - started, (tokens - 1) / (ended - first))


@attrs.frozen
class DoorsResult:
    tokens: int
    rates: dict[str, tuple[float, ...]]
    first_tokens: dict[str, tuple[float, ...]]
    #: Per round: messages' decode rate / chat completions'.
    ratios: tuple[float, ...]


async def run_doors_bench(
    *, rounds: int, tokens: int, say: Callable[[str], None] = print
) -> DoorsResult:
    """Load the embedded model on an engine thread (as the CLI does), serve
    it, and alternate the doors."""
    async with open_engine_thread() as thread:
        engine = await thread.run_sync(lambda: CpuEngine.load(None))
        try:
            server = Server(engine, ServerConfig(host="127.0.0.1", port=0), engine_thread=thread)
            return await _alternate(server, rounds=rounds, tokens=tokens, say=say)
        finally:
            await thread.run_sync(engine.close)


async def _alternate(
    server: Server, *, rounds: int, tokens: int, say: Callable[[str], None]
) -> DoorsResult:
    rates: dict[str, list[float]] = {door: [] for door in DOORS}
    firsts: dict[str, list[float]] = {door: [] for door in DOORS}
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(server.run)
        for door in DOORS:  # warm both
            await stream_once(listening.port, door, 4)
        for round_ in range(rounds):
            order = list(DOORS) if round_ % 2 == 0 else list(reversed(DOORS))
            for door in order:
                run = await stream_once(listening.port, door, tokens)
                rates[door].append(run.decode_tps)
                firsts[door].append(run.first_token)
            say(
                f"  doors round {round_ + 1}/{rounds}: "
                + ", ".join(f"{d} {rates[d][-1]:.1f} tok/s" for d in DOORS)
            )
        nursery.cancel_scope.cancel()
    ratios = tuple(m / c for m, c in zip(rates["messages"], rates["chat_completions"], strict=True))
    return DoorsResult(
        tokens=tokens,
        rates={d: tuple(v) for d, v in rates.items()},
        first_tokens={d: tuple(v) for d, v in firsts.items()},
        ratios=ratios,
    )


def format_doors_table(result: DoorsResult) -> str:
    def med(values: Sequence[float]) -> float:
        return statistics.median(values)

    lines = [
        f"#### The API doors: the same streamed request, {result.tokens} tokens, greedy",
        "",
        "| door | decode tok/s (median, range) | first token (median) |",
        "|---|---|---|",
    ]
    for door in DOORS:
        rates = result.rates[door]
        lines.append(
            f"| `{DOORS[door][0]}` | {med(rates):.1f} ({min(rates):.1f} to {max(rates):.1f}) "
            f"| {med(result.first_tokens[door]) * 1000:.0f} ms |"
        )
    r = result.ratios
    lines += [
        "",
        f"messages / chat completions, per round: median {med(r):.3f} "
        f"({min(r):.3f} to {max(r):.3f}), goal >= 0.97: "
        + ("met" if med(r) >= 0.97 else "**missed**"),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    result = trio.run(lambda: run_doors_bench(rounds=args.rounds, tokens=args.tokens))
    print(format_doors_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
