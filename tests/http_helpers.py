"""Helpers for tests of the HTTP front door: a raw HTTP/1.1 client (h11 as
the client's parser, bytes sent as given) and a front door on a loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h11
import trio

from trioserve.server.front_door import FrontDoor, serve_front_door


@attrs.frozen
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        import json

        return json.loads(self.body)


class RawClient:
    """Sends bytes as they are (malformed ones too) and parses what comes
    back. ``response(method)`` reads the next response to a request of that
    method, or returns None when the server closed without one."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._h11 = h11.Connection(h11.CLIENT)

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def response(self, method: str = "GET", *, within: float = 10.0) -> Reply | None:
        conn = self._h11
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        if conn.our_state is not h11.IDLE:
            return None
        # Tell the parser which request the next response answers (the bytes
        # were sent already, as they were).
        conn.send(h11.Request(method=method, target="/", headers=[("Host", "test")]))
        conn.send(h11.EndOfMessage())
        status = 0
        headers: dict[str, str] = {}
        body = b""
        with trio.fail_after(within):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    try:
                        data = await self.stream.receive_some(65536)
                    except trio.BrokenResourceError:
                        data = b""
                    conn.receive_data(bytes(data))
                    continue
                if isinstance(event, h11.InformationalResponse):
                    continue
                if isinstance(event, h11.Response):
                    status = event.status_code
                    headers = {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    return Reply(status, headers, body)
                elif isinstance(event, h11.ConnectionClosed):
                    return None

    async def closed(self, *, within: float = 10.0) -> bool:
        """Whether the server closes the connection (EOF) within ``within``
        seconds, with no further bytes."""
        with trio.move_on_after(within):
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    return True
                if not data:
                    return True
                if not data.strip():
                    continue
                return False
        return False


def request(
    method: str = "GET",
    path: str = "/health",
    headers: dict[str, str] | None = None,
    body: bytes = b"",
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test"]
    all_headers = dict(headers or {})
    if body and "Content-Length" not in all_headers and "Transfer-Encoding" not in all_headers:
        all_headers["Content-Length"] = str(len(body))
    lines += [f"{k}: {v}" for k, v in all_headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@asynccontextmanager
async def running(door: FrontDoor) -> AsyncIterator[int]:
    """``door`` listening on a loopback port (yielded), stopped at exit."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(serve_front_door, door, "127.0.0.1", 0)
        port = listeners[0].socket.getsockname()[1]
        yield port
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def connect(port: int) -> AsyncIterator[RawClient]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        yield RawClient(stream)


async def get(port: int, path: str = "/health", **kwargs: Any) -> Reply:
    async with connect(port) as client:
        await client.send(request(path=path, **kwargs))
        reply = await client.response(kwargs.get("method", "GET"))
    assert reply is not None
    return reply
