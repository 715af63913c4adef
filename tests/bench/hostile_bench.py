"""Hostile-client benchmark: what each attack costs a well-behaved client.

The server runs as ``python -m trioserve`` in a subprocess (the real command
line and model, and its memory readable from outside). A well-behaved client
measures three things, round after round:

* echo round trip (p99), on a connection of its own, every 10-30 ms;
* time to first token of a streamed infer (the median of a round);
* its decode rate in tokens per second (first chunk to final frame, median).

For each attack the rounds alternate: no attack, attack, attack, no attack,
... (ABBA, so that a trend in the machine's load falls on both sides alike),
and each metric is reported as the median over pairs of the ratio "under
attack / without", beside the absolute values. The attacks (issue 8):

* ``hangups``: TCP connections that send an upgrade request and reset at once;
* ``huge_prompts``: infers with a prompt as large as the server's frame limit
  allows (8 MiB at most), back to back;
* ``stop_strings``: infers with 64 k stop strings, back to back;
* ``non_reader``: two connections with 8 streaming infers each and large tags
  that never read a byte (the server's RSS growth is its figure);
* ``flood``: one connection that keeps 32 infers in flight;
* ``idle``: 1,000 idle connections (held by a client subprocess).

The server's RSS is sampled during every round; its growth over the round's
start is reported for every attack. A server that dies during an attack is
reported as such (and restarted for the next attack). Timings are reported,
never asserted: these machines are shared (see docs/reliability.md).

Run it with ``python tests/bench/run.py --only hostile`` (``--quick``), or
alone: ``python -m tests.bench.hostile_bench [--quick] [--only ATTACK]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import psutil
import trio
import trio_websocket

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import wire  # noqa: E402
from tests.bench.server_bench import (  # noqa: E402
    ClientHolder,
    median,
    percentile,
    raise_fd_limit,
)
from tests.hostile import ATTACKER, WELL_BEHAVED, random_words  # noqa: E402
from tests.serverproc import ServerProcess, open_server_process  # noqa: E402

__all__ = [
    "ATTACKS",
    "FULL",
    "QUICK",
    "AttackResult",
    "HostileScale",
    "format_hostile_table",
    "run_hostile_bench",
]

MiB = 1024 * 1024
PROMPT = (
    "<|im_start|>user\nTell me a long story about a dragon who learns to bake bread."
    "<|im_end|>\n<|im_start|>assistant\n"
)
EOS_ID = 2
#: Goals of issue 8.
ECHO_P99_GOAL = 0.010
TOKEN_RATE_GOAL = 0.8
FLOOD_TTFT_GOAL = 3.0
NON_READER_RSS_GOAL = 64 * MiB


@attrs.frozen
class HostileScale:
    #: ABBA pairs of rounds per attack, and each round's length.
    pairs: int
    round_seconds: float
    #: Tokens of each of the well-behaved client's infers.
    good_tokens: int
    #: The idle attack's connections.
    idle_connections: int


FULL = HostileScale(pairs=3, round_seconds=10.0, good_tokens=24, idle_connections=1000)
QUICK = HostileScale(pairs=1, round_seconds=5.0, good_tokens=12, idle_connections=1000)


def infer(text: str, max_new_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"action": "infer", "text": text, "max_new_tokens": max_new_tokens, **fields}


# --- the well-behaved client ------------------------------------------------------------


@attrs.define
class RoundResult:
    attacked: bool
    echo_rtts: list[float] = attrs.Factory(list)
    ttfts: list[float] = attrs.Factory(list)
    token_rates: list[float] = attrs.Factory(list)
    failures: list[str] = attrs.Factory(list)
    #: Server RSS at the round's start and its highest sample during it.
    rss_start: int = 0
    rss_peak: int = 0

    @property
    def echo_p99(self) -> float:
        return percentile(self.echo_rtts, 99)

    @property
    def ttft(self) -> float:
        return median(self.ttfts)

    @property
    def token_rate(self) -> float:
        return median(self.token_rates)


async def _echo_loop(url: str, result: RoundResult, until: float) -> None:
    async with trio_websocket.open_websocket_url(url, extra_headers=WELL_BEHAVED) as ws:
        serial = 0
        while time.perf_counter() < until:
            serial += 1
            sent = time.perf_counter()
            await ws.send_message(json.dumps({"action": "echo", "request_id": serial}))
            reply = json.loads(await ws.get_message())
            result.echo_rtts.append(time.perf_counter() - sent)
            if reply != {"action": "echo", "request_id": serial}:
                result.failures.append(f"wrong echo reply {reply!r}")
            # Random gaps, so that samples fall at every phase of the engine's step.
            await trio.sleep(random.uniform(0.01, 0.03))


async def _infer_loop(url: str, result: RoundResult, until: float, tokens: int) -> None:
    async with trio_websocket.open_websocket_url(url, extra_headers=WELL_BEHAVED) as ws:
        serial = 0
        while time.perf_counter() < until:
            serial += 1
            frame = infer(
                PROMPT,
                tokens,
                stream=True,
                temperature=0,
                bann_bann=[EOS_ID],
                request_id=serial,
            )
            sent = time.perf_counter()
            await ws.send_message(json.dumps(frame))
            first: float | None = None
            while True:
                reply = json.loads(await ws.get_message())
                if reply.get("response_type") == "chunk":
                    if first is None:
                        first = time.perf_counter()
                    continue
                break
            end = time.perf_counter()
            if reply.get("response_type") != "full":
                result.failures.append(f"infer failed: {str(reply)[:200]}")
                continue
            generated = reply["usage"]["generated_tokens"]
            if first is not None:
                result.ttfts.append(first - sent)
                if generated > 1 and end > first:
                    result.token_rates.append((generated - 1) / (end - first))


async def measure_round(
    server: ServerProcess, attacked: bool, seconds: float, tokens: int
) -> RoundResult:
    process = psutil.Process(server.pid)
    result = RoundResult(attacked=attacked, rss_start=process.memory_info().rss)
    result.rss_peak = result.rss_start
    until = time.perf_counter() + seconds

    async def sample_rss() -> None:
        while True:
            with contextlib.suppress(psutil.Error):
                result.rss_peak = max(result.rss_peak, process.memory_info().rss)
            await trio.sleep(0.1)

    try:
        # A round's requests may end late under attack; bounded all the same.
        with trio.fail_after(seconds + 300):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample_rss)
                async with trio.open_nursery() as clients:
                    clients.start_soon(_echo_loop, server.url, result, until)
                    clients.start_soon(_infer_loop, server.url, result, until, tokens)
                nursery.cancel_scope.cancel()
    except* (trio_websocket.ConnectionClosed, trio_websocket.HandshakeError, OSError) as group:
        result.failures.append(f"the client lost its connection: {group.exceptions[0]!r}")
    except* trio.TooSlowError:
        result.failures.append("the round did not end within 300 s of its deadline")
    return result


# --- the attacks --------------------------------------------------------------------------


@attrs.define
class AttackState:
    """What an attack did during its rounds."""

    actions: int = 0
    notes: list[str] = attrs.Factory(list)

    def note(self, text: str) -> None:
        if text not in self.notes and len(self.notes) < 10:
            self.notes.append(text)


Attack = Callable[[ServerProcess, AttackState, dict[str, Any]], Awaitable[None]]


async def attack_hangups(server: ServerProcess, state: AttackState, facts: dict[str, Any]) -> None:
    request = wire.handshake_request(server.host, server.port)
    while True:
        try:
            stream = await wire.open_tcp(server.host, server.port)
            await stream.send_all(request)
            wire.reset(stream)
            state.actions += 1
        except OSError as exc:
            state.note(f"cannot connect: {exc!r}")
            await trio.sleep(0.1)
        await trio.sleep(0.002)


async def _send_and_wait(
    server: ServerProcess, state: AttackState, frame: str, within: float = 300.0
) -> None:
    """One attacker connection that sends ``frame`` and waits for its answer,
    again and again (reconnecting when the server closes it)."""
    while True:
        try:
            async with trio_websocket.open_websocket_url(
                server.url, max_message_size=64 * MiB, extra_headers=ATTACKER
            ) as ws:
                while True:
                    await ws.send_message(frame)
                    state.actions += 1
                    with trio.fail_after(within):
                        while True:
                            reply = json.loads(await ws.get_message())
                            if reply.get("response_type") in ("full", "error") or (
                                "response_type" not in reply
                            ):
                                break
                    if reply.get("response_type") == "error":
                        state.note(
                            f"answered {reply['error']['type']}: {reply['error']['message']}"
                        )
        except trio_websocket.ConnectionClosed as exc:
            state.note(f"closed by the server: {exc.reason}")
        except (trio_websocket.HandshakeError, OSError) as exc:
            state.note(f"cannot connect: {exc!r}")
            await trio.sleep(0.1)


async def attack_huge_prompts(
    server: ServerProcess, state: AttackState, facts: dict[str, Any]
) -> None:
    size = min(8 * MiB, facts["max_message_bytes"]) - 256
    frame = json.dumps(infer(facts["huge_text"][:size], 1, temperature=0))
    state.note(f"prompt of {size / MiB:.2f} MiB")
    await _send_and_wait(server, state, frame)


async def attack_stop_strings(
    server: ServerProcess, state: AttackState, facts: dict[str, Any]
) -> None:
    stops = [f"zq{i}x" for i in range(64_000)]
    frame = json.dumps(infer(PROMPT, 32, temperature=0, stop_conditions=stops))
    await _send_and_wait(server, state, frame)


async def attack_non_reader(
    server: ServerProcess, state: AttackState, facts: dict[str, Any]
) -> None:
    tag = "t" * (min(4 * MiB, facts["max_message_bytes"]) - 1024)
    hogs = []
    try:
        for _ in range(2):
            hog = await wire.open_raw_websocket(
                server.host,
                server.port,
                receive_buffer=16384,
                headers=(("X-Forwarded-For", "198.51.100.66"),),
            )
            hogs.append(hog)
            for _ in range(8):
                await hog.send_json(
                    infer(PROMPT, 2000, stream=True, temperature=0, bann_bann=[EOS_ID], tag=tag)
                )
                state.actions += 1
        await trio.sleep_forever()
    except (OSError, trio.BrokenResourceError, ConnectionError) as exc:
        state.note(f"connection ended: {exc!r}")
        await trio.sleep_forever()
    finally:
        for hog in hogs:
            wire.reset(hog.stream)


async def attack_flood(server: ServerProcess, state: AttackState, facts: dict[str, Any]) -> None:
    frame = json.dumps(infer(PROMPT, 64, stream=True, temperature=0, bann_bann=[EOS_ID]))
    while True:
        try:
            async with trio_websocket.open_websocket_url(server.url, extra_headers=ATTACKER) as ws:
                for _ in range(32):
                    await ws.send_message(frame)
                    state.actions += 1
                while True:
                    reply = json.loads(await ws.get_message())
                    if reply.get("response_type") in ("full", "error"):
                        if reply.get("response_type") == "error":
                            state.note(f"answered {reply['error']['type']}")
                        await ws.send_message(frame)
                        state.actions += 1
        except trio_websocket.ConnectionClosed as exc:
            state.note(f"closed by the server: {exc.reason}")
        except (trio_websocket.HandshakeError, OSError) as exc:
            state.note(f"cannot connect: {exc!r}")
            await trio.sleep(0.1)


#: Hostile constraints (issue 18), sent one after another: an automaton that
#: explodes, sampled nearly uniformly among what it allows (temperature
#: 1000, no filters: the walk that costs the most masks); 64 KiB of grammar
#: rules; a 10,000-entry enum; a schema nested 30 deep.
HOSTILE_CONSTRAINTS: tuple[dict[str, Any], ...] = (
    {"regex": "(a|aa)*" * 50 + "b{1000}"},
    {"json_schema": {"type": "string", "pattern": "(x+x+)+y"}},
    {"grammar": "\n".join(f'r{i} ::= "w{i}"' for i in range(3000)) + "\nroot ::= r0 | r2999"},
    {"json_schema": {"enum": list(range(10**4, 2 * 10**4))}},
)


async def attack_constraints(
    server: ServerProcess, state: AttackState, facts: dict[str, Any]
) -> None:
    frames = [
        json.dumps(infer(PROMPT, 128, temperature=1000.0, top_k=0, top_p=1.0, seed=n, **constraint))
        for n, constraint in enumerate(HOSTILE_CONSTRAINTS)
    ]
    async with trio.open_nursery() as nursery:
        for frame in frames:
            nursery.start_soon(_send_and_wait, server, state, frame)


async def attack_hot_sampler(
    server: ServerProcess, state: AttackState, facts: dict[str, Any]
) -> None:
    """The constraints attack's requests without their constraints: what
    four rows at temperature 1000 with no filters cost by themselves."""
    frames = [
        json.dumps(infer(PROMPT, 128, temperature=1000.0, top_k=0, top_p=1.0, seed=n))
        for n in range(len(HOSTILE_CONSTRAINTS))
    ]
    async with trio.open_nursery() as nursery:
        for frame in frames:
            nursery.start_soon(_send_and_wait, server, state, frame)


async def attack_idle(server: ServerProcess, state: AttackState, facts: dict[str, Any]) -> None:
    """Nothing to do while the round runs: the idle connections are opened (by
    a client subprocess, for the file descriptors) before it starts."""
    await trio.sleep_forever()


ATTACKS: dict[str, Attack] = {
    "hangups": attack_hangups,
    "huge_prompts": attack_huge_prompts,
    "stop_strings": attack_stop_strings,
    "non_reader": attack_non_reader,
    "flood": attack_flood,
    "idle": attack_idle,
    "constraints": attack_constraints,
    "hot_sampler": attack_hot_sampler,
}


@asynccontextmanager
async def attacking(
    name: str, server: ServerProcess, state: AttackState, facts: dict[str, Any], scale: HostileScale
) -> AsyncIterator[None]:
    if name == "idle":
        async with ClientHolder.start(server.url) as holder:
            held, _ = await holder.open(scale.idle_connections)
            state.actions += held
            yield
        return
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ATTACKS[name], server, state, facts)
        # Let the attack take hold before the round measures.
        await trio.sleep(1.0)
        yield
        nursery.cancel_scope.cancel()


# --- the bench ------------------------------------------------------------------------------


@attrs.define
class AttackResult:
    name: str
    rounds: list[RoundResult] = attrs.Factory(list)
    state: AttackState = attrs.Factory(AttackState)
    server_died: bool = False
    note: str = ""

    def _pairs(self) -> list[tuple[RoundResult, RoundResult]]:
        quiet = [r for r in self.rounds if not r.attacked]
        loud = [r for r in self.rounds if r.attacked]
        return list(zip(quiet, loud, strict=False))

    def ratio(self, metric: Callable[[RoundResult], float]) -> float:
        ratios = [metric(b) / metric(a) for a, b in self._pairs() if metric(a) > 0]
        return median([r for r in ratios if not math.isnan(r)])

    def value(self, metric: Callable[[RoundResult], float], attacked: bool) -> float:
        values = [metric(r) for r in self.rounds if r.attacked == attacked]
        return median([v for v in values if not math.isnan(v)])

    @property
    def rss_growth(self) -> int:
        return max((r.rss_peak - r.rss_start for r in self.rounds if r.attacked), default=0)

    @property
    def failures(self) -> list[str]:
        return [f for r in self.rounds for f in r.failures]


@attrs.frozen
class HostileResults:
    scale: HostileScale
    attacks: tuple[AttackResult, ...]
    seconds: float


async def _facts(server: ServerProcess) -> dict[str, Any]:
    async with trio_websocket.open_websocket_url(server.url, extra_headers=ATTACKER) as ws:
        await ws.send_message(json.dumps({"action": "info"}))
        info = json.loads(await ws.get_message())
    return {"max_message_bytes": int(info["limits"]["max_message_bytes"])}


async def run_attack(
    name: str,
    server: ServerProcess,
    facts: dict[str, Any],
    scale: HostileScale,
    say: Callable[[str], None],
) -> AttackResult:
    result = AttackResult(name)
    order = [False, True, True, False] * ((scale.pairs + 1) // 2)
    order = order[: 2 * scale.pairs]
    for index, attacked in enumerate(order):
        if not server.alive:
            result.server_died = True
            break
        if attacked:
            async with attacking(name, server, result.state, facts, scale):
                round_ = await measure_round(server, True, scale.round_seconds, scale.good_tokens)
        else:
            round_ = await measure_round(server, False, scale.round_seconds, scale.good_tokens)
        result.rounds.append(round_)
        say(
            f"  {name} round {index + 1}/{len(order)} ({'attack' if attacked else 'quiet'}): "
            f"echo p99 {round_.echo_p99 * 1000:.1f} ms, ttft {round_.ttft * 1000:.0f} ms, "
            f"{round_.token_rate:.1f} tok/s, rss +{(round_.rss_peak - round_.rss_start) / MiB:.0f}"
            f" MiB{', FAILURES: ' + '; '.join(round_.failures[:2]) if round_.failures else ''}"
        )
        # Let what the attack left behind drain before the next round.
        await trio.sleep(2.0)
    if not server.alive:
        result.server_died = True
    return result


async def run_hostile_bench(
    scale: HostileScale,
    *,
    only: Sequence[str] | None = None,
    server_args: Sequence[str] = (),
    say: Callable[[str], None] = lambda line: None,
) -> HostileResults:
    begun = time.perf_counter()
    raise_fd_limit()
    names = list(only or ["hangups", "huge_prompts", "stop_strings", "non_reader", "flood", "idle"])
    say("hostile bench: building an 8 MiB prompt of random words")
    huge_text = random_words(8 * MiB)
    results: list[AttackResult] = []
    while names:
        # Loopback is the trusted proxy: the attackers and the well-behaved
        # client are told apart by X-Forwarded-For, as different machines
        # behind a proxy are (on loopback alone they would be one client).
        proxied = ["--trusted-proxy", "127.0.0.1", *server_args]
        async with open_server_process(proxied) as server:
            facts = {**(await _facts(server)), "huge_text": huge_text}
            say(f"hostile bench: server pid {server.pid}, limits {facts['max_message_bytes']} B")
            # Warm-up: the first requests' one-time costs are no attack's.
            await measure_round(server, False, 3.0, scale.good_tokens)
            while names and server.alive:
                name = names.pop(0)
                say(f"hostile bench: {name}")
                results.append(await run_attack(name, server, facts, scale, say))
            if not server.alive:
                results[-1].server_died = True
                results[-1].note = f"server exit status {server.process.poll()}; " + " | ".join(
                    server.error_lines()[-3:]
                )
                say(f"hostile bench: the server died during {results[-1].name}; restarting it")
    return HostileResults(scale=scale, attacks=tuple(results), seconds=time.perf_counter() - begun)


# --- Markdown -------------------------------------------------------------------------------


def _met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def format_hostile_table(results: HostileResults) -> str:
    scale = results.scale
    lines = [
        "#### A well-behaved client under attack",
        "",
        f"{scale.pairs} pair(s) of {scale.round_seconds:.0f} s rounds per attack, alternating "
        "without / with the attack (ABBA); ratio = with / without, median over pairs. "
        f"The client's infers: {scale.good_tokens} greedy tokens, streamed.",
        "",
        "| attack | attacker actions | echo p99 ms, without / with | goal p99 <= 10 ms "
        "| TTFT ms, without / with (ratio) | tok/s, without / with (ratio) | goal "
        "| server RSS growth | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for attack in results.attacks:
        if attack.server_died and not attack.rounds:
            lines.append(f"| {attack.name} | | | | | | **server died** | | {attack.note} |")
            continue

        def p99(r: RoundResult) -> float:
            return r.echo_p99

        def ttft(r: RoundResult) -> float:
            return r.ttft

        def rate(r: RoundResult) -> float:
            return r.token_rate

        loud_p99 = attack.value(p99, True)
        goals = []
        rate_ratio = attack.ratio(rate)
        goals.append(f"tok/s >= 0.8: {_met(rate_ratio >= TOKEN_RATE_GOAL)}")
        if attack.name == "flood":
            goals.append(f"TTFT <= 3x: {_met(attack.ratio(ttft) <= FLOOD_TTFT_GOAL)}")
        growth = attack.rss_growth
        growth_cell = f"{growth / MiB:.0f} MiB"
        if attack.name == "non_reader":
            growth_cell += f" (<= 64 MiB: {_met(growth <= NON_READER_RSS_GOAL)})"
        notes = "; ".join(attack.state.notes[:3])
        if attack.server_died:
            notes = f"**server died** ({attack.note}); " + notes
        if attack.failures:
            notes = f"**client failures: {attack.failures[0][:80]}**; " + notes
        lines.append(
            f"| {attack.name} | {attack.state.actions} "
            f"| {attack.value(p99, False) * 1000:.1f} / {loud_p99 * 1000:.1f} "
            f"| {_met(loud_p99 <= ECHO_P99_GOAL)} "
            f"| {attack.value(ttft, False) * 1000:.0f} / {attack.value(ttft, True) * 1000:.0f} "
            f"({attack.ratio(ttft):.2f}) "
            f"| {attack.value(rate, False):.1f} / {attack.value(rate, True):.1f} "
            f"({rate_ratio:.2f}) | {', '.join(goals)} | {growth_cell} | {notes} |"
        )
    lines += ["", f"Hostile bench wall time: {results.seconds:.0f} s."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.hostile_bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", action="append", choices=list(ATTACKS))
    parser.add_argument("--server-arg", action="append", default=[])
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average at start: {load}; cpus {psutil.cpu_count()}")
    results = trio.run(
        lambda: run_hostile_bench(
            QUICK if args.quick else FULL, only=args.only, server_args=args.server_arg, say=say
        )
    )
    print(format_hostile_table(results))
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
