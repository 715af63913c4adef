"""Hostile clients: a regression test for each defect of issue 8, on real sockets.

Every test here plays a client that is hostile or merely broken against a real
server on a loopback port (``trioserve.serve`` in this process), and checks what
issue 8's "Build" section asks for: the server neither crashes nor freezes nor
starves anyone, the attacker gets a clear answer (an error frame or a close
code), and a well-behaved client on another connection (the bystander, see
tests/hostile.py) is not touched. Tests of defects that involve the model run
on the real embedded engine; the others on the scripted engine of
tests/helpers.py, whose steps are cheap, so that the attack is all that costs.

Where a test bounds a time (an echo's round trip while another connection
tokenizes megabytes), the bound is generous on purpose (0.5 s): the defect
it catches is a stall of seconds, and the benchmark (tests/bench/hostile_bench.py)
measures the real figure.

Assumed names (issue 8 names only ``--max-connections``; the rest follow the
server's ``ServerConfig`` as the lead is writing it; if one changes, change it
here, in ``ASSUMED_CONFIG_FIELDS``):

* ``max_connections``: open connections; more handshakes are answered 503;
* ``max_output_bytes``: unsent output one connection may hold before it is
  closed with 1008 (or 1013);
* ``send_timeout``: a client that accepts nothing for this long is closed;
* ``handshake_timeout``: a peer must finish its handshake within this time;
* ``close_timeout``: how long the server waits for a close handshake.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio
import trio_websocket

from trioserve.server import Listening, Server, ServerConfig

from . import wire
from .helpers import EOS, ScriptedEngine, raw_client, wait_until
from .hostile import open_bystander, open_echo_probe, random_words

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

MiB = 1024 * 1024
#: How long another connection's echo may wait while one connection attacks.
#: The defects stalled it for seconds; this is "not seconds", not a benchmark.
STALL_BOUND = 0.5
#: ServerConfig fields these tests use that today's main does not have.
ASSUMED_CONFIG_FIELDS = (
    "max_connections",
    "max_output_bytes",
    "send_timeout",
    "handshake_timeout",
    "close_timeout",
)
SMOL_EOS = 2


def make_config(**options: Any) -> ServerConfig:
    """A loopback ServerConfig on a free port; an assumed field that the
    server does not have is a clear failure, not a TypeError deep inside."""
    missing = [
        name
        for name in options
        if name in ASSUMED_CONFIG_FIELDS and name not in attrs_fields(ServerConfig)
    ]
    if missing:
        pytest.fail(
            f"ServerConfig has no field {', '.join(missing)} (issue 8's limits; "
            "see ASSUMED_CONFIG_FIELDS in tests/test_hostile.py)"
        )
    return ServerConfig(host="127.0.0.1", port=0, **options)


def attrs_fields(cls: type) -> set[str]:
    return {field.name for field in attrs.fields(cls)}


@asynccontextmanager
async def serving(engine: Any, **options: Any) -> AsyncIterator[tuple[Server, Listening]]:
    """The server in this process, with its Server object for statistics()."""
    server = Server(engine, make_config(**options))
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(server.run)
        yield server, listening
        nursery.cancel_scope.cancel()


def infer(text: str, max_new_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"action": "infer", "text": text, "max_new_tokens": max_new_tokens, **fields}


def scripted_stream(serial: int) -> dict[str, Any]:
    """The scripted bystander's request: 120 tokens of DEFAULT_SCRIPT, streamed."""
    return infer("go", 120, stream=True)


def chat(prompt: str) -> str:
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


STORY = chat("Tell me a long story about a dragon.")


def model_stream(serial: int) -> dict[str, Any]:
    """The real model's bystander: 12 greedy tokens, EOS banned, streamed."""
    return infer(STORY, 12, stream=True, temperature=0, bann_bann=[SMOL_EOS])


def assert_error(frame: dict[str, Any], error_type: str, field: str | None = None) -> None:
    assert frame.get("response_type") == "error", frame
    assert frame["error"]["type"] == error_type, frame
    if field is not None:
        assert frame["error"].get("field") == field, frame


def nested(depth: int) -> str:
    """A JSON array nested ``depth`` deep, as text (json.dumps of such a value
    would itself hit the recursion limit)."""
    return "[" * depth + "]" * depth


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


async def settle(predicate: Any, within: float) -> bool:
    """Poll ``predicate`` for up to ``within`` seconds; whether it came true."""
    with trio.move_on_after(within):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.005)
        return True
    return False


async def still_serves(url: str) -> None:
    """A new connection gets an answer: the listener and the loop are alive."""
    async with raw_client(url) as ws:
        assert await ws.request({"action": "echo", "request_id": "alive"}) == {
            "action": "echo",
            "request_id": "alive",
        }


# --- defect 1: a peer that goes away during the handshake -----------------------------------------


@pytest.mark.parametrize("kind", ["accept", "reject_401", "reject_403", "half_request"])
async def test_a_peer_hanging_up_during_the_handshake_harms_no_one(kind: str) -> None:
    """Issue 8, defect 1: ``accept()``/``reject()`` raised ConnectionClosed into
    the nursery that held every connection, and the server exited."""
    options: dict[str, Any] = {}
    headers: tuple[tuple[str, str], ...] = ()
    if kind == "reject_401":
        options["api_key"] = "sesame"
    if kind == "reject_403":
        headers = (("Origin", "https://evil.example"),)
    good_headers = [(b"Authorization", b"Bearer sesame")] if kind == "reject_401" else []
    engine = ScriptedEngine(step_delay=0.002)
    async with serving(engine, **options) as (_, listening):
        bystander_url = listening.url + ("?api_key=sesame" if kind == "reject_401" else "")
        async with open_bystander(bystander_url, scripted_stream) as bystander:
            for _ in range(8):
                stream = await wire.open_tcp("127.0.0.1", listening.port)
                request = wire.handshake_request("127.0.0.1", listening.port, headers=headers)
                if kind == "half_request":
                    request = request[: len(request) // 2]
                await stream.send_all(request)
                # A reset, not a FIN: the server's answer meets a dead socket.
                wire.reset(stream)
                await trio.sleep(0.02)
            completed = bystander.completed
            with trio.fail_after(30):
                while bystander.completed < completed + 2:  # noqa: ASYNC110
                    await trio.sleep(0.01)
        async with raw_client(listening.url, extra_headers=good_headers) as ws:
            assert await ws.request({"action": "echo"}) == {"action": "echo"}


async def test_a_silent_peer_is_dropped_after_the_handshake_timeout() -> None:
    """A connection that never completes its handshake must not be held
    forever (assumes ``handshake_timeout``)."""
    async with serving(ScriptedEngine(), handshake_timeout=0.5) as (_, listening):
        stream = await wire.open_tcp("127.0.0.1", listening.port)
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
        with trio.fail_after(10):
            while await stream.receive_some(4096):
                pass
        await stream.aclose()
        await still_serves(listening.url)


async def test_max_connections_answers_503_and_frees_places() -> None:
    """Issue 8, defect 7 (no cap on connections): ``--max-connections``, answered
    503 at the handshake; a hang-up at that answer harms no one."""
    async with serving(ScriptedEngine(), max_connections=2) as (server, listening):
        async with raw_client(listening.url) as first, raw_client(listening.url) as second:
            with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
                async with raw_client(listening.url):
                    pass
            assert rejected.value.status_code == 503
            # A peer that hangs up at its 503.
            for _ in range(5):
                stream = await wire.open_tcp("127.0.0.1", listening.port)
                await stream.send_all(wire.handshake_request("127.0.0.1", listening.port))
                wire.reset(stream)
            assert await first.request({"action": "echo"}) == {"action": "echo"}
            assert await second.request({"action": "echo"}) == {"action": "echo"}
        await wait_until(lambda: server.statistics().connections == 0)
        await still_serves(listening.url)


# --- defect 2: deep nesting -----------------------------------------------------------------------


#: Frames with a value nested ``{D}`` deep in each place an id, a tag or a
#: target is copied or compared. Where the recursion limit bites depends on
#: how deep the server's stack already is (the issue saw 979 crash json.dumps
#: in the CLI; under pytest the decoder gives up first), so each template is
#: sent at every depth from 65 to 1,000: one of them falls between "the
#: decoder still copes" and "encoding the reply does not".
NESTED_TEMPLATES = {
    "echo_id": '{"action":"echo","request_id":{D}}',
    "echo_response_id": '{"action":"echo","response_id":{D}}',
    "info_id": '{"action":"info","request_id":{D}}',
    "infer_tag": '{"action":"infer","text":"go","max_new_tokens":2,"tag":{D}}',
    "unknown_action_id": '{"action":"dance","request_id":{D}}',
    "error_reply_id": '{"action":"infer","text":"go","max_new_tokens":-1,"request_id":{D}}',
    "stop_target": '{"action":"stop","target":{D}}',
    "estimate_id": '{"action":"estimate_token","text":"x","request_id":{D}}',
}


def nested_objects(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("place", list(NESTED_TEMPLATES))
async def test_deep_nesting_never_crashes_and_gets_one_reply(place: str) -> None:
    """Issue 8, defect 2: encoding the reply of a frame nested 979 deep raised
    RecursionError and took every connection down. Whatever the cap, every
    depth gets exactly one reply (``invalid_json``, or the normal reply with
    the value copied unchanged) and a bystander streams on untouched."""
    template = NESTED_TEMPLATES[place].replace('"max_new_tokens":2', '"max_new_tokens":1')
    # Every depth near the recursion limit (where the server's stack depth
    # puts the crash), every tenth below it.
    depths = [*range(1, 700, 10), *range(700, 1001), 5000, 100_000]
    # 8 MiB frames: the deepest values are bigger than the default frame limit,
    # which is not what this test is about.
    async with serving(ScriptedEngine(step_delay=0.001), max_message_bytes=8 * MiB) as (
        _,
        listening,
    ):
        async with open_bystander(listening.url, scripted_stream):
            async with trio_websocket.open_websocket_url(listening.url) as ws:
                for depth in depths:
                    for value in (nested(depth), nested_objects(depth)):
                        await ws.send_message(template.replace("{D}", value))
                        with trio.fail_after(30):
                            message = await ws.get_message()
                        assert isinstance(message, str)
                        if '"type":"invalid_json"' in message:
                            continue
                        # Not refused: the reply is the normal one, with the
                        # value copied (compared as text: json.loads would
                        # itself run out of stack at these depths).
                        assert '"response_type":"error"' not in message or place in (
                            "unknown_action_id",
                            "error_reply_id",
                        ), (depth, message[:300])
                        if place != "stop_target":
                            assert value in message, (depth, message[:300])
                # Exactly one reply each: the next one answers the next request.
                await ws.send_message('{"action":"echo","request_id":"next"}')
                assert await ws.get_message() == '{"action":"echo","request_id":"next"}'


@pytest.mark.parametrize("place", list(NESTED_TEMPLATES))
async def test_nesting_deeper_than_64_is_invalid_json(place: str) -> None:
    """Issue 8's bound: "depth 64 is plenty; deeper is invalid_json"."""
    template = NESTED_TEMPLATES[place]
    async with (
        serving(ScriptedEngine(), max_message_bytes=8 * MiB) as (_, listening),
        raw_client(listening.url) as ws,
    ):
        for depth in (70, 100, 500, 2000):
            for value in (nested(depth), nested_objects(depth)):
                reply = await ws.request(template.replace("{D}", value))
                assert reply.get("response_type") == "error", (depth, str(reply)[:200])
                assert reply["error"]["type"] == "invalid_json", (depth, str(reply)[:300])
        for frame in (nested(70), nested_objects(70), nested(1_000_000)):
            assert_error(await ws.request(frame), "invalid_json")
        assert await ws.request({"action": "echo"}) == {"action": "echo"}


async def test_stop_target_nested_deep_does_not_crash_the_comparison() -> None:
    """Issue 8, defect 2: an infer whose request_id is nested ~350 deep, then a
    stop targeting the same value while it runs, crashed ``json_equal``.
    Whatever the cap, both get exactly one answer: both refused
    (``invalid_json``), or the infer stopped (its final frame, then the stop's
    reply)."""
    async with serving(ScriptedEngine(step_delay=0.002)) as (_, listening):
        async with open_bystander(listening.url, scripted_stream):
            async with trio_websocket.open_websocket_url(listening.url) as ws:
                for depth in (100, 200, 350, 500, 700, 900):
                    deep = nested(depth)
                    await ws.send_message(
                        '{"action":"infer","text":"long","max_new_tokens":500,"request_id":'
                        + deep
                        + "}"
                    )
                    await ws.send_message('{"action":"stop","target":' + deep + "}")
                    with trio.fail_after(30):
                        first = await ws.get_message()
                        second = await ws.get_message()
                    assert isinstance(first, str) and isinstance(second, str)
                    if '"invalid_json"' in first:
                        assert '"invalid_json"' in second, (depth, second[:300])
                    else:
                        assert '"stop_reason":"interrupted"' in first, (depth, first[:300])
                        assert second == '{"action":"stop","stopped":1}', (depth, second[:300])
                await ws.send_message('{"action":"stop"}')
                assert await ws.get_message() == '{"action":"stop","stopped":0}'


async def test_moderate_nesting_is_still_echoed_exactly() -> None:
    """The cap must not cut what clients legitimately send: ids nested a few
    levels (here 30) come back unchanged."""
    value: Any = "leaf"
    for depth in range(30):
        value = [value] if depth % 2 else {"k": value}
    async with serving(ScriptedEngine()) as (_, listening), raw_client(listening.url) as ws:
        reply = await ws.request({"action": "echo", "request_id": value, "response_id": value})
        assert reply == {"action": "echo", "request_id": value, "response_id": value}
        await ws.send(infer("say:ok", 5, tag=value, request_id=1))
        (final,) = await ws.recv_until_final(request_id=1)
        assert final["tag"] == value and final["response"] == "ok"


# --- defect 3: one request fails everyone's batch -------------------------------------------------


#: (field, value, must be refused). The top_k values are the issue's; for the
#: others either answer is right (refused naming the field, or served
#: normally), as long as nothing fails a step.
SAMPLER_EXTREMES: list[tuple[str, Any, bool]] = [
    ("top_k", 2**63, True),
    ("top_k", 2**64 + 1, True),
    ("top_k", 1e30, True),
    ("top_k", 1e308, True),
    ("rep_pen", 1e-300, False),
    ("rep_pen", 1e308, False),
    ("pres_pen", -1e308, False),
    ("pres_pen", 1e308, False),
    ("freq_pen", 1e308, False),
    ("freq_pen", -1e308, False),
    ("temperature", 1e308, False),
    ("temperature", 1e-308, False),
    ("top_a", 1e308, False),
    ("skew", 1e308, False),
    ("skew", -1e308, False),
    ("top_p", 5e-324, False),
    ("min_p", 5e-324, False),
    ("typical", 5e-324, False),
]


async def test_extreme_sampler_values_fail_no_one_elses_batch(cpu_engine: CpuEngine) -> None:
    """Issue 8, defect 3: top_k >= 2**63 (or 1e30) passed validation and
    overflowed in the sampler: the step raised and every job in the batch,
    other clients' too, ended ``internal``."""
    async with serving(cpu_engine) as (server, listening):
        async with raw_client(listening.url) as victim, raw_client(listening.url) as attacker:
            # One long job that shares every batch with the attacker's, and
            # samples with top_k as the attacker's does (greedy rows take
            # another path through the sampler).
            await victim.send(
                infer(
                    STORY,
                    3000,
                    stream=True,
                    temperature=0.8,
                    top_k=40,
                    seed=1,
                    bann_bann=[SMOL_EOS],
                    request_id="v",
                )
            )
            first = await victim.recv(within=120)
            assert first["response_type"] == "chunk", first
            answers: dict[str, dict[str, Any]] = {}
            for index, (field, value, refuse) in enumerate(SAMPLER_EXTREMES):
                rid = f"{field}={value!r}"
                await attacker.send(infer(STORY, 2, request_id=rid, seed=2, **{field: value}))
                (reply,) = await attacker.recv_until_final(request_id=rid, within=120)
                answers[rid] = reply
                if refuse or reply["response_type"] == "error":
                    assert_error(reply, "invalid_request", f"$.{field}")
                else:
                    assert reply["response_type"] == "full", (index, reply)
            # The victim streamed through all of it and ends as asked.
            await victim.send({"action": "stop", "target": "v"})
            frames = [first]
            while (frame := await victim.recv(within=120))["action"] != "stop":
                frames.append(frame)
            assert all(f["response_type"] != "error" for f in frames), frames[-1]
            assert frames[-1]["response_type"] == "full"
            assert frames[-1]["stop_reason"] == "interrupted"
            assert frame["stopped"] == 1
        await wait_until(lambda: server.statistics().scheduler.running == 0)
        assert server.statistics().scheduler.failed == 0, answers


# --- defect 4: dead jobs block the queue ----------------------------------------------------------


class GatedEngine(ScriptedEngine):
    """A scripted engine whose steps wait until the test opens the gate."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.gate = threading.Event()
        self.in_step = threading.Event()

    def step(self, submit: Any, cancel: Any, pause: Any = ()) -> Any:
        self.in_step.set()
        self.gate.wait(60)
        return super().step(submit, cancel, pause)


def as_client(n: int) -> dict[str, Any]:
    """Options of a connection that comes, through a trusted proxy on
    loopback, from client address number ``n``."""
    return {"extra_headers": [(b"X-Forwarded-For", f"192.0.2.{n}".encode())]}


async def test_stopped_or_abandoned_queued_jobs_free_their_places_at_once() -> None:
    """Issue 8, defect 4: a queued job that was stopped (or whose client left)
    kept its place in the bounded queue until a slot freed, so other clients
    got ``overloaded``."""
    engine = ScriptedEngine(step_delay=0.005, max_batch=2)
    # Four clients, each its own (as four machines behind a trusted proxy):
    # one client holds at most all but one of the engine's slots.
    async with serving(engine, max_waiting_jobs=4, trusted_proxies=("127.0.0.1",)) as (
        server,
        listening,
    ):
        url = listening.url
        async with raw_client(url, **as_client(1)) as a1, raw_client(url, **as_client(2)) as a2:
            # Both engine slots busy, one connection each.
            for ws, rid in ((a1, "a1"), (a2, "a2")):
                await ws.send(infer("long", 10_000, stream=True, request_id=rid))
                await ws.recv()
            await wait_until(lambda: server.statistics().scheduler.running == 2)
            for round_ in ("stop", "disconnect"):
                async with raw_client(url, **as_client(3)) as b:
                    for i in range(4):
                        await b.send(infer("long", 1000, request_id=f"b{i}"))
                    await wait_until(lambda: server.statistics().scheduler.waiting == 4)
                    # The queue is full now; the bound still holds.
                    overflow = await b.request(infer("long", 1000, request_id="b-over"))
                    assert_error(overflow, "overloaded")
                    if round_ == "stop":
                        await b.send({"action": "stop"})
                        reply, finals = await b.until("stop")
                        assert reply["stopped"] == 4
                        assert all(f["stop_reason"] == "interrupted" for f in finals)
                # Four places are free again, at once, while both slots stay busy.
                async with raw_client(url, **as_client(4)) as c:
                    for i in range(4):
                        await c.send(infer("say:ok", 5, request_id=f"c{i}"))
                    await settle(lambda: server.statistics().scheduler.waiting == 4, within=5)
                    await c.send({"action": "stop"})
                    reply, finals = await c.until("stop")
                    refused = [f for f in finals if f["response_type"] == "error"]
                    assert not refused, f"after the {round_}, other clients were refused: {refused}"
                    assert reply["stopped"] == 4, finals
            await a1.send({"action": "stop"})
            await a1.until("stop")
            await a2.send({"action": "stop"})
            await a2.until("stop")


async def test_a_burst_fills_free_engine_slots_not_just_the_queue() -> None:
    """Issue 8, defect 4: a burst on an idle server admitted only
    max_waiting_jobs + 1 requests although engine slots were free."""
    engine = GatedEngine(max_batch=4)
    proxied = {"trusted_proxies": ("127.0.0.1",)}
    async with serving(engine, max_waiting_jobs=1, **proxied) as (server, listening):
        clients = []
        async with trio.open_nursery() as nursery:
            done = trio.Event()

            async def hold(index: int, ready: trio.Event) -> None:
                async with raw_client(listening.url, **as_client(index)) as ws:
                    clients.append(ws)
                    ready.set()
                    await done.wait()

            for index in range(8):
                ready = trio.Event()
                nursery.start_soon(hold, index, ready)
                await ready.wait()
            # The first job reaches the engine and its step waits at the gate.
            await clients[0].send(infer("say:first", 20, request_id=0))
            await trio.to_thread.run_sync(engine.in_step.wait, 10)
            # Seven more, one per connection, while the engine has 3 free slots
            # and the queue 1 place: 4 fit, 3 must be refused.
            for index in range(1, 8):
                await clients[index].send(infer(f"say:r{index}", 20, request_id=index))
            # Every one of them decided before the first job can end and free a place.
            refused = {"api": "websocket", "action": "infer", "outcome": "overloaded"}
            await wait_until(
                lambda: (
                    server.metrics.registry.get_sample_value("trioserve_requests_total", refused)
                    == 3
                    and server.statistics().requests_in_flight == 5
                )
            )
            engine.gate.set()
            replies = [await ws.recv() for ws in clients]
            done.set()
    kinds = sorted(r.get("error", {}).get("type", r["response_type"]) for r in replies)
    assert kinds == ["full"] * 5 + ["overloaded"] * 3, replies
    assert server.statistics().scheduler.failed == 0


# --- defect 5: long texts freeze the event loop ---------------------------------------------------


@pytest.fixture(scope="module")
def long_text() -> str:
    return random_words(2_700_000)


@pytest.mark.slow
@pytest.mark.parametrize("action", ["estimate_token", "lefttrim_token", "infer"])
async def test_a_long_text_does_not_stall_other_connections(
    cpu_engine: CpuEngine, long_text: str, action: str
) -> None:
    """Issue 8, defect 5: the tokenizer holds the GIL for the whole call, so
    one estimate_token of 2.7 M characters stalled every other connection's
    echo for about 2 s even in a worker thread. The frame limit is set to
    8 MiB here so that the text is accepted whatever the default becomes."""
    frame: dict[str, Any] = {"action": action, "text": long_text, "request_id": "long"}
    if action == "lefttrim_token":
        frame["trimmed_length"] = 5
    if action == "infer":
        # Most of the context left for new tokens, so that the kept prompt is
        # short (prefilling 8 k tokens would dominate the test); stopped at its
        # first chunk.
        frame.update(max_new_tokens=cpu_engine.info.context_length - 64, temperature=0, stream=True)
    async with serving(cpu_engine, max_message_bytes=8 * MiB) as (_, listening):
        async with open_echo_probe(listening.url) as probe, raw_client(listening.url) as ws:
            await ws.send(frame)
            reply = await ws.recv(within=300)
            stall = probe.longest()
            if reply.get("response_type") == "chunk":
                await ws.send({"action": "stop"})
                _, frames = await ws.until("stop", within=300)
                reply = frames[-1]
    assert reply.get("response_type") != "error", reply
    if action == "estimate_token":
        assert reply["num_tokens"] > 100_000
    elif action == "lefttrim_token":
        assert long_text.endswith(reply["trimmed_text"].lstrip()) and reply["trimmed_text"]
    else:
        assert reply["response_type"] == "full" and reply["usage"]["trimmed_tokens"] > 0
        assert reply["usage"]["prompt_tokens"] <= 64
        assert long_text.endswith(reply["util_text"][-100:])
    assert stall < STALL_BOUND, f"another connection's echo waited {stall:.2f} s"


# --- defect 6: unbounded per-token work inside the shared step ------------------------------------


@pytest.fixture(params=["scripted", "model"])
def stop_string_setup(request: pytest.FixtureRequest) -> tuple[Any, str, float]:
    """(engine, prompt, seconds per rate window): the scripted engine, whose
    steps cost nothing besides the stop-string matching (the engines share
    it, engine/text.py), and the real model."""
    if request.param == "scripted":
        return ScriptedEngine(step_delay=0.002, max_batch=4), "long", 1.0
    engine = request.getfixturevalue("cpu_engine")
    return engine, STORY, 4.0


async def victim_beside(
    engine: Any,
    prompt: str,
    window: float,
    benign: dict[str, Any],
    attack: dict[str, Any],
    before_window: float | None = None,
) -> tuple[float, float, float, list[dict[str, Any]]]:
    """A victim streams ``prompt`` (EOS banned) while another connection sends
    ``benign``, then ``attack`` (each stopped by its ``request_id``): the
    victim's chunk rate during each (over ``window`` seconds), the longest
    wait of an echo probe during the attack, and the frames the attacking
    connection received before its stop reply."""
    async with serving(engine, max_message_bytes=8 * MiB) as (_, listening):
        async with open_echo_probe(listening.url) as probe, raw_client(listening.url) as victim:
            await victim.send(
                infer(
                    prompt, 3000, stream=True, temperature=0, bann_bann=[SMOL_EOS], request_id="v"
                )
            )
            await victim.recv(within=120)

            async def rate(seconds: float) -> float:
                start, count = time.perf_counter(), 0
                with trio.move_on_after(seconds):
                    while True:
                        frame = await victim.recv(within=120)
                        assert frame["response_type"] == "chunk", frame
                        count += 1
                return count / (time.perf_counter() - start)

            async with raw_client(listening.url) as other:
                await other.send(benign)
                before = await rate(window if before_window is None else before_window)
                await other.send({"action": "stop", "target": benign["request_id"]})
                await other.until("stop", within=120)
                probe.reset()
                await other.send(attack)
                during = await rate(window)
                stall = probe.longest()
                await other.send({"action": "stop", "target": attack["request_id"]})
                _, frames = await other.until("stop", within=300)
            await victim.send({"action": "stop"})
            await victim.until("stop", within=120)
    return before, during, stall, frames


@pytest.mark.slow
async def test_300k_stop_strings_are_refused_or_cost_no_one_else(
    stop_string_setup: tuple[Any, str, float],
) -> None:
    """Issue 8, defect 6: 300 k stop strings were scanned in Python for every
    token of the shared step (another client fell from 10.8 to 2.3 tok/s),
    and decoding the frame blocked the loop for 0.8 s. Either answer is
    right: refused naming ``$.stop_conditions``, or served at a cost that
    does not cut another client's rate below 0.4 of what it is beside the
    same request without the stop strings."""
    engine, prompt, window = stop_string_setup
    stops = [f"zq{i}x" for i in range(300_000)]
    benign = infer(prompt, 3000, temperature=0, request_id="benign")
    attack = {**benign, "stop_conditions": stops, "request_id": "stops"}
    before, during, stall, frames = await victim_beside(engine, prompt, window, benign, attack)
    (reply,) = frames
    assert stall < STALL_BOUND, f"another connection's echo waited {stall:.2f} s"
    if reply["response_type"] == "error":
        assert reply["error"]["type"] == "invalid_request", reply
        assert reply["error"]["field"].startswith("$.stop_conditions"), reply
    else:
        assert reply["response_type"] == "full", reply
        assert during >= 0.4 * before, f"the victim fell from {before:.1f} to {during:.1f} tok/s"


# --- defect 7: memory held for clients that do not read -------------------------------------------


@pytest.mark.slow
async def test_a_client_that_does_not_read_is_closed_and_memory_stays_bounded() -> None:
    """Issue 8, defect 7: every chunk frame repeats the request's tag and the
    result channels were unbounded: two connections with 8 streams each, a
    large tag and no reading took hundreds of MiB until keepalive dropped them.
    Now the connection is closed (1008 or 1013) once its unsent output passes
    a byte limit or it accepts nothing for a while, its jobs are cancelled,
    and the server's memory stays bounded (assumes ``max_output_bytes``,
    ``send_timeout``, ``close_timeout``)."""
    tag = "t" * 16_000  # the largest tag the protocol takes (16 KiB as JSON)
    engine = ScriptedEngine(step_delay=0.001, max_batch=20)
    async with serving(
        engine,
        max_message_bytes=8 * MiB,
        max_output_bytes=4 * MiB,
        send_timeout=2.0,
        close_timeout=30.0,
        ping_interval=600.0,
        ping_timeout=600.0,
    ) as (server, listening):
        async with open_bystander(listening.url, scripted_stream):
            baseline = rss_bytes()
            peak = baseline
            hogs = [
                await wire.open_raw_websocket("127.0.0.1", listening.port, receive_buffer=16384)
                for _ in range(2)
            ]
            for hog in hogs:
                for i in range(8):
                    await hog.send_json(infer("long", 10_000, stream=True, tag=tag, request_id=i))
            # Nobody reads. Watch the memory until the server has given up on
            # both: their requests ended and their jobs cancelled (only the
            # bystander's may remain).
            seen_hogs = gave_up = False
            with trio.move_on_after(30):
                while not gave_up:
                    peak = max(peak, rss_bytes())
                    stats = server.statistics()
                    seen_hogs = seen_hogs or stats.requests_in_flight >= 3
                    gave_up = (
                        seen_hogs and stats.requests_in_flight <= 1 and stats.scheduler.running <= 1
                    )
                    await trio.sleep(0.02)
            for _ in range(25):
                peak = max(peak, rss_bytes())
                await trio.sleep(0.02)
            growth = peak - baseline
            assert growth <= 64 * MiB, f"the server grew by {growth / MiB:.0f} MiB"
            assert gave_up, "the server still serves clients that have read nothing for 30 s"
            closes = []
            for hog in hogs:
                frames, close = await hog.read_to_close(within=30)
                assert all(f.opcode in (wire.TEXT, wire.PING) for f in frames)
                closes.append(None if close is None else close.close_code)
                await hog.aclose()
    assert all(code in (1008, 1013) for code in closes), closes


@pytest.mark.slow
async def test_a_slow_but_live_reader_is_not_dropped_by_keepalive() -> None:
    """Issue 8, defect 7: a reader blocked on the outgoing buffer stopped pong
    processing, so keepalive dropped a client that was slow but alive. This
    client reads 16 kB every 50 ms (far slower than its 4 streams produce),
    answers every ping, and sends an echo every 100 ms; with pings every
    0.2 s and a 1 s timeout it must stay connected and get every answer."""
    engine = ScriptedEngine(step_delay=0.002, max_batch=8)
    async with serving(engine, ping_interval=0.2, ping_timeout=1.0) as (_, listening):
        ws = await wire.open_raw_websocket("127.0.0.1", listening.port, receive_buffer=16384)
        for i in range(4):
            await ws.send_json(infer("long", 10_000, stream=True, tag="x" * 16_000, request_id=i))
        echoes_sent = echoes_back = 0
        close_code: int | None = None
        finals: list[dict[str, Any]] = []
        stop_reply: dict[str, Any] | None = None
        parser = wire.FrameParser()

        async def handle(data: bytes) -> None:
            nonlocal echoes_back, close_code, stop_reply
            for frame in parser.feed(data):
                if frame.opcode == wire.PING:
                    await ws.send_raw(wire.build_frame(wire.PONG, frame.payload))
                elif frame.opcode == wire.CLOSE:
                    close_code = frame.close_code if frame.close_code is not None else -1
                elif frame.opcode == wire.TEXT:
                    reply = frame.json()
                    if reply["action"] == "echo":
                        echoes_back += 1
                    elif reply["action"] == "stop":
                        stop_reply = reply
                    elif reply.get("response_type") != "chunk":
                        finals.append(reply)

        deadline = trio.current_time() + 4.0
        next_echo = trio.current_time()
        while trio.current_time() < deadline and close_code is None:
            if trio.current_time() >= next_echo:
                await ws.send_json({"action": "echo", "request_id": echoes_sent})
                echoes_sent += 1
                next_echo += 0.1
            with trio.move_on_after(0.05):
                data = await ws.stream.receive_some(16384)
                if not data:
                    close_code = close_code or -2
                await handle(data)
            await trio.sleep(0.05)
        assert close_code is None, f"the server closed a live client with {close_code}"
        # Now read at full speed: everything is still answered.
        await ws.send_json({"action": "stop", "request_id": "s"})
        with trio.fail_after(60):
            while stop_reply is None and close_code is None:
                data = await ws.stream.receive_some(65536)
                if not data:
                    break
                await handle(data)
        await ws.aclose()
    assert close_code is None, f"the server closed a live client with {close_code}"
    assert stop_reply is not None and stop_reply["stopped"] == 4, stop_reply
    assert [f["stop_reason"] for f in finals] == ["interrupted"] * 4
    assert echoes_back == echoes_sent


# --- defect 8: no fairness ------------------------------------------------------------------------


async def test_one_connection_flooding_does_not_starve_another() -> None:
    """Issue 8, defect 8: one connection could hold 32 requests against the
    engine's slots: it took every slot and the queue, and another client's
    short request waited behind all of them. Counted in engine steps, not
    seconds: the newcomer must be served within about one of the flooder's
    requests (41 tokens), not after all 32 (about 330 steps)."""
    engine = ScriptedEngine(step_delay=0.002, max_batch=4)
    async with serving(engine) as (server, listening):
        async with raw_client(listening.url) as flood, raw_client(listening.url) as newcomer:
            for i in range(32):
                await flood.send(infer("say:" + "a" * 40, 100, request_id=i))
            await wait_until(lambda: server.statistics().scheduler.running >= 3)
            before = engine.steps
            await newcomer.send(infer("say:abcd", 10, request_id="n"))
            (final,) = await newcomer.recv_until_final(request_id="n")
            waited = engine.steps - before
            assert final["response"] == "abcd"
            flood_finals = [await flood.recv(within=60) for _ in range(32)]
    assert waited <= 2 * 41 + 5 + 10, f"the newcomer waited {waited} engine steps"
    # The flooder loses nothing: each request is served (or, if a per-connection
    # limit refuses it, answered overloaded at once).
    for frame in flood_finals:
        if frame["response_type"] == "full":
            assert frame["response"] == "a" * 40
        else:
            assert_error(frame, "overloaded")


# --- defect 9: the frame limit counts bytes -------------------------------------------------------


async def send_then_receive(ws: Any, frame: str) -> None:
    await ws.send(frame)
    await ws.recv()


@pytest.mark.parametrize(
    ("text", "closed"),
    [
        ("🙂" * 65_476, True),  # 261,944 bytes in 65,476 characters: the frame
        ("🙂" * 16_500, True),  # 66,000 bytes in 16,500 characters
        ("a" * 65_000, False),  # under the limit either way
    ],
    ids=["issue_frame", "just_over_in_bytes", "ascii_under"],
)
async def test_the_frame_limit_counts_bytes(text: str, closed: bool) -> None:
    """Issue 8, defect 9: with --max-message-bytes 65536 a 261,944-byte frame of
    emoji was accepted, since the limit counted characters."""
    frame = json.dumps({"action": "estimate_token", "text": text}, ensure_ascii=False)
    async with serving(ScriptedEngine(), max_message_bytes=65536) as (_, listening):
        async with raw_client(listening.url) as ws:
            if not closed:
                await ws.send(frame)
                assert (await ws.recv())["num_tokens"] == len(text.encode())
                return
            # The server may close before the client has sent the whole frame
            # (it counts as the bytes arrive): then the send itself fails.
            with pytest.raises(trio_websocket.ConnectionClosed) as error:
                await send_then_receive(ws, frame)
            assert error.value.reason is not None and error.value.reason.code == 1009
        await still_serves(listening.url)


async def test_a_client_that_sends_a_6mb_frame_before_reading_gets_its_1009() -> None:
    """Found by the 100,000-frame fuzz run: a client that writes a whole frame
    over the limit before it reads anything saw its connection reset (1006):
    the server stopped reading at the limit, and while closing it read and
    dropped only 256 KiB of the rest before closing the socket under it."""
    frame = wire.build_frame(wire.TEXT, b'{"action":"echo","x":"' + b"a" * 6_000_000 + b'"}')
    async with serving(ScriptedEngine(), max_message_bytes=256 * 1024) as (_, listening):
        ws = await wire.open_raw_websocket("127.0.0.1", listening.port)
        with trio.fail_after(20):
            await ws.send_raw(frame)  # all of it, reading nothing meanwhile
        frames, close = await ws.read_to_close(within=20)
        await ws.aclose()
        assert frames == []
        assert close is not None and close.close_code == 1009, close
        await still_serves(listening.url)


# --- defect 10: terminal frames of jobs that had finished -----------------------------------------


@pytest.mark.parametrize("how", ["stop", "shutdown"])
async def test_a_job_that_finished_keeps_its_real_stop_reason(how: str) -> None:
    """Issue 8, defect 10: a job whose Finished was delivered but not yet read
    by its request (its client reads slowly) ended ``interrupted``, losing
    ``eos_reason`` and ``stop_token``, when a ``stop`` (or the shutdown's
    drain) reached it. The client here does not read until the engine has
    finished the job (its 400 chunk frames of 20 kB each fill every buffer
    on the way); then it stops it (or the server shuts down) and reads."""
    answer = "ab" * 200
    engine = ScriptedEngine()
    server = Server(engine, make_config(shutdown_grace=5.0))
    server_scope = trio.CancelScope()

    async def run_server(*, task_status: trio.TaskStatus[Listening]) -> None:
        with server_scope:
            await server.run(task_status=task_status)

    async with trio.open_nursery() as nursery:
        listening = await nursery.start(run_server)
        ws = await wire.open_raw_websocket("127.0.0.1", listening.port, receive_buffer=16384)
        await ws.send_json(
            infer("say:" + answer, 1000, stream=True, tag="x" * 16_000, request_id="done")
        )
        await wait_until(lambda: server.statistics().scheduler.served == 1, within=60)
        close = None
        if how == "stop":
            await ws.send_json({"action": "stop", "target": "done", "request_id": "s"})
            replies = [await ws.receive_json(within=60)]
            while replies[-1]["action"] != "stop":
                replies.append(await ws.receive_json(within=60))
        else:
            server_scope.cancel()
            frames, close = await ws.read_to_close(within=60)
            replies = [f.json() for f in frames if f.opcode == wire.TEXT]
        await ws.aclose()
        server_scope.cancel()
    infer_frames = [r for r in replies if r["action"] == "infer"]
    final = infer_frames[-1]
    assert final["response_type"] == "full", final
    assert (final["stop_reason"], final["eos_reason"], final["stop_token"]) == (
        "eos",
        "stop_token",
        EOS,
    ), {k: final[k] for k in ("stop_reason", "eos_reason", "stop_token")}
    assert final["response"] == answer
    assert "".join(r["chunk"] for r in infer_frames[:-1]) == answer
    if how == "stop":
        assert replies[-1]["action"] == "stop"
    else:
        assert close is not None and close.close_code == 1001


# --- defect 11: RFC 6455 violations get the RFC's close codes -------------------------------------


B = wire.build_frame
VIOLATIONS: dict[str, tuple[bytes, int]] = {
    "invalid_utf8": (B(wire.TEXT, b'{"action":"echo","x":"\xff"}'), 1007),
    "invalid_utf8_across_fragments": (
        B(wire.TEXT, b'{"action":"echo","x":"\xe2', fin=False) + B(wire.CONTINUATION, b'\x28"}'),
        1007,
    ),
    "reserved_opcode": (B(0x3, b"{}"), 1002),
    "reserved_control_opcode": (B(0xB, b""), 1002),
    "rsv1_bit": (B(wire.TEXT, b'{"action":"echo"}', rsv=4), 1002),
    "rsv3_bit": (B(wire.TEXT, b'{"action":"echo"}', rsv=1), 1002),
    "unmasked": (B(wire.TEXT, b'{"action":"echo"}', mask=False), 1002),
    "stray_continuation": (B(wire.CONTINUATION, b'{"action":"echo"}'), 1002),
    "text_inside_a_fragmented_message": (
        B(wire.TEXT, b'{"action":', fin=False) + B(wire.TEXT, b'"echo"}'),
        1002,
    ),
    "fragmented_ping": (B(wire.PING, b"x", fin=False), 1002),
    "oversized_ping": (B(wire.PING, b"x" * 126), 1002),
    "close_code_999": (B(wire.CLOSE, wire.close_payload(999)), 1002),
    "close_code_1005": (B(wire.CLOSE, wire.close_payload(1005)), 1002),
    "close_one_byte": (B(wire.CLOSE, b"\x03"), 1002),
    "close_reason_invalid_utf8": (B(wire.CLOSE, wire.close_payload(1000, b"\xff")), 1007),
}


@pytest.mark.parametrize("violation", list(VIOLATIONS))
async def test_rfc6455_violations_get_the_rfc_close_code(violation: str) -> None:
    """Issue 8, defect 11: invalid UTF-8, a reserved opcode, an RSV bit, an
    unmasked frame or a stray continuation dropped the TCP connection without
    a close frame; RFC 6455 (5.2, 5.5, 7.4.1, 8.1) asks for 1002 or 1007."""
    data, code = VIOLATIONS[violation]
    async with serving(ScriptedEngine(step_delay=0.002)) as (_, listening):
        async with open_bystander(listening.url, scripted_stream):
            ws = await wire.open_raw_websocket("127.0.0.1", listening.port)
            # A request first: the connection works until the violation.
            await ws.send_json({"action": "echo", "request_id": 1})
            assert await ws.receive_json() == {"action": "echo", "request_id": 1}
            await ws.send_raw(data)
            frames, close = await ws.read_to_close(within=10)
            await ws.aclose()
            assert frames == [], frames
            assert close is not None, "no close frame before the TCP connection ended"
            assert close.close_code == code
        await still_serves(listening.url)


@pytest.mark.slow
async def test_a_violation_while_replies_are_queued_closes_with_its_code(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by the 100,000-frame fuzz run: the close frame for a violation
    waited for the writer, which held the stream while a reader that did not
    read blocked it; the writer's next reply then met wsproto after the close
    frame (LocalProtocolError) and the server logged "writer failed" (in the
    fuzz run one peer saw its connection drop, 1006, instead of its close code)."""
    rid = "x" * 1000  # request ids are at most 1,024 bytes: each echo is about 1 kB
    async with serving(
        ScriptedEngine(step_delay=0.002), max_message_bytes=2**20, max_output_bytes=2**27
    ) as (server, listening):
        ws = await wire.open_raw_websocket("127.0.0.1", listening.port, receive_buffer=4096)
        for n in range(200):  # 200 kB of replies: more than the sockets hold for a 4 kB window
            await ws.send_json({"action": "echo", "request_id": [n, rid]})
        (connection,) = server._connections
        # The writer is in the middle of a frame the socket does not take, and
        # 50 more replies wait behind it (the client reads nothing).
        await wait_until(
            lambda: (
                connection._sending_since is not None and connection.outbox.bytes > 50 * len(rid)
            )
        )
        await ws.send_raw(wire.build_frame(0x3, b"{}"))  # a reserved opcode
        # The reader has seen the violation: its close frame waits behind the writer.
        await wait_until(lambda: connection.ws._close_reason is not None)
        assert connection._sending_since is not None
        frames, close = await ws.read_to_close(within=20)
        await ws.aclose()
        assert close is not None and close.close_code == 1002, close
        assert 0 < len(frames) <= 200
        await still_serves(listening.url)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


# --- defect 12: token healing on SentencePiece-style tokenizers -----------------------------------


def metaspace_tokenizer_json() -> str:
    """A SentencePiece-style (Metaspace) BPE tokenizer trained here on a few
    hundred lines: its decoder drops the leading space of the first token it
    decodes, which is what broke healing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "home"]
    lines = [" ".join(rng.choices(words, k=rng.randint(4, 12))) + "." for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(lines, trainer)
    return str(tok.to_str())


@pytest.fixture(scope="module")
def metaspace_engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """SmolLM2's weights behind a SentencePiece-style tokenizer: its text is
    nonsense, but healing's constraint (the first token must extend the
    prompt's last one) decides the one token this test asks for."""
    from trioserve.engine.cpu.engine import CpuEngine

    directory = tmp_path_factory.mktemp("metaspace")
    for name in ("config.json", "generation_config.json"):
        shutil.copy(model_dir / name, directory / name)
    (directory / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    (directory / "tokenizer.json").write_text(metaspace_tokenizer_json(), encoding="utf-8")
    engine = CpuEngine.load(directory, context_length=128, max_batch=2)
    yield engine
    engine.close()


async def test_token_healing_with_a_sentencepiece_tokenizer_does_not_repeat_the_word(
    metaspace_engine: Any,
) -> None:
    """Issue 8, defect 12: the CPU engine decoded the prompt's last token alone,
    which drops its leading space with SentencePiece-style decoders, so the
    healed text was not recognised and sent again: " lazy lazy dog"."""
    prompt = "the quick brown fox jumps over the lazy"
    ids = metaspace_engine.encode(prompt)
    assert metaspace_engine.decode(ids[-1:]) == "lazy"  # the leading space is gone
    async with serving(metaspace_engine) as (_, listening), raw_client(listening.url) as ws:
        healed = await ws.request(infer(prompt, 1, temperature=0, token_healing=True))
        plain = await ws.request(infer(prompt, 1, temperature=0))
    assert healed["response_type"] == "full", healed
    # The one generated token re-made " lazy" (or a longer token starting with
    # it); only what goes beyond the prompt is new text.
    assert "lazy" not in healed["response"], healed["response"]
    assert plain["response_type"] == "full"


# --- the engine is freed on every path ------------------------------------------------------------


async def test_every_attack_leaves_no_job_behind() -> None:
    """After a mix of the attacks above on one server, nothing is running or
    waiting and the server still serves: no leak of slots or queue places."""
    engine = ScriptedEngine(step_delay=0.001)
    async with serving(engine, max_message_bytes=65536) as (server, listening):
        for data, _ in VIOLATIONS.values():
            ws = await wire.open_raw_websocket("127.0.0.1", listening.port)
            await ws.send_json(infer("long", 10_000, stream=True))
            await ws.send_raw(data)
            await ws.read_to_close(within=10)
            await ws.aclose()
        for _ in range(3):
            stream = await wire.open_tcp("127.0.0.1", listening.port)
            await stream.send_all(wire.handshake_request("127.0.0.1", listening.port))
            wire.reset(stream)
        async with raw_client(listening.url) as client:
            await client.send(infer("long", 10_000, stream=True))
            await client.recv()
        await wait_until(
            lambda: (
                server.statistics().scheduler.running == 0
                and server.statistics().scheduler.waiting == 0
                and server.statistics().requests_in_flight == 0
            ),
            within=20,
        )
        await still_serves(listening.url)


# --- issue 18: hostile constraints ---------------------------------------------------------------


def _deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE_CONSTRAINTS: list[tuple[str, Any]] = [
    # 10,000 enum entries: about the most a 64 KiB schema holds.
    ("json_schema", {"enum": list(range(10**4, 10**4 + 10_000))}),
    # 100,000 entries: beyond max_schema_bytes, refused before any work.
    ("json_schema", {"enum": list(range(100_000))}),
    # As deep as a frame nests (64 levels of JSON, 30 of schema objects).
    ("json_schema", _deep_schema(30)),
    # An automaton that explodes: a new lexer state at every token.
    ("regex", "(a|aa)*" * 50 + "b{1000}"),
    ("json_schema", {"type": "string", "pattern": "(x+x+)+y"}),
    # Left recursion: fine for an Earley parser.
    ("grammar", 'root ::= root "a" | "a"'),
    # 64 KiB of grammar rules.
    ("grammar", "\n".join(f'r{i} ::= "w{i}"' for i in range(3000)) + "\nroot ::= r0 | r2999"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "value"), HOSTILE_CONSTRAINTS, ids=lambda v: str(v)[:30])
async def test_hostile_constraints_are_refused_or_bounded(
    cpu_engine: CpuEngine, kind: str, value: Any
) -> None:
    """Issue 18: a pathological schema, regex or grammar is refused (naming
    the field) or runs within bounds: compiled off the event loop (another
    connection's echo never waits long), and a job whose masks cost too much
    fails alone, with the figure. Another client's decode rate beside it is
    measured and printed, not judged here (timing is the bench's:
    ``nox -s bench -- --only hostile --attack constraints`` takes it in
    alternating rounds)."""
    window = 4.0
    benign = infer(STORY, 400, temperature=1.0, seed=1, regex="[a-z ]{1,400}", request_id="b")
    # Temperature 1000 draws nearly uniformly among the allowed tokens: the
    # walk through the grammar's states that costs the most masks.
    attack = infer(
        STORY, 400, temperature=1000.0, top_k=0, top_p=1.0, seed=1, request_id="h", **{kind: value}
    )
    # The rate before the attack is only printed here: a second of it will do.
    before, during, stall, frames = await victim_beside(
        cpu_engine, STORY, window, benign, attack, before_window=1.0
    )
    (reply,) = [f for f in frames if f.get("request_id") == "h"]
    print(
        f"{kind} {str(value)[:40]!r}: {reply['response_type']}, victim {before:.1f} ->"
        f" {during:.1f} tok/s, echo stall {stall * 1000:.0f} ms"
    )
    assert stall < STALL_BOUND, f"another connection's echo waited {stall:.2f} s"
    if reply["response_type"] == "error":
        assert reply["error"]["type"] in ("invalid_request", "internal"), reply
        if reply["error"]["type"] == "invalid_request":
            assert reply["error"]["field"] == f"$.{kind}", reply
        else:
            assert "the constraint is too costly" in reply["error"]["message"], reply
    else:
        assert reply["response_type"] == "full", reply
    assert before > 0 and during > 0, "the victim must keep streaming"
