"""Server benchmark: what the WebSocket layer costs on top of the engine.

Measured in one process run, against one engine shared by both sides:

* throughput: tokens per second of 1, 8 and 32 streaming clients over
  loopback WebSockets, against the engine alone driven by a plain loop of
  ``engine.step`` calls (what the generation task does, minus the server);
  the two sides alternate round by round so that both see the same machine
  load, and each round gives one ratio;
* stop latency: time from sending ``stop`` to receiving the interrupted
  final frame, with the stopped stream alone and with 8 other streams
  running, beside the engine's decode step time in the same runs;
* echo round trip on its own connection, idle and while 8 clients stream;
* memory per idle connection: the server process's RSS growth with 500 and
  1,000 connections held open by a client subprocess (so the clients' own
  memory is not counted).

Every infer is greedy (``temperature: 0``) with EOS banned (``bann_bann``),
so every run generates exactly ``max_new_tokens`` tokens on both sides.

Timings are reported, never asserted: these machines are shared and noisy.
Run it with ``python tests/bench/run.py`` (``--only server``, ``--quick``);
``python -m tests.bench.server_bench hold-clients URL`` is the client
subprocess of the memory measurement.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import json
import math
import random
import resource
import subprocess
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import attrs
import h11
import trio
import trio_websocket

from tests.helpers import RawClient, raw_client
from trioserve import protocol as p
from trioserve.engine.base import Engine, EngineInfo, GenerationSpec, PausingEngine
from trioserve.generation.engine_thread import EngineThread
from trioserve.server import Server, ServerConfig
from trioserve.vocabulary.results import Failed, Finished, Update
from trioserve.vocabulary.sampling import SamplingSettings

__all__ = [
    "FULL",
    "QUICK",
    "EchoResult",
    "LatencySummary",
    "MemoryResult",
    "ServerResults",
    "ServerScale",
    "StopResult",
    "ThroughputResult",
    "TimedEngine",
    "format_server_tables",
    "run_server_bench",
]

ROOT = Path(__file__).resolve().parents[2]

#: The prompt of every infer: a chat turn that invites a long answer.
PROMPT = (
    "<|im_start|>user\nTell me a long story about a dragon who learns to bake bread."
    "<|im_end|>\n<|im_start|>assistant\n"
)
#: SmolLM2's end-of-turn id; banned so that every run reaches max_new_tokens.
EOS_ID = 2


@attrs.frozen
class ServerScale:
    """How much of each measurement to run."""

    #: Interleaved engine-alone / through-socket rounds of the single stream,
    #: and its tokens. Short rounds, many of them: the two sides of a round
    #: then see the same machine load, and the median of the rounds' ratios
    #: shrugs off the rounds that another process disturbed.
    rounds: int
    single_tokens: int
    #: Client counts of the aggregate scenarios, their rounds, and each
    #: client's tokens.
    aggregate_clients: tuple[int, ...]
    aggregate_rounds: int
    aggregate_tokens: int
    #: Stop trials per variant, and the chunks each trial waits for first.
    stop_trials: int
    stop_after_chunks: int
    #: Echo round trips per variant.
    echo_samples: int
    #: Streams running in the loaded stop and echo variants.
    background_clients: int
    #: Idle connections held for the memory measurement (also measured at half).
    idle_connections: int


FULL = ServerScale(
    rounds=15,
    single_tokens=24,
    aggregate_clients=(8, 32),
    aggregate_rounds=5,
    aggregate_tokens=16,
    stop_trials=60,
    stop_after_chunks=3,
    echo_samples=400,
    background_clients=8,
    idle_connections=1000,
)
QUICK = ServerScale(
    rounds=4,
    single_tokens=12,
    aggregate_clients=(8, 32),
    aggregate_rounds=2,
    aggregate_tokens=8,
    stop_trials=15,
    stop_after_chunks=3,
    echo_samples=100,
    background_clients=8,
    idle_connections=1000,
)


# --- statistics -------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between the closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


@attrs.frozen
class LatencySummary:
    """Percentiles of a set of durations, in seconds."""

    samples: int
    p50: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencySummary:
        return cls(
            samples=len(values),
            p50=percentile(values, 50),
            p99=percentile(values, 99),
            max=max(values, default=math.nan),
        )


# --- an engine that times its steps ---------------------------------------------------


@attrs.frozen
class StepRecord:
    #: time.perf_counter() when the step started, and how long it took.
    started: float
    seconds: float
    submitted: int
    updates: int


class TimedEngine:
    """Delegates to an engine and records how long each ``step`` takes.

    The server runs on this wrapper so that the decode step time that the stop
    latency goal refers to is measured in the very runs that measure the stop
    latency. The cost is two clock reads and an append per step.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.steps: list[StepRecord] = []

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.engine.decode(ids)

    def step(
        self, submit: Sequence[GenerationSpec], cancel: Sequence[int], pause: Sequence[int] = ()
    ) -> list[Update]:
        started = time.perf_counter()
        if pause:  # only sent when the engine's info says it pauses
            updates = cast(PausingEngine, self.engine).step(submit, cancel, pause)
        else:
            updates = self.engine.step(submit, cancel)
        self.steps.append(
            StepRecord(started, time.perf_counter() - started, len(submit), len(updates))
        )
        return updates

    def close(self) -> None:
        self.engine.close()

    def decode_steps_since(self, since: float) -> list[float]:
        """Durations of the steps since ``since`` that only decoded: no job was
        submitted (so no prefill ran) and at least one job produced a token."""
        return [
            s.seconds for s in self.steps if s.started >= since and not s.submitted and s.updates
        ]


# --- throughput -----------------------------------------------------------------------


def infer_frame(request_id: str, max_new_tokens: int) -> dict[str, Any]:
    """The one kind of infer every scenario sends."""
    return {
        "action": "infer",
        "request_id": request_id,
        "text": PROMPT,
        "max_new_tokens": max_new_tokens,
        "stream": True,
        "temperature": 0,
        "bann_bann": [EOS_ID],
    }


def engine_specs(
    engine: Engine, server: Server, count: int, max_new_tokens: int
) -> list[GenerationSpec]:
    """The GenerationSpecs the server would build for ``count`` infer frames:
    the frame goes through the protocol codec, so both sides sample with the
    same settings (the protocol's defaults besides the greedy temperature)."""
    request = p.decode_request(json.dumps(infer_frame("engine", max_new_tokens)))
    assert isinstance(request, p.InferRequest) and request.text is not None
    prompt_ids = tuple(engine.encode(request.custom_bos + request.text))
    return [
        GenerationSpec(
            job_id=server.scheduler.new_job_id(),
            prompt_ids=prompt_ids,
            max_new_tokens=request.max_new_tokens,
            sampling=request.sampling_settings(),
            stop_token_ids=frozenset(engine.info.eos_token_ids),
            banned_ids=frozenset(request.bann_bann),
        )
        for _ in range(count)
    ]


@attrs.frozen
class EngineRun:
    seconds: float
    tokens: int
    #: Durations of the steps that only decoded (after the first).
    decode_steps: tuple[float, ...]
    #: Time between consecutive steps.
    gaps: tuple[float, ...]
    #: Seconds spent inside ``engine.step``, and how many steps ran.
    busy: float
    steps: int
    #: Duration of the first step (prefill and the first token).
    first_step: float = 0.0


def drive_engine(engine: Engine, specs: Sequence[GenerationSpec]) -> EngineRun:
    """Run ``specs`` to their ends with a plain loop of ``engine.step`` calls:
    all jobs submitted with the first step, as the generation task does when
    they arrive together. Runs on the engine thread (the one that loaded the
    engine), between the server's runs, so that the trio loop stays responsive
    meanwhile and both sides step from the same thread."""
    pending = {spec.job_id for spec in specs}
    tokens = 0
    decode_steps: list[float] = []
    gaps: list[float] = []
    submit: Sequence[GenerationSpec] = specs
    start = last_end = time.perf_counter()
    first_step = 0.0
    while pending:
        before = time.perf_counter()
        if submit is not specs:
            gaps.append(before - last_end)
        updates = engine.step(submit, [])
        last_end = time.perf_counter()
        if not submit:
            decode_steps.append(last_end - before)
        elif not first_step:
            first_step = last_end - before
        submit = ()
        for update in updates:
            if isinstance(update, Failed):
                raise RuntimeError(f"engine job failed: {update.message}")
            if isinstance(update, Finished):
                pending.discard(update.job_id)
                tokens += update.generated_tokens
    elapsed = time.perf_counter() - start
    busy = elapsed - sum(gaps)
    return EngineRun(
        elapsed, tokens, tuple(decode_steps), tuple(gaps), busy, len(gaps) + 1, first_step
    )


async def stream_to_final(client: RawClient, frame: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Send one infer and read its frames; the final frame and the number of
    chunk frames. The final frame must report every token generated."""
    await client.send(frame)
    frames = await client.recv_until_final(frame["request_id"], within=600.0)
    final = frames[-1]
    if final.get("response_type") != "full" or final["stop_reason"] != "num_tokens":
        raise RuntimeError(f"infer did not run to max_new_tokens: {final!r}")
    if final["usage"]["generated_tokens"] != frame["max_new_tokens"]:
        raise RuntimeError(f"infer generated the wrong number of tokens: {final['usage']!r}")
    return final, len(frames) - 1


async def socket_run(
    timed: TimedEngine, clients: Sequence[RawClient], max_new_tokens: int, tag: str
) -> EngineRun:
    """All ``clients`` send one infer at once; wall time to the last final frame."""
    tokens = 0

    async def one(index: int, client: RawClient) -> None:
        nonlocal tokens
        final, _ = await stream_to_final(client, infer_frame(f"{tag}-{index}", max_new_tokens))
        tokens += final["usage"]["generated_tokens"]

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index, client in enumerate(clients):
            nursery.start_soon(one, index, client)
    elapsed = time.perf_counter() - start
    steps = [s for s in timed.steps if s.started >= start]
    gaps = [b.started - (a.started + a.seconds) for a, b in itertools.pairwise(steps)]
    busy = sum(s.seconds for s in steps)
    decode_steps = tuple(s.seconds for s in steps if not s.submitted and s.updates)
    return EngineRun(elapsed, tokens, decode_steps, tuple(gaps), busy, len(steps))


@attrs.frozen
class ThroughputResult:
    clients: int
    tokens_per_client: int
    #: Aggregate tokens per second of each round, per side.
    engine_tps: tuple[float, ...]
    socket_tps: tuple[float, ...]
    #: socket / engine, per round.
    ratios: tuple[float, ...]
    #: Median decode step of the engine-alone runs, and of the same engine's
    #: steps behind the server: longer there when the trio thread's work
    #: (frames, and the in-process clients) keeps the step waiting for the GIL.
    engine_decode_step: float
    socket_decode_step: float
    #: Time between the end of one engine step and the start of the next, per
    #: side: the engine-alone loop's own cost, and the server's (the thread
    #: hand-offs, routing the updates, starting the next step).
    engine_gaps: LatencySummary
    socket_gaps: LatencySummary
    #: Share of each run's wall time spent inside engine steps, per round.
    #: Their ratio measures the server's cost with each run's own step time
    #: as the yardstick, so it is far less noisy than the tok/s ratio (but it
    #: misses whatever the server makes the steps themselves slower by).
    engine_busy: tuple[float, ...]
    socket_busy: tuple[float, ...]
    #: Engine steps per run, per round: more on the socket side when the
    #: clients' requests reach the engine in more than one step.
    engine_steps: tuple[int, ...]
    socket_steps: tuple[int, ...]


# --- the HTTP path: streamed /v1/chat/completions -----------------------------------------


#: The chat message of the HTTP path: PROMPT's user turn.
CHAT_MESSAGE = "Tell me a long story about a dragon who learns to bake bread."


def chat_body(max_tokens: int) -> bytes:
    """A streamed, greedy chat completion of ``max_tokens`` tokens (EOS banned,
    through the ExLlamaV2 extension field, so every run generates exactly that)."""
    return json.dumps(
        {
            "model": "any",
            "messages": [{"role": "user", "content": CHAT_MESSAGE}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "bann_bann": [EOS_ID],
        }
    ).encode()


@attrs.frozen
class HttpRun:
    seconds: float
    first_token: float
    tokens: int


async def sse_payloads(port: int, target: str, body: bytes) -> AsyncIterator[bytes]:
    """POST ``body`` to ``target`` and yield the ``data:`` payload of each
    Server-Sent Event as it arrives (named events' too). A plain h11 client,
    so that the client's own cost is small and the same every run."""
    conn = h11.Connection(h11.CLIENT)
    buffer = b""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        head = h11.Request(
            method="POST",
            target=target,
            headers=[
                ("Host", "bench"),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
            ],
        )
        await stream.send_all(
            (conn.send(head) or b"")
            + (conn.send(h11.Data(data=body)) or b"")
            + (conn.send(h11.EndOfMessage()) or b"")
        )
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Response) and event.status_code != 200:
                raise RuntimeError(f"{target} answered {event.status_code}")
            if isinstance(event, h11.Data):
                buffer += bytes(event.data)
                while b"\n\n" in buffer:
                    chunk, buffer = buffer.split(b"\n\n", 1)
                    for line in chunk.split(b"\n"):
                        if line.startswith(b"data: "):
                            yield line.removeprefix(b"data: ")
            if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return


async def http_stream(port: int, body: bytes) -> HttpRun:
    """POST one streamed chat completion and read its Server-Sent Events to
    ``[DONE]``: wall time, time to the first content delta, and the
    completion tokens its usage reports."""
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    done = False
    async for payload in sse_payloads(port, "/v1/chat/completions", body):
        if payload == b"[DONE]":
            done = True
            break
        chunk = json.loads(payload)
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        choices = chunk.get("choices") or []
        if first is None and choices and choices[0]["delta"].get("content"):
            first = time.perf_counter()
    ended = time.perf_counter()
    if not done or first is None:
        raise RuntimeError("the chat completion stream ended without [DONE] or content")
    return HttpRun(ended - started, first - started, tokens)


@attrs.frozen
class HttpResult:
    tokens: int
    engine_tps: tuple[float, ...]
    http_tps: tuple[float, ...]
    ratios: tuple[float, ...]
    #: Time to the first content delta, through HTTP; and the engine alone's
    #: first token (the step that prefills and samples it) in the same rounds.
    http_first_token: LatencySummary
    engine_first_token: LatencySummary


async def measure_http(
    timed: TimedEngine,
    server: Server,
    port: int,
    max_new_tokens: int,
    rounds: int,
    say: Callable[[str], None],
) -> HttpResult:
    """One streamed chat completion at a time vs the engine alone on the same
    prompt (the chat template's rendering of the same message), alternating."""
    engine = timed.engine
    thread = server.engine_thread
    assert thread is not None and server.chat_template is not None
    prompt = server.chat_template.render([{"role": "user", "content": CHAT_MESSAGE}])
    prompt_ids = tuple(engine.encode(prompt))

    def specs(tokens: int) -> list[GenerationSpec]:
        return [
            GenerationSpec(
                job_id=server.scheduler.new_job_id(),
                prompt_ids=prompt_ids,
                max_new_tokens=tokens,
                sampling=SamplingSettings(temperature=0.0, top_k=0, top_p=1.0, rep_pen=1.0),
                stop_token_ids=frozenset(engine.info.eos_token_ids),
                banned_ids=frozenset({EOS_ID}),
            )
        ]

    await thread.run_sync(drive_engine, engine, specs(4))
    await http_stream(port, chat_body(4))
    engine_tps: list[float] = []
    http_tps: list[float] = []
    http_first: list[float] = []
    engine_first: list[float] = []
    for round_ in range(rounds):
        order = ("engine", "http") if round_ % 2 == 0 else ("http", "engine")
        for side in order:
            if side == "engine":
                run = await thread.run_sync(drive_engine, engine, specs(max_new_tokens))
                engine_tps.append(run.tokens / run.seconds)
                engine_first.append(run.first_step)
            else:
                result = await http_stream(port, chat_body(max_new_tokens))
                if result.tokens != max_new_tokens:
                    raise RuntimeError(f"the chat completion made {result.tokens} tokens")
                http_tps.append(result.tokens / result.seconds)
                http_first.append(result.first_token)
        say(
            f"  http round {round_ + 1}/{rounds}: engine {engine_tps[-1]:.1f} tok/s, "
            f"http {http_tps[-1]:.1f} tok/s"
        )
    return HttpResult(
        tokens=max_new_tokens,
        engine_tps=tuple(engine_tps),
        http_tps=tuple(http_tps),
        ratios=tuple(h / e for h, e in zip(http_tps, engine_tps, strict=True)),
        http_first_token=LatencySummary.of(http_first),
        engine_first_token=LatencySummary.of(engine_first),
    )


@asynccontextmanager
async def open_clients(url: str, count: int) -> AsyncIterator[list[RawClient]]:
    """``count`` connections, opened before any timing starts."""
    clients: list[RawClient] = []
    async with trio.open_nursery() as nursery:
        done = trio.Event()

        async def hold(ready: trio.Event) -> None:
            async with raw_client(url) as client:
                clients.append(client)
                ready.set()
                await done.wait()

        for _ in range(count):
            ready = trio.Event()
            nursery.start_soon(hold, ready)
            await ready.wait()
        try:
            yield clients
        finally:
            done.set()


async def measure_throughput(
    timed: TimedEngine,
    server: Server,
    url: str,
    clients: int,
    max_new_tokens: int,
    rounds: int,
    say: Callable[[str], None],
) -> ThroughputResult:
    engine = timed.engine
    # The engine alone steps on the thread that loaded it, as a user of the
    # engine without the server would; the server steps on that thread too.
    thread = server.engine_thread
    assert thread is not None
    engine_tps: list[float] = []
    socket_tps: list[float] = []
    steps: list[float] = []
    served_steps: list[float] = []
    engine_gaps: list[float] = []
    socket_gaps: list[float] = []
    engine_busy: list[float] = []
    socket_busy: list[float] = []
    engine_steps: list[int] = []
    socket_steps: list[int] = []
    async with open_clients(url, clients) as connections:
        # Warm-up, both sides: first calls, allocations, cache growth.
        await thread.run_sync(drive_engine, engine, engine_specs(engine, server, clients, 4))
        await socket_run(timed, connections, 4, f"warm{clients}")
        for round_ in range(rounds):
            # Alternate which side goes first, so that a trend in the machine's
            # load does not favour one side.
            order = ("engine", "socket") if round_ % 2 == 0 else ("socket", "engine")
            for side in order:
                if side == "engine":
                    specs = engine_specs(engine, server, clients, max_new_tokens)
                    run = await thread.run_sync(drive_engine, engine, specs)
                    steps.extend(run.decode_steps)
                    engine_gaps.extend(run.gaps)
                    engine_busy.append(run.busy / run.seconds)
                    engine_steps.append(run.steps)
                    engine_tps.append(run.tokens / run.seconds)
                else:
                    tag = f"r{round_}c{clients}"
                    run = await socket_run(timed, connections, max_new_tokens, tag)
                    socket_gaps.extend(run.gaps)
                    served_steps.extend(run.decode_steps)
                    socket_busy.append(run.busy / run.seconds)
                    socket_steps.append(run.steps)
                    socket_tps.append(run.tokens / run.seconds)
            say(
                f"  {clients} client(s), round {round_ + 1}/{rounds}: engine "
                f"{engine_tps[-1]:.1f} tok/s, socket {socket_tps[-1]:.1f} tok/s"
            )
    return ThroughputResult(
        clients=clients,
        tokens_per_client=max_new_tokens,
        engine_tps=tuple(engine_tps),
        socket_tps=tuple(socket_tps),
        ratios=tuple(s / e for s, e in zip(socket_tps, engine_tps, strict=True)),
        engine_decode_step=median(steps),
        socket_decode_step=median(served_steps),
        engine_gaps=LatencySummary.of(engine_gaps),
        socket_gaps=LatencySummary.of(socket_gaps),
        engine_busy=tuple(engine_busy),
        socket_busy=tuple(socket_busy),
        engine_steps=tuple(engine_steps),
        socket_steps=tuple(socket_steps),
    )


# --- background streams -------------------------------------------------------------------


@asynccontextmanager
async def background_streams(url: str, count: int) -> AsyncIterator[None]:
    """``count`` clients that stream long infers, one after another, for the
    duration of the block; returns once every one has its first chunk."""
    async with trio.open_nursery() as nursery:
        started = [trio.Event() for _ in range(count)]

        async def stream(index: int) -> None:
            async with raw_client(url) as client:
                for serial in range(1_000_000):
                    await client.send(infer_frame(f"bg-{index}-{serial}", 256))
                    while True:
                        frame = await client.recv(within=600.0)
                        started[index].set()
                        if frame.get("response_type") in ("full", "error"):
                            break

        for index in range(count):
            nursery.start_soon(stream, index)
        for event in started:
            await event.wait()
        yield
        nursery.cancel_scope.cancel()


# --- stop latency -----------------------------------------------------------------------


@attrs.frozen
class StopResult:
    background: int
    stop_to_final: LatencySummary
    decode_step: LatencySummary

    @property
    def goal_s(self) -> float:
        """The goal: p99 at most one decode step (its median) plus 20 ms."""
        return self.decode_step.p50 + 0.020


async def measure_stop(
    timed: TimedEngine, url: str, trials: int, after_chunks: int, background: int
) -> StopResult:
    latencies: list[float] = []
    since = time.perf_counter()
    async with raw_client(url) as client:
        for trial in range(trials):
            rid = f"stop-{background}-{trial}"
            await client.send(infer_frame(rid, 512))
            chunks = 0
            while chunks < after_chunks:
                frame = await client.recv(within=600.0)
                if frame.get("response_type") != "chunk":
                    raise RuntimeError(f"unexpected frame before the stop: {frame!r}")
                chunks += 1
            sent = time.perf_counter()
            await client.send({"action": "stop", "request_id": f"{rid}-stop"})
            while True:
                frame = await client.recv(within=600.0)
                if frame.get("request_id") == rid and frame.get("response_type") == "full":
                    latencies.append(time.perf_counter() - sent)
                    if frame["stop_reason"] != "interrupted":
                        raise RuntimeError(f"stop did not interrupt: {frame!r}")
                    break
            reply, _ = await client.until("stop")
            if reply.get("stopped") != 1:
                raise RuntimeError(f"stop stopped {reply.get('stopped')!r} infers, not 1")
            # Trials apart in time, at a random phase of the engine's step.
            await trio.sleep(random.uniform(0.0, 0.05))
    return StopResult(
        background=background,
        stop_to_final=LatencySummary.of(latencies),
        decode_step=LatencySummary.of(timed.decode_steps_since(since)),
    )


# --- echo round trip ----------------------------------------------------------------------


@attrs.frozen
class EchoResult:
    background: int
    round_trip: LatencySummary
    #: Decode steps that ran meanwhile (none when idle).
    decode_step: LatencySummary


async def measure_echo(timed: TimedEngine, url: str, samples: int, background: int) -> EchoResult:
    rtts: list[float] = []
    since = time.perf_counter()
    async with raw_client(url) as client:
        for sample in range(samples):
            sent = time.perf_counter()
            reply = await client.request({"action": "echo", "request_id": sample})
            rtts.append(time.perf_counter() - sent)
            if reply != {"action": "echo", "request_id": sample}:
                raise RuntimeError(f"unexpected echo reply {reply!r}")
            # A random gap, so that samples fall at every phase of the step.
            await trio.sleep(random.uniform(0.0, 0.02))
    return EchoResult(
        background=background,
        round_trip=LatencySummary.of(rtts),
        decode_step=LatencySummary.of(timed.decode_steps_since(since)),
    )


# --- memory per idle connection -------------------------------------------------------------


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit; return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size from /proc (VmRSS), of this process by default."""
    path = Path(f"/proc/{pid or 'self'}/status")
    for line in path.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS line in {path}")


@attrs.frozen
class MemoryResult:
    #: Connections held, and the server process's RSS growth over its
    #: baseline at each count.
    counts: tuple[int, ...]
    server_growth: tuple[int, ...]
    #: Python heap growth per connection (tracemalloc, a separate pass at the
    #: largest count): the part of the RSS growth that Python objects make up.
    traced_per_connection: float
    #: The client subprocess's RSS at the largest count (not counted above).
    client_rss: int
    fd_limit: int
    #: Whether free heap memory was given back to the OS before the baseline.
    trimmed: bool

    def per_connection(self, index: int) -> float:
        return self.server_growth[index] / self.counts[index]

    @property
    def marginal(self) -> float:
        """Growth per connection between the two largest counts: free of any
        one-time cost of the first connections."""
        if len(self.counts) < 2:
            return self.per_connection(-1)
        added = self.counts[-1] - self.counts[-2]
        return (self.server_growth[-1] - self.server_growth[-2]) / added


class ClientHolder:
    """The client subprocess of the memory measurement, driven by lines:
    ``open N`` opens N more connections and answers ``open <total> <rss>``;
    closing its stdin makes it close everything and exit."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""

    @classmethod
    @asynccontextmanager
    async def start(cls, url: str) -> AsyncIterator[ClientHolder]:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "tests.bench.server_bench", "hold-clients", url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
        )
        holder = cls(process)
        try:
            yield holder
        finally:
            assert process.stdin is not None
            await process.stdin.aclose()
            with trio.move_on_after(30) as timeout:
                await process.wait()
            if timeout.cancelled_caught:
                process.kill()
                await process.wait()

    async def open(self, count: int) -> tuple[int, int]:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(f"open {count}\n".encode())
        line = await self._line()
        word, total, rss = line.split()
        if word != "open":
            raise RuntimeError(f"client holder said {line!r}")
        return int(total), int(rss)

    async def _line(self) -> str:
        assert self.process.stdout is not None
        while b"\n" not in self._buffer:
            with trio.fail_after(300):
                data = await self.process.stdout.receive_some()
            if not data:
                raise RuntimeError("the client holder exited early")
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()


async def settled_rss(server: Server, connections: int) -> int:
    """The server process's RSS once it holds exactly ``connections``."""
    with trio.fail_after(120):
        # Polled: the count changes in connection tasks that signal nothing.
        while server.statistics().connections != connections:  # noqa: ASYNC110
            await trio.sleep(0.01)
    # Let the connection tasks reach their idle waits.
    await trio.sleep(0.5)
    gc.collect()
    return rss_bytes()


def trim_heap() -> bool:
    """Give free heap memory back to the OS (glibc's ``malloc_trim``).

    Loading the model frees hundreds of MiB of temporaries; without this, new
    connections would be carved out of that free memory and the RSS would
    hardly move, however much they cost.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    libc.malloc_trim(0)
    return True


async def measure_memory(server: Server, url: str, total: int) -> MemoryResult:
    fd_limit = raise_fd_limit()
    if fd_limit < total + 100:
        raise RuntimeError(f"the open-file limit {fd_limit} is too low for {total} connections")
    # Warm-up: the first connections allocate what every later one reuses
    # (code paths, interned names, arena growth).
    async with ClientHolder.start(url) as holder:
        await holder.open(50)
        await settled_rss(server, 50)
    await settled_rss(server, 0)
    trimmed = trim_heap()
    baseline = rss_bytes()
    counts = (total // 2, total)
    growth: list[int] = []
    client_rss = 0
    async with ClientHolder.start(url) as holder:
        held = 0
        for count in counts:
            held, client_rss = await holder.open(count - held)
            growth.append(await settled_rss(server, held) - baseline)
    await settled_rss(server, 0)
    # A second pass under tracemalloc (it costs memory itself, so not in the
    # RSS pass): live Python allocations made while the connections open.
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        async with ClientHolder.start(url) as holder:
            await holder.open(total)
            await settled_rss(server, total)
            traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    await settled_rss(server, 0)
    return MemoryResult(
        counts=counts,
        server_growth=tuple(growth),
        traced_per_connection=traced / total,
        client_rss=client_rss,
        fd_limit=fd_limit,
        trimmed=trimmed,
    )


async def hold_clients(url: str) -> None:
    """The client subprocess: open connections on request and hold them."""
    raise_fd_limit()
    stdin = trio.wrap_file(sys.stdin)
    held: list[trio_websocket.WebSocketConnection] = []
    # Bounded handshakes at a time: a burst of 1,000 would overflow the
    # listen backlog and measure retries instead of connections.
    limiter = trio.CapacityLimiter(32)

    async with trio.open_nursery() as readers:

        async def connect() -> None:
            async with limiter:
                held.append(await trio_websocket.connect_websocket_url(readers, url))

        while True:
            words = (await stdin.readline()).split()
            if not words:
                break
            async with trio.open_nursery() as batch:
                for _ in range(int(words[1])):
                    batch.start_soon(connect)
            gc.collect()
            print(f"open {len(held)} {rss_bytes()}", flush=True)
        with trio.move_on_after(20):
            async with trio.open_nursery() as closing:
                for ws in held:
                    closing.start_soon(ws.aclose)
        readers.cancel_scope.cancel()


# --- the whole server bench -------------------------------------------------------------


@attrs.frozen
class ServerResults:
    scale: ServerScale
    throughput: tuple[ThroughputResult, ...]
    stop: tuple[StopResult, ...]
    echo: tuple[EchoResult, ...]
    memory: MemoryResult | None
    seconds: float
    http: HttpResult | None = None


async def run_server_bench(
    engine: Engine,
    scale: ServerScale,
    *,
    engine_thread: EngineThread,
    memory: bool = True,
    say: Callable[[str], None] = lambda line: None,
) -> ServerResults:
    """Run every server measurement against ``engine`` (one in-process server
    on a free loopback port); ``say`` receives progress lines."""
    needed = max((1, *scale.aggregate_clients, scale.background_clients + 1))
    if engine.info.max_batch < needed:
        raise ValueError(
            f"the engine's max_batch must be >= {needed} for this scale, "
            f"got {engine.info.max_batch!r}"
        )
    begun = time.perf_counter()
    timed = TimedEngine(engine)
    # Every bench client is on loopback, so all are one client to the server:
    # let that client hold every slot, as the engine-alone runs do.
    config = ServerConfig(host="127.0.0.1", port=0, max_running_per_client=engine.info.max_batch)
    server = Server(timed, config, engine_thread=engine_thread)
    throughput: list[ThroughputResult] = []
    stops: list[StopResult] = []
    echoes: list[EchoResult] = []
    memory_result: MemoryResult | None = None
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(server.run)
        url = listening.url
        if memory:
            say(f"memory: {scale.idle_connections} idle connections")
            memory_result = await measure_memory(server, url, scale.idle_connections)
        say("throughput: 1 client")
        throughput.append(
            await measure_throughput(timed, server, url, 1, scale.single_tokens, scale.rounds, say)
        )
        for clients in scale.aggregate_clients:
            say(f"throughput: {clients} clients")
            throughput.append(
                await measure_throughput(
                    timed,
                    server,
                    url,
                    clients,
                    scale.aggregate_tokens,
                    scale.aggregate_rounds,
                    say,
                )
            )
        say("http: streamed chat completions")
        http = await measure_http(
            timed, server, listening.port, scale.single_tokens, scale.rounds, say
        )
        say("echo round trip, idle")
        echoes.append(await measure_echo(timed, url, scale.echo_samples, 0))
        say("stop latency, one stream")
        stops.append(await measure_stop(timed, url, scale.stop_trials, scale.stop_after_chunks, 0))
        async with background_streams(url, scale.background_clients):
            say(f"echo round trip, {scale.background_clients} clients streaming")
            echoes.append(
                await measure_echo(timed, url, scale.echo_samples, scale.background_clients)
            )
            say(f"stop latency, {scale.background_clients} other clients streaming")
            stops.append(
                await measure_stop(
                    timed,
                    url,
                    scale.stop_trials,
                    scale.stop_after_chunks,
                    scale.background_clients,
                )
            )
        nursery.cancel_scope.cancel()
    return ServerResults(
        scale=scale,
        throughput=tuple(throughput),
        stop=tuple(stops),
        echo=tuple(echoes),
        memory=memory_result,
        seconds=time.perf_counter() - begun,
        http=http,
    )


# --- Markdown -----------------------------------------------------------------------------


def _ms(seconds: float, digits: int = 1) -> str:
    return f"{seconds * 1000:.{digits}f}"


def _met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def format_server_tables(results: ServerResults) -> str:
    """The server section's tables, in Markdown."""
    lines = [
        "#### Throughput: through the socket vs the engine alone",
        "",
        f"Medians of {results.scale.rounds} (1 client) and {results.scale.aggregate_rounds} "
        "(more clients) interleaved rounds; ratio = socket / engine per round, "
        "spread = lowest-highest round.",
        "",
        "| clients | tokens each | engine alone tok/s | through socket tok/s "
        "| ratio | ratio spread | goal | in-step share, engine alone / socket "
        "| steps per run, engine alone / socket "
        "| decode step ms, engine alone / socket "
        "| gap between steps ms, engine alone / server (p50, p99) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in results.throughput:
        ratio = median(t.ratios)
        goal = f">= 0.97: {_met(ratio >= 0.97)}" if t.clients == 1 else "(reported)"
        lines.append(
            f"| {t.clients} | {t.tokens_per_client} | {median(t.engine_tps):.1f} "
            f"| {median(t.socket_tps):.1f} | {ratio:.3f} "
            f"| {min(t.ratios):.3f}-{max(t.ratios):.3f} | {goal} "
            f"| {median(t.engine_busy):.3f} / {median(t.socket_busy):.3f} "
            f"| {median(t.engine_steps):.0f} / {median(t.socket_steps):.0f} "
            f"| {_ms(t.engine_decode_step)} / {_ms(t.socket_decode_step)} "
            f"| {_ms(t.engine_gaps.p50, 2)}, {_ms(t.engine_gaps.p99, 2)} / "
            f"{_ms(t.socket_gaps.p50, 2)}, {_ms(t.socket_gaps.p99, 2)} |"
        )
    h = results.http
    if h is not None:
        ratio = median(h.ratios)
        lines += [
            "",
            "#### The HTTP path: streamed /v1/chat/completions vs the engine alone",
            "",
            f"One request at a time, {h.tokens} tokens each, {len(h.ratios)} interleaved rounds.",
            "",
            "| engine alone tok/s | through HTTP (SSE) tok/s | ratio | ratio spread | goal "
            "| first token ms, HTTP (p50, p99) | first step ms, engine alone (p50) |",
            "|---|---|---|---|---|---|---|",
            f"| {median(h.engine_tps):.1f} | {median(h.http_tps):.1f} | {ratio:.3f} "
            f"| {min(h.ratios):.3f}-{max(h.ratios):.3f} | >= 0.97: {_met(ratio >= 0.97)} "
            f"| {_ms(h.http_first_token.p50)}, {_ms(h.http_first_token.p99)} "
            f"| {_ms(h.engine_first_token.p50)} |",
        ]
    lines += [
        "",
        "#### Latency (ms)",
        "",
        "| measure | streams running | samples | p50 | p99 | max | goal |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in results.stop:
        goal = f"p99 <= {_ms(s.goal_s)} (step + 20): {_met(s.stop_to_final.p99 <= s.goal_s)}"
        running = 1 + s.background
        lines.append(_latency_row("stop sent -> final frame", running, s.stop_to_final, goal))
        lines.append(_latency_row("decode step, same runs", running, s.decode_step, ""))
    for e in results.echo:
        goal = "" if not e.background else f"p99 <= 20: {_met(e.round_trip.p99 <= 0.020)}"
        lines.append(_latency_row("echo round trip", e.background, e.round_trip, goal))
        if e.background:
            lines.append(_latency_row("decode step, same runs", e.background, e.decode_step, ""))
    m = results.memory
    if m is not None:
        lines += [
            "",
            "#### Idle connections",
            "",
            "| connections | server RSS growth | per connection | goal |",
            "|---|---|---|---|",
        ]
        for index, count in enumerate(m.counts):
            per = m.per_connection(index) / 1024
            goal = f"<= 50 KiB: {_met(per <= 50)}" if index == len(m.counts) - 1 else ""
            lines.append(
                f"| {count} | {m.server_growth[index] / 2**20:.1f} MiB | {per:.1f} KiB | {goal} |"
            )
        if len(m.counts) > 1:
            lines.append(
                f"| {m.counts[-2]} -> {m.counts[-1]} (marginal) | "
                f"{(m.server_growth[-1] - m.server_growth[-2]) / 2**20:.1f} MiB "
                f"| {m.marginal / 1024:.1f} KiB | |"
            )
        lines += [
            "",
            f"Python heap per connection (tracemalloc, {m.counts[-1]} connections): "
            f"{m.traced_per_connection / 1024:.1f} KiB. Free heap given back to the OS "
            f"before the baseline: {'yes' if m.trimmed else 'no'}. Client subprocess RSS with "
            f"{m.counts[-1]} connections: {m.client_rss / 2**20:.1f} MiB (not counted above); "
            f"open-file limit {m.fd_limit}.",
        ]
    lines += ["", f"Server bench wall time: {results.seconds:.0f} s."]
    return "\n".join(lines)


def _latency_row(name: str, running: int, summary: LatencySummary, goal: str) -> str:
    return (
        f"| {name} | {running} | {summary.samples} | {_ms(summary.p50)} "
        f"| {_ms(summary.p99)} | {_ms(summary.max)} | {goal} |"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``hold-clients URL``: the memory measurement's client subprocess."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 2 and args[0] == "hold-clients":
        trio.run(hold_clients, args[1])
        return 0
    print(
        "usage: python -m tests.bench.server_bench hold-clients URL\n"
        "(run the benchmarks with python tests/bench/run.py)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
