"""trio-websocket, with the two RFC 6455 rules its server side misses.

trio-websocket stays the WebSocket layer; this module makes its server side
keep two promises of RFC 6455 that version 0.12 does not:

* the frame-size limit counts bytes: trio-websocket adds up ``len()`` of the
  text fragments, which counts characters, so a limit of 65,536 let a
  261,944-byte frame of emoji through;
* a protocol violation by the peer (invalid UTF-8 in a text frame, a reserved
  opcode or RSV bit, an unmasked frame, a stray continuation) is answered
  with a close frame carrying wsproto's code (1002, or 1007 for invalid
  UTF-8) before the TCP connection is closed, as section 7.1.7 asks;
  trio-websocket dropped the connection without one. A message sent after
  that close frame ends in ``ConnectionClosed``, as after any other close.

Both are overrides of two event handlers of ``WebSocketConnection``; the
tests in ``tests/test_hostile.py`` pin the behaviour, so a trio-websocket
release that renames them fails loudly rather than silently.
"""

from __future__ import annotations

import contextlib

import trio
import wsproto
from trio_websocket import CloseReason, ConnectionClosed, WebSocketConnection, WebSocketRequest
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import CloseConnection, TextMessage
from wsproto.utilities import LocalProtocolError

__all__ = ["HandshakeAborted", "ServerWebSocket", "accept_stream"]


class ServerWebSocket(WebSocketConnection):
    """The server side of one WebSocket connection (see the module docstring)."""

    async def _handle_message_event(
        self, event: wsproto.events.BytesMessage | wsproto.events.TextMessage
    ) -> None:
        if isinstance(event, TextMessage):
            # The base class adds len(event.data) to the running size; add the
            # difference to the UTF-8 size so that the limit counts bytes.
            # (wsproto has already checked the UTF-8; surrogatepass cannot fail.)
            extra = len(event.data.encode("utf-8", "surrogatepass")) - len(event.data)
            self._message_size += extra
        await super()._handle_message_event(event)

    async def _handle_close_connection_event(self, event: CloseConnection) -> None:
        if self._wsproto.state == ConnectionState.OPEN and self._close_reason is None:
            # wsproto reports a frame it could not parse as a CloseConnection
            # event without a close frame from the peer (the state is still
            # OPEN): tell the peer why before the stream is closed.
            # The close reason is set first (as trio-websocket does for a
            # close the peer starts): sending the close frame may wait for a
            # writer that holds the stream, and a writer's next message must
            # then end in ConnectionClosed, not in wsproto's LocalProtocolError
            # for a message after the close frame.
            self._close_reason = CloseReason(event.code, event.reason or None)
            # The peer may be gone already; the stream is closed below anyway.
            with contextlib.suppress(Exception):
                await self._send(CloseConnection(code=event.code, reason=event.reason))
        await super()._handle_close_connection_event(event)

    async def send_message(self, message: str | bytes) -> None:
        """Send one message; :class:`ConnectionClosed` once a close frame has gone
        out, whichever side started the close."""
        try:
            await super().send_message(message)
        except LocalProtocolError:
            if self._wsproto.state == ConnectionState.OPEN:
                raise
            raise ConnectionClosed(
                self._close_reason or CloseReason(1006, "the connection is closing")
            ) from None


class HandshakeAborted(Exception):
    """The peer went away (or broke the protocol) before its handshake was complete."""


async def accept_stream(
    nursery: trio.Nursery,
    stream: trio.abc.Stream,
    *,
    max_message_bytes: int,
    message_queue_size: int = 1,
) -> WebSocketRequest:
    """Read a WebSocket handshake from ``stream``: ``wrap_server_stream`` for
    :class:`ServerWebSocket`. The connection's reader runs in ``nursery``.

    Raises :class:`HandshakeAborted` when the peer goes away before its
    handshake is complete (trio-websocket's own wrapper then waits forever).
    Callers bound the wait with a timeout: a peer may also just stay silent.
    """
    connection = ServerWebSocket(
        stream,
        WSConnection(ConnectionType.SERVER),
        message_queue_size=message_queue_size,
        max_message_size=max_message_bytes,
    )
    reader_done = trio.Event()

    async def read() -> None:
        try:
            await connection._reader_task()
        finally:
            reader_done.set()

    nursery.start_soon(read)
    request: WebSocketRequest | None = None
    async with trio.open_nursery() as race:

        async def get_request() -> None:
            nonlocal request
            request = await connection._get_request()
            race.cancel_scope.cancel()

        async def reader_ended() -> None:
            await reader_done.wait()
            race.cancel_scope.cancel()

        race.start_soon(get_request)
        race.start_soon(reader_ended)
    if request is None:
        raise HandshakeAborted("the peer went away during the handshake")
    return request
