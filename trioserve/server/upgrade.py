"""The WebSocket upgrade of the front door: whether a request head may
become a WebSocket connection, and running one that may.

:func:`check_upgrade` is pure: RFC 6455's handshake fields, then the access
policy and the door's state, in the order a refusal is reported.
:func:`run_websocket` hands the connection to trio-websocket (through
:mod:`.websocket`) over a stream that replays the request head already read,
bounds the handshake, and runs the handler on the accepted connection.
"""

from __future__ import annotations

import logging
import re
from typing import Final

import trio
import trio_websocket

from .http_connection import has_body
from .http_types import AccessPolicy, Reject, RequestHead, WebSocketHandler
from .websocket import HandshakeAborted, accept_stream

__all__ = ["check_upgrade", "run_websocket"]

log = logging.getLogger("trioserve.http")

_WS_KEY: Final = re.compile(rb"^[A-Za-z0-9+/]{22}==$")


def check_upgrade(
    head: RequestHead, policy: AccessPolicy, *, accepting: bool, draining: bool
) -> Reject | None:
    """Why the upgrade request ``head`` is refused, or None: RFC 6455's
    handshake fields (wsproto's checks, so that what passes here passes
    there), then whether the door takes WebSocket connections at all
    (``accepting``), origin, key and draining."""
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
    if has_body(head):
        return Reject(400, "a websocket upgrade request carries no body")
    if not accepting:
        return Reject(404, "this server takes no websocket connections", code="not_found")
    reject = policy.check_origin(head) or policy.check_key(head, allow_query=True)
    if reject is not None:
        return reject
    if draining:
        return Reject(
            503,
            "the server is shutting down",
            "draining",
            (("Retry-After", "1"),),
            code="overloaded",
        )
    return None


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


def _request_bytes(head: RequestHead) -> bytes:
    """The request head again, as the client sent it in substance (h11 has
    checked every byte of it), for trio-websocket's own parser."""
    lines = [f"{head.method} {head.target} HTTP/1.1".encode("ascii")]
    lines += [name + b": " + value for name, value in head.headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def run_websocket(
    stream: trio.abc.Stream,
    head: RequestHead,
    trailing: bytes,
    handler: WebSocketHandler,
    *,
    peer: str,
    handshake_timeout: float,
    max_message_bytes: int,
) -> None:
    """Complete the handshake of the accepted upgrade ``head`` on ``stream``
    (``trailing``: what the client sent after the head, already read) and
    run ``handler`` on the connection until it ends.

    A peer that leaves during the handshake, or does not complete it within
    ``handshake_timeout``, ends this connection only (logged).

    Resource handling: the WebSocket is closed (within ``handshake_timeout``,
    shielded) when the handler returns or raises; the caller closes ``stream``.
    """
    replay = _ReplayStream(stream, _request_bytes(head) + trailing)
    async with trio.open_nursery() as nursery:
        with trio.move_on_after(handshake_timeout) as scope:
            try:
                request = await accept_stream(nursery, replay, max_message_bytes=max_message_bytes)
                ws = await request.accept()
            except (HandshakeAborted, trio_websocket.ConnectionClosed):
                # The peer left during the handshake (it used to crash the server):
                # that ends this connection, nothing else.
                log.info("websocket peer %s left during the handshake", peer)
                nursery.cancel_scope.cancel()
                return
        if scope.cancelled_caught:
            log.info("websocket handshake with %s timed out", peer)
            nursery.cancel_scope.cancel()
            return
        try:
            await handler(ws, head)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(handshake_timeout):
                await ws.aclose()
            nursery.cancel_scope.cancel()
