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
composes a :class:`FrontDoor` from its routes and callbacks. One connection's
reading and writing under the limits is :mod:`.http_connection`'s; the
upgrade's checks and the handover to trio-websocket are :mod:`.upgrade`'s.
"""

from __future__ import annotations

import contextlib
import email.utils
import http
import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

import attrs
import h11
import trio

from trioserve._version import __version__

from .http_connection import EndConnection, HTTPConnection, Refused, ResponseWriter, has_body
from .http_types import (
    AccessPolicy,
    ClientGone,
    ErrorBody,
    FrontDoorStatistics,
    Handler,
    HTTPError,
    HTTPLimits,
    HTTPRequest,
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
from .upgrade import check_upgrade, run_websocket

__all__ = ["FrontDoor", "serve_front_door"]

log = logging.getLogger("trioserve.http")

_TOKEN: Final = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


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
        error_body: ErrorBody | None = None,
    ) -> None:
        self.router = router
        self.policy = policy
        self.limits = limits
        self._websocket_handler = websocket_handler
        self._admit_websocket = admit_websocket
        self._observer: Observer = observer if observer is not None else NoObserver()
        self._max_message_bytes = max_message_bytes
        self._error_body = error_body
        self._connections: set[HTTPConnection] = set()
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
        conn = HTTPConnection(stream, self.limits)
        over_capacity = (
            self.limits.max_connections is not None
            and len(self._connections) >= self.limits.max_connections
        )
        self._connections.add(conn)
        self._observer.connection_opened("http")
        # Whether closing lingers (see HTTPLimits.linger); not when cancelled,
        # which closes the connection at once.
        linger = True
        try:
            await self._serve(conn, over_capacity)
        except EndConnection:
            pass
        except BaseException as exc:
            if _must_propagate(exc):
                linger = False
                raise
            self._errors += 1
            log.error("connection from %s failed", conn.peer, exc_info=exc)
        finally:
            self._connections.discard(conn)
            self._observer.connection_closed(conn.protocol)
            if not any(c.protocol == "http" for c in self._connections):
                self._idle.set()
            if linger:
                with trio.CancelScope(shield=True), trio.move_on_after(self.limits.linger):
                    await conn.close()
            await trio.aclose_forcefully(stream)

    async def _serve(self, conn: HTTPConnection, over_capacity: bool) -> None:
        head: RequestHead | None = None
        try:
            while True:
                head = None
                head = await conn.next_request(lambda: self._draining)
                conn.requests += 1
                if over_capacity:
                    if b"websocket" in head.header_tokens(b"upgrade"):
                        self._observer.handshake_rejected("capacity")
                    await self._refuse(conn, _TOO_MANY, head)
                if b"websocket" in head.header_tokens(b"upgrade"):
                    await self._upgrade(conn, head)
                    return
                await self._serve_request(conn, head)
                if conn.h11.our_state is h11.MUST_CLOSE or conn.h11.their_state is h11.MUST_CLOSE:
                    raise EndConnection
                try:
                    conn.h11.start_next_cycle()
                except h11.LocalProtocolError:
                    raise EndConnection from None
        except Refused as refused:
            # What the client broke while its request was read (the head, when
            # it was whole, names the API whose error shape answers).
            await self._refuse(conn, refused.reject, head)

    # -- answering ----------------------------------------------------------------------

    def _headers(
        self, head: RequestHead | None, extra: Iterable[tuple[str, str]], content_type: str | None
    ) -> list[tuple[bytes, bytes]]:
        base = [(b"server", self._server_header), (b"date", self._date.get())]
        return _response_headers(base, self.policy, head, extra, content_type)

    def _error(self, head: RequestHead | None, status: int, message: str, **kw: Any) -> Response:
        """An error the door answers itself, in the shape of the API the
        request's path belongs to (``error_body``), else the server's."""
        response = Response.error(status, message, **kw)
        if head is not None and self._error_body is not None:
            body = self._error_body(head, status, message)
            if body is not None:
                response = attrs.evolve(response, body=body)
        return response

    def _closing(self, conn: HTTPConnection) -> bool:
        return self._draining or conn.requests >= self.limits.max_requests_per_connection

    async def _respond(
        self, conn: HTTPConnection, head: RequestHead | None, response: Response, route: str
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
        await conn.send(data)

    async def _refuse(
        self, conn: HTTPConnection, reject: Reject, head: RequestHead | None = None
    ) -> None:
        """Answer with an error (when the state allows one) and close."""
        self._errors += 1
        if conn.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            response = self._error(
                head,
                reject.status,
                reject.message,
                code=reject.code,
                headers=(("Connection", "close"), *reject.headers),
            )
            with contextlib.suppress(ClientGone, h11.LocalProtocolError):
                await self._respond(conn, head, response, "none")
        raise EndConnection

    # -- one HTTP request -----------------------------------------------------------------

    async def _serve_request(self, conn: HTTPConnection, head: RequestHead) -> None:
        reject = self.policy.check_origin(head)
        if reject is not None:
            await self._refuse(conn, reject, head)
        if head.method == "OPTIONS":
            await conn.read_body(head)
            preflight = _preflight(head, self.router.methods(head.path))
            await self._respond(conn, head, preflight, "preflight")
            return
        # The key and the route are checked before the body is read: a
        # client without the key cannot make the server read megabytes.
        response: Response | None = None
        reject = self.policy.check_key(head)
        found = self.router.match(head.method, head.path)
        if reject is not None:
            response = self._error(
                head, reject.status, reject.message, code=reject.code, headers=reject.headers
            )
        elif isinstance(found, list):
            response = _no_route(head, found, self._error)
        if response is not None:
            if has_body(head):
                # Unread, the body would be taken for the next request.
                response = attrs.evolve(
                    response, headers=(*response.headers, ("Connection", "close"))
                )
                await self._respond(conn, head, response, "unmatched")
                raise EndConnection
            await conn.read_body(head)
            await self._respond(conn, head, response, "unmatched")
            return
        assert not isinstance(found, list)
        route, params = found
        body = await conn.read_body(head)
        request = HTTPRequest(head=head, body=body, route=route.pattern, params=params)
        await self._run_handler(conn, request, route.handler)

    async def _run_handler(
        self, conn: HTTPConnection, request: HTTPRequest, handler: Handler
    ) -> None:
        """Run ``handler`` while watching for the client to go away, and send
        what it returns; raise :class:`EndConnection` when the connection must end."""
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
                data = await conn.receive()
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
            raise EndConnection
        if not complete:
            raise EndConnection

    async def _answer(
        self, conn: HTTPConnection, request: HTTPRequest, handler: Handler, scope: trio.CancelScope
    ) -> bool:
        """Run the handler and send its response; False when the response
        could not be completed (the connection must close)."""
        writer: list[ResponseWriter] = []
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
            if isinstance(exc, ExceptionGroup) and exc.split(ClientGone)[1] is None:
                # A handler that writes from a nursery of its own (a stream
                # that follows its generation meanwhile) sees a client that
                # leaves as a group of ClientGone: the client left, no bug.
                raise ClientGone("the client went away") from None
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
            response = self._error(request.head, 500, "internal error", code="internal")
            await self._respond(conn, request.head, response, request.route)
            return True
        return False  # cancelled: the client left (the caller closes)

    async def _stream(
        self,
        conn: HTTPConnection,
        request: HTTPRequest,
        response: StreamingResponse,
        writer: list[ResponseWriter],
    ) -> None:
        headers = self._headers(request.head, response.headers, response.content_type)
        if self._closing(conn):
            headers.append((b"connection", b"close"))
        event = h11.Response(
            status_code=response.status, headers=headers, reason=_reason(response.status)
        )
        out = ResponseWriter(conn, event, discard=request.method == "HEAD")
        writer.append(out)
        # write is always called, even for HEAD (it discards the body), so
        # that what the handler opened (an engine job) is released by it.
        await response.write(out)
        self._requests += 1
        self._observer.http_response(request.route, response.status)
        await out.end()

    # -- WebSocket ----------------------------------------------------------------------

    async def _upgrade(self, conn: HTTPConnection, head: RequestHead) -> None:
        reject = check_upgrade(
            head,
            self.policy,
            accepting=self._websocket_handler is not None,
            draining=self._draining,
        )
        if reject is None and self._admit_websocket is not None:
            reject = self._admit_websocket(head)
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
        assert self._websocket_handler is not None
        # The request's (empty) body and h11's pause after an upgrade request.
        body = await conn.read_body(head)
        if body or conn.h11.next_event() is not h11.PAUSED:
            await self._refuse(
                conn, Reject(400, "a websocket upgrade request carries no body"), head
            )
        trailing, _ = conn.h11.trailing_data
        self._observer.connection_closed("http")
        conn.protocol = "websocket"
        self._websockets += 1
        self._observer.connection_opened("websocket")
        if not any(c.protocol == "http" for c in self._connections):
            self._idle.set()
        try:
            await run_websocket(
                conn.stream,
                head,
                trailing,
                self._websocket_handler,
                peer=conn.peer,
                handshake_timeout=self.limits.websocket_handshake_timeout,
                max_message_bytes=self._max_message_bytes,
            )
        finally:
            self._websockets -= 1


def _response_headers(
    base: list[tuple[bytes, bytes]],
    policy: AccessPolicy,
    head: RequestHead | None,
    extra: Iterable[tuple[str, str]],
    content_type: str | None,
) -> list[tuple[bytes, bytes]]:
    """A response's headers: ``base`` (Server, Date), its content type, the
    CORS headers when ``head`` comes from an origin ``policy`` allows, and
    ``extra``."""
    headers = list(base)
    if content_type is not None:
        headers.append((b"content-type", content_type.encode("latin-1")))
    if head is not None:
        origin = head.header("origin")
        if origin is not None and policy.origin_allowed(origin):
            headers += [
                (b"access-control-allow-origin", origin.encode("latin-1")),
                (b"access-control-expose-headers", b"retry-after"),
                (b"vary", b"origin"),
            ]
    headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in extra]
    return headers


def _preflight(head: RequestHead, methods: list[str]) -> Response:
    """The answer to a CORS preflight (an ``OPTIONS`` request) for a path
    whose routes take ``methods``; the origin is already allowed."""
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


def _no_route(head: RequestHead, allowed: list[str], error: Callable[..., Response]) -> Response:
    if not allowed:
        return error(head, 404, f"no route {head.path[:200]!r}", code="not_found")
    return error(
        head,
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
    try:
        await trio.serve_listeners(
            front_door.handle_connection,
            listeners,
            handler_nursery=handler_nursery,
            task_status=task_status,
        )
    finally:
        # trio.serve_listeners leaves its listeners open: the kernel would go
        # on accepting connections that nobody serves, and a client would
        # hang instead of being refused (found by the state machine's drain).
        with trio.CancelScope(shield=True):
            for listener in listeners:
                await listener.aclose()
