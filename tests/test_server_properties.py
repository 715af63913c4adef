"""Property tests of the server: arbitrary frames, and random interleavings.

* Any frame a client may send gets exactly one answer (one reply, or for an
  ``infer`` its chunks and exactly one terminal frame), and the connection stays
  open.
* A Hypothesis state machine drives several connections with random
  interleavings of infer, stop, stop-with-target, echo and disconnect, OpenAI
  requests on the same server (completions and chat, streamed and not, some
  abandoned mid-answer by their client) and a drain, and checks the invariants
  of protocol.md 3.4 and 3.5 on everything received (a stop's ``stopped`` is
  exactly the number of requests it interrupted) and OpenAI's answer shapes.
  It runs on the scripted engine (fast), and a shorter run on the real model.

The server runs in its own trio loop in a thread (``server_in_thread``); the
state machine's clients live in that loop too, driven with
``trio.from_thread.run``.
"""

from __future__ import annotations

import itertools
import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import h11
import pytest
import trio
import trio_websocket
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from .helpers import ScriptedEngine, raw_client, server_in_thread, wait_until
from .http_helpers import RawClient, request
from .strategies import json_values, valid_requests

TERMINAL = ("full", "error")


@pytest.fixture(scope="module")
def scripted_url() -> Iterator[str]:
    # A small context keeps generated infer requests short (a larger
    # max_new_tokens is answered with invalid_request, which is fine here).
    with server_in_thread(lambda: ScriptedEngine(context_length=96, max_batch=4)) as (
        listening,
        _,
        _,
    ):
        yield listening.url


def frames_any() -> st.SearchStrategy[str | bytes]:
    """Anything a client could put in one frame."""
    return st.one_of(
        st.text(max_size=50),
        st.binary(max_size=50),
        json_values().map(json.dumps),
        st.dictionaries(
            st.sampled_from(["action", "text", "max_new_tokens", "request_id", "stop", "x"]),
            json_values(max_leaves=3),
            max_size=4,
        ).map(json.dumps),
        valid_requests().map(json.dumps),
    )


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(frames=st.lists(frames_any(), min_size=1, max_size=4))
async def test_every_frame_gets_exactly_one_answer(scripted_url: str, frames: list[Any]) -> None:
    async with raw_client(scripted_url) as ws:
        for index, frame in enumerate(frames):
            await ws.send(frame)
            first = await ws.recv()
            answer = [first]
            is_infer_stream = first.get("action") == "infer" and first.get("response_type") not in (
                None,
                *TERMINAL,
            )
            while is_infer_stream and answer[-1].get("response_type") not in TERMINAL:
                answer.append(await ws.recv())
            if first.get("response_type") == "error":
                assert first["error"]["type"] in {
                    "invalid_json",
                    "invalid_request",
                    "unknown_action",
                    "overloaded",
                    "internal",
                }
            if first.get("action") == "infer" and first.get("response_type") != "error":
                assert answer[-1]["response_type"] == "full"
                chunks = [f["chunk"] for f in answer if f["response_type"] == "chunk"]
                if json.loads(frame).get("stream"):
                    assert "".join(chunks) == answer[-1]["response"]
                else:
                    assert chunks == []
            # Nothing more follows, and the connection is still open.
            marker = {"action": "echo", "request_id": f"marker-{index}"}
            assert await ws.request(marker) == marker


# --- the state machine -----------------------------------------------------------


@attrs.define(eq=False)
class Conn:
    name: str
    ws: trio_websocket.WebSocketConnection
    frames: list[dict[str, Any]] = attrs.Factory(list)
    #: What was sent, in order: (kind, request_id, extra).
    sent: list[tuple[str, str, Any]] = attrs.Factory(list)
    closed: bool = False


@attrs.define(eq=False)
class HttpCall:
    """One OpenAI request of the machine, and what came back."""

    name: str
    chat: bool
    stream: bool
    max_tokens: int
    #: The client closes its socket after the first bytes of the answer.
    hang_up: bool
    #: Sent after the drain began.
    after_drain: bool
    status: int | None = None
    body: bytes = b""
    done: bool = False
    #: The connection ended without an answer; only a drain may do that.
    unanswered: bool = False
    #: Whether the server was draining when the call ended.
    drain_seen: bool = False


def _template_dir() -> str:
    """A model directory holding only a chat template: the last message's
    content is the prompt (so "say:X" chats are answered X by the scripted
    engine)."""
    folder = tempfile.mkdtemp(prefix="trioserve-template-")
    template = "{{ messages[-1]['content'] }}"
    (Path(folder) / "chat_template.jinja").write_text(template, encoding="utf-8")
    return folder


class ServerMachine(RuleBasedStateMachine):
    """Random interleavings over several connections of one server, and
    OpenAI requests on its HTTP door."""

    engine_factory: Callable[[], Any] = staticmethod(
        lambda: ScriptedEngine(step_delay=0.002, max_batch=3, model_dir=_template_dir())
    )
    #: Upper bound of max_new_tokens (the real model is slower).
    token_cap = 40

    connections = Bundle("connections")

    def __init__(self) -> None:
        super().__init__()
        self._ids = itertools.count()
        # A short grace: a drain interrupts what still runs after it.
        self._server = server_in_thread(self.engine_factory, shutdown_grace=0.3)
        self.listening, self.token, self.handle = self._server.__enter__()
        self.open: list[Conn] = []
        self.all: list[Conn] = []
        self.calls: list[HttpCall] = []
        self.drained = False

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return trio.from_thread.run(fn, *args, trio_token=self.token)

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids)}"

    async def _connect(self) -> Conn:
        nursery = self.handle.nursery
        assert nursery is not None
        ws = await trio_websocket.connect_websocket_url(nursery, self.listening.url)
        conn = Conn(name=self._new_id("c"), ws=ws)

        async def collect() -> None:
            try:
                while True:
                    conn.frames.append(json.loads(await ws.get_message()))
            except trio_websocket.ConnectionClosed:
                conn.closed = True

        nursery.start_soon(collect)
        return conn

    def _open(self) -> Conn:
        conn: Conn = self._run(self._connect)
        self.open.append(conn)
        self.all.append(conn)
        return conn

    @initialize(target=connections)
    def first_connection(self) -> Conn:
        return self._open()

    @precondition(lambda self: not self.drained)
    @rule(target=connections)
    def connect(self) -> Conn:
        return self._open()

    def _send(self, conn: Conn, frame: dict[str, Any]) -> None:
        async def send() -> None:
            await conn.ws.send_message(json.dumps(frame))

        self._run(send)

    @rule(conn=connections, n=st.integers(1, 40), stream=st.booleans(), full=st.booleans())
    def infer(self, conn: Conn, n: int, stream: bool, full: bool) -> None:
        if conn.closed or conn not in self.open or self.drained:
            return
        n = min(n, self.token_cap)
        request_id = self._new_id("r")
        conn.sent.append(("infer", request_id, (n, stream)))
        text = "go" if n > 20 else f"say:{request_id}"
        self._send(
            conn,
            {
                "action": "infer",
                "request_id": request_id,
                "text": text,
                "max_new_tokens": n,
                "stream": stream,
                "stream_full": full,
                "temperature": 0,
            },
        )

    @rule(conn=connections, pick=st.integers(0, 1000), targeted=st.booleans())
    def stop(self, conn: Conn, pick: int, targeted: bool) -> None:
        if conn.closed or conn not in self.open or self.drained:
            return
        request_id = self._new_id("s")
        frame: dict[str, Any] = {"action": "stop", "request_id": request_id}
        target = None
        if targeted:
            infers = [rid for kind, rid, _ in conn.sent if kind == "infer"]
            target = infers[pick % len(infers)] if infers and pick % 3 else "nobody"
            frame["target"] = target
        # How many frames had arrived when the stop was sent: a request whose
        # final frame was among them had ended before the stop.
        conn.sent.append(("stop", request_id, (targeted, target, len(conn.frames), self.drained)))
        self._send(conn, frame)

    @rule(conn=connections)
    def echo(self, conn: Conn) -> None:
        if conn.closed or conn not in self.open or self.drained:
            return
        request_id = self._new_id("e")
        conn.sent.append(("echo", request_id, None))
        self._send(conn, {"action": "echo", "request_id": request_id})

    @rule(conn=consumes(connections))
    def disconnect(self, conn: Conn) -> None:
        if conn in self.open:
            self.open.remove(conn)
            self._run(conn.ws.aclose)

    @rule(
        n=st.integers(1, 40),
        chat=st.booleans(),
        stream=st.booleans(),
        hang_up=st.booleans(),
    )
    def openai(self, n: int, chat: bool, stream: bool, hang_up: bool) -> None:
        n = min(n, self.token_cap)
        call = HttpCall(self._new_id("h"), chat, stream, n, hang_up, self.drained)
        self.calls.append(call)
        text = "go" if n > 20 else f"say:{call.name}"
        fields: dict[str, Any] = {"max_tokens": n, "stream": stream, "temperature": 0}
        body: dict[str, Any]
        if chat:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
        else:
            path, body = "/v1/completions", {"prompt": text}
        data = json.dumps({**body, **fields}).encode()
        port = self.listening.port
        nursery = self.handle.nursery
        assert nursery is not None

        async def send() -> None:
            try:
                stream_ = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                call.done = True  # the listener is gone (after a drain)
                return
            try:
                async with stream_:
                    client = RawClient(stream_)
                    headers = {"Content-Type": "application/json"}
                    await client.send(request("POST", path, headers, data))
                    if call.hang_up:
                        with trio.move_on_after(5):
                            await stream_.receive_some(1)
                        return
                    reply = await client.response("POST", within=60)
                    if reply is not None:
                        call.status, call.body = reply.status, reply.body
                    else:
                        call.unanswered = True
            except (
                trio.BrokenResourceError,
                trio.ClosedResourceError,
                OSError,
                h11.RemoteProtocolError,
            ):
                call.unanswered = True
            finally:
                call.drain_seen = self.drained
                call.done = True

        async def start() -> None:
            nursery.start_soon(send)

        self._run(start)

    @precondition(lambda self: not self.drained)
    @rule()
    def drain(self) -> None:
        """The graceful shutdown: running requests finish (or are interrupted
        after the grace period), new ones are refused, connections close."""
        self.drained = True
        self._run(_cancel, self.handle.serve_scope)

    @invariant()
    def frames_follow_the_protocol(self) -> None:
        for conn in self.all:
            check_connection(conn, complete=False)
        for call in self.calls:
            check_call(call)

    def teardown(self) -> None:
        try:
            # Every request of an open connection gets its terminal frame
            # (after a drain too: the server closes a connection only after
            # its requests were answered).
            for conn in self.open:
                if self.drained:
                    # The drain answers what the server had read, then closes
                    # every connection (1001): a frame still in flight then
                    # gets no answer, and the client sees the close.
                    self._run(wait_until, lambda conn=conn: conn.closed, 60)
                    check_connection(conn, complete=False)
                    check_started_requests_ended(conn)
                    continue
                self._run(wait_until, lambda conn=conn: answered_all(conn), 60)
                check_connection(conn, complete=True)
            # Every HTTP request is answered (or was abandoned by its client).
            self._run(wait_until, lambda: all(c.done for c in self.calls), 60)
            for call in self.calls:
                check_call(call)

            async def idle() -> None:
                with trio.fail_after(30):
                    for conn in self.open:
                        await conn.ws.aclose()
                    await wait_until(lambda: not self.handle.engine.running_jobs)

            if hasattr(self.handle.engine, "running_jobs"):
                self._run(idle)
        finally:
            self._server.__exit__(None, None, None)


async def _cancel(scope: trio.CancelScope) -> None:
    scope.cancel()


def check_call(call: HttpCall) -> None:
    """An OpenAI answer: a whole one, a stream that ends with [DONE], or a
    503 while the server drains; never another server error."""
    if not call.done or call.hang_up:
        return
    if call.unanswered or call.status is None:
        # A draining server closes connections; nothing else leaves a
        # request without an answer.
        assert call.drain_seen or call.after_drain, call
        return
    if call.status == 503:
        assert json.loads(call.body)["error"]["code"] == "overloaded"
        return
    assert call.status == 200, (call, call.body[:300])
    if not call.stream:
        answer = json.loads(call.body)
        usage = answer["usage"]
        assert usage["completion_tokens"] <= call.max_tokens
        choice = answer["choices"][0]
        text = choice["message"]["content"] if call.chat else choice["text"]
        if choice["finish_reason"] == "length":
            assert usage["completion_tokens"] == call.max_tokens
        assert isinstance(text, str)
        return
    events = [e for e in call.body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events[-3:]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    errors = [e for e in payloads if "error" in e]
    if errors:
        # Only the drain past its grace ends a stream with an error event.
        assert errors == payloads[-1:], payloads
        assert errors[0]["error"]["code"] == "overloaded"
        return
    reasons = [c["finish_reason"] for e in payloads for c in e["choices"] if c["finish_reason"]]
    assert len(reasons) == 1, payloads


def check_started_requests_ended(conn: Conn) -> None:
    """Every infer the server answered at all got its terminal frame."""
    for kind, rid, _ in conn.sent:
        own = [f for f in conn.frames if f.get("request_id") == rid]
        if kind == "infer" and own:
            assert any(is_terminal(f) for f in own), f"{rid}: started, never ended"


def answered_all(conn: Conn) -> bool:
    ids = {f.get("request_id") for f in conn.frames if is_terminal(f)}
    return all(rid in ids for _, rid, _ in conn.sent)


def is_terminal(frame: dict[str, Any]) -> bool:
    if frame.get("action") == "infer":
        return frame.get("response_type") in TERMINAL
    return True


def check_connection(conn: Conn, *, complete: bool) -> None:
    """protocol.md 3.4 and 3.5 over one connection's frames so far."""
    frames = list(conn.frames)
    by_id: dict[Any, list[int]] = {}
    for index, frame in enumerate(frames):
        by_id.setdefault(frame.get("request_id"), []).append(index)
    sent = {rid: (kind, extra) for kind, rid, extra in conn.sent}
    unknown = set(by_id) - set(sent)
    assert not unknown, f"frames for requests never sent: {unknown}"
    for rid, (kind, extra) in sent.items():
        own = [frames[i] for i in by_id.get(rid, [])]
        terminals = [f for f in own if is_terminal(f)]
        assert len(terminals) <= 1, f"{rid}: more than one terminal frame"
        if terminals:
            assert own[-1] is terminals[0], f"{rid}: a frame followed its terminal frame"
        if complete:
            assert terminals, f"{rid}: no terminal frame"
        if kind == "echo" and own:
            assert own == [{"action": "echo", "request_id": rid}]
        if kind == "infer" and terminals:
            final = terminals[0]
            if final["response_type"] == "error":
                # Only a request that arrives while the server drains is refused.
                assert final["error"]["type"] == "overloaded", final
                continue
            assert final["response_type"] == "full", final
            max_new_tokens, stream = extra
            chunks = [f["chunk"] for f in own if f.get("response_type") == "chunk"]
            assert all(chunks), "empty chunk frame"
            if stream:
                assert "".join(chunks) == final["response"]
            else:
                assert chunks == []
            assert final["usage"]["generated_tokens"] <= max_new_tokens
            if final["stop_reason"] == "num_tokens":
                assert final["usage"]["generated_tokens"] == max_new_tokens
        if kind == "stop" and terminals:
            reply_at = by_id[rid][0]
            targeted, target, _, drained = extra
            stop_sent_at = [r for _, r, _ in conn.sent].index(rid)
            for kind2, rid2, _ in conn.sent[:stop_sent_at]:
                if kind2 != "infer" or (targeted and rid2 != target):
                    continue
                # Every matching infer sent before the stop has its terminal
                # frame before the stop's reply.
                assert any(is_terminal(frames[i]) and i < reply_at for i in by_id.get(rid2, [])), (
                    f"{rid2} not finished before the reply to {rid}"
                )
            interrupted = len(stopped_by(conn, rid, frames, by_id))
            if drained:
                # The drain interrupts requests too: a stop during it counts
                # only what it found still running.
                assert frames[reply_at]["stopped"] <= interrupted
            else:
                assert frames[reply_at]["stopped"] == interrupted


def stopped_by(
    conn: Conn, stop_id: str, frames: list[dict[str, Any]], by_id: dict[Any, list[int]]
) -> list[str]:
    """The infers that the stop ``stop_id`` interrupted.

    An interrupted infer belongs to the first stop sent after it that matches
    it, that was sent before the infer's final frame arrived, and whose reply
    follows that final frame: the server answers a stop only after the final
    frames of the requests it interrupted, and does not count one it found
    already ended."""
    owner: dict[str, str] = {}
    for index, (kind, rid, _) in enumerate(conn.sent):
        if kind != "infer":
            continue
        final_at = next((i for i in by_id.get(rid, []) if is_terminal(frames[i])), None)
        if final_at is None or frames[final_at].get("stop_reason") != "interrupted":
            continue
        for kind2, sid, extra in conn.sent[index + 1 :]:
            if kind2 != "stop":
                continue
            targeted, target, seen, _ = extra
            replies = by_id.get(sid, [])
            matches = not targeted or target == rid
            if matches and seen <= final_at and replies and replies[0] > final_at:
                owner[rid] = sid
                break
    return [rid for rid, sid in owner.items() if sid == stop_id]


ServerMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestServerMachine = ServerMachine.TestCase
TestServerMachine.pytestmark = [pytest.mark.slow]  # type: ignore[attr-defined]


class RealModelMachine(ServerMachine):
    """The same machine on the real embedded model, shorter."""

    token_cap = 8


@pytest.fixture
def real_model_machine(cpu_engine: Any) -> type[RealModelMachine]:
    RealModelMachine.engine_factory = staticmethod(lambda: cpu_engine)
    return RealModelMachine


@pytest.mark.slow
def test_state_machine_on_the_real_model(real_model_machine: type[RealModelMachine]) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        real_model_machine,
        settings=settings(
            max_examples=4,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
