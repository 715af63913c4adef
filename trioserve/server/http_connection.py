"""One HTTP/1.1 connection of the front door: its h11 state and the reading
side (request heads and bodies under their size limits and deadlines), its
bounded writes and its lingering close.

What the client did wrong is raised, not answered: :class:`Refused` carries
the :class:`Reject` the front door answers with before it closes, and
:class:`EndConnection` ends the connection with nothing (more) to say. Routing,
access rules and the responses themselves are :mod:`.front_door`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final
from urllib.parse import urlsplit

import h11
import trio

from .http_types import ClientGone, HTTPLimits, KiB, MiB, Reject, RequestHead

__all__ = [
    "EndConnection",
    "HTTPConnection",
    "Refused",
    "ResponseWriter",
    "has_body",
]

log = logging.getLogger("trioserve.http")

_RECEIVE_SIZE: Final = 64 * KiB
#: At most this much of a client's data is read and discarded while the
#: connection closes (within ``HTTPLimits.linger``), so that a response or a
#: close frame sent before the rest was read is not lost to a TCP reset: a
#: client still sending a frame over the WebSocket limit (the fuzz run sent
#: 6 MB ones) reads its 1009 only after its own send completes. Draining is a
#: few milliseconds per 10 MB on a socket; the linger time bounds it.
_LINGER_BYTES: Final = 64 * MiB


class EndConnection(Exception):
    """End this connection now (its answer, if any, is already sent)."""


class Refused(Exception):
    """The client broke a rule before its request could be routed: answer
    with ``reject`` (when h11's state allows an answer), then close."""

    def __init__(self, reject: Reject) -> None:
        super().__init__(reject.message)
        self.reject = reject


def has_body(head: RequestHead) -> bool:
    """Whether the request announces a body (which must then be read, or the
    connection closed, before the next request)."""
    return head.header_bytes(b"content-length", b"0") != b"0" or b"transfer-encoding" in dict(
        head.headers
    )


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


class HTTPConnection:
    """One HTTP connection's state, and its reading and writing under
    ``limits``."""

    def __init__(self, stream: trio.abc.Stream, limits: HTTPLimits) -> None:
        self.stream = stream
        self.peer = _peer(stream)
        self.limits = limits
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
        self.requests = 0
        #: Set while the connection waits for a request's first byte; drain
        #: cancels it to close idle connections at once.
        self.idle_scope: trio.CancelScope | None = None
        self.protocol = "http"

    # -- reading ------------------------------------------------------------------------

    async def next_request(self, draining: Callable[[], bool]) -> RequestHead:
        """The next request head, under the idle and head deadlines.
        ``draining()`` says whether the door drains (an idle connection then
        closes instead of waiting).

        Raises:
            Refused: the head is malformed, too large or too slow.
            EndConnection: the client closed, or stayed silent.
        """
        limits = self.limits
        now = trio.current_time()
        started = bool(self.h11.trailing_data[0])
        if self.requests == 0 or started:
            deadline = now + limits.head_timeout
        else:
            deadline = now + limits.idle_timeout
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise self._protocol_error(exc) from None
            if isinstance(event, h11.Request):
                # h11 bounds a head that is still incomplete; one that
                # arrived whole in a single read is measured here.
                size = len(event.method) + len(event.target) + 12
                size += sum(len(name) + len(value) + 4 for name, value in event.headers)
                if size > limits.max_head_bytes:
                    raise Refused(Reject(431, "the request head is too large"))
                if event.http_version not in (b"1.0", b"1.1"):
                    raise Refused(Reject(505, "only HTTP/1.0 and HTTP/1.1 are served"))
                return _head_from(event, self.peer)
            if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                raise EndConnection
            if event is not h11.NEED_DATA:  # pragma: no cover - h11 gives nothing else here
                raise EndConnection
            # Between requests a kept-alive connection is idle: drain closes
            # it at once. A new connection's first request is read (and
            # answered: a WebSocket upgrade gets 503 while draining).
            idle = not started and self.requests > 0
            if idle and draining():
                raise EndConnection
            scope = trio.CancelScope(deadline=deadline)
            if idle:
                self.idle_scope = scope
            try:
                with scope:
                    data = await self.receive()
            finally:
                self.idle_scope = None
            if scope.cancelled_caught:
                if not started:
                    raise EndConnection  # no byte of a request came: close quietly
                raise Refused(Reject(408, "the request head took too long to arrive"))
            self.h11.receive_data(data)
            if data and not started:
                started = True
                deadline = trio.current_time() + limits.head_timeout

    async def receive(self) -> bytes:
        """The next bytes from the client; ``b""`` once it is gone."""
        try:
            return bytes(await self.stream.receive_some(_RECEIVE_SIZE))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def read_body(self, head: RequestHead) -> bytes:
        """The body of the request ``head`` began, under the size limit and
        the body deadline.

        Raises:
            Refused: the body is too large, too slow or malformed.
            EndConnection: the client closed.
            ClientGone: the client did not read a ``100 Continue``.
        """
        limits = self.limits
        too_large = Reject(413, f"the request body is larger than {limits.max_body_bytes} bytes")
        length = head.header_bytes(b"content-length")
        if length and int(length) > limits.max_body_bytes:
            # h11 has checked that it is a number.
            raise Refused(too_large)
        if self.h11.they_are_waiting_for_100_continue:
            await self.send(self.h11.send(h11.InformationalResponse(status_code=100, headers=[])))
        deadline = trio.current_time() + limits.body_timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise self._protocol_error(exc) from None
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > limits.max_body_bytes:
                    raise Refused(too_large)
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            elif event is h11.NEED_DATA:
                with trio.move_on_at(deadline) as scope:
                    data = await self.receive()
                if scope.cancelled_caught:
                    raise Refused(Reject(408, "the request body took too long to arrive"))
                self.h11.receive_data(data)
            else:
                raise EndConnection

    def _protocol_error(self, exc: h11.RemoteProtocolError) -> Refused:
        status = exc.error_status_hint if 400 <= exc.error_status_hint < 500 else 400
        message = (
            "the request head is too large"
            if status == 431
            else f"malformed request: {str(exc)[:200]}"
        )
        log.debug("protocol error from %s: %s", self.peer, exc)
        return Refused(Reject(status, message))

    # -- writing and closing ------------------------------------------------------------

    async def send(self, data: bytes | None) -> None:
        """Send ``data`` (h11's output, None for nothing), waiting at most
        ``limits.send_timeout``; :class:`ClientGone` when the client is gone
        or does not read."""
        if not data:
            return
        with trio.move_on_after(self.limits.send_timeout) as scope:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise ClientGone("the client went away") from None
        if scope.cancelled_caught:
            raise ClientGone(f"the client read nothing for {self.limits.send_timeout:g} s")

    async def close(self) -> None:
        """Close after sending: end our side, read and drop what the client
        still sends (boundedly; the caller bounds the time), then close the
        socket."""
        stream = self.stream
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


class ResponseWriter:
    """The :class:`~.http_types.BodyWriter` of one streamed response. The
    status line and headers go out with the first piece of the body, so that
    a ``write`` that fails before it sends anything can still be answered
    with a 500."""

    def __init__(self, conn: HTTPConnection, response: h11.Response, discard: bool) -> None:
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
        await self._conn.send(out)

    async def end(self) -> None:
        await self.send(b"")
        await self._conn.send(self._conn.h11.send(h11.EndOfMessage()))
