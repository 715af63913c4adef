"""The client against a tiny rule-based server written here.

The server below speaks the protocol through ``trioserve.protocol`` (so what
the client meets is real frames over a real loopback socket) but answers from
fixed rules instead of a model: ``estimate_token`` counts words, ``infer``
streams the prompt back upper-cased in three-character chunks, and a prompt
holding ``slow`` streams forever, one chunk per 10 ms, until stopped.
The real server is tested against the client in its own test file.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable
from typing import Any

import attrs
import pytest
import trio
import trio_websocket
from hypothesis import given, settings

from tests.helpers import ScriptedEngine, running_server
from tests.strategies import json_values
from trioserve import protocol as p
from trioserve.client import (
    Client,
    ConnectionClosed,
    ConnectionFailed,
    InferStream,
    RequestIdInUse,
    ServerError,
    open_client,
)

pytestmark = pytest.mark.unit

API_KEY = "s3cret"


@attrs.define(eq=False)
class _Job:
    request: p.InferRequest
    scope: trio.CancelScope
    done: trio.Event = attrs.Factory(trio.Event)


@attrs.define(eq=False)
class RuleServer:
    """Answers one connection at a time from fixed rules."""

    api_key: str | None = None
    #: request_id of every frame received, for checks on the client's ids.
    seen_ids: list[Any] = attrs.Factory(list)
    #: Close the connection after this many frames (None: never).
    close_after: int | None = None

    async def handle(self, ws_request: trio_websocket.WebSocketRequest) -> None:
        if self.api_key is not None:
            headers = dict(ws_request.headers)
            if headers.get(b"authorization") != f"Bearer {self.api_key}".encode():
                await ws_request.reject(401)
                return
        ws = await ws_request.accept()
        jobs: list[_Job] = []
        frames = 0
        async with trio.open_nursery() as nursery:
            try:
                while True:
                    message = await ws.get_message()
                    frames += 1
                    if self.close_after is not None and frames > self.close_after:
                        await ws.aclose(1011, "scripted close")
                        return
                    await self._answer(ws, message, jobs, nursery)
            except trio_websocket.ConnectionClosed:
                pass
            finally:
                nursery.cancel_scope.cancel()

    async def _answer(
        self,
        ws: trio_websocket.WebSocketConnection,
        message: str | bytes,
        jobs: list[_Job],
        nursery: trio.Nursery,
    ) -> None:
        try:
            request = p.decode_request(message)
        except p.ProtocolError as error:
            await ws.send_message(p.encode_reply(error.reply()))
            return
        self.seen_ids.append(request.echoed.get("request_id"))
        reply: p.Reply
        if isinstance(request, p.EchoRequest):
            reply = p.EchoReply(echoed=request.echoed)
        elif isinstance(request, p.EstimateTokenRequest):
            reply = p.EstimateTokenReply(len(request.text.split()), echoed=request.echoed)
        elif isinstance(request, p.LefttrimTokenRequest):
            words = request.text.split()
            kept = words[len(words) - request.trimmed_length :] if request.trimmed_length else []
            reply = p.LefttrimTokenReply(" ".join(kept), echoed=request.echoed)
        elif isinstance(request, p.InfoRequest):
            reply = attrs.evolve(INFO, echoed=request.echoed)
        elif isinstance(request, p.StopRequest):
            stopped = [j for j in jobs if j.request.matches_stop(request)]
            for job in stopped:
                job.scope.cancel()
            for job in stopped:
                await job.done.wait()
            reply = p.StopReply(len(stopped), echoed=request.echoed)
        else:
            job = _Job(request, trio.CancelScope())
            jobs.append(job)
            nursery.start_soon(self._infer, ws, job, jobs)
            return
        await ws.send_message(p.encode_reply(reply))

    async def _infer(
        self, ws: trio_websocket.WebSocketConnection, job: _Job, jobs: list[_Job]
    ) -> None:
        request = job.request
        if request.top_k > 1000:
            # Stands for a limit that depends on the model, checked after decoding.
            error = p.ProtocolError(
                "invalid_request",
                f"top_k must be at most 1000, got {request.top_k!r}",
                field="$.top_k",
                action="infer",
                echoed=request.echoed,
            )
            await ws.send_message(p.encode_reply(error.reply()))
            jobs.remove(job)
            job.done.set()
            return
        # A chat is answered like its contents joined (no template here).
        prompt = (
            request.text
            if request.text is not None
            else " ".join(m.content for m in request.messages or ())
        )
        slow = "slow" in prompt
        answer = prompt.upper()
        chunks: Iterable[str] = (
            itertools.repeat("ab")
            if slow
            else (answer[i : i + 3] for i in range(0, len(answer), 3))
        )
        response = ""
        stop_reason: p.StopReason = "num_tokens"
        with job.scope:
            for chunk in chunks:
                response += chunk
                if request.stream:
                    frame = p.InferChunk(
                        chunk,
                        response if request.stream_full else None,
                        util_text=None if request.compact_chunks else prompt,
                        echoed=request.echoed,
                    )
                    await ws.send_message(p.encode_reply(frame))
                await trio.sleep(0.01 if slow else 0)
        if job.scope.cancelled_caught:
            stop_reason = "interrupted"
        final = p.InferFinal(
            response=response,
            util_text=prompt,
            stop_reason=stop_reason,
            eos_reason=None,
            stop_string=None,
            stop_token=None,
            usage=p.Usage(len(prompt.split()), 0, len(response)),
            timing=p.Timing(0.0, 0.0, 0.0),
            echoed=request.echoed,
        )
        await ws.send_message(p.encode_reply(final))
        jobs.remove(job)
        job.done.set()


INFO = p.InfoReply(
    server=p.ServerInfo("rules", "1"),
    model=p.ModelInfo("words", "rules", 64, 100, None, (0,), 4, True),
    limits=p.Limits(1024, 8, 8, 63),
)


async def serve(server: RuleServer, nursery: trio.Nursery) -> str:
    ws_server = await nursery.start(
        trio_websocket.serve_websocket, server.handle, "127.0.0.1", 0, None
    )
    return f"ws://127.0.0.1:{ws_server.port}"


@pytest.fixture
async def url(nursery: trio.Nursery) -> str:
    return await serve(RuleServer(), nursery)


@pytest.fixture
async def client(url: str) -> AsyncIterator[Client]:
    async with open_client(url) as client:
        yield client


# --------------------------------------------------------------------------


async def test_simple_actions(client: Client) -> None:
    assert await client.echo() == p.EchoReply(echoed={"request_id": "trioserve-client-1"})
    assert await client.estimate_token("one two three") == 3
    assert await client.lefttrim_token("a b c d", 2) == "c d"
    assert await client.lefttrim_token("a b c d", 0) == ""
    info = await client.info(request_id={"mine": [1]})
    assert info.echoed == {"request_id": {"mine": [1]}}
    assert info.model == INFO.model
    assert await client.stop() == 0


async def test_every_request_gets_a_fresh_id(nursery: trio.Nursery) -> None:
    server = RuleServer()
    url = await serve(server, nursery)
    async with open_client(url) as client:
        await client.echo()
        await client.generate("x", 4)
        await client.echo(request_id=None)
        await client.echo(request_id=5)
    assert server.seen_ids[-1] == 5
    assert len(set(server.seen_ids[:-1])) == 3
    assert all(str(i).startswith("trioserve-client-") for i in server.seen_ids[:-1])


async def test_streamed_chunks_add_up_to_the_final_response(client: Client) -> None:
    chunks: list[str] = []
    async with client.infer("hello world", 50, stream=True, stream_full=True, tag=7) as stream:
        async for message in stream:
            if isinstance(message, p.InferChunk):
                chunks.append(message.chunk)
                assert message.response == "".join(chunks)
                assert message.echoed["tag"] == 7
    assert stream.done
    assert "".join(chunks) == stream.final.response == "HELLO WORLD"
    assert len(chunks) == 4
    assert stream.final.echoed == {"request_id": stream.request_id, "tag": 7}


async def test_without_stream_only_the_final_frame_comes(client: Client) -> None:
    messages = [m async for m in client.infer("hello", 5)]
    assert len(messages) == 1
    assert isinstance(messages[0], p.InferFinal)
    assert messages[0].response == "HELLO"


async def test_error_frames_raise_server_error(client: Client) -> None:
    with pytest.raises(ServerError) as info:
        await client.generate("hi", 5, top_k=-1, request_id="r", tag="t")
    error = info.value
    assert (error.error_type, error.field, error.action) == ("invalid_request", "$.top_k", "infer")
    assert error.message == "top_k must be an integer from 0 to 2^31-1, got -1"
    assert error.echoed == {"request_id": "r", "tag": "t"}
    stream = client.infer("hi", 5, top_k=5000)
    with pytest.raises(ServerError) as info:
        await stream.result()
    assert "at most 1000" in info.value.message
    assert stream.done
    # The stream keeps its outcome: asking again raises the same error.
    with pytest.raises(ServerError) as again:
        await stream.result()
    assert again.value is info.value
    with pytest.raises(RuntimeError):
        _ = stream.final
    # The connection is still good, and "r" is free again.
    assert await client.echo(request_id="r") == p.EchoReply(echoed={"request_id": "r"})


async def test_replies_are_routed_while_an_infer_streams(client: Client) -> None:
    async with client.infer("slow one", 10, stream=True) as slow:
        first = await slow.__anext__()
        assert isinstance(first, p.InferChunk)
        # Answered at once although the infer keeps streaming.
        assert await client.estimate_token("a b") == 2
        other = await client.generate("quick", 5, stream=True)
        assert other.response == "QUICK"
        assert await client.stop(target=slow.request_id) == 1
        final = await slow.result()
    assert final.stop_reason == "interrupted"
    assert final.response.startswith("ab")
    assert set(final.response) == {"a", "b"}


async def test_stop_without_target_stops_every_infer(client: Client) -> None:
    async with client.infer("slow a", 1) as a, client.infer("slow b", 1) as b:
        assert await client.stop() == 2
        assert (await a.result()).stop_reason == "interrupted"
        assert (await b.result()).stop_reason == "interrupted"


async def test_concurrent_requests_get_their_own_replies(client: Client) -> None:
    results: dict[int, Any] = {}

    async def one(i: int) -> None:
        if i % 2:
            results[i] = (await client.generate(f"text {i}", 9, stream=True)).response
        else:
            results[i] = await client.estimate_token("w " * i)

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(one, i)
    for i in range(20):
        assert results[i] == (f"TEXT {i}" if i % 2 else i)


async def test_cancelled_stream_frames_are_dropped(client: Client) -> None:
    stream = client.infer("slow drop", 1, stream=True, request_id="dropme")
    with trio.move_on_after(0.05):
        async with stream:
            async for _ in stream:
                pass
    assert not stream.done
    # The job still runs on the server: its id is still taken.
    with pytest.raises(RequestIdInUse):
        await client.echo(request_id="dropme")
    assert await client.stop(target="dropme") == 1
    # Its remaining frames were dropped, not handed out as unrouted.
    await client.send_raw({"action": "echo", "request_id": "marker"})
    assert await client.next_unrouted() == {"action": "echo", "request_id": "marker"}
    assert await client.echo(request_id="dropme") == p.EchoReply(echoed={"request_id": "dropme"})


async def test_request_ids_in_flight_cannot_be_reused(client: Client) -> None:
    async with client.infer("slow x", 1, request_id=[1, 2]) as stream:
        with pytest.raises(RequestIdInUse):
            await client.echo(request_id=[1, 2])
        await client.stop(target=[1, 2])
        await stream.result()


async def test_raw_frames_and_unrouted_replies(client: Client) -> None:
    await client.send_raw("not json")
    frame = await client.next_unrouted()
    assert frame["response_type"] == "error"
    assert frame["error"]["type"] == "invalid_json"
    assert frame["action"] is None
    await client.send_raw(b"\x00binary")
    assert (await client.next_unrouted())["error"]["type"] == "invalid_json"
    await client.send_raw({"action": "shout", "response_id": 3})
    frame = await client.next_unrouted()
    assert (frame["action"], frame["response_id"]) == ("shout", 3)
    assert frame["error"]["type"] == "unknown_action"


@settings(max_examples=20, deadline=None)
@given(json_values(6).filter(lambda v: v is not None))
async def test_any_json_request_id_routes_back(request_id: Any) -> None:
    # None asks the client for a fresh id, so it is the one value left out.
    async with trio.open_nursery() as nursery:
        url = await serve(RuleServer(), nursery)
        async with open_client(url) as client:
            reply = await client.echo(request_id=request_id)
            assert json.dumps(reply.echoed["request_id"]) == json.dumps(request_id)
        nursery.cancel_scope.cancel()


async def test_api_key_goes_in_the_authorization_header(nursery: trio.Nursery) -> None:
    url = await serve(RuleServer(api_key=API_KEY), nursery)
    async with open_client(url, api_key=API_KEY) as client:
        await client.echo()
    with pytest.raises(ConnectionFailed) as info:
        async with open_client(url, api_key="wrong"):
            pass  # pragma: no cover
    assert info.value.status_code == 401
    with pytest.raises(ConnectionFailed):
        async with open_client(url):
            pass  # pragma: no cover


async def test_connection_refused_is_connection_failed() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    with pytest.raises(ConnectionFailed):
        async with open_client(f"ws://127.0.0.1:{port}"):
            pass  # pragma: no cover


async def test_closed_connection_wakes_every_waiter(nursery: trio.Nursery) -> None:
    url = await serve(RuleServer(close_after=0), nursery)
    async with open_client(url) as client:
        stream: InferStream = client.infer("slow", 1, stream=True)
        async with stream:
            with pytest.raises(ConnectionClosed) as info:
                async for _ in stream:
                    pass
        assert info.value.code == 1011
        assert client.closed
        with pytest.raises(ConnectionClosed):
            await client.echo()
        with pytest.raises(ConnectionClosed):
            await client.next_unrouted()
        with pytest.raises(ConnectionClosed):
            await client.send_raw("{}")


async def test_exceptions_from_the_block_are_not_wrapped(url: str) -> None:
    with pytest.raises(KeyError):
        async with open_client(url):
            raise KeyError("mine")


async def test_chat_once_prints_the_answer(url: str) -> None:
    result = await trio.run_process(
        [sys.executable, "-m", "trioserve.client", "--url", url, "--once", "hi there"],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    expected_prompt = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert result.stdout.decode() == expected_prompt.upper() + "\n"


async def test_chat_once_says_when_the_question_itself_was_cut() -> None:
    """A question longer than the context is answered from its end only, and
    the chat says so (it says so too when it drops earlier exchanges)."""
    async with running_server(ScriptedEngine(context_length=64)) as listening:
        once = ["--once", "why " * 40, "--max-new-tokens", "8"]
        result = await trio.run_process(
            [sys.executable, "-m", "trioserve.client", "--url", listening.url, *once],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert result.returncode == 0, result.stderr.decode()
    notes = result.stderr.decode()
    assert "[the question is too long for the context: the server kept its last 56 tokens" in notes
    assert result.stdout.decode().strip()


async def test_chat_reports_server_errors(url: str) -> None:
    result = await trio.run_process(
        [
            sys.executable,
            "-m",
            "trioserve.client",
            "--url",
            url,
            "--once",
            "x",
            "--max-new-tokens=0",
        ],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    # Refused before anything is sent: a usage error (the real server's
    # refusals are in test_client_e2e.py).
    assert result.returncode == 2
    assert "argument --max-new-tokens: expected an integer >= 1, got '0'" in result.stderr.decode()


async def test_chat_keeps_the_conversation(url: str) -> None:
    result = await trio.run_process(
        [sys.executable, "-m", "trioserve.client", "--url", url, "--system", "be brief"],
        stdin=b"hello\n\nworld\n",
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    first = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
    first += "<|im_start|>assistant\n"
    # The rule server answers with the prompt upper-cased; the second prompt
    # holds the first exchange.
    second = first + first.upper() + "<|im_end|>\n<|im_start|>user\nworld<|im_end|>\n"
    second += "<|im_start|>assistant\n"
    assert result.stdout.decode() == first.upper() + "\n" + second.upper() + "\n"


@pytest.mark.skipif(sys.platform == "win32", reason="needs SIGINT delivery to a child")
async def test_ctrl_c_while_streaming_stops_the_answer(url: str) -> None:
    command = [sys.executable, "-m", "trioserve.client", "--url", url, "--once", "slow story"]
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None
    assert process.stderr is not None
    try:
        received = b""
        while b"abab" not in received:
            data = await process.stdout.receive_some()
            assert data, "the client ended before streaming"
            received += data
        process.send_signal(signal.SIGINT)
        async for data in process.stdout:
            received += data
        errors = b"".join([data async for data in process.stderr])
        assert await process.wait() == 0, errors.decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert b"[stopped]" in errors
    answer = received.decode()
    assert answer.endswith("\n")
    assert set(answer.strip()) == {"a", "b"}
