"""A WebSocket client written byte by byte, for hostile tests, the fuzzer and benchmarks.

The ordinary clients (trio-websocket, websockets) refuse to break RFC 6455, and
that is exactly what a hostile client does: this module writes the opening
handshake by hand, builds frames with any opcode, RSV bits, mask and length
(true or not), and parses what the server sends back, close frames included.
It also hangs up in the rudest way TCP allows (a reset, with ``SO_LINGER`` 0).

Nothing here knows the trioserve protocol beyond "text frames hold JSON".
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import struct
from typing import Any

import attrs
import trio

__all__ = [
    "BINARY",
    "CLOSE",
    "CONTINUATION",
    "PING",
    "PONG",
    "TEXT",
    "Frame",
    "FrameParser",
    "Handshake",
    "RawWebSocket",
    "build_frame",
    "close_payload",
    "handshake_request",
    "open_raw_websocket",
    "open_tcp",
    "reset",
]

CONTINUATION = 0x0
TEXT = 0x1
BINARY = 0x2
CLOSE = 0x8
PING = 0x9
PONG = 0xA


def handshake_request(
    host: str,
    port: int,
    *,
    path: str = "/",
    headers: tuple[tuple[str, str], ...] = (),
    key: str | None = None,
) -> bytes:
    """An HTTP/1.1 upgrade request, as a browser or a library would send it."""
    key = key or base64.b64encode(os.urandom(16)).decode()
    lines = [
        f"GET {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
        *(f"{name}: {value}" for name, value in headers),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def build_frame(
    opcode: int,
    payload: bytes = b"",
    *,
    fin: bool = True,
    rsv: int = 0,
    mask: bool = True,
    declared_length: int | None = None,
) -> bytes:
    """One frame, exactly as asked: ``rsv`` is the three RSV bits (0..7);
    ``declared_length`` writes a length other than the payload's (a lie)."""
    length = len(payload) if declared_length is None else declared_length
    head = bytearray([(0x80 if fin else 0) | (rsv & 7) << 4 | (opcode & 0xF)])
    mask_bit = 0x80 if mask else 0
    if length < 126:
        head.append(mask_bit | length)
    elif length < 1 << 16:
        head.append(mask_bit | 126)
        head += struct.pack("!H", length)
    else:
        head.append(mask_bit | 127)
        head += struct.pack("!Q", length)
    if not mask:
        return bytes(head) + payload
    key = os.urandom(4)
    return bytes(head) + key + _xor(payload, key)


def _xor(payload: bytes, key: bytes) -> bytes:
    if not payload:
        return b""
    repeated = (key * (len(payload) // 4 + 1))[: len(payload)]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(repeated, "big")).to_bytes(
        len(payload), "big"
    )


def close_payload(code: int | None, reason: bytes = b"") -> bytes:
    return b"" if code is None else struct.pack("!H", code) + reason


@attrs.frozen
class Frame:
    """A frame from the server (servers never mask)."""

    fin: bool
    rsv: int
    opcode: int
    masked: bool
    payload: bytes

    @property
    def close_code(self) -> int | None:
        """The status code of a close frame (None when it carries none)."""
        if self.opcode != CLOSE or len(self.payload) < 2:
            return None
        code: int = struct.unpack("!H", self.payload[:2])[0]
        return code

    def json(self) -> Any:
        return json.loads(self.payload.decode("utf-8"))


class FrameParser:
    """Incremental parser of the server's frames (no reassembly of fragments:
    the server sends whole messages, and a test wants to see each frame)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames: list[Frame] = []
        while True:
            frame = self._next()
            if frame is None:
                return frames
            frames.append(frame)

    def _next(self) -> Frame | None:
        buf = self._buffer
        if len(buf) < 2:
            return None
        first, second = buf[0], buf[1]
        length = second & 0x7F
        offset = 2
        if length == 126:
            if len(buf) < 4:
                return None
            length = struct.unpack_from("!H", buf, 2)[0]
            offset = 4
        elif length == 127:
            if len(buf) < 10:
                return None
            length = struct.unpack_from("!Q", buf, 2)[0]
            offset = 10
        masked = bool(second & 0x80)
        key = b""
        if masked:
            if len(buf) < offset + 4:
                return None
            key = bytes(buf[offset : offset + 4])
            offset += 4
        if len(buf) < offset + length:
            return None
        payload = bytes(buf[offset : offset + length])
        del buf[: offset + length]
        if masked:
            payload = _xor(payload, key)
        return Frame(
            fin=bool(first & 0x80),
            rsv=(first >> 4) & 7,
            opcode=first & 0xF,
            masked=masked,
            payload=payload,
        )


@attrs.frozen
class Handshake:
    """The server's answer to the opening handshake."""

    status: int
    head: bytes
    #: Bytes received after the head (the first frames, or a reject body).
    rest: bytes


async def open_tcp(host: str, port: int, *, receive_buffer: int | None = None) -> trio.SocketStream:
    """A TCP connection; ``receive_buffer`` sets SO_RCVBUF before connecting
    (a small one makes a client that does not read fill the server's buffers
    sooner)."""
    if receive_buffer is None:
        return await trio.open_tcp_stream(host, port)
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


def reset(stream: trio.SocketStream) -> None:
    """Close with a TCP reset instead of a FIN: the peer's next send fails."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    stream.socket.close()


async def read_handshake(stream: trio.SocketStream, within: float = 30.0) -> Handshake:
    """Read the server's HTTP response head; raise EOFError if it hangs up first."""
    buffer = b""
    with trio.fail_after(within):
        while b"\r\n\r\n" not in buffer:
            data = await stream.receive_some(65536)
            if not data:
                raise EOFError(f"the server hung up during the handshake after {buffer!r}")
            buffer += data
    head, _, rest = buffer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return Handshake(status=status, head=head, rest=rest)


class RawWebSocket:
    """A connection whose frames the test writes itself."""

    def __init__(self, stream: trio.SocketStream, rest: bytes = b"") -> None:
        self.stream = stream
        self.parser = FrameParser()
        self._pending: list[Frame] = self.parser.feed(rest)
        self.eof = False

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send_text(self, text: str | bytes) -> None:
        payload = text.encode("utf-8") if isinstance(text, str) else text
        await self.stream.send_all(build_frame(TEXT, payload))

    async def send_json(self, value: Any) -> None:
        await self.send_text(json.dumps(value))

    async def receive_frame(self, within: float = 30.0) -> Frame | None:
        """The next frame, or None at end of stream (or a reset)."""
        with trio.fail_after(within):
            while not self._pending:
                if self.eof:
                    return None
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    data = b""
                if not data:
                    self.eof = True
                    continue
                self._pending = self.parser.feed(data)
        return self._pending.pop(0)

    async def receive_json(self, within: float = 30.0) -> dict[str, Any]:
        """The next data frame as JSON, answering pings on the way."""
        while True:
            frame = await self.receive_frame(within)
            if frame is None:
                raise EOFError("the server closed the connection")
            if frame.opcode == PING:
                await self.send_raw(build_frame(PONG, frame.payload))
                continue
            if frame.opcode == CLOSE:
                raise EOFError(f"the server closed the connection with {frame.close_code}")
            value = frame.json()
            assert isinstance(value, dict)
            return value

    async def read_to_close(self, within: float = 30.0) -> tuple[list[Frame], Frame | None]:
        """Every frame up to the server's close frame (answered) or the end of
        the stream; the frames before it and the close frame (None if none came)."""
        frames: list[Frame] = []
        with trio.fail_after(within):
            while True:
                frame = await self.receive_frame(within)
                if frame is None:
                    return frames, None
                if frame.opcode == CLOSE:
                    # Answer the close as RFC 6455 asks; the server may be gone.
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        await self.send_raw(build_frame(CLOSE, frame.payload[:2]))
                    return frames, frame
                frames.append(frame)

    async def aclose(self) -> None:
        await self.stream.aclose()


async def open_raw_websocket(
    host: str,
    port: int,
    *,
    headers: tuple[tuple[str, str], ...] = (),
    receive_buffer: int | None = None,
    path: str = "/",
) -> RawWebSocket:
    """Connect and complete the opening handshake by hand (101 expected)."""
    stream = await open_tcp(host, port, receive_buffer=receive_buffer)
    try:
        await stream.send_all(handshake_request(host, port, path=path, headers=headers))
        answer = await read_handshake(stream)
        if answer.status != 101:
            raise ConnectionError(f"handshake refused: {answer.head!r}")
    except BaseException:
        await stream.aclose()
        raise
    return RawWebSocket(stream, answer.rest)
