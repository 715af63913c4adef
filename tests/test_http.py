"""The HTTP front door over real loopback sockets and in-memory streams:
routing, keep-alive, limits, timeouts, CORS and the API key, streaming and
disconnects, exception boundaries, WebSocket upgrades (with the `websockets`
library and trio-websocket as clients), drain, and a Hypothesis test of
malformed request heads."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
import trio_websocket
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import wait_until
from tests.http_helpers import RawClient, connect, get, request, running
from trioserve.metrics import Metrics
from trioserve.server.front_door import FrontDoor
from trioserve.server.http_types import (
    AccessPolicy,
    BodyWriter,
    HTTPError,
    HTTPLimits,
    HTTPRequest,
    Reject,
    RequestHead,
    Response,
    Router,
    StreamingResponse,
    event_stream,
)

pytestmark = pytest.mark.unit

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPEN = AccessPolicy()
FAST = HTTPLimits(
    head_timeout=0.5,
    idle_timeout=0.5,
    body_timeout=0.5,
    send_timeout=0.5,
    linger=0.2,
    max_body_bytes=1000,
    max_head_bytes=2000,
)


class PanicException(BaseException):
    """Stands for a native library's panic (pyo3's PanicException is a
    BaseException, not an Exception)."""


class App:
    """Routes of a test server, and what they saw."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.stream_cancelled = trio.Event()
        self.stream_started = trio.Event()
        self.ws_heads: list[RequestHead] = []
        self.slow_release = trio.Event()

    def router(self) -> Router:
        router = Router()
        router.add("GET", "/health", self.health)
        router.add("GET", "/ready", self.health)
        router.add("POST", "/echo", self.echo)
        router.add("GET", "/items/{name}", self.item)
        router.add("GET", "/fail", self.fail)
        router.add("GET", "/panic", self.panic)
        router.add("GET", "/teapot", self.teapot)
        router.add("GET", "/overloaded", self.overloaded)
        router.add("GET", "/stream", self.stream)
        router.add("GET", "/forever", self.forever)
        router.add("GET", "/break", self.breaking)
        router.add("GET", "/slow", self.slow)
        router.add("GET", "/early-break", self.early_break)
        return router

    async def health(self, request: HTTPRequest) -> Response:
        return Response.json({"status": "ok"})

    async def echo(self, request: HTTPRequest) -> Response:
        self.bodies.append(request.body)
        return Response(200, request.body, "application/octet-stream")

    async def item(self, request: HTTPRequest) -> Response:
        return Response.json({"name": request.params["name"], "route": request.route})

    async def fail(self, request: HTTPRequest) -> Response:
        raise RuntimeError("a bug in a handler")

    async def panic(self, request: HTTPRequest) -> Response:
        raise PanicException("a panic in native code")

    async def teapot(self, request: HTTPRequest) -> Response:
        raise HTTPError(418, "short and stout", code="teapot")

    async def overloaded(self, request: HTTPRequest) -> Response:
        raise HTTPError(503, "busy", code="overloaded", headers=[("Retry-After", "2")])

    async def stream(self, request: HTTPRequest) -> StreamingResponse:
        async def write(out: BodyWriter) -> None:
            for i in range(3):
                await out.send(f"data: {i}\n\n".encode())

        return event_stream(write)

    async def forever(self, request: HTTPRequest) -> StreamingResponse:
        async def write(out: BodyWriter) -> None:
            try:
                self.stream_started.set()
                while True:
                    await out.send(b"data: " + b"x" * 8192 + b"\n\n")
                    await trio.sleep(0.01)
            finally:
                self.stream_cancelled.set()

        return event_stream(write)

    async def breaking(self, request: HTTPRequest) -> StreamingResponse:
        async def write(out: BodyWriter) -> None:
            await out.send(b"data: 1\n\n")
            raise RuntimeError("a bug mid-stream")

        return event_stream(write)

    async def early_break(self, request: HTTPRequest) -> StreamingResponse:
        async def write(out: BodyWriter) -> None:
            try:
                raise RuntimeError("a bug before the first byte")
            finally:
                self.stream_cancelled.set()

        return event_stream(write)

    async def slow(self, request: HTTPRequest) -> Response:
        await self.slow_release.wait()
        return Response.json({"done": True})

    async def websocket(self, ws: trio_websocket.WebSocketConnection, head: RequestHead) -> None:
        self.ws_heads.append(head)
        while True:
            try:
                message = await ws.get_message()
            except trio_websocket.ConnectionClosed:
                return
            await ws.send_message(message)


def door(
    app: App,
    *,
    policy: AccessPolicy = OPEN,
    limits: HTTPLimits = FAST,
    **kwargs: Any,
) -> FrontDoor:
    return FrontDoor(
        app.router(), policy=policy, limits=limits, websocket_handler=app.websocket, **kwargs
    )


# -- routing and responses ----------------------------------------------------------------


async def test_get_and_head() -> None:
    async with running(door(App())) as port:
        reply = await get(port)
        assert reply.status == 200
        assert reply.json() == {"status": "ok"}
        assert reply.headers["content-type"] == "application/json"
        assert reply.headers["content-length"] == str(len(reply.body))
        assert reply.headers["server"].startswith("trioserve/")
        assert "date" in reply.headers
        head = await get(port, method="HEAD")
        assert head.status == 200
        assert head.body == b""
        assert head.headers["content-length"] == str(len(reply.body))


async def test_not_found_and_method_not_allowed() -> None:
    async with running(door(App())) as port:
        missing = await get(port, "/nope")
        assert missing.status == 404
        assert missing.json()["error"]["code"] == "not_found"
        wrong = await get(port, "/health", method="DELETE")
        assert wrong.status == 405
        assert wrong.headers["allow"] == "GET, HEAD"
        assert set(wrong.json()["error"]) == {"message", "type", "param", "code"}


async def test_path_parameters_and_query() -> None:
    async with running(door(App())) as port:
        reply = await get(port, "/items/a%20b?x=1")
        assert reply.json() == {"name": "a b", "route": "/items/{name}"}
        assert (await get(port, "/items/")).status == 404


async def test_keep_alive_and_pipelining() -> None:
    async with running(door(App())) as port, connect(port) as client:
        # Three requests in one write; the answers come in order.
        await client.send(
            request(path="/items/one")
            + request("POST", "/echo", body=b"two")
            + request(path="/items/three")
        )
        first = await client.response()
        second = await client.response("POST")
        third = await client.response()
        assert first is not None and first.json()["name"] == "one"
        assert second is not None and second.body == b"two"
        assert third is not None and third.json()["name"] == "three"
        # The same connection serves another request later.
        await client.send(request())
        assert (reply := await client.response()) is not None and reply.status == 200


async def test_max_requests_per_connection() -> None:
    limits = attrs_evolve(FAST, max_requests_per_connection=2)
    async with running(door(App(), limits=limits)) as port, connect(port) as client:
        await client.send(request())
        assert (first := await client.response()) is not None
        assert "connection" not in first.headers
        await client.send(request())
        assert (second := await client.response()) is not None
        assert second.headers["connection"] == "close"
        assert await client.closed()


async def test_http_1_0_without_keep_alive_closes() -> None:
    async with running(door(App())) as port, connect(port) as client:
        await client.send(b"GET /health HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := await client.stream.receive_some(4096):
            data += chunk
        assert data.startswith(b"HTTP/1.1 200 ")
        assert data.endswith(b'{"status":"ok"}')


# -- bodies ---------------------------------------------------------------------------


async def test_bodies_with_content_length_and_chunked() -> None:
    app = App()
    async with running(door(app)) as port, connect(port) as client:
        await client.send(request("POST", "/echo", body=b"hello"))
        assert (reply := await client.response("POST")) is not None and reply.body == b"hello"
        chunked = b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n"
        await client.send(request("POST", "/echo", {"Transfer-Encoding": "chunked"}, body=chunked))
        assert (reply := await client.response("POST")) is not None and reply.body == b"abcdefg"
    assert app.bodies == [b"hello", b"abcdefg"]


async def test_expect_100_continue() -> None:
    async with running(door(App())) as port, connect(port) as client:
        await client.send(
            request("POST", "/echo", {"Expect": "100-continue", "Content-Length": "2"})
        )
        interim = await client.stream.receive_some(4096)
        assert interim.startswith(b"HTTP/1.1 100 ")
        await client.send(b"ok")
        rest = b""
        while not rest.endswith(b"ok"):
            rest += await client.stream.receive_some(4096)
        assert rest.startswith(b"HTTP/1.1 200 ")


async def test_body_too_large_by_content_length_is_refused_unread() -> None:
    app = App()
    async with running(door(app)) as port, connect(port) as client:
        await client.send(request("POST", "/echo", {"Content-Length": "5000"}) + b"x" * 100)
        reply = await client.response("POST")
        assert reply is not None and reply.status == 413
        assert reply.headers["connection"] == "close"
        assert await client.closed()
    assert app.bodies == []


async def test_chunked_body_too_large_is_refused() -> None:
    app = App()
    async with running(door(app)) as port, connect(port) as client:
        chunk = b"%x\r\n%s\r\n" % (600, b"y" * 600)
        await client.send(request("POST", "/echo", {"Transfer-Encoding": "chunked"}) + chunk * 2)
        reply = await client.response("POST")
        assert reply is not None and reply.status == 413
        assert await client.closed()
    assert app.bodies == []


@pytest.mark.parametrize(
    "headers",
    [
        {"Content-Length": "abc"},
        {"Content-Length": "-1"},
        {"Content-Length": "1, 2"},
        {"Transfer-Encoding": "gzip"},
    ],
)
async def test_bad_framing_is_400(headers: dict[str, str]) -> None:
    async with running(door(App())) as port, connect(port) as client:
        await client.send(request("POST", "/echo", headers) + b"x")
        reply = await client.response("POST")
        assert reply is not None and reply.status in (400, 501)
        assert await client.closed()


async def test_body_of_a_refused_request_is_not_taken_for_the_next() -> None:
    # A 404 before the body is read must close: the body's bytes would
    # otherwise be parsed as the next request (request smuggling).
    smuggled = request("GET", "/items/smuggled")
    async with running(door(App())) as port, connect(port) as client:
        await client.send(request("POST", "/nope", body=smuggled))
        reply = await client.response("POST")
        assert reply is not None and reply.status == 404
        assert await client.closed()


# -- heads: size, time, garbage ---------------------------------------------------------------


async def test_huge_header_is_431() -> None:
    async with running(door(App())) as port, connect(port) as client:
        await client.send(request(headers={"X-Big": "a" * 5000}))
        reply = await client.response()
        assert reply is not None and reply.status == 431
        assert await client.closed()


async def test_many_small_headers_are_431() -> None:
    headers = {f"X-H{i}": "v" for i in range(400)}
    async with running(door(App())) as port, connect(port) as client:
        await client.send(request(headers=headers))
        assert (reply := await client.response()) is not None and reply.status == 431


async def test_slowloris_gets_408_while_others_are_served() -> None:
    async with running(door(App())) as port, connect(port) as slow:
        # A byte at a time, never finishing the head: the deadline counts
        # from the first byte, not from the last.
        async def dribble() -> None:
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ":
                await slow.send(bytes([byte]))
                await trio.sleep(0.05)
            while True:
                await slow.send(b"a")
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(dribble)
            assert (await get(port)).status == 200
            reply = await slow.response()
            assert reply is not None and reply.status == 408
            nursery.cancel_scope.cancel()


async def test_silent_connection_is_closed() -> None:
    async with running(door(App())) as port, connect(port) as client:
        # Nothing at all: closed after the head deadline, without an answer.
        assert await client.closed()


async def test_idle_keep_alive_connection_is_closed_quietly() -> None:
    async with running(door(App())) as port, connect(port) as client:
        await client.send(request())
        assert (await client.response()) is not None
        assert await client.closed()


async def test_cancelling_the_door_closes_a_keep_alive_connection_without_lingering() -> None:
    # Lingering (reading what a client still sends after an error, for up to
    # `linger` seconds) is for connections the server ends; a cancelled server
    # closes at once. Here the linger is 60 s and the idle timeout longer: the
    # shutdown must not wait for either.
    limits = attrs_evolve(FAST, idle_timeout=120, linger=60)
    stream = None
    with trio.fail_after(10):
        async with running(door(App(), limits=limits)) as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            client = RawClient(stream)
            await client.send(request())
            assert (await client.response()) is not None
        # running() cancelled the door, the kept-alive connection still open.
        assert await client.closed()
    await stream.aclose()


async def test_slow_body_is_408() -> None:
    async with running(door(App())) as port, connect(port) as client:
        await client.send(request("POST", "/echo", {"Content-Length": "100"}) + b"x" * 10)
        reply = await client.response("POST")
        assert reply is not None and reply.status == 408


@pytest.mark.parametrize(
    "raw",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,  # a TLS ClientHello
        b"GARBAGE\r\n\r\n",
        b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\n: empty\r\n\r\n",
        b"GET /he\x00alth HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /health HTTP/1.1\r\n\r\n",  # no Host
        b"GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
        b"\r\n" * 3000,
    ],
)
async def test_malformed_heads_are_400_or_closed(raw: bytes) -> None:
    async with running(door(App())) as port:
        async with connect(port) as client:
            await client.send(raw)
            reply = await client.response()
            assert reply is None or 400 <= reply.status < 500 or reply.status == 505
        assert (await get(port)).status == 200


# -- the exception boundary -----------------------------------------------------------------


async def test_a_failing_handler_costs_a_500_not_the_connection() -> None:
    async with running(door(App())) as port, connect(port) as client:
        await client.send(request(path="/fail"))
        reply = await client.response()
        assert reply is not None and reply.status == 500
        assert reply.json()["error"]["message"] == "internal error"
        await client.send(request())
        assert (reply := await client.response()) is not None and reply.status == 200


async def test_a_panicking_handler_costs_its_connection_only() -> None:
    front = door(App())
    async with running(front) as port:
        async with connect(port) as client:
            await client.send(request(path="/panic"))
            assert await client.closed()
        assert (await get(port)).status == 200
    assert front.statistics().errors >= 1


async def test_handler_errors_with_status() -> None:
    async with running(door(App())) as port:
        teapot = await get(port, "/teapot")
        assert teapot.status == 418
        assert teapot.json()["error"] == {
            "message": "short and stout",
            "type": "invalid_request_error",
            "param": None,
            "code": "teapot",
        }
        busy = await get(port, "/overloaded")
        assert busy.status == 503
        assert busy.headers["retry-after"] == "2"
        assert busy.json()["error"]["type"] == "server_error"


async def test_a_stream_that_breaks_closes_its_connection() -> None:
    async with running(door(App())) as port:
        async with connect(port) as client:
            await client.send(request(path="/break"))
            data = b""
            while chunk := await client.stream.receive_some(4096):
                data += chunk
            assert b"data: 1" in data
            # The chunked body never got its last chunk: the client can tell.
            assert not data.endswith(b"0\r\n\r\n")
        assert (await get(port)).status == 200


async def test_a_stream_that_breaks_before_its_first_byte_is_a_500() -> None:
    app = App()
    async with running(door(app)) as port, connect(port) as client:
        await client.send(request(path="/early-break"))
        reply = await client.response()
        assert reply is not None and reply.status == 500
        assert app.stream_cancelled.is_set()
        await client.send(request())
        assert (reply := await client.response()) is not None and reply.status == 200


async def test_head_of_a_stream_runs_its_writer_and_sends_no_body() -> None:
    app = App()
    async with running(door(app)) as port:
        reply = await get(port, "/early-break", method="HEAD")
        assert reply.status == 500
        assert app.stream_cancelled.is_set()
        head = await get(port, "/stream", method="HEAD")
        assert head.status == 200 and head.body == b""


# -- streaming and disconnects ---------------------------------------------------------------


async def test_streaming_response_is_chunked_server_sent_events() -> None:
    async with running(door(App())) as port:
        reply = await get(port, "/stream")
        assert reply.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert reply.headers["transfer-encoding"] == "chunked"
        assert reply.headers["cache-control"] == "no-cache"
        assert reply.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def test_disconnect_mid_stream_cancels_the_handler() -> None:
    app = App()
    async with running(door(app)) as port:
        async with connect(port) as client:
            await client.send(request(path="/forever"))
            await client.stream.receive_some(4096)
        with trio.fail_after(10):
            await app.stream_cancelled.wait()


async def test_disconnect_while_the_handler_works_cancels_it() -> None:
    app = App()
    cancelled = trio.Event()

    async def slow(request: HTTPRequest) -> Response:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    router = app.router()
    router.add("GET", "/sleep", slow)
    async with running(FrontDoor(router, limits=FAST)) as port:
        async with connect(port) as client:
            await client.send(request(path="/sleep"))
            await trio.sleep(0.1)
        with trio.fail_after(10):
            await cancelled.wait()


async def test_a_client_that_does_not_read_is_dropped() -> None:
    app = App()
    async with running(door(app)) as port, connect(port) as client:
        await client.send(request(path="/forever"))
        # Never read: the socket buffers fill, a write waits past the send
        # timeout, and the handler is cancelled.
        with trio.fail_after(20):
            await app.stream_cancelled.wait()


# -- CORS and the API key ----------------------------------------------------------------


async def test_api_key_on_every_route_but_health() -> None:
    async with running(door(App(), policy=AccessPolicy(api_key=KEY))) as port:
        assert (await get(port, "/health")).status == 200
        assert (await get(port, "/ready")).status == 200
        refused = await get(port, "/items/x")
        assert refused.status == 401
        assert refused.headers["www-authenticate"] == 'Bearer realm="trioserve"'
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert (await get(port, "/items/x", headers=AUTH)).status == 200
        wrong = {"Authorization": f"Bearer {KEY}x"}
        assert (await get(port, "/items/x", headers=wrong)).status == 401
        assert (await get(port, "/items/x", headers={"Authorization": KEY})).status == 401
        # The query-string key is for WebSocket handshakes only.
        assert (await get(port, f"/items/x?api_key={KEY}")).status == 401
        # Unknown paths do not tell a client without the key what exists.
        assert (await get(port, "/secret-route")).status == 401


async def test_unauthorized_request_with_a_body_is_not_read() -> None:
    app = App()
    async with (
        running(door(app, policy=AccessPolicy(api_key=KEY))) as port,
        connect(port) as client,
    ):
        await client.send(request("POST", "/echo", body=b"z" * 500))
        reply = await client.response("POST")
        assert reply is not None and reply.status == 401
        assert await client.closed()
    assert app.bodies == []


async def test_origins() -> None:
    policy = AccessPolicy(allowed_origins=("https://chat.example.org",))
    async with running(door(App(), policy=policy)) as port:
        ok = await get(port, headers={"Origin": "https://chat.example.org"})
        assert ok.status == 200
        assert ok.headers["access-control-allow-origin"] == "https://chat.example.org"
        assert ok.headers["vary"] == "origin"
        evil = await get(port, headers={"Origin": "https://evil.example.com"})
        assert evil.status == 403
        assert evil.json()["error"]["code"] == "origin_not_allowed"
        # No Origin header: not a browser's cross-origin request.
        plain = await get(port)
        assert plain.status == 200 and "access-control-allow-origin" not in plain.headers


async def test_loopback_origins_by_default() -> None:
    async with running(door(App())) as port:
        assert (await get(port, headers={"Origin": "http://localhost:5173"})).status == 200
        assert (await get(port, headers={"Origin": "http://127.0.0.1"})).status == 200
        assert (await get(port, headers={"Origin": "http://example.com"})).status == 403


async def test_preflight_needs_no_key() -> None:
    policy = AccessPolicy(api_key=KEY, allowed_origins=("https://ui.example.org",))
    async with running(door(App(), policy=policy)) as port:
        reply = await get(
            port,
            "/echo",
            method="OPTIONS",
            headers={
                "Origin": "https://ui.example.org",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
            },
        )
        assert reply.status == 204
        assert "content-length" not in reply.headers
        assert reply.headers["access-control-allow-origin"] == "https://ui.example.org"
        assert reply.headers["access-control-allow-methods"] == "POST, OPTIONS"
        allowed = reply.headers["access-control-allow-headers"]
        assert allowed == "authorization, content-type, x-stainless-os"
        refused = await get(
            port,
            "/echo",
            method="OPTIONS",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert refused.status == 403


# -- WebSocket upgrades ------------------------------------------------------------------------


def websockets_round_trip(url: str, message: str, **kwargs: Any) -> str:
    from websockets.sync.client import connect as ws_connect

    with ws_connect(url, open_timeout=10, **kwargs) as ws:
        ws.send(message)
        reply = ws.recv(timeout=10)
    assert isinstance(reply, str)
    return reply


def websockets_status(url: str, **kwargs: Any) -> int:
    """The HTTP status a refused handshake got, seen by the websockets library."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect as ws_connect

    try:
        with ws_connect(url, open_timeout=10, **kwargs):
            return 101
    except InvalidStatus as exc:
        return int(exc.response.status_code)


async def test_websocket_upgrade_with_the_websockets_library() -> None:
    app = App()
    async with running(door(app)) as port:
        url = f"ws://127.0.0.1:{port}/some/path?x=1"
        reply = await trio.to_thread.run_sync(websockets_round_trip, url, "héllo 🙂")
    assert reply == "héllo 🙂"
    assert app.ws_heads[0].path == "/some/path"
    assert app.ws_heads[0].peer.startswith("127.0.0.1:")


async def test_websocket_upgrade_with_trio_websocket() -> None:
    app = App()
    async with running(door(app)) as port:
        async with trio_websocket.open_websocket_url(f"ws://127.0.0.1:{port}/") as ws:
            await ws.send_message("one")
            assert await ws.get_message() == "one"
            await ws.send_message(b"\x00\x01")
            assert await ws.get_message() == b"\x00\x01"


async def test_http_and_websocket_interleave_on_one_port() -> None:
    metrics = Metrics(process=False)
    async with running(door(App(), observer=metrics)) as port:
        async with trio_websocket.open_websocket_url(f"ws://127.0.0.1:{port}/") as ws:
            for i in range(3):
                await ws.send_message(f"m{i}")
                assert (await get(port)).status == 200
                assert await ws.get_message() == f"m{i}"
            opened = metrics.registry.get_sample_value(
                "trioserve_open_connections", {"protocol": "websocket"}
            )
            assert opened == 1
        await wait_until(
            lambda: (
                metrics.registry.get_sample_value(
                    "trioserve_open_connections", {"protocol": "websocket"}
                )
                == 0
            )
        )
    total = metrics.registry.get_sample_value("trioserve_connections_total", {"protocol": "http"})
    assert total == 4
    count = metrics.registry.get_sample_value(
        "trioserve_http_responses_total", {"route": "/health", "code": "200"}
    )
    assert count == 3


async def test_websocket_refusals_are_plain_http() -> None:
    metrics = Metrics(process=False)
    policy = AccessPolicy(api_key=KEY, allowed_origins=("https://ok.example",))

    def admit(head: RequestHead) -> Reject | None:
        if head.path == "/full":
            return Reject(503, "too many connections", "capacity")
        return None

    front = door(App(), policy=policy, observer=metrics, admit_websocket=admit)
    async with running(front) as port:
        base = f"ws://127.0.0.1:{port}"
        status = await trio.to_thread.run_sync(websockets_status, f"{base}/")
        assert status == 401
        headers = {"Authorization": f"Bearer {KEY}", "Origin": "https://evil.example"}
        status = await trio.to_thread.run_sync(
            lambda: websockets_status(f"{base}/", additional_headers=headers)
        )
        assert status == 403
        status = await trio.to_thread.run_sync(websockets_status, f"{base}/full?api_key={KEY}")
        assert status == 503
        # The key in the query string works for WebSocket.
        reply = await trio.to_thread.run_sync(websockets_round_trip, f"{base}/?api_key={KEY}", "hi")
        assert reply == "hi"

    def rejected(reason: str) -> float | None:
        return metrics.registry.get_sample_value(
            "trioserve_rejected_handshakes_total", {"reason": reason}
        )

    assert (rejected("auth"), rejected("origin"), rejected("capacity")) == (1, 1, 1)


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Sec-WebSocket-Version": "8"}, 426),
        ({"Sec-WebSocket-Key": "short"}, 400),
        ({"Connection": "keep-alive"}, 400),
        ({"Content-Length": "5"}, 400),
    ],
)
async def test_bad_upgrade_requests(headers: dict[str, str], status: int) -> None:
    base = {
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
    }
    async with running(door(App())) as port:
        async with connect(port) as client:
            await client.send(request(headers={**base, **headers}))
            reply = await client.response()
            assert reply is not None and reply.status == status
            if status == 426:
                assert reply.headers["sec-websocket-version"] == "13"
        assert (await get(port)).status == 200


async def test_peers_that_vanish_during_the_handshake_cost_nothing() -> None:
    # Issue 8, defect 1: an upgrade request then a reset, or a refused one
    # whose peer hangs up before the 401; many in a row.
    upgrade = request(
        path="/",
        headers={
            "Connection": "Upgrade",
            "Upgrade": "websocket",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        },
    )
    for policy in (AccessPolicy(), AccessPolicy(api_key=KEY)):
        front = door(App(), policy=policy)
        async with running(front) as port:
            for _ in range(20):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(upgrade)
                stream.socket.setsockopt(  # close with a TCP reset
                    trio.socket.SOL_SOCKET,
                    trio.socket.SO_LINGER,
                    b"\x01\x00\x00\x00\x00\x00\x00\x00",
                )
                await stream.aclose()
            assert (await get(port)).status == 200
            reply = await trio.to_thread.run_sync(
                websockets_round_trip, f"ws://127.0.0.1:{port}/?api_key={KEY}", "still here"
            )
            assert reply == "still here"


async def test_upgrade_after_http_requests_on_one_connection() -> None:
    # A kept-alive connection may make HTTP requests, then upgrade.
    async with running(door(App())) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        client = RawClient(stream)
        for _ in range(2):
            await client.send(request())
            assert (reply := await client.response()) is not None and reply.status == 200
        async with trio.open_nursery() as nursery:
            ws = await trio_websocket.wrap_client_stream(nursery, stream, "127.0.0.1", "/after")
            await ws.send_message("x")
            assert await ws.get_message() == "x"
            await ws.aclose()


# -- drain and capacity ----------------------------------------------------------------------


async def test_drain_closes_idle_connections_and_finishes_requests() -> None:
    app = App()
    limits = attrs_evolve(FAST, idle_timeout=30.0, head_timeout=30.0)
    front = door(app, limits=limits)
    async with running(front) as port, connect(port) as idle, connect(port) as busy:
        await idle.send(request())
        assert (await idle.response()) is not None
        await busy.send(request(path="/slow"))
        await wait_until(lambda: front.statistics().requests >= 1)
        await trio.sleep(0.1)
        front.drain()
        assert await idle.closed()
        status = await trio.to_thread.run_sync(websockets_status, f"ws://127.0.0.1:{port}/")
        assert status == 503
        app.slow_release.set()
        reply = await busy.response()
        assert reply is not None and reply.json() == {"done": True}
        assert reply.headers["connection"] == "close"
        assert await busy.closed()
        with trio.fail_after(10):
            await front.wait_http_closed()


async def test_connection_cap() -> None:
    limits = attrs_evolve(FAST, max_connections=1, idle_timeout=30.0, head_timeout=30.0)
    async with running(door(App(), limits=limits)) as port, connect(port) as first:
        await first.send(request())
        assert (await first.response()) is not None
        second = await get(port)
        assert second.status == 503
        assert second.headers["retry-after"] == "1"


# -- in-memory streams, and a Hypothesis test of malformed heads -------------------------------


async def serve_memory(front: FrontDoor, data: bytes) -> tuple[bytes, bool]:
    """Run one connection of ``front`` over an in-memory stream: send
    ``data``, return what came back and whether the server closed."""
    client, server = trio.testing.memory_stream_pair()
    received = b""
    closed = False
    async with trio.open_nursery() as nursery:
        nursery.start_soon(front.handle_connection, server)
        await client.send_all(data)
        with trio.move_on_after(5):
            while True:
                chunk = await client.receive_some(65536)
                if not chunk:
                    closed = True
                    break
                received += chunk
        nursery.cancel_scope.cancel()
    return received, closed


async def test_in_memory_stream() -> None:
    received, _ = await serve_memory(door(App()), request() + request(path="/items/x"))
    assert received.count(b"HTTP/1.1 200 OK") == 2


VALID = request("POST", "/echo", {"Content-Type": "application/json"}, body=b'{"a": 1}')
heads = st.one_of(
    st.binary(max_size=300),
    st.builds(
        lambda cut, insert, at: VALID[:at] + insert + VALID[at + cut :],
        st.integers(0, 20),
        st.binary(max_size=20),
        st.integers(0, len(VALID)),
    ),
    st.builds(
        lambda name, value: (
            b"GET /health HTTP/1.1\r\nHost: x\r\n" + name + b": " + value + b"\r\n\r\n"
        ),
        st.binary(max_size=30),
        st.binary(max_size=60),
    ),
    st.builds(
        lambda method, target, version: (
            method + b" " + target + b" " + version + b"\r\nHost: x\r\n\r\n"
        ),
        st.sampled_from([b"GET", b"POST", b"OPTIONS", b"HEAD", b"CONNECT", b"G\x00T", b""]),
        st.binary(max_size=30),
        st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"HTTP/1.1 extra", b""]),
    ),
)


@pytest.mark.slow
@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=heads)
async def test_malformed_heads_never_crash(data: bytes) -> None:
    limits = attrs_evolve(FAST, head_timeout=0.1, idle_timeout=0.1, body_timeout=0.1, linger=0.05)
    front = door(App(), limits=limits)
    # handle_connection raising would fail this test (and, in a server,
    # crash its nursery): every outcome is an answer or a close.
    received, closed = await serve_memory(front, data)
    statuses = [
        int(line[9:12]) for line in received.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")
    ]
    assert received or closed
    for status in statuses:
        assert status < 500 or status in (501, 505), received
    # The same front door still serves a good request.
    again, _ = await serve_memory(front, request(headers={"Connection": "close"}))
    assert again.startswith(b"HTTP/1.1 200 OK")


def attrs_evolve(limits: HTTPLimits, **changes: Any) -> HTTPLimits:
    import attrs

    return attrs.evolve(limits, **changes)


async def test_targets_in_absolute_and_odd_forms() -> None:
    async with running(door(App(), policy=AccessPolicy(api_key=KEY))) as port:
        assert (await get(port, "http://test/health")).status == 200
        assert (await get(port, "http://test/items/x?q=1", headers=AUTH)).json()["name"] == "x"
        # "//health" is a path, not a host: it is not the public /health.
        assert (await get(port, "//health")).status == 401
        assert (await get(port, "//health", headers=AUTH)).status == 404
        assert (await get(port, "*", method="OPTIONS")).status == 404


async def test_a_client_leaving_a_stream_written_from_a_nursery_is_no_handler_error() -> None:
    """A stream that follows its work in a task of its own (as the OpenAI
    routes follow their generation) sees the client's leaving as a group of
    ClientGone; it was logged as a failed handler (found by the state
    machine's abandoned OpenAI streams)."""
    left = trio.Event()

    async def nursery_stream(request: HTTPRequest) -> StreamingResponse:
        async def write(out: BodyWriter) -> None:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(trio.sleep_forever)
                    while True:
                        await out.send(b"data: " + b"x" * 8192 + b"\n\n")
            finally:
                left.set()

        return event_stream(write)

    router = Router()
    router.add("GET", "/nursery", nursery_stream)
    front = FrontDoor(router, limits=FAST)
    async with running(front) as port, connect(port) as client:
        await client.send(request(path="/nursery"))
        # Never read: a write waits past the send timeout (ClientGone).
        with trio.fail_after(20):
            await left.wait()
        await trio.sleep(0.1)
    assert front.statistics().errors == 0
