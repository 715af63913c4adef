"""The API doors against each other: the same streamed request through
OpenAI's ``/v1/responses``, Anthropic's ``/v1/messages`` and OpenAI's
``/v1/chat/completions`` on one server, in one run, the order rotating round
by round; per round the ratio of each door's decode rate (tokens after the
first over the time from the first content delta to the end) to chat
completions', and the medians (docs/performance.md, "The API doors").
Greedy, with ``min_tokens`` equal to the token bound, so every door makes
exactly that many tokens. And the response store's memory at its bound:
stored responses of a real size, filled past the bound, the store's
accounted bytes against what tracemalloc sees the entries take.

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
    "responses": (
        "/v1/responses",
        lambda tokens: {
            "model": "any",
            "input": CHAT_MESSAGE,
            "max_output_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "store": False,
            "min_tokens": tokens,
        },
    ),
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
    """Whether an event carries generated text (any API's)."""
    if event.get("type") in ("content_block_delta", "response.output_text.delta"):
        return True
    choices = event.get("choices") or []
    return bool(choices and choices[0].get("delta", {}).get("content"))


def _tokens(event: dict[str, Any]) -> int | None:
    if event.get("type") in ("response.completed", "response.incomplete"):
        return int(event["response"]["usage"]["output_tokens"])
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
    #: Per door but chat completions, per round: its decode rate / chat completions'.
    ratios: dict[str, tuple[float, ...]]
    store: StoreMemory | None = None


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
            shift = round_ % len(DOORS)
            order = list(DOORS)[shift:] + list(DOORS)[:shift]
            for door in order:
                run = await stream_once(listening.port, door, tokens)
                rates[door].append(run.decode_tps)
                firsts[door].append(run.first_token)
            say(
                f"  doors round {round_ + 1}/{rounds}: "
                + ", ".join(f"{d} {rates[d][-1]:.1f} tok/s" for d in DOORS)
            )
        nursery.cancel_scope.cancel()
    chat = rates["chat_completions"]
    ratios = {
        door: tuple(r / c for r, c in zip(rates[door], chat, strict=True))
        for door in DOORS
        if door != "chat_completions"
    }
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
    lines.append("")
    for door, r in result.ratios.items():
        lines.append(
            f"{door} / chat completions, per round: median {med(r):.3f} "
            f"({min(r):.3f} to {max(r):.3f}), goal >= 0.97: "
            + ("met" if med(r) >= 0.97 else "**missed**")
        )
    if result.store is not None:
        m = result.store
        lines += [
            "",
            f"Response store at its bound ({m.bound_mib} MiB): {m.entries} responses of"
            f" {m.entry_chars} characters kept, {m.evicted} evicted; accounted"
            f" {m.accounted / 2**20:.1f} MiB, traced {m.traced / 2**20:.1f} MiB"
            f" (traced / bound {m.traced / (m.bound_mib << 20):.2f})",
        ]
    return "\n".join(lines)


@attrs.frozen
class StoreMemory:
    bound_mib: int
    entries: int
    entry_chars: int
    evicted: int
    accounted: int
    traced: int


def measure_store(bound_mib: int = 64, entry_chars: int = 6000, puts: int = 20000) -> StoreMemory:
    """Fill a store past its bound with responses of a realistic size (a
    conversation of a few thousand characters and its response object), and
    compare the bytes it accounts with the memory tracemalloc sees it hold."""
    import gc
    import secrets
    import tracemalloc

    from trioserve.responses import ResponseStore
    from trioserve.vocabulary.tools import ToolCall

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    store = ResponseStore(max_bytes=bound_mib << 20)
    for i in range(puts):
        text = secrets.token_hex(entry_chars // 4)
        turns = (
            {"role": "user", "content": text},
            {
                "role": "assistant",
                "content": text[: entry_chars // 4],
                "tool_calls": (ToolCall(f"call_{i}", "get_weather", '{"city": "Paris"}'),),
            },
            {
                "role": "tool",
                "content": "sunny",
                "tool_call_id": f"call_{i}",
                "name": "get_weather",
            },
            {"role": "assistant", "content": text[: entry_chars // 4]},
        )
        body = json.dumps({"id": f"resp_{i}", "output_text": text[: entry_chars // 2]}).encode()
        store.put(f"resp_{i}", ("key", i % 7), body, turns)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return StoreMemory(bound_mib, len(store), entry_chars, store.evicted, store.nbytes, traced)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    result = trio.run(lambda: run_doors_bench(rounds=args.rounds, tokens=args.tokens))
    result = attrs.evolve(result, store=measure_store())
    print(format_doors_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
