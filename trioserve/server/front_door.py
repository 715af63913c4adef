"""The front door of one port: HTTP/1.1 for plain requests, WebSocket upgrades
handed to trio-websocket.

Every accepted connection goes to :meth:`FrontDoor.handle_connection`. It
reads the first request head with h11 (the trio authors' sans-IO HTTP/1.1
library) under a size limit and a deadline, then:

* an upgrade to WebSocket is checked (RFC 6455's handshake fields, then the
  Origin rule, the API key, draining and capacity): a refusal is answered
  here as plain HTTP (400, 401 with ``WWW-Authenticate``, 403, 426, 503), so a
  peer that vanishes meanwhile costs nothing; an accepted upgrade is handed to
  ``trio_websocket.wrap_server_stream`` over a stream that replays the request
  head already read, and the resulting connection to ``websocket_handler``;
* anything else is served as HTTP/1.1 with keep-alive: each request is routed
  by a :class:`Router` to a handler that returns a :class:`Response` (sent with
  Content-Length) or a :class:`StreamingResponse` (chunked, for Server-Sent
  Events), until the client closes, a limit is reached, or the door drains.

Hostile or broken clients cost their own connection only. Every bound holds
before work is done: the head's size (431) and the time to send it (408), the
time a kept-alive connection may idle, the body's size (413, also for chunked
bodies, before reading it when Content-Length says so) and the time to send
it (408), the time each write may wait on a client that does not read, and
requests per connection. A malformed request gets 400 and a close. Each
connection runs inside an exception boundary: nothing but cancellation leaves
:meth:`FrontDoor.handle_connection`, so a handler's bug ends one connection
(500 when no byte of the response was sent yet), never the listener.

A client that disconnects while its request is being handled (or its response
streamed) has its handler's cancel scope cancelled: a generation handler frees
its engine job in its ``finally``, exactly as on the WebSocket side. A client
that half-closes its sending side counts as gone.

Cross-origin rules: a request carrying an ``Origin`` header that the
:class:`AccessPolicy` does not allow is refused with 403 before anything else
(browsers send Origin on every cross-origin request, so a page on another site
cannot make the server work). Allowed origins get CORS headers, and their
preflight ``OPTIONS`` requests are answered without the API key (browsers
never send credentials on a preflight).

This module knows nothing of the scheduler, the engine or torch; the server
composes a :class:`FrontDoor` from its routes and callbacks.
"""

from __future__ import annotations

import contextlib
import email.utils
import http
import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Final
from urllib.parse import urlsplit

import attrs
import h11
import trio
import trio_websocket

from trioserve._version import __version__

from .http_types import (
    AccessPolicy,
    ClientGone,
    FrontDoorStatistics,
    Handler,
    HTTPError,
    HTTPLimits,
    HTTPRequest,
    KiB,
    MiB,
    NoObserver,
    Observer,
    Reject,
    RequestHead,
    Response,
    Router,
    StreamingResponse,
    WebSocketHandler,
)
from .websocket import HandshakeAborted, accept_stream

__all__ = ["FrontDoor", "serve_front_door"]

log = logging.getLogger("trioserve.http")

_RECEIVE_SIZE: Final = 64 * KiB
#: At most this much of a client's data is read and discarded while the
#: connection closes (within ``HTTPLimits.linger``), so that a response or a
#: close frame sent before the rest was read is not lost to a TCP reset: a
#: client still sending a frame over the WebSocket limit (the fuzz run sent
#: 6 MB ones) reads its 1009 only after its own send completes. Draining is a
#: few milliseconds per 10 MB on a socket; the linger time bounds it.
_LINGER_BYTES: Final = 64 * MiB
_TOKEN: Final = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_WS_KEY: Final = re.compile(rb"^[A-Za-z0-9+/]{22}==$")


# --------------------------------------------------------------------------
# The front door


_DEFAULT_POLICY: Final = AccessPolicy()
_DEFAULT_LIMITS: Final = HTTPLimits()

_TOO_MANY: Final = Reject(
    503,
    "the server has too many connections; retry later",
    "capacity",
    (("Retry-After", "1"),),
    code="overloaded",
)


class _Close(Exception):
    """End this connection now (its answer, if any, is already sent)."""


def _must_propagate(exc: BaseException) -> bool:
    """Cancellation and the interpreter's own exits leave the boundary;
    anything else (including non-Exception BaseExceptions such as a Rust
    panic from a native library) ends only the connection."""
    kinds = (trio.Cancelled, KeyboardInterrupt, SystemExit, GeneratorExit)
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(lambda e: isinstance(e, kinds)) is not None
    return isinstance(exc, kinds)


class _DateCache:
    """The ``Date`` header, formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = email.utils.formatdate(now, usegmt=True).encode("ascii")
        return self._value


class _ReplayStream(trio.abc.Stream):
    """A stream that first gives back bytes already read from ``stream``
    (the upgrade request's head), then reads ``stream`` itself."""

    def __init__(self, stream: trio.abc.Stream, prefix: bytes) -> None:
        self._stream = stream
        self._prefix = prefix

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._prefix:
            size = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:size], self._prefix[size:]
            await trio.lowlevel.checkpoint()
            return data
        return bytes(await self._stream.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()


def _peer(stream: trio.abc.Stream) -> str:
    socket = getattr(stream, "socket", None)
    try:
        address = socket.getpeername() if socket is not None else None
    except OSError:
        address = None
    if isinstance(address, tuple) and len(address) >= 2:
        host = str(address[0])
        return f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}"
    return "unknown"


def _head_from(event: h11.Request, peer: str) -> RequestHead:
    target = event.target.decode("ascii", "replace")
    if target.startswith(("http://", "https://")):  # absolute form (RFC 9112 3.2.2)
        split = urlsplit(target)
        path, query = split.path or "/", split.query
    else:
        # Origin form, split by hand: urlsplit would read "//x" as a host.
        path, _, query = target.partition("?")
    return RequestHead(
        method=event.method.decode("ascii", "replace").upper(),
        target=target,
        path=path,
        query=query,
        headers=tuple((name.lower(), value) for name, value in event.headers),
        http_version=event.http_version.decode("ascii", "replace"),
        peer=peer,
    )


class _Connection:
    """One HTTP connection's state, for the front door's loop."""

    def __init__(self, stream: trio.abc.Stream, peer: str, max_head_bytes: int) -> None:
        self.stream = stream
        self.peer = peer
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.requests = 0
        #: Set while the connection waits for a request's first byte; drain
        #: cancels it to close idle connections at once.
        self.idle_scope: trio.CancelScope | None = None
        self.protocol = "http"


class _Writer:
    """The :class:`BodyWriter` of one streamed response. The status line and
    headers go out with the first piece of the body, so that a ``write`` that
    fails before it sends anything can still be answered with a 500."""

    def __init__(
        self, door: FrontDoor, conn: _Connection, response: h11.Response, discard: bool
    ) -> None:
        self._door = door
        self._conn = conn
        self._response: h11.Response | None = response
        #: HEAD: the headers only.
        self._discard = discard

    @property
    def started(self) -> bool:
        return self._response is None

    async def send(self, data: bytes) -> None:
        out = b""
        if self._response is not None:
            out = self._conn.h11.send(self._response) or b""
            self._response = None
        if data and not self._discard:
            out += self._conn.h11.send(h11.Data(data=data)) or b""
        await self._door._send(self._conn, out)

    async def end(self) -> None:
        await self.send(b"")
        await self._door._send(self._conn, self._conn.h11.send(h11.EndOfMessage()))


class FrontDoor:
    """HTTP/1.1 and WebSocket on one port; see the module's docstring.

    ``router`` maps HTTP requests to handlers; ``websocket_handler(ws, head)``
    runs an accepted WebSocket connection until it ends (None: upgrades are
    refused with 404); ``admit_websocket(head)`` may refuse an upgrade that
    passed the policy (the server's connection cap, for instance) with a
    :class:`Reject`. ``max_message_bytes`` bounds a WebSocket frame (UTF-8
    bytes of a text frame; bigger closes the connection with 1009).
    """

    def __init__(
        self,
        router: Router,
        *,
        policy: AccessPolicy = _DEFAULT_POLICY,
        limits: HTTPLimits = _DEFAULT_LIMITS,
        websocket_handler: WebSocketHandler | None = None,
        admit_websocket: Callable[[RequestHead], Reject | None] | None = None,
        observer: Observer | None = None,
        max_message_bytes: int = MiB,
    ) -> None:
        self.router = router
        self.policy = policy
        self.limits = limits
        self._websocket_handler = websocket_handler
        self._admit_websocket = admit_websocket
        self._observer: Observer = observer if observer is not None else NoObserver()
        self._max_message_bytes = max_message_bytes
        self._connections: set[_Connection] = set()
        self._websockets = 0
        self._requests = 0
        self._errors = 0
        self._draining = False
        self._date = _DateCache()
        self._server_header = f"trioserve/{__version__}".encode("ascii")
        self._idle = trio.Event()

    # -- state ----------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        """Start a graceful close: connections waiting for a request close
        now, responses in flight end with ``Connection: close``, and new
        WebSocket upgrades get 503. Synchronous and idempotent."""
        self._draining = True
        for conn in list(self._connections):
            if conn.idle_scope is not None:
                conn.idle_scope.cancel()

    def statistics(self) -> FrontDoorStatistics:
        return FrontDoorStatistics(
            http_connections=sum(1 for c in self._connections if c.protocol == "http"),
            websocket_connections=self._websockets,
            requests=self._requests,
            errors=self._errors,
        )

    async def wait_http_closed(self) -> None:
        """Return once no HTTP connection is open (after :meth:`drain`, the
        ones still answering a request finish it first)."""
        while any(c.protocol == "http" for c in self._connections):
            if self._idle.is_set():
                self._idle = trio.Event()
            await self._idle.wait()

    # -- one connection ---------------------------------------------------------------

    async def handle_connection(self, stream: trio.abc.Stream) -> None:
        """Serve one accepted connection until it ends; a handler for
        ``trio.serve_listeners``.

        Cancellation: cancelling it closes the connection at once. Nothing but
        cancellation (and the interpreter's own exits) ever leaves it.
        """
        conn = _Connection(stream, _peer(stream), self.limits.max_head_bytes)
        over_capacity = (
            self.limits.max_connections is not None
            and len(self._connections) >= self.limits.max_connections
        )
        self._connections.add(conn)
        self._observer.connection_opened("http")
        try:
            await self._serve(conn, over_capacity)
        except _Close:
            pass
        except BaseException as exc:
            if _must_propagate(exc):
                raise
            self._errors += 1
            log.error("connection from %s failed", conn.peer, exc_info=exc)
        finally:
            self._connections.discard(conn)
            self._observer.connection_closed(conn.protocol)
            if not any(c.protocol == "http" for c in self._connections):
                self._idle.set()
            with trio.CancelScope(shield=True), trio.move_on_after(self.limits.linger):
                await self._close(conn)
            await trio.aclose_forcefully(stream)

    async def _serve(self, conn: _Connection, over_capacity: bool) -> None:
        while True:
            event = await self._next_request(conn)
            conn.requests += 1
            head = _head_from(event, conn.peer)
            if over_capacity:
                if b"websocket" in head.header_tokens(b"upgrade"):
                    self._observer.handshake_rejected("capacity")
                await self._refuse(conn, _TOO_MANY, head)
            if b"websocket" in head.header_tokens(b"upgrade"):
                await self._upgrade(conn, head)
                return
            await self._serve_request(conn, head)
            if conn.h11.our_state is h11.MUST_CLOSE or conn.h11.their_state is h11.MUST_CLOSE:
                raise _Close
            try:
                conn.h11.start_next_cycle()
            except h11.LocalProtocolError:
                raise _Close from None

    # -- reading ------------------------------------------------------------------------

    async def _next_request(self, conn: _Connection) -> h11.Request:
        """The next request head, under the idle and head deadlines."""
        limits = self.limits
        now = trio.current_time()
        started = bool(conn.h11.trailing_data[0])
        if conn.requests == 0 or started:
            deadline = now + limits.head_timeout
        else:
            deadline = now + limits.idle_timeout
        while True:
            try:
                event = conn.h11.next_event()
            except h11.RemoteProtocolError as exc:
                await self._protocol_error(conn, exc)
            if isinstance(event, h11.Request):
                # h11 bounds a head that is still incomplete; one that
                # arrived whole in a single read is measured here.
                size = len(event.method) + len(event.target) + 12
                size += sum(len(name) + len(value) + 4 for name, value in event.headers)
                if size > limits.max_head_bytes:
                    await self._refuse(conn, Reject(431, "the request head is too large"))
                if event.http_version not in (b"1.0", b"1.1"):
                    await self._refuse(conn, Reject(505, "only HTTP/1.0 and HTTP/1.1 are served"))
                return event
            if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                raise _Close
            if event is not h11.NEED_DATA:  # pragma: no cover - h11 gives nothing else here
                raise _Close
            # Between requests a kept-alive connection is idle: drain closes
            # it at once. A new connection's first request is read (and
            # answered: a WebSocket upgrade gets 503 while draining).
            idle = not started and conn.requests > 0
            if idle and self._draining:
                raise _Close
            scope = trio.CancelScope(deadline=deadline)
            if idle:
                conn.idle_scope = scope
            try:
                with scope:
                    data = await self._receive(conn)
            finally:
                conn.idle_scope = None
            if scope.cancelled_caught:
                if not started:
                    raise _Close  # no byte of a request came: close quietly
                await self._refuse(conn, Reject(408, "the request head took too long to arrive"))
            conn.h11.receive_data(data)
            if data and not started:
                started = True
                deadline = trio.current_time() + limits.head_timeout

    async def _receive(self, conn: _Connection) -> bytes:
        try:
            return bytes(await conn.stream.receive_some(_RECEIVE_SIZE))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def _read_body(self, conn: _Connection, head: RequestHead) -> bytes:
        limits = self.limits
        length = head.header_bytes(b"content-length")
        if length and int(length) > limits.max_body_bytes:
            # h11 has checked that it is a number.
            await self._refuse(
                conn, Reject(413, f"the request body is larger than {limits.max_body_bytes} bytes")
            )
        if conn.h11.they_are_waiting_for_100_continue:
            await self._send(
                conn, conn.h11.send(h11.InformationalResponse(status_code=100, headers=[]))
            )
        deadline = trio.current_time() + limits.body_timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                event = conn.h11.next_event()
            except h11.RemoteProtocolError as exc:
                await self._protocol_error(conn, exc)
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > limits.max_body_bytes:
                    await self._refuse(
                        conn,
                        Reject(
                            413, f"the request body is larger than {limits.max_body_bytes} bytes"
                        ),
                    )
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            elif event is h11.NEED_DATA:
                with trio.move_on_at(deadline) as scope:
                    data = await self._receive(conn)
                if scope.cancelled_caught:
                    await self._refuse(
                        conn, Reject(408, "the request body took too long to arrive")
                    )
                conn.h11.receive_data(data)
            else:
                raise _Close

    # -- answering ----------------------------------------------------------------------

    async def _send(self, conn: _Connection, data: bytes | None) -> None:
        if not data:
            return
        with trio.move_on_after(self.limits.send_timeout) as scope:
            try:
                await conn.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise ClientGone("the client went away") from None
        if scope.cancelled_caught:
            raise ClientGone(f"the client read nothing for {self.limits.send_timeout:g} s")

    def _headers(
        self, head: RequestHead | None, extra: Iterable[tuple[str, str]], content_type: str | None
    ) -> list[tuple[bytes, bytes]]:
        headers = [(b"server", self._server_header), (b"date", self._date.get())]
        if content_type is not None:
            headers.append((b"content-type", content_type.encode("latin-1")))
        if head is not None:
            origin = head.header("origin")
            if origin is not None and self.policy.origin_allowed(origin):
                headers += [
                    (b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"access-control-expose-headers", b"retry-after"),
                    (b"vary", b"origin"),
                ]
        headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in extra]
        return headers

    def _closing(self, conn: _Connection) -> bool:
        return self._draining or conn.requests >= self.limits.max_requests_per_connection

    async def _respond(
        self, conn: _Connection, head: RequestHead | None, response: Response, route: str
    ) -> None:
        headers = self._headers(head, response.headers, response.content_type)
        if response.status not in (204, 304):  # which must carry no Content-Length
            headers.append((b"content-length", str(len(response.body)).encode("ascii")))
        if self._closing(conn):
            headers.append((b"connection", b"close"))
        data = (
            conn.h11.send(
                h11.Response(
                    status_code=response.status, headers=headers, reason=_reason(response.status)
                )
            )
            or b""
        )
        if response.body and (head is None or head.method != "HEAD"):
            data += conn.h11.send(h11.Data(data=response.body)) or b""
        data += conn.h11.send(h11.EndOfMessage()) or b""
        self._requests += 1
        self._observer.http_response(route, response.status)
        await self._send(conn, data)

    async def _refuse(
        self, conn: _Connection, reject: Reject, head: RequestHead | None = None
    ) -> None:
        """Answer with an error (when the state allows one) and close."""
        self._errors += 1
        if conn.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            response = Response.error(
                reject.status,
                reject.message,
                code=reject.code,
                headers=(("Connection", "close"), *reject.headers),
            )
            with contextlib.suppress(ClientGone, h11.LocalProtocolError):
                await self._respond(conn, head, response, "none")
        raise _Close

    async def _protocol_error(self, conn: _Connection, exc: h11.RemoteProtocolError) -> None:
        status = exc.error_status_hint if 400 <= exc.error_status_hint < 500 else 400
        message = (
            "the request head is too large"
            if status == 431
            else f"malformed request: {str(exc)[:200]}"
        )
        log.debug("protocol error from %s: %s", conn.peer, exc)
        await self._refuse(conn, Reject(status, message))

    async def _close(self, conn: _Connection) -> None:
        """Close after sending: end our side, read and drop what the client
        still sends (briefly, boundedly), then close the socket."""
        stream = conn.stream
        try:
            if isinstance(stream, trio.abc.HalfCloseableStream):
                await stream.send_eof()
                dropped = 0
                while dropped < _LINGER_BYTES:
                    data = await stream.receive_some(_RECEIVE_SIZE)
                    if not data:
                        break
                    dropped += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    # -- one HTTP request -----------------------------------------------------------------

    async def _serve_request(self, conn: _Connection, head: RequestHead) -> None:
        reject = self.policy.check_origin(head)
        if reject is not None:
            await self._refuse(conn, reject, head)
        if head.method == "OPTIONS":
            await self._read_body(conn, head)
            await self._respond(conn, head, self._options(head), "preflight")
            return
        # The key and the route are checked before the body is read: a
        # client without the key cannot make the server read megabytes.
        response: Response | None = None
        reject = self.policy.check_key(head)
        found = self.router.match(head.method, head.path)
        if reject is not None:
            response = Response.error(
                reject.status, reject.message, code=reject.code, headers=reject.headers
            )
        elif isinstance(found, list):
            response = _no_route(head, found)
        if response is not None:
            if _has_body(head):
                # Unread, the body would be taken for the next request.
                response = attrs.evolve(
                    response, headers=(*response.headers, ("Connection", "close"))
                )
                await self._respond(conn, head, response, "unmatched")
                raise _Close
            await self._read_body(conn, head)
            await self._respond(conn, head, response, "unmatched")
            return
        assert not isinstance(found, list)
        route, params = found
        body = await self._read_body(conn, head)
        request = HTTPRequest(head=head, body=body, route=route.pattern, params=params)
        await self._run_handler(conn, request, route.handler)

    def _options(self, head: RequestHead) -> Response:
        methods = self.router.methods(head.path)
        if not methods:
            return Response.error(404, f"no route {head.path[:200]!r}", code="not_found")
        allow = ", ".join([*methods, "OPTIONS"])
        headers = [("Allow", allow)]
        if head.header("origin") is not None and head.header("access-control-request-method"):
            requested = head.header_tokens(b"access-control-request-headers")
            # Reflect what the (already allowed) origin asks for, when it is
            # made of header names: SDKs in browsers send their own headers.
            names = [t.decode("ascii") for t in requested[:64] if _TOKEN.match(t)]
            headers += [
                ("Access-Control-Allow-Methods", allow),
                (
                    "Access-Control-Allow-Headers",
                    ", ".join(names or ["authorization", "content-type"]),
                ),
                ("Access-Control-Max-Age", "600"),
            ]
        return Response(204, b"", None, tuple(headers))

    async def _run_handler(self, conn: _Connection, request: HTTPRequest, handler: Handler) -> None:
        """Run ``handler`` while watching for the client to go away, and send
        what it returns; raise :class:`_Close` when the connection must end."""
        scope = trio.CancelScope()
        gone = False

        async def watch() -> None:
            # Read what the client sends while we answer: pipelined requests
            # go into h11's buffer (up to a bound, then TCP pushes back), an
            # EOF means the client left.
            nonlocal gone
            bound = self.limits.max_head_bytes + self.limits.max_body_bytes
            buffered = 0
            while buffered <= bound:
                data = await self._receive(conn)
                if not data:
                    gone = True
                    scope.cancel()
                    return
                buffered += len(data)
                conn.h11.receive_data(data)
            await trio.sleep_forever()

        complete = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            try:
                complete = await self._answer(conn, request, handler, scope)
            except ClientGone:
                gone = True
            finally:
                nursery.cancel_scope.cancel()
        if gone or scope.cancelled_caught:
            log.debug("client %s left during %s %s", conn.peer, request.method, request.path)
            raise _Close
        if not complete:
            raise _Close

    async def _answer(
        self, conn: _Connection, request: HTTPRequest, handler: Handler, scope: trio.CancelScope
    ) -> bool:
        """Run the handler and send its response; False when the response
        could not be completed (the connection must close)."""
        writer: list[_Writer] = []
        try:
            with scope:
                try:
                    response = await handler(request)
                except HTTPError as exc:
                    response = exc.response()
                if isinstance(response, Response):
                    await self._respond(conn, request.head, response, request.route)
                else:
                    await self._stream(conn, request, response, writer)
                return True
        except ClientGone:
            raise
        except Exception as exc:
            self._errors += 1
            log.error(
                "handler of %s %s failed (client %s)",
                request.method,
                request.route,
                conn.peer,
                exc_info=exc,
            )
            began = bool(writer) and writer[0].started
            if began or conn.h11.our_state is not h11.SEND_RESPONSE:
                return False
            response = Response.error(500, "internal error", code="internal")
            await self._respond(conn, request.head, response, request.route)
            return True
        return False  # cancelled: the client left (the caller closes)

    async def _stream(
        self,
        conn: _Connection,
        request: HTTPRequest,
        response: StreamingResponse,
        writer: list[_Writer],
    ) -> None:
        headers = self._headers(request.head, response.headers, response.content_type)
        if self._closing(conn):
            headers.append((b"connection", b"close"))
        event = h11.Response(
            status_code=response.status, headers=headers, reason=_reason(response.status)
        )
        out = _Writer(self, conn, event, discard=request.method == "HEAD")
        writer.append(out)
        # write is always called, even for HEAD (it discards the body), so
        # that what the handler opened (an engine job) is released by it.
        await response.write(out)
        self._requests += 1
        self._observer.http_response(request.route, response.status)
        await out.end()

    # -- WebSocket ----------------------------------------------------------------------

    async def _upgrade(self, conn: _Connection, head: RequestHead) -> None:
        reject = self._check_upgrade(head)
        if reject is not None:
            self._observer.handshake_rejected(reject.reason)
            origin = head.header("origin")
            log.info(
                "refused a websocket handshake from %s: %s (%d)%s",
                conn.peer,
                reject.message,
                reject.status,
                "" if origin is None else f", origin {origin[:200]!r}",
                extra={
                    "fields": {
                        "peer": conn.peer,
                        "status": reject.status,
                        "reason": reject.reason,
                        "origin": None if origin is None else origin[:200],
                    }
                },
            )
            await self._refuse(conn, reject, head)
        # The request's (empty) body and h11's pause after an upgrade request.
        body = await self._read_body(conn, head)
        if body or conn.h11.next_event() is not h11.PAUSED:
            await self._refuse(
                conn, Reject(400, "a websocket upgrade request carries no body"), head
            )
        trailing, _ = conn.h11.trailing_data
        replay = _ReplayStream(conn.stream, _request_bytes(head) + trailing)
        self._observer.connection_closed("http")
        conn.protocol = "websocket"
        self._websockets += 1
        self._observer.connection_opened("websocket")
        if not any(c.protocol == "http" for c in self._connections):
            self._idle.set()
        try:
            await self._run_websocket(conn, replay, head)
        finally:
            self._websockets -= 1

    def _check_upgrade(self, head: RequestHead) -> Reject | None:
        """RFC 6455's handshake fields (wsproto's checks, so that what passes
        here passes there), then origin, key, draining and capacity."""
        if head.method != "GET" or head.http_version != "1.1":
            return Reject(400, "a websocket upgrade must be an HTTP/1.1 GET request")
        if b"upgrade" not in head.header_tokens(b"connection"):
            return Reject(400, "a websocket upgrade needs 'Connection: Upgrade'")
        if head.header_bytes(b"upgrade").strip().lower() != b"websocket":
            return Reject(400, "a websocket upgrade needs 'Upgrade: websocket'")
        if head.header_bytes(b"sec-websocket-version") != b"13":
            return Reject(
                426,
                "only websocket version 13 is supported",
                headers=(("Sec-WebSocket-Version", "13"),),
            )
        if not _WS_KEY.match(head.header_bytes(b"sec-websocket-key")):
            return Reject(400, "a websocket upgrade needs a valid Sec-WebSocket-Key")
        try:
            head.header_bytes(b"host").decode("idna")
        except UnicodeError:
            return Reject(400, "the Host header is not a valid host name")
        if _has_body(head):
            return Reject(400, "a websocket upgrade request carries no body")
        if self._websocket_handler is None:
            return Reject(404, "this server takes no websocket connections", code="not_found")
        reject = self.policy.check_origin(head) or self.policy.check_key(head, allow_query=True)
        if reject is not None:
            return reject
        if self._draining:
            return Reject(
                503,
                "the server is shutting down",
                "draining",
                (("Retry-After", "1"),),
                code="overloaded",
            )
        if self._admit_websocket is not None:
            return self._admit_websocket(head)
        return None

    async def _run_websocket(
        self, conn: _Connection, replay: _ReplayStream, head: RequestHead
    ) -> None:
        assert self._websocket_handler is not None
        timeout = self.limits.websocket_handshake_timeout
        async with trio.open_nursery() as nursery:
            with trio.move_on_after(timeout) as scope:
                try:
                    request = await accept_stream(
                        nursery, replay, max_message_bytes=self._max_message_bytes
                    )
                    ws = await request.accept()
                except (HandshakeAborted, trio_websocket.ConnectionClosed):
                    # The peer left during the handshake (issue 8, defect 1):
                    # that ends this connection, nothing else.
                    log.info("websocket peer %s left during the handshake", conn.peer)
                    nursery.cancel_scope.cancel()
                    return
            if scope.cancelled_caught:
                log.info("websocket handshake with %s timed out", conn.peer)
                nursery.cancel_scope.cancel()
                return
            try:
                await self._websocket_handler(ws, head)
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(timeout):
                    await ws.aclose()
                nursery.cancel_scope.cancel()


def _has_body(head: RequestHead) -> bool:
    return head.header_bytes(b"content-length", b"0") != b"0" or b"transfer-encoding" in dict(
        head.headers
    )


def _no_route(head: RequestHead, allowed: list[str]) -> Response:
    if not allowed:
        return Response.error(404, f"no route {head.path[:200]!r}", code="not_found")
    return Response.error(
        405,
        f"method {head.method[:20]} is not allowed on {head.path[:200]!r}; "
        f"allowed: {', '.join(allowed)}",
        code="method_not_allowed",
        headers=(("Allow", ", ".join(allowed)),),
    )


def _reason(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


def _request_bytes(head: RequestHead) -> bytes:
    """The request head again, as the client sent it in substance (h11 has
    checked every byte of it), for trio-websocket's own parser."""
    lines = [f"{head.method} {head.target} HTTP/1.1".encode("ascii")]
    lines += [name + b": " + value for name, value in head.headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def serve_front_door(
    front_door: FrontDoor,
    host: str | None,
    port: int,
    *,
    handler_nursery: trio.Nursery | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on ``host:port`` and serve every connection through
    ``front_door`` until cancelled; reports the listeners once bound.

    Connections run in ``handler_nursery`` when given (so that closing the
    listener does not cut them short), else in the listener's own nursery.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    await trio.serve_listeners(
        front_door.handle_connection,
        listeners,
        handler_nursery=handler_nursery,
        task_status=task_status,
    )
