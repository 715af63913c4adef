"""Well-behaved clients that watch what hostile ones do to them.

Shared by tests/test_hostile.py, the fuzzer (tests/fuzz/) and the hostile-client
benchmark (tests/bench/hostile_bench.py):

* :class:`Bystander` streams one infer after another on its own connection and
  checks every frame it gets against protocol.md: chunks concatenate to the
  final response, each request ends with exactly one terminal frame, nothing
  is an error. It records what went wrong instead of raising, so that a test
  can say "the bystander failed" beside whatever the attacker saw.
* :class:`EchoProbe` sends ``echo`` on its own connection in a loop and keeps
  every round-trip time: the longest one is how long the server's event loop
  stalled meanwhile.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Final

import trio
import trio_websocket

#: The well-behaved client's address, for a server that trusts loopback as
#: its proxy (the hostile bench): the attackers come from another, so that
#: the server's per-client fairness tells them apart as it would in
#: production. A server without --trusted-proxy ignores the header.
WELL_BEHAVED: Final = [(b"X-Forwarded-For", b"192.0.2.1")]
ATTACKER: Final = [(b"X-Forwarded-For", b"198.51.100.66")]

__all__ = ["Bystander", "EchoProbe", "open_bystander", "open_echo_probe", "random_words"]


class Bystander:
    """A client that streams infers back to back and checks every frame.

    ``frame(serial)`` builds the infer to send (its ``request_id`` is replaced
    by the serial). ``expect_stop_reasons`` are the ``stop_reason`` values a
    final frame may carry.
    """

    def __init__(
        self,
        url: str,
        frame: Callable[[int], dict[str, Any]],
        *,
        expect_stop_reasons: tuple[str, ...] = ("num_tokens", "eos"),
        within: float = 120.0,
    ) -> None:
        self.url = url
        self.frame = frame
        self.expect_stop_reasons = expect_stop_reasons
        self.within = within
        #: Requests that ended with a correct final frame, and chunk frames seen.
        self.completed = 0
        self.chunks = 0
        #: What went wrong, one line each (empty: nothing).
        self.failures: list[str] = []
        #: Per completed request: seconds from send to first chunk, tokens,
        #: and seconds from first chunk to final frame.
        self.ttft: list[float] = []
        self.token_rates: list[float] = []
        self.first_chunk = trio.Event()
        self._stopping = False

    async def run(self) -> None:
        try:
            async with trio_websocket.open_websocket_url(
                self.url, extra_headers=WELL_BEHAVED
            ) as ws:
                serial = 0
                while not self._stopping:
                    serial += 1
                    await self._one(ws, serial)
        except trio_websocket.ConnectionClosed as exc:
            if not self._stopping:
                self.failures.append(f"connection closed: {exc.reason}")
        except (OSError, trio_websocket.HandshakeError) as exc:
            self.failures.append(f"cannot connect: {exc!r}")
        except trio.TooSlowError:
            self.failures.append(f"no frame for {self.within} s")

    async def _one(self, ws: trio_websocket.WebSocketConnection, serial: int) -> None:
        frame = {**self.frame(serial), "request_id": serial}
        sent = time.perf_counter()
        first: float | None = None
        await ws.send_message(json.dumps(frame))
        response = ""
        while True:
            with trio.fail_after(self.within):
                message = await ws.get_message()
            if not isinstance(message, str):
                self.failures.append(f"a binary frame: {message[:100]!r}")
                return
            reply = json.loads(message)
            if reply.get("request_id") != serial:
                self.failures.append(f"frame of another request: {message[:200]}")
                continue
            kind = reply.get("response_type")
            if kind == "chunk":
                if not reply.get("chunk"):
                    self.failures.append(f"empty chunk frame: {message[:200]}")
                if first is None:
                    first = time.perf_counter()
                    self.first_chunk.set()
                response += reply["chunk"]
                self.chunks += 1
                continue
            if kind != "full":
                self.failures.append(f"request {serial} failed: {message[:300]}")
                return
            if frame.get("stream") and reply["response"] != response:
                self.failures.append(f"chunks do not join to the response of request {serial}")
            if reply["stop_reason"] not in self.expect_stop_reasons:
                self.failures.append(f"request {serial} ended {reply['stop_reason']!r}")
                return
            self.completed += 1
            end = time.perf_counter()
            if first is not None:
                self.ttft.append(first - sent)
                tokens = reply["usage"]["generated_tokens"]
                if tokens > 1 and end > first:
                    self.token_rates.append((tokens - 1) / (end - first))
            return

    def stop(self) -> None:
        self._stopping = True

    def check(self) -> None:
        """Raise AssertionError if anything went wrong or nothing was served."""
        assert not self.failures, f"the bystander failed: {self.failures[:5]}"
        assert self.chunks > 0, "the bystander received no chunk at all"


@asynccontextmanager
async def open_bystander(
    url: str,
    frame: Callable[[int], dict[str, Any]],
    *,
    expect_stop_reasons: tuple[str, ...] = ("num_tokens", "eos"),
    within: float = 120.0,
) -> AsyncIterator[Bystander]:
    """Run a :class:`Bystander` for the block, once it streams (its first
    chunk arrived). It is checked on the way out: any failure raises."""
    bystander = Bystander(url, frame, expect_stop_reasons=expect_stop_reasons, within=within)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bystander.run)
        with trio.fail_after(within):
            await bystander.first_chunk.wait()
        yield bystander
        # Let the request in flight end by itself (its final frame is checked),
        # up to a bound; then cut it.
        bystander.stop()
        nursery.cancel_scope.deadline = trio.current_time() + within
    bystander.check()


class EchoProbe:
    """Sends ``echo`` in a loop, ``gap`` seconds apart, and keeps how late each
    cycle (sleep, send, reply) came back beyond its ``gap``: the longest is how
    long the event loop stalled meanwhile, wherever in the cycle the stall
    fell. The client runs in the caller's process: when the server is in that
    process too, a stalled event loop stalls the probe as well, and that is
    what it measures."""

    def __init__(self, url: str, *, gap: float = 0.01) -> None:
        self.url = url
        self.gap = gap
        self.round_trips: list[float] = []
        self.lateness: list[float] = []
        self.failures: list[str] = []
        self.started = trio.Event()
        self._cycle_since: float | None = None

    async def run(self) -> None:
        try:
            async with trio_websocket.open_websocket_url(
                self.url, extra_headers=WELL_BEHAVED
            ) as ws:
                self.started.set()
                serial = 0
                while True:
                    serial += 1
                    self._cycle_since = begun = time.perf_counter()
                    await trio.sleep(self.gap)
                    sent = time.perf_counter()
                    await ws.send_message(json.dumps({"action": "echo", "request_id": serial}))
                    reply = json.loads(await ws.get_message())
                    now = time.perf_counter()
                    self.round_trips.append(now - sent)
                    self.lateness.append(now - begun - self.gap)
                    if reply != {"action": "echo", "request_id": serial}:
                        self.failures.append(f"wrong echo reply {reply!r}")
        except trio_websocket.ConnectionClosed as exc:
            self.failures.append(f"connection closed: {exc.reason}")
        finally:
            self.started.set()

    def reset(self) -> None:
        """Forget what was measured so far."""
        self.round_trips.clear()
        self.lateness.clear()

    def longest(self) -> float:
        """The longest stall seen, counting a cycle still under way."""
        pending = 0.0
        if self._cycle_since is not None:
            pending = time.perf_counter() - self._cycle_since - self.gap
        return max([pending, *self.lateness])


@asynccontextmanager
async def open_echo_probe(url: str, *, gap: float = 0.01) -> AsyncIterator[EchoProbe]:
    probe = EchoProbe(url, gap=gap)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe.run)
        await probe.started.wait()
        # One answered echo first: the connection works before the attack.
        with trio.fail_after(30):
            while not probe.round_trips and not probe.failures:  # noqa: ASYNC110
                await trio.sleep(0.005)
        yield probe
        nursery.cancel_scope.cancel()
    assert not probe.failures, f"the echo probe failed: {probe.failures[:5]}"


def random_words(chars: int, seed: int = 0) -> str:
    """Text of ``chars`` characters made of random lowercase words: what a
    tokenizer really works through (a repeated sentence hits its cache)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(50_000)]
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(words)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]
