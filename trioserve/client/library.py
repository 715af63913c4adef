"""A small trio client for the trioserve protocol.

One WebSocket connection carries many requests at once: every request gets a
``request_id`` (``"trioserve-client-<n>"`` unless the caller chooses one) and a
background reader task routes each reply frame to the request that caused it,
so an ``echo`` or a ``stop`` is answered while an ``infer`` streams::

    async with open_client("ws://127.0.0.1:7862") as client:
        async with client.infer("Once upon a time", 40, stream=True) as stream:
            async for message in stream:
                if isinstance(message, InferChunk):
                    print(message.chunk, end="")
        print(stream.final.stop_reason)

``python -m trioserve.client`` is a small interactive chat on top of it
(:mod:`trioserve.client.chat`).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Final, Self, TypeVar

import attrs
import trio
import trio_websocket

from trioserve import protocol as p
from trioserve.errors import TrioserveError

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE",
    "Client",
    "ConnectionClosed",
    "ConnectionFailed",
    "InferStream",
    "RequestIdInUse",
    "ServerError",
    "open_client",
]

logger = logging.getLogger("trioserve.client")

#: Frames up to this size are accepted from the server (an ``info`` or final
#: frame carries the whole prompt in ``util_text``).
DEFAULT_MAX_MESSAGE_SIZE: Final = 16 * 1024 * 1024

_R = TypeVar("_R")


class ServerError(TrioserveError):
    """The server answered a request with an error frame (protocol section 5)."""

    def __init__(self, reply: p.ErrorReply) -> None:
        self.reply = reply
        self.error_type: p.ErrorType = reply.error.type
        self.message = reply.error.message
        self.field = reply.error.field
        self.action = reply.action
        self.echoed = reply.echoed
        where = f" at {self.field}" if self.field else ""
        super().__init__(f"{self.error_type}{where}: {self.message}")


class ConnectionFailed(TrioserveError):
    """The WebSocket connection could not be opened; ``status_code`` is the
    HTTP status when the server rejected the handshake (401: bad or missing
    API key, 403: origin not allowed)."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class ConnectionClosed(TrioserveError):
    """The connection closed while a request waited for its reply, or a
    request was made on a closed connection."""

    def __init__(self, code: int | None = None, reason: str | None = None) -> None:
        detail = f" (code {code}{': ' + reason if reason else ''})" if code is not None else ""
        super().__init__(f"the connection to the server is closed{detail}")
        self.code = code
        self.reason = reason


class RequestIdInUse(TrioserveError):
    """A caller-chosen ``request_id`` belongs to a request still in flight
    (replies are routed by it, so two requests cannot share one)."""


def _route_key(request_id: Any) -> str:
    # Any JSON value may be a request_id; its canonical text is hashable. The
    # server echoes ids unchanged, so the echoed value has the same text.
    return json.dumps(request_id, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


_Routed = p.Reply | p.ProtocolError

_ABSENT: Final[Any] = object()


@attrs.define(eq=False)
class _Route:
    send: trio.MemorySendChannel[_Routed]
    receive: trio.MemoryReceiveChannel[_Routed]
    infer: bool


@attrs.define(eq=False)
class Client:
    """One connection to a trioserve (or ExLlamaV2-protocol) server.

    Make one with :func:`open_client`. Every method may be called from many
    tasks at once; replies are routed by ``request_id``. A method given
    ``request_id=None`` (the default) gets a fresh id; a caller-chosen id must
    not belong to a request still in flight (:class:`RequestIdInUse`).

    Errors: an error frame for a request raises :class:`ServerError`; a
    closed connection raises :class:`ConnectionClosed`; a frame the server
    should never have sent raises :class:`trioserve.protocol.ProtocolError`.
    """

    _ws: trio_websocket.WebSocketConnection
    _routes: dict[str, _Route] = attrs.Factory(dict)
    # Requests whose caller stopped waiting (cancelled): their remaining
    # frames are dropped until the terminal one. Key -> "is an infer".
    _abandoned: dict[str, bool] = attrs.Factory(dict)
    _ids: itertools.count[int] = attrs.Factory(lambda: itertools.count(1))
    _closed: ConnectionClosed | None = None
    # Unbounded, like the routes: the reader must never wait for a slow
    # consumer, or one unread stream would hold up every other request.
    _unrouted_send: trio.MemorySendChannel[dict[str, Any] | p.ProtocolError] = attrs.field(
        init=False
    )
    _unrouted_receive: trio.MemoryReceiveChannel[dict[str, Any] | p.ProtocolError] = attrs.field(
        init=False
    )

    def __attrs_post_init__(self) -> None:
        self._unrouted_send, self._unrouted_receive = trio.open_memory_channel[
            dict[str, Any] | p.ProtocolError
        ](math.inf)

    # -- the reader task ----------------------------------------------------

    async def _read_frames(self) -> None:
        """Route every frame until the connection closes; then wake every
        waiter with :class:`ConnectionClosed`."""
        try:
            while True:
                try:
                    message = await self._ws.get_message()
                except trio_websocket.ConnectionClosed as exc:
                    reason = exc.reason
                    self._closed = ConnectionClosed(
                        getattr(reason, "code", None), getattr(reason, "reason", None)
                    )
                    return
                self._route(message)
        finally:
            if self._closed is None:
                self._closed = ConnectionClosed()
            for route in self._routes.values():
                route.send.close()
            self._unrouted_send.close()

    def _route(self, message: str | bytes) -> None:
        try:
            obj = json.loads(message)
        except ValueError as exc:
            self._unrouted_send.send_nowait(
                p.ProtocolError("invalid_json", f"server sent a frame that is not json: {exc}")
            )
            return
        key = (
            _route_key(obj["request_id"]) if isinstance(obj, dict) and "request_id" in obj else None
        )
        route = self._routes.get(key) if key is not None else None
        if route is not None:
            try:
                item: _Routed = p.structure_reply(obj)
            except p.ProtocolError as exc:
                item = exc
            route.send.send_nowait(item)
        elif key is not None and key in self._abandoned:
            if not self._abandoned[key] or obj.get("response_type") in ("full", "error"):
                del self._abandoned[key]
        else:
            self._unrouted_send.send_nowait(obj)

    # -- plumbing -----------------------------------------------------------

    def _new_id(self, request_id: Any) -> Any:
        return f"trioserve-client-{next(self._ids)}" if request_id is None else request_id

    def _open_route(self, request_id: Any, *, infer: bool) -> tuple[str, _Route]:
        if self._closed is not None:
            raise self._closed
        key = _route_key(request_id)
        if key in self._routes or key in self._abandoned:
            raise RequestIdInUse(f"request_id {request_id!r} belongs to a request still in flight")
        send, receive = trio.open_memory_channel[_Routed](math.inf)
        route = _Route(send, receive, infer)
        self._routes[key] = route
        return key, route

    def _close_route(self, key: str, *, finished: bool) -> None:
        route = self._routes.pop(key, None)
        if route is None:
            return
        route.send.close()
        if not finished and self._closed is None:
            self._abandoned[key] = route.infer

    async def _send_text(self, text: str) -> None:
        if self._closed is not None:
            raise self._closed
        try:
            await self._ws.send_message(text)
        except trio_websocket.ConnectionClosed as exc:
            reason = exc.reason
            raise ConnectionClosed(
                getattr(reason, "code", None), getattr(reason, "reason", None)
            ) from None

    async def _next(self, route: _Route) -> p.Reply:
        try:
            item = await route.receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._closed or ConnectionClosed() from None
        if isinstance(item, p.ProtocolError):
            raise item
        if isinstance(item, p.ErrorReply):
            raise ServerError(item)
        return item

    async def _call(self, action: str, request_id: Any, fields: dict[str, Any]) -> p.Reply:
        request_id = self._new_id(request_id)
        key, route = self._open_route(request_id, infer=False)
        finished = False
        try:
            frame = {"action": action, "request_id": request_id, **fields}
            await self._send_text(_dumps(frame))
            try:
                reply = await self._next(route)
            except (ServerError, p.ProtocolError):
                finished = True
                raise
            finished = True
            return reply
        finally:
            self._close_route(key, finished=finished)

    @staticmethod
    def _expect(reply: p.Reply, cls: type[_R]) -> _R:
        if not isinstance(reply, cls):
            raise p.ProtocolError(
                "invalid_request",
                f"expected a {cls.__name__} reply, got {type(reply).__name__}",
                echoed=reply.echoed,
            )
        return reply

    # -- the actions --------------------------------------------------------

    async def echo(self, *, request_id: Any = None) -> p.EchoReply:
        """Round trip an ``echo``: a ping that also shows the connection routes.

        Cancellation: safe; a late reply is dropped.
        """
        return self._expect(await self._call("echo", request_id, {}), p.EchoReply)

    async def estimate_token(self, text: str, *, request_id: Any = None) -> int:
        """How many tokens ``text`` encodes to (no BOS; special-token strings
        count as one token each).

        Cancellation: safe; a late reply is dropped.
        """
        reply = await self._call("estimate_token", request_id, {"text": text})
        return self._expect(reply, p.EstimateTokenReply).num_tokens

    async def lefttrim_token(
        self, text: str, trimmed_length: int, *, request_id: Any = None
    ) -> str:
        """The last ``trimmed_length`` tokens of ``text`` as text (``text``
        itself when it is no longer; ``""`` for 0).

        Cancellation: safe; a late reply is dropped.
        """
        reply = await self._call(
            "lefttrim_token", request_id, {"text": text, "trimmed_length": trimmed_length}
        )
        return self._expect(reply, p.LefttrimTokenReply).trimmed_text

    async def info(self, *, request_id: Any = None) -> p.InfoReply:
        """The server's name and version, the model and the limits.

        Cancellation: safe; a late reply is dropped.
        """
        return self._expect(await self._call("info", request_id, {}), p.InfoReply)

    async def stop(self, target: Any = _ABSENT, *, request_id: Any = None) -> int:
        """Stop this connection's infers: all of them, or with ``target``
        only the one(s) whose ``request_id`` equals it. Returns how many
        stopped. Their final frames (``stop_reason`` ``"interrupted"``) arrive
        before this returns.

        Cancellation: the stop frame may already have been sent; if so the
        server still stops the infers.
        """
        fields = {} if target is _ABSENT else {"target": target}
        return self._expect(await self._call("stop", request_id, fields), p.StopReply).stopped

    def infer(
        self, text: str, max_new_tokens: int, *, request_id: Any = None, **fields: Any
    ) -> InferStream:
        """Start an ``infer``; returns an :class:`InferStream` that yields its
        frames. Nothing is sent until the stream is entered or iterated.

        ``fields`` are the wire fields of protocol section 3.4 under their
        wire names (``stream``, ``stream_full``, ``top_k``, ..., ``customBos``,
        ``stop_conditions``, ``bann_bann``, ``token_healing``, ``tag``,
        ``seed``); they are sent as given, and the server is the judge of
        them (a bad one raises :class:`ServerError` from the stream).
        """
        request_id = self._new_id(request_id)
        frame = {
            "action": "infer",
            "request_id": request_id,
            "text": text,
            "max_new_tokens": max_new_tokens,
            **fields,
        }
        return InferStream(self, request_id, frame)

    async def generate(
        self, text: str, max_new_tokens: int, *, request_id: Any = None, **fields: Any
    ) -> p.InferFinal:
        """Run an ``infer`` to its end and return its final frame (any chunk
        frames are read and dropped; ``response`` holds the whole text).

        Cancellation: stops waiting, not the job; see :class:`InferStream`.
        """
        async with self.infer(text, max_new_tokens, request_id=request_id, **fields) as stream:
            return await stream.result()

    async def send_raw(self, frame: str | bytes | dict[str, Any]) -> None:
        """Send one frame as is (a dict is encoded as JSON; bytes go as a
        binary frame). Its replies arrive through :meth:`next_unrouted`
        unless it carries the ``request_id`` of a request in flight."""
        if isinstance(frame, dict):
            frame = _dumps(frame)
        if isinstance(frame, bytes):
            if self._closed is not None:
                raise self._closed
            try:
                await self._ws.send_message(frame)
            except trio_websocket.ConnectionClosed:
                raise self._closed or ConnectionClosed() from None
        else:
            await self._send_text(frame)

    async def next_unrouted(self) -> dict[str, Any]:
        """The next frame that matched no request in flight (no
        ``request_id``, or an unknown one), as a JSON object.

        Raises :class:`ConnectionClosed` once the connection is closed and
        every such frame was read, or ProtocolError for a frame that was not
        JSON.
        """
        try:
            item = await self._unrouted_receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._closed or ConnectionClosed() from None
        if isinstance(item, p.ProtocolError):
            raise item
        return item

    @property
    def closed(self) -> bool:
        """Whether the connection is closed (replies can no longer arrive)."""
        return self._closed is not None


@attrs.define(eq=False)
class InferStream:
    """The frames of one ``infer``: an async iterator of
    :class:`~trioserve.protocol.InferChunk` frames and then the
    :class:`~trioserve.protocol.InferFinal`, after which it stops. An error
    frame raises :class:`ServerError` instead.

    Use it as an async context manager (``async with client.infer(...) as
    s``), which sends the request on entry and lets go of its frames on exit,
    or call :meth:`result`.

    Cancellation: cancelling an iteration (or leaving the ``async with``
    early) stops *waiting* for the job, not the job: the server keeps
    generating, and the client drops the job's remaining frames. To end the
    job itself, call ``await client.stop(target=stream.request_id)``.
    """

    _client: Client
    #: The request's ``request_id``; the ``target`` that stops it.
    request_id: Any
    _frame: dict[str, Any]
    _key: str | None = None
    _route: _Route | None = None
    _final: p.InferFinal | None = None
    _error: BaseException | None = None

    async def start(self) -> None:
        """Send the request (once; iterating and entering call this)."""
        if self._route is not None or self._final is not None or self._error is not None:
            return
        key, route = self._client._open_route(self.request_id, infer=True)
        self._key, self._route = key, route
        try:
            await self._client._send_text(_dumps(self._frame))
        except BaseException:
            self._client._close_route(key, finished=False)
            raise

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._release(finished=self.done)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> p.InferChunk | p.InferFinal:
        if self._final is not None or self._error is not None:
            raise StopAsyncIteration
        await self.start()
        assert self._route is not None
        try:
            reply = await self._client._next(self._route)
        except (ServerError, ConnectionClosed, p.ProtocolError) as exc:
            self._error = exc
            self._release(finished=True)
            raise
        if isinstance(reply, p.InferFinal):
            self._final = reply
            self._release(finished=True)
            return reply
        if isinstance(reply, p.InferChunk):
            return reply
        error = p.ProtocolError(
            "invalid_request",
            f"expected an infer frame, got {type(reply).__name__}",
            echoed=reply.echoed,
        )
        self._error = error
        self._release(finished=True)
        raise error

    async def result(self) -> p.InferFinal:
        """Read the remaining frames and return the final one (raising
        :class:`ServerError` if the request failed)."""
        async for _ in self:
            pass
        if self._error is not None:
            raise self._error
        assert self._final is not None
        return self._final

    @property
    def done(self) -> bool:
        """Whether the terminal frame (final or error) was read."""
        return self._final is not None or self._error is not None

    @property
    def final(self) -> p.InferFinal:
        """The final frame; only after the stream ended without error."""
        if self._final is None:
            raise RuntimeError("the infer has not ended yet (or it ended with an error)")
        return self._final

    def _release(self, *, finished: bool) -> None:
        if self._key is not None:
            self._client._close_route(self._key, finished=finished)
            self._key = None


def _dumps(frame: dict[str, Any]) -> str:
    return json.dumps(frame, ensure_ascii=False, separators=(",", ":"))


def leaf_error(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception of a group of one (nested groups of one unwrapped)."""
    inner: BaseException = group
    while isinstance(inner, BaseExceptionGroup):
        if len(inner.exceptions) != 1:
            return None
        inner = inner.exceptions[0]
    return inner


@asynccontextmanager
async def open_client(
    url: str,
    *,
    api_key: str | None = None,
    origin: str | None = None,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    connect_timeout: float = 60.0,
) -> AsyncIterator[Client]:
    """Connect to ``url`` (``ws://host:port``) and yield a :class:`Client`.

    ``api_key`` goes in an ``Authorization: Bearer`` header; ``origin`` in an
    ``Origin`` header (a browser would send one; tests use it to check the
    server's origin rule). A rejected or failed handshake raises
    :class:`ConnectionFailed`.

    Resource handling: a reader task runs in a nursery of its own for the
    life of the block; on exit it is cancelled and the connection closed.
    Exceptions from the block come out as they were raised, not wrapped in
    an exception group (the reader task never raises).

    Cancellation: cancelling the block closes the connection, which makes
    the server cancel every request of this connection.
    """
    headers: list[tuple[bytes, bytes]] = []
    if api_key is not None:
        headers.append((b"Authorization", f"Bearer {api_key}".encode()))
    if origin is not None:
        headers.append((b"Origin", origin.encode()))
    connected = False
    try:
        async with trio_websocket.open_websocket_url(
            url,
            extra_headers=headers,
            max_message_size=max_message_size,
            connect_timeout=connect_timeout,
        ) as ws:
            connected = True
            try:
                async with trio.open_nursery() as nursery:
                    client = Client(ws)
                    nursery.start_soon(client._read_frames)
                    try:
                        yield client
                    finally:
                        nursery.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                leaf = leaf_error(group)
                if leaf is None:
                    raise
                raise leaf from None
    except trio_websocket.ConnectionRejected as exc:
        if connected:
            raise
        raise ConnectionFailed(
            f"the server rejected the handshake with http status {exc.status_code}",
            exc.status_code,
        ) from None
    except (trio_websocket.HandshakeError, OSError) as exc:
        if connected:
            raise
        raise ConnectionFailed(f"cannot connect to {url!r}: {exc!r}") from exc
