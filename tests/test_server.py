"""The server over real loopback sockets, on the scripted engine.

These pin protocol.md's rules quickly and deterministically; test_e2e.py runs
the same features against the real embedded model.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio_websocket

from trioserve.errors import ConfigError
from trioserve.server import Listening, ServerConfig, serve

from .helpers import (
    DEFAULT_SCRIPT,
    EOS,
    ScriptedEngine,
    chunks_of,
    raw_client,
    running_server,
    wait_until,
)


def assert_error(frame: dict[str, Any], error_type: str, field: str | None = None) -> None:
    assert frame["response_type"] == "error", frame
    assert frame["error"]["type"] == error_type, frame
    assert isinstance(frame["error"]["message"], str) and frame["error"]["message"]
    if field is None:
        assert "field" not in frame["error"], frame
    else:
        assert frame["error"]["field"] == field, frame


async def test_echo_copies_ids_unchanged() -> None:
    async with running_server(ScriptedEngine()) as server, raw_client(server.url) as ws:
        ids = {"request_id": {"a": [1, None]}, "response_id": None}
        assert await ws.request({"action": "echo", **ids}) == {"action": "echo", **ids}
        assert await ws.request({"action": "echo"}) == {"action": "echo"}


async def test_token_actions_share_one_encoding() -> None:
    engine = ScriptedEngine()
    async with running_server(engine) as server, raw_client(server.url) as ws:
        reply = await ws.request({"action": "estimate_token", "text": "ab<|bos|>日"})
        assert reply == {"action": "estimate_token", "num_tokens": 2 + 1 + 3}
        trim = {"action": "lefttrim_token", "text": "hello world"}
        assert (await ws.request({**trim, "trimmed_length": 5}))["trimmed_text"] == "world"
        assert (await ws.request({**trim, "trimmed_length": 0}))["trimmed_text"] == ""
        assert (await ws.request({**trim, "trimmed_length": 11}))["trimmed_text"] == "hello world"
        special = await ws.request({**trim, "text": "x<|eos|>", "trimmed_length": 1})
        assert special["trimmed_text"] == "<|eos|>"
        bad = await ws.request({**trim, "trimmed_length": -1})
        assert_error(bad, "invalid_request", "$.trimmed_length")


async def test_infer_without_streaming_sends_one_final_frame() -> None:
    async with running_server(ScriptedEngine()) as server, raw_client(server.url) as ws:
        await ws.send(
            {
                "action": "infer",
                "text": "say:Hi 🙂",
                "max_new_tokens": 50,
                "tag": {"t": 1},
                "request_id": 7,
            }
        )
        (final,) = await ws.recv_until_final(request_id=7)
    assert final["action"] == "infer" and final["response_type"] == "full"
    assert final["response"] == "Hi 🙂"
    assert final["tag"] == {"t": 1}
    assert final["util_text"] == "say:Hi 🙂"
    assert (final["stop_reason"], final["eos_reason"]) == ("eos", "stop_token")
    assert final["stop_token"] == EOS and final["stop_string"] is None
    assert final["usage"] == {
        "prompt_tokens": len(b"say:Hi ") + 4,
        "trimmed_tokens": 0,
        "generated_tokens": len("Hi 🙂".encode()) + 1,
        "cached_tokens": 0,
    }
    timing = final["timing"]
    assert 0 <= timing["queued_s"] <= timing["total_s"]
    assert 0 < timing["first_token_s"] <= timing["total_s"]


@pytest.mark.parametrize("stream_full", [False, True])
async def test_streamed_chunks_join_to_the_response(stream_full: bool) -> None:
    async with running_server(ScriptedEngine()) as server, raw_client(server.url) as ws:
        await ws.send(
            {
                "action": "infer",
                "text": "go",
                "max_new_tokens": 40,
                "stream": True,
                "stream_full": stream_full,
            }
        )
        frames = await ws.recv_until_final()
    final = frames[-1]
    chunks = chunks_of(frames)
    assert len(chunks) == len(frames) - 1 > 1
    assert all(chunks), "chunk frames are never empty"
    assert "".join(chunks) == final["response"]
    assert final["stop_reason"] == "num_tokens" and final["eos_reason"] is None
    # 40 bytes of the script, cut inside no character here.
    assert final["response"] == DEFAULT_SCRIPT.encode()[:40].decode("utf-8", "replace")
    so_far = ""
    for frame in frames[:-1]:
        so_far += frame["chunk"]
        assert ("response" in frame) is stream_full
        if stream_full:
            assert frame["response"] == so_far
    assert "\ufffd" not in "".join(chunks)


async def test_held_text_is_flushed_at_max_new_tokens() -> None:
    async with running_server(ScriptedEngine()) as server, raw_client(server.url) as ws:
        # Stop strings hold back "wor" (could become "world!!"), and the last
        # token cuts the multi-byte "é" in half: both are flushed, not lost.
        await ws.send(
            {
                "action": "infer",
                "text": "say:hello wor",
                "max_new_tokens": 9,
                "stream": True,
                "stop_conditions": ["world!!"],
            }
        )
        frames = await ws.recv_until_final()
    assert frames[-1]["response"] == "hello wor"
    assert "".join(chunks_of(frames)) == "hello wor"
    assert frames[-1]["stop_reason"] == "num_tokens"


async def test_stop_string_spanning_tokens_cuts_the_text_there() -> None:
    async with running_server(ScriptedEngine()) as server, raw_client(server.url) as ws:
        await ws.send(
            {
                "action": "infer",
                "text": "say:one, two; three",
                "max_new_tokens": 50,
                "stream": True,
                "stop_conditions": ["; th", 9999 % 258],
            }
        )
        frames = await ws.recv_until_final()
    final = frames[-1]
    assert final["response"] == "one, two"
    assert "".join(chunks_of(frames)) == "one, two"
    assert (final["stop_reason"], final["eos_reason"], final["stop_string"]) == (
        "eos",
        "stop_string",
        "; th",
    )
    assert final["stop_token"] is None


async def test_stop_token_from_the_request() -> None:
    async with running_server(ScriptedEngine()) as server, raw_client(server.url) as ws:
        await ws.send(
            {
                "action": "infer",
                "text": "say:abc;def",
                "max_new_tokens": 50,
                "stop_conditions": ord(";"),
            }
        )
        (final,) = await ws.recv_until_final()
    assert final["response"] == "abc"
    assert (final["eos_reason"], final["stop_token"]) == ("stop_token", ord(";"))


async def test_trimming_keeps_the_prompt_tail_and_the_custom_bos_token() -> None:
    engine = ScriptedEngine(context_length=32)
    async with running_server(engine) as server, raw_client(server.url) as ws:
        text = "0123456789" * 4 + "say:ok"
        await ws.send({"action": "infer", "text": text, "max_new_tokens": 12})
        (plain,) = await ws.recv_until_final()
        await ws.send(
            {"action": "infer", "text": text, "max_new_tokens": 12, "customBos": "<|bos|>"}
        )
        (custom,) = await ws.recv_until_final()
    assert plain["util_text"] == text[-20:]
    assert plain["usage"]["trimmed_tokens"] == len(text) - 20
    assert plain["usage"]["prompt_tokens"] == 20
    assert plain["response"] == "ok"
    assert custom["util_text"] == "<|bos|>" + text[-19:]
    assert custom["usage"]["prompt_tokens"] == 20
    assert custom["usage"]["trimmed_tokens"] == len(text) + 1 - 20


async def test_max_new_tokens_beyond_the_context_is_refused() -> None:
    async with running_server(ScriptedEngine(context_length=64)) as server:
        async with raw_client(server.url) as ws:
            reply = await ws.request(
                {"action": "infer", "text": "x", "max_new_tokens": 64, "request_id": "r"}
            )
            assert_error(reply, "invalid_request", "$.max_new_tokens")
            assert reply["request_id"] == "r" and reply["action"] == "infer"
            assert "at most 63" in reply["error"]["message"]
            ok = await ws.request({"action": "infer", "text": "say:y", "max_new_tokens": 63})
            # Accepted, and the prompt trimmed to the one token that fits.
            assert ok["util_text"] == "y"
            assert ok["usage"]["trimmed_tokens"] == 4
            assert ok["usage"]["generated_tokens"] == 63


async def test_bad_input_gets_one_error_and_the_connection_stays_open() -> None:
    async with running_server(ScriptedEngine()) as server, raw_client(server.url) as ws:
        assert_error(await ws.request("{not json"), "invalid_json")
        await ws.send(b'{"action": "echo"}')
        assert_error(await ws.recv(), "invalid_json")
        assert_error(await ws.request([1, 2]), "invalid_json")
        reply = await ws.request({"action": "dance", "request_id": 3})
        assert_error(reply, "unknown_action", "$.action")
        assert reply["request_id"] == 3
        reply = await ws.request({"action": "infer", "text": "x", "max_new_tokens": 5, "top_q": 1})
        assert_error(reply, "invalid_request", "$.top_q")
        reply = await ws.request(
            {"action": "infer", "text": "x", "max_new_tokens": 5, "bann_bann": [1, 300]}
        )
        assert_error(reply, "invalid_request", "$.bann_bann[1]")
        reply = await ws.request({"action": "infer", "text": "", "max_new_tokens": 5})
        assert_error(reply, "invalid_request", "$.text")
        assert await ws.request({"action": "echo"}) == {"action": "echo"}


async def test_a_failing_job_answers_internal_and_others_go_on() -> None:
    async with running_server(ScriptedEngine()) as server, raw_client(server.url) as ws:
        await ws.send({"action": "infer", "text": "FAIL", "max_new_tokens": 5, "request_id": 1})
        await ws.send({"action": "infer", "text": "say:ok", "max_new_tokens": 5, "request_id": 2})
        frames = [await ws.recv(), await ws.recv()]
    by_id = {f["request_id"]: f for f in frames}
    assert_error(by_id[1], "internal")
    assert by_id[2]["response"] == "ok"


async def test_stop_interrupts_this_connection_only_and_replies_last() -> None:
    engine = ScriptedEngine(step_delay=0.005, max_batch=8)
    async with running_server(engine) as server:
        async with raw_client(server.url) as a, raw_client(server.url) as b:
            await b.send(
                {
                    "action": "infer",
                    "text": "say:" + "b" * 60,
                    "max_new_tokens": 70,
                    "request_id": "b1",
                }
            )
            for rid in ("a1", "a2"):
                await a.send(
                    {
                        "action": "infer",
                        "text": "long",
                        "max_new_tokens": 2000,
                        "stream": True,
                        "request_id": rid,
                    }
                )
            # Wait until both stream.
            seen: set[str] = set()
            while seen != {"a1", "a2"}:
                seen.add((await a.recv())["request_id"])
            await a.send({"action": "stop", "request_id": "s"})
            finals = []
            while True:
                frame = await a.recv()
                if frame["action"] == "stop":
                    break
                if frame["response_type"] == "full":
                    finals.append(frame)
            assert frame == {"action": "stop", "request_id": "s", "stopped": 2}
            assert sorted(f["request_id"] for f in finals) == ["a1", "a2"]
            assert all(f["stop_reason"] == "interrupted" for f in finals)
            # Each got the text generated so far: a non-empty prefix of the script.
            assert all(f["response"] for f in finals)
            assert all((DEFAULT_SCRIPT * 100).startswith(f["response"]) for f in finals)
            # b was not touched.
            (b_final,) = await b.recv_until_final()
            assert b_final["stop_reason"] == "eos" and b_final["response"] == "b" * 60
            # Stopping nothing is fine.
            assert await a.request({"action": "stop"}) == {"action": "stop", "stopped": 0}


async def test_stop_with_target_stops_only_that_request() -> None:
    engine = ScriptedEngine(step_delay=0.005)
    async with running_server(engine) as server, raw_client(server.url) as ws:
        for rid in (1, True, "x"):
            await ws.send(
                {
                    "action": "infer",
                    "text": "long",
                    "max_new_tokens": 2000,
                    "stream": True,
                    "request_id": rid,
                }
            )
        seen: list[Any] = []
        while len({json.dumps(r) for r in seen}) < 3:
            seen.append((await ws.recv())["request_id"])
        await ws.send({"action": "stop", "target": 1})
        chunks: list[str] = []
        while True:
            frame = await ws.recv()
            if frame["action"] == "stop":
                break
            # true must not be mistaken for 1
            if frame["request_id"] == 1 and frame["request_id"] is not True:
                if frame["response_type"] == "chunk":
                    chunks.append(frame["chunk"])
                else:
                    final = frame
        assert frame["stopped"] == 1
        assert final["stop_reason"] == "interrupted"
        # The other two keep streaming: their chunks may come first.
        await ws.send({"action": "stop", "target": "nobody"})
        reply, _ = await ws.until("stop")
        assert reply == {"action": "stop", "stopped": 0}
        await ws.send({"action": "stop"})
        stopped_ids = []
        while True:
            frame = await ws.recv()
            if frame["action"] == "stop":
                break
            if frame["response_type"] == "full":
                stopped_ids.append(frame["request_id"])
        assert frame["stopped"] == 2
        assert sorted(map(json.dumps, stopped_ids)) == ['"x"', "true"]


async def test_interrupted_streams_still_join_to_the_response() -> None:
    engine = ScriptedEngine(step_delay=0.002)
    async with running_server(engine) as server, raw_client(server.url) as ws:
        await ws.send(
            {
                "action": "infer",
                "text": "go",
                "max_new_tokens": 3000,
                "stream": True,
                "stop_conditions": ["日本語 works 🙂 and so on. Hello, world! Ü"],
            }
        )
        frames = [await ws.recv() for _ in range(5)]
        await ws.send({"action": "stop"})
        while frames[-1]["action"] != "stop":
            frames.append(await ws.recv())
    infer_frames = frames[:-1]
    final = infer_frames[-1]
    assert final["stop_reason"] == "interrupted"
    assert "".join(chunks_of(infer_frames)) == final["response"]
    assert final["usage"]["generated_tokens"] >= len(final["response"].encode()) - 4


async def test_disconnect_frees_the_engine() -> None:
    engine = ScriptedEngine(step_delay=0.005)
    async with running_server(engine) as server:
        async with raw_client(server.url) as ws:
            await ws.send(
                {"action": "infer", "text": "long", "max_new_tokens": 5000, "stream": True}
            )
            await ws.recv()
            assert engine.running_jobs == 1
        await wait_until(lambda: engine.running_jobs == 0)
        async with raw_client(server.url) as ws:
            assert (await ws.request({"action": "infer", "text": "say:ok", "max_new_tokens": 5}))[
                "response"
            ] == "ok"


@pytest.mark.slow
async def test_echo_is_answered_while_a_slow_step_runs() -> None:
    engine = ScriptedEngine(step_delay=1.0)
    async with running_server(engine) as server:
        async with raw_client(server.url) as a, raw_client(server.url) as b:
            await a.send({"action": "infer", "text": "long", "max_new_tokens": 4, "stream": True})
            await wait_until(lambda: engine.steps > 0)
            assert await b.request({"action": "echo", "request_id": "b"}) == {
                "action": "echo",
                "request_id": "b",
            }
            await a.send({"action": "echo", "request_id": "a"})
            while (frame := await a.recv())["action"] != "echo":
                pass
            assert frame == {"action": "echo", "request_id": "a"}
            # Both answered while the second step was still running.
            assert engine.steps == 1


async def test_per_connection_limit_answers_overloaded() -> None:
    engine = ScriptedEngine(step_delay=0.01)
    async with running_server(engine, max_requests_per_connection=2) as server:
        async with raw_client(server.url) as ws:
            for i in range(3):
                await ws.send(
                    {"action": "infer", "text": "long", "max_new_tokens": 1000, "request_id": i}
                )
            reply = await ws.recv()
            assert_error(reply, "overloaded")
            assert reply["request_id"] == 2
            # The refusal lost nothing: the two accepted requests are in flight.
            await ws.send({"action": "stop"})
            frames = [await ws.recv() for _ in range(3)]
            assert frames[-1] == {"action": "stop", "stopped": 2}
            assert sorted(f["request_id"] for f in frames[:2]) == [0, 1]


async def test_full_queue_answers_overloaded() -> None:
    engine = ScriptedEngine(step_delay=0.01, max_batch=1)
    async with running_server(engine, max_waiting_jobs=1) as server:
        async with raw_client(server.url) as ws:
            await ws.send(
                {"action": "infer", "text": "long", "max_new_tokens": 1000, "request_id": "running"}
            )
            await wait_until(lambda: engine.running_jobs > 0)
            await ws.send(
                {"action": "infer", "text": "say:q", "max_new_tokens": 10, "request_id": "queued"}
            )
            await ws.send(
                {"action": "infer", "text": "say:q", "max_new_tokens": 10, "request_id": "refused"}
            )
            reply = await ws.recv()
            assert_error(reply, "overloaded")
            assert reply["request_id"] == "refused"


async def test_info_reports_model_and_limits() -> None:
    engine = ScriptedEngine(context_length=100)
    async with running_server(engine, max_waiting_jobs=9) as server:
        async with raw_client(server.url) as ws:
            reply = await ws.request({"action": "info"})
    assert reply["server"]["name"] == "trioserve"
    assert reply["model"]["context_length"] == 100
    assert reply["model"]["eos_token_ids"] == [EOS]
    assert reply["limits"]["max_waiting_jobs"] == 9
    assert reply["limits"]["max_new_tokens"] == 99
    assert reply["status"] == {
        "connections": 1,
        "requests_in_flight": 0,
        "running_jobs": 0,
        "waiting_jobs": 0,
    }


async def test_info_shows_what_the_server_holds() -> None:
    engine = ScriptedEngine(step_delay=0.01, max_batch=1)
    async with running_server(engine) as server:
        async with raw_client(server.url) as ws, raw_client(server.url) as other:
            for i in range(3):
                await ws.send(
                    {"action": "infer", "text": "long", "max_new_tokens": 500, "request_id": i}
                )
            await wait_until(lambda: engine.steps > 0)
            status = (await other.request({"action": "info"}))["status"]
            assert status == {
                "connections": 2,
                "requests_in_flight": 3,
                "running_jobs": 1,
                "waiting_jobs": 2,
            }
            await ws.send({"action": "stop"})
            await ws.until("stop")
            status = (await other.request({"action": "info"}))["status"]
            assert status["requests_in_flight"] == 0
            assert (status["running_jobs"], status["waiting_jobs"]) == (0, 0)


async def test_oversized_frame_closes_with_1009() -> None:
    async with running_server(ScriptedEngine(), max_message_bytes=1000) as server:
        async with raw_client(server.url) as ws:
            await ws.send({"action": "estimate_token", "text": "x" * 2000})
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.reason is not None
            assert closed.value.reason.code == 1009


async def test_api_key_by_header_or_query_parameter() -> None:
    async with running_server(ScriptedEngine(), api_key="sesame") as server:
        for url, headers in [
            (server.url, [(b"Authorization", b"Bearer sesame")]),
            (server.url + "?api_key=sesame", []),
        ]:
            async with raw_client(url, extra_headers=headers) as ws:
                assert await ws.request({"action": "echo"}) == {"action": "echo"}
        for url, headers in [
            (server.url, []),
            (server.url, [(b"Authorization", b"Bearer wrong")]),
            (server.url + "?api_key=sesam", []),
        ]:
            with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
                async with raw_client(url, extra_headers=headers):
                    pass
            assert rejected.value.status_code == 401


async def _origin_accepted(url: str, origin: bytes) -> bool:
    try:
        async with raw_client(url, extra_headers=[(b"Origin", origin)]) as ws:
            assert await ws.request({"action": "echo"}) == {"action": "echo"}
    except trio_websocket.ConnectionRejected as rejected:
        status = rejected.status_code
    else:
        return True
    assert status == 403
    return False


@pytest.mark.slow
async def test_origin_check() -> None:
    loopback = (
        b"http://localhost:3000",
        b"http://127.0.0.1",
        b"http://[::1]:8080",
        b"https://localhost:5173",
        b"HTTPS://LOCALHOST",
    )
    foreign = (b"https://evil.example", b"http://localhost.evil.example", b"null")
    async with running_server(ScriptedEngine()) as server:
        for origin in loopback:
            assert await _origin_accepted(server.url, origin), origin
        for origin in foreign:
            assert not await _origin_accepted(server.url, origin), origin
    # --allowed-origin adds to the loopback origins.
    config = ServerConfig(host="127.0.0.1", port=0, allowed_origins=("https://app.example",))
    async with running_server(ScriptedEngine(), config) as server:
        assert await _origin_accepted(server.url, b"https://app.example")
        assert await _origin_accepted(server.url, b"http://localhost")
        assert not await _origin_accepted(server.url, b"https://evil.example")
    # ... unless the loopback default is removed ('--allowed-origin none').
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        allowed_origins=("https://app.example",),
        allow_loopback_origins=False,
    )
    async with running_server(ScriptedEngine(), config) as server:
        assert await _origin_accepted(server.url, b"https://app.example")
        assert not await _origin_accepted(server.url, b"http://localhost")
    # '*' allows any origin but null.
    config = ServerConfig(host="127.0.0.1", port=0, allowed_origins=("*",))
    async with running_server(ScriptedEngine(), config) as server:
        assert await _origin_accepted(server.url, b"https://evil.example")
        assert not await _origin_accepted(server.url, b"null")


def test_allowed_origins_must_be_origins() -> None:
    with pytest.raises(ConfigError, match="scheme://host"):
        ServerConfig(allowed_origins=("app.example",))
    with pytest.raises(ConfigError, match="scheme://host"):
        ServerConfig(allowed_origins=("https://app.example/path",))


async def _serve_in_scope(
    engine: ScriptedEngine,
    config: ServerConfig,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[Listening],
) -> None:
    """Run serve inside ``scope``, so that cancelling it starts the server's
    shutdown while the test body (outside the scope) goes on."""
    with scope:
        await serve(engine, config, task_status=task_status)


async def test_shutdown_lets_jobs_finish_within_the_grace_period() -> None:
    engine = ScriptedEngine(step_delay=0.005)
    server_scope = trio.CancelScope()
    checked = False
    async with trio.open_nursery() as nursery:
        config = ServerConfig(host="127.0.0.1", port=0, shutdown_grace=5)
        listening = await nursery.start(_serve_in_scope, engine, config, server_scope)
        async with raw_client(listening.url) as ws:
            await ws.send({"action": "infer", "text": "say:" + "z" * 30, "max_new_tokens": 50})
            await wait_until(lambda: engine.steps > 0)
            server_scope.cancel()
            (final,) = await ws.recv_until_final()
            assert final["response"] == "z" * 30 and final["stop_reason"] == "eos"
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.reason is not None and closed.value.reason.code == 1001
            checked = True
    assert checked


async def test_shutdown_interrupts_what_outlives_the_grace_period() -> None:
    engine = ScriptedEngine(step_delay=0.005)
    server_scope = trio.CancelScope()
    checked = False
    async with trio.open_nursery() as nursery:
        config = ServerConfig(host="127.0.0.1", port=0, shutdown_grace=0.2)
        listening = await nursery.start(_serve_in_scope, engine, config, server_scope)
        async with raw_client(listening.url) as ws:
            await ws.send(
                {"action": "infer", "text": "long", "max_new_tokens": 10000, "stream": True}
            )
            frames = [await ws.recv()]
            server_scope.cancel()
            frames += await ws.recv_until_final()
            assert frames[-1]["stop_reason"] == "interrupted"
            assert "".join(chunks_of(frames)) == frames[-1]["response"]
            assert frames[-1]["response"].startswith(DEFAULT_SCRIPT[:5])
            checked = True
    assert checked
    assert engine.running_jobs == 0


@pytest.mark.slow
async def test_keepalive_keeps_live_peers_and_closes_silent_ones() -> None:
    import wsproto
    from wsproto.events import AcceptConnection, Request

    async with running_server(ScriptedEngine(), ping_interval=0.1, ping_timeout=0.2) as server:
        # A live client answers the pings (trio-websocket does so by itself).
        async with raw_client(server.url) as ws:
            await trio.sleep(0.6)
            assert await ws.request({"action": "echo"}) == {"action": "echo"}
        # A peer that completes the handshake and then never reads again.
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        client = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
        await stream.send_all(client.send(Request(host="127.0.0.1", target="/")))
        accepted = False
        while not accepted:
            client.receive_data(await stream.receive_some())
            accepted = any(isinstance(e, AcceptConnection) for e in client.events())
        # The server pings, gets no pong, and closes the socket.
        with trio.fail_after(10):
            while await stream.receive_some():
                pass
        await stream.aclose()


async def test_a_busy_port_is_one_clear_error() -> None:
    from trioserve.errors import ListenError
    from trioserve.server import serve

    with trio.socket.socket() as taken:
        await taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        async with trio.open_nursery() as nursery:
            with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port}"):
                await nursery.start(serve, ScriptedEngine(), ServerConfig(port=port))


async def test_the_port_is_closed_once_the_listener_stops() -> None:
    """trio.serve_listeners does not close its listeners: a drained or
    stopped server's port went on accepting connections that nobody served,
    and a client hung instead of being refused."""
    engine = ScriptedEngine()
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(serve, engine, ServerConfig(port=0))
        stream = await trio.open_tcp_stream("127.0.0.1", listening.port)
        await stream.aclose()
        nursery.cancel_scope.cancel()
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", listening.port)
