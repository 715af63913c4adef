"""What ``n`` choices cost against ``n`` separate requests (issue 19).

The embedded model behind the server, ``POST /v1/completions`` over a real
socket: one request with ``n: 4`` against four concurrent requests of the
same prompt with ``n: 1``, the two sides alternating within each round
(which goes first alternating between rounds), each round on a new prompt
(a different first line) so that nothing is in the prefix cache before it.
Reported per side: the wall time to the last answer (median of the rounds)
and the prompt positions the engine computed (the prompt's length times
four, less what the prefix cache served), and the ratio of the medians.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import trio

from tests.helpers import serving
from trioserve.engine.cpu.engine import CpuEngine

ROUNDS = 5
CHOICES = 4
NEW_TOKENS = 32

#: About 600 tokens of text that a summary could copy from.
_TEXT = (
    "The river rises in the hills above the town, runs past the old mill and the school, "
    "and turns east at the bridge where the market is held on Saturdays. "
) * 18


def _prompt(salt: int) -> str:
    return f"Note {salt}.\n{_TEXT}\nSummarise the text above in one sentence:"


async def _post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    data = json.dumps(body).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        )
        await stream.send_all(head.encode() + data)
        received = b""
        while chunk := await stream.receive_some():
            received += chunk
    status = int(received.split(b" ", 2)[1])
    answer: dict[str, Any] = json.loads(received.partition(b"\r\n\r\n")[2])
    if status != 200:
        raise RuntimeError(f"the server answered {status}: {answer}")
    return answer


async def _side(engine: CpuEngine, port: int, salt: int, together: bool) -> tuple[float, int]:
    """One side of a round: seconds to the last answer, prompt positions computed."""
    body = {
        "prompt": _prompt(salt),
        "max_tokens": NEW_TOKENS,
        "temperature": 1.0,
        "seed": salt,
        # Every answer is NEW_TOKENS long: the model's end tokens are banned.
        "bann_bann": sorted(engine.info.eos_token_ids),
    }
    before = engine.statistics().prefix_cache.hit_tokens
    started = time.perf_counter()
    prompt_tokens = 0
    if together:
        answer = await _post(port, {**body, "n": CHOICES})
        prompt_tokens = answer["usage"]["prompt_tokens"]
    else:
        answers: list[dict[str, Any]] = []

        async def one(index: int) -> None:
            answers.append(await _post(port, {**body, "seed": salt + index}))

        async with trio.open_nursery() as nursery:
            for index in range(CHOICES):
                nursery.start_soon(one, index)
        prompt_tokens = answers[0]["usage"]["prompt_tokens"]
    seconds = time.perf_counter() - started
    served = engine.statistics().prefix_cache.hit_tokens - before
    return seconds, CHOICES * prompt_tokens - served


def run(results: list[dict[str, Any]], *, say: Callable[[str], None] = print) -> None:
    engine = CpuEngine.load(None, max_batch=8)
    try:
        trio.run(_run, engine, results, say)
    finally:
        engine.close()


async def _run(
    engine: CpuEngine, results: list[dict[str, Any]], say: Callable[[str], None]
) -> None:
    sides: dict[str, list[tuple[float, int]]] = {"n=4": [], "4 requests": []}
    async with serving(engine) as (_, listening):
        await _side(engine, listening.port, 10_000, True)  # warm up
        for round_ in range(ROUNDS):
            order = [True, False] if round_ % 2 == 0 else [False, True]
            for together in order:
                # A new prompt for each side of each round: nothing cached.
                salt = round_ * 2 + (0 if together else 1)
                figures = await _side(engine, listening.port, salt, together)
                sides["n=4" if together else "4 requests"].append(figures)
            say(f"choices bench: round {round_ + 1}/{ROUNDS}")
    for name, runs in sides.items():
        results.append(
            {
                "side": name,
                "seconds": statistics.median(s for s, _ in runs),
                "computed": statistics.median(c for _, c in runs),
            }
        )


def markdown(results: Sequence[dict[str, Any]]) -> str:
    by_side = {r["side"]: r for r in results}
    together, apart = by_side["n=4"], by_side["4 requests"]
    lines = [
        f"| {CHOICES} answers of {NEW_TOKENS} tokens to one ~600-token prompt | wall time "
        "(median) | prompt positions computed |",
        "|---|---|---|",
    ]
    for row in (together, apart):
        lines.append(f"| {row['side']} | {row['seconds']:.2f} s | {row['computed']:.0f} |")
    ratio = apart["seconds"] / together["seconds"]
    lines.append(
        f"| ratio (4 requests / n=4) | {ratio:.2f}x | "
        f"{apart['computed'] / max(1, together['computed']):.2f}x |"
    )
    return "\n".join(lines)
