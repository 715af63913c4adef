"""One WebSocket client: its socket I/O, its requests, and their frames.

A :class:`Connection` runs three tasks and one task per ``infer``::

    connection nursery
    ├── reader      frames -> decode/validate -> dispatch; never waits on output
    ├── writer      the only caller of ws.send_message; composes chunk frames
    │               when it can send them, so a slow reader gets fewer, larger ones
    ├── keepalive   pings; closes a peer that stops answering
    └── infer task  (one per infer, in its own cancel scope) runs a Generation

Output goes through an :class:`Outbox` that is bounded by bytes, not frames.
Putting a frame never waits: a client that does not read makes its own
output grow until the limit closes its connection (1008), never the
generation task, another client, or this connection's reader (which keeps
reading, so pongs keep being processed). Streamed text is not queued as
frames at all: an infer marks itself as having text to send, and the writer
builds one chunk frame from everything new when it gets there.

Every task has an exception boundary: whatever escapes a request ends that
request with an ``internal`` error frame; whatever escapes the connection
closes it with 1011. Nothing reaches the server or another connection.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from trioserve import protocol as p
from trioserve.generation import InvalidGeneration, Overloaded
from trioserve.metrics import Metrics

from . import access
from .doors import from_infer, infer_error
from .infer import InferEntry
from .models import ModelError, Models
from .served import ServedModel

__all__ = [
    "Connection",
    "ConnectionServices",
    "ConnectionSettings",
    "Outbox",
    "OutboxOverflow",
]

log = logging.getLogger("trioserve.server")


def is_cancellation(exc: BaseException) -> bool:
    """Exceptions that must propagate through every exception boundary."""
    if isinstance(exc, BaseExceptionGroup):
        return any(is_cancellation(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled | KeyboardInterrupt | SystemExit | GeneratorExit)


def split_cancellation(exc: BaseException) -> tuple[BaseException | None, BaseException | None]:
    """``(what must propagate, what the boundary handles)`` of an exception."""
    if isinstance(exc, BaseExceptionGroup):
        fatal, rest = exc.split(is_cancellation)
        return fatal, rest
    return (exc, None) if is_cancellation(exc) else (None, exc)


def short_repr(value: Any, limit: int = 80) -> str:
    """A log-safe rendering of a client value (ids can be any JSON)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class OutboxOverflow(Exception):
    """The client's unsent output passed the connection's byte limit."""


class Outbox:
    """Frames waiting for the writer, bounded by their bytes.

    Items are encoded frames, or an :class:`InferEntry` standing for "the
    chunk frame of this request, built when written". ``put`` never waits;
    it raises :class:`OutboxOverflow` past ``max_bytes``.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: collections.deque[str | InferEntry] = collections.deque()
        self._ready = trio.Event()
        self.closed = False

    def put(self, item: str | InferEntry) -> None:
        if self.closed:
            return
        if isinstance(item, str):
            # A frame's size in bytes is at least its length in characters; the
            # exact UTF-8 size is not worth a second encoding here.
            self.bytes += len(item)
            if self.bytes > self.max_bytes:
                raise OutboxOverflow(
                    f"more than {self.max_bytes} bytes of output are waiting for this client"
                )
        self._items.append(item)
        self._ready.set()

    async def get(self) -> str | InferEntry:
        """The next item; raises ``trio.EndOfChannel`` once closed and empty."""
        while not self._items:
            if self.closed:
                raise trio.EndOfChannel
            self._ready = trio.Event()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, str):
            self.bytes -= len(item)
        return item

    def close(self) -> None:
        """Take no more items; what is queued is still handed out."""
        self.closed = True
        self._ready.set()

    def discard(self) -> None:
        """Close and drop what is queued (the client will not get it)."""
        self.close()
        self._items.clear()
        self.bytes = 0


@attrs.frozen(kw_only=True)
class ConnectionSettings:
    """A connection's limits and timers (``ServerConfig``'s, resolved)."""

    max_message_bytes: int
    max_requests: int
    max_output_bytes: int
    send_timeout: float
    close_timeout: float
    ping_interval: float
    ping_timeout: float
    log_prompts: bool = False


@attrs.frozen(kw_only=True)
class ConnectionServices:
    """What a connection needs of its server, and nothing more."""

    models: Models
    metrics: Metrics
    settings: ConnectionSettings
    #: The ``info`` reply with these echoed ids (the server's live status).
    info_reply: Callable[[Mapping[str, Any]], p.InfoReply]


class Connection:
    """One client: a reader, a writer, a keepalive and its infer tasks.

    ``client`` is who the connection belongs to (its API key, else its
    address): its generations count against that client's limits, shared
    with the client's other connections and HTTP requests.
    """

    def __init__(
        self, services: ConnectionServices, ws: WebSocketConnection, peer: str, client: Hashable
    ) -> None:
        self.services = services
        self.settings = services.settings
        self.ws = ws
        self.peer = peer
        self.client = client
        self.requests: set[InferEntry] = set()
        #: Infers waiting for their model to load, by the scope that ends the wait.
        self._loading: dict[trio.CancelScope, p.InferRequest] = {}
        self.outbox = Outbox(services.settings.max_output_bytes)
        self.access = access.ConnectionLog(services.metrics, peer, self.settings.log_prompts)
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._writer_done = trio.Event()
        #: Set once a wind-down (see _wind_down) has sent its close frame.
        self._wound_down: trio.Event | None = None
        #: trio.current_time() when the frame being written started, or None.
        self._sending_since: float | None = None
        #: The close code and reason this side chose, if it closed the connection.
        self.close_code: int | None = None

    # -- lifecycle ----------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._guard, self._writer, "writer")
                nursery.start_soon(self._guard, self._keepalive, "keepalive")
                nursery.start_soon(self._guard, self._send_watchdog, "send watchdog")
                await self._reader()
                if self._wound_down is not None:
                    # The reader stopped because the connection is being wound
                    # down: let the close frame go out first.
                    await self._wound_down.wait()
                nursery.cancel_scope.cancel()
        finally:
            # Disconnect: every infer of this connection was cancelled with the
            # nursery, and each freed its engine job in its own finally.
            self.requests.clear()
            self.outbox.close()

    async def _guard(self, fn: Callable[[], Any], name: str) -> None:
        """An exception boundary for one of the connection's own tasks."""
        try:
            await fn()
        except BaseException as exc:
            fatal, rest = split_cancellation(exc)
            if rest is not None:
                log.error("connection %s: %s failed", self.peer, name, exc_info=rest)
                await self._abort(1011, "internal error")
            if fatal is not None:
                raise fatal from None

    def interrupt_all(self) -> None:
        for entry in self.requests:
            if not entry.generation.decided:
                entry.cancel_cause = "shutdown"
                entry.scope.cancel()

    async def wait_requests_done(self) -> None:
        for entry in list(self.requests):
            await entry.done.wait()

    async def close(self, code: int, reason: str) -> None:
        """Send what is queued, then close the WebSocket."""
        self._closing = True
        self.outbox.close()
        with trio.move_on_after(self.settings.close_timeout):
            await self._writer_done.wait()
        await self._close_ws(code, reason)

    async def _close_ws(self, code: int, reason: str) -> None:
        if self.close_code is None:
            self.close_code = code
        # A peer that does not read will not answer the close handshake
        # either; cancelling aclose closes the socket.
        with trio.move_on_after(self.settings.close_timeout):
            await self.ws.aclose(code, reason)

    async def _abort(self, code: int, reason: str) -> None:
        """Close now with ``code`` and cancel everything of this connection."""
        self._closing = True
        self.outbox.discard()
        self._cancel()
        with trio.CancelScope(shield=True):
            await self._close_ws(code, reason)

    def _cancel(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def _put(self, item: str | InferEntry) -> None:
        try:
            self.outbox.put(item)
        except OutboxOverflow as exc:
            log.info("closing connection %s: %s", self.peer, exc)
            self._wind_down(1008, "too much unread output: read your frames")

    def _wind_down(self, code: int, reason: str) -> None:
        """Give up on a client that does not read: synchronous.

        Its requests are interrupted at once (their jobs cancelled, their
        frames dropped) and the reader stops; the frame being written is
        left to finish, so that the close frame with ``code`` can follow it
        once the client reads again. If it does not within ``close_timeout``,
        the socket is dropped. Cancelling the write instead would cut the
        frame in half and leave no way to tell the client why.
        """
        if self._closing or self._nursery is None:
            return
        self._closing = True
        self._wound_down = trio.Event()
        self.outbox.discard()
        for entry in self.requests:
            entry.scope.cancel()
        self._nursery.start_soon(self._close_after_writer, code, reason)

    async def _close_after_writer(self, code: int, reason: str) -> None:
        assert self._wound_down is not None
        try:
            with trio.move_on_after(self.settings.close_timeout):
                await self._writer_done.wait()
            await self._close_ws(code, reason)
        finally:
            self._wound_down.set()
            self._cancel()

    def _reply(self, reply: p.Reply) -> None:
        self._put(p.encode_reply(reply))

    # -- the writer and the keepalive ----------------------------------------------

    async def _writer(self) -> None:
        try:
            while True:
                try:
                    item = await self.outbox.get()
                except trio.EndOfChannel:
                    return
                frame = item.chunk_frame() if isinstance(item, InferEntry) else item
                if frame is None:
                    continue
                self._sending_since = trio.current_time()
                await self.ws.send_message(frame)
                self._sending_since = None
        except ConnectionClosed:
            self._cancel()
        finally:
            self._writer_done.set()

    async def _send_watchdog(self) -> None:
        """Wind down a client that accepts no byte of a frame for ``send_timeout``."""
        timeout = self.settings.send_timeout
        while True:
            since = self._sending_since
            if since is None:
                await trio.sleep(timeout)
                continue
            waited = trio.current_time() - since
            if waited < timeout:
                await trio.sleep(timeout - waited)
                continue
            log.info("closing connection %s: it accepted nothing for %.0f s", self.peer, waited)
            self._wind_down(1008, "the client stopped reading")
            return

    async def _keepalive(self) -> None:
        config = self.settings
        while True:
            await trio.sleep(config.ping_interval)
            with trio.move_on_after(config.ping_timeout) as timeout:
                try:
                    await self.ws.ping()
                except ConnectionClosed:
                    return
            if timeout.cancelled_caught:
                log.info("closing connection %s: it did not answer a ping", self.peer)
                await self._abort(1011, "keepalive ping timeout")
                return

    # -- requests -----------------------------------------------------------------

    async def _reader(self) -> None:
        max_bytes = self.settings.max_message_bytes
        while True:
            try:
                message = await self.ws.get_message()
            except ConnectionClosed:
                return
            if self._closing:
                return
            if isinstance(message, str) and len(message) * 4 > max_bytes:
                # trio-websocket checked the size in bytes already (see
                # _websocket.py); this guards an engine built on another layer.
                size = len(message.encode("utf-8", "surrogatepass"))
                if size > max_bytes:
                    await self._abort(1009, f"message of {size} bytes exceeds {max_bytes}")
                    return
            await self._dispatch(message)

    async def _dispatch(self, message: str | bytes) -> None:
        """Answer one frame; an exception boundary for the quick actions."""
        request: p.Request | None = None
        try:
            request = p.decode_request(message)
            await self._handle(request)
        except p.ProtocolError as error:
            self._reply(error.reply())
            self.access.refused(error)
        except BaseException as exc:
            fatal, rest = split_cancellation(exc)
            if rest is not None:
                action = p.action_name(request)
                log.error(
                    "connection %s: %s request failed", self.peer, action or "a", exc_info=rest
                )
                echoed = request.echoed if request is not None else {}
                self._reply(
                    p.ProtocolError(
                        "internal",
                        "the server failed to answer this request",
                        action=action,
                        echoed=echoed,
                    ).reply()
                )
            if fatal is not None:
                raise fatal from None

    async def _handle(self, request: p.Request) -> None:
        if isinstance(request, p.EchoRequest):
            self._reply(p.EchoReply(echoed=request.echoed))
            self.access.request(request, quiet=True)
        elif isinstance(request, p.EstimateTokenRequest):
            served = await _acquire(self.services.models, request)
            ids = await served.tokenizing.encode(request.text)
            self._reply(p.EstimateTokenReply(num_tokens=len(ids), echoed=request.echoed))
            self.access.request(request, prompt_tokens=len(ids))
        elif isinstance(request, p.LefttrimTokenRequest):
            served = await _acquire(self.services.models, request)
            text = await _lefttrim(served, request.text, request.trimmed_length)
            self._reply(p.LefttrimTokenReply(trimmed_text=text, echoed=request.echoed))
            self.access.request(request)
        elif isinstance(request, p.InferRequest):
            self._start_infer(request)
        elif isinstance(request, p.StopRequest):
            stopped = await self._stop(request)
            self._reply(p.StopReply(stopped=stopped, echoed=request.echoed))
            self.access.request(request, stopped=stopped)
        elif isinstance(request, p.InfoRequest):
            self._reply(self.services.info_reply(request.echoed))
            self.access.request(request, quiet=True)
        else:  # pragma: no cover - decode_request returns only the above
            raise AssertionError(request)

    def _start_infer(self, request: p.InferRequest) -> None:
        limit = self.settings.max_requests
        if len(self.requests) + len(self._loading) >= limit:
            raise p.ProtocolError(
                "overloaded",
                f"this connection already has {len(self.requests) + len(self._loading)} infer "
                f"requests in flight (the limit is {limit}); wait for one to finish",
                action="infer",
                echoed=request.echoed,
            )
        models = self.services.models
        try:
            slot = models.slot(request.model)
        except ModelError as exc:
            raise _model_error(exc, "infer", request.echoed) from None
        if slot.served is None or slot.status != "loaded":
            assert self._nursery is not None  # its model loads first; the reader goes on
            self._nursery.start_soon(self._infer_after_load, request)
            return
        slot.last_used = trio.current_time()
        self._open_infer(slot.served, request)

    async def _infer_after_load(self, request: p.InferRequest) -> None:
        """Wait for ``request``'s model to load, then start it; a stop that
        matches it meanwhile ends the wait (an ``overloaded`` error frame:
        nothing was generated)."""
        scope = trio.CancelScope()
        self._loading[scope] = request
        try:
            with scope:
                try:
                    served = await _acquire(self.services.models, request, self.client)
                    self._open_infer(served, request)
                except p.ProtocolError as error:
                    self._reply(error.reply())
                    self.access.refused(error)
            if scope.cancelled_caught:
                stopped = _stopped_while_loading(request)
                self._reply(stopped.reply())
                self.access.refused(stopped)
        finally:
            del self._loading[scope]

    def _open_infer(self, served: ServedModel, request: p.InferRequest) -> None:
        try:
            generation = served.generations.open(
                from_infer(request), client=self.client, owner=self, api="websocket"
            )
        except InvalidGeneration as exc:
            raise infer_error(exc, request) from None
        except Overloaded as exc:
            raise p.ProtocolError(
                "overloaded", exc.message, action="infer", echoed=request.echoed
            ) from None
        entry = InferEntry(request, generation)
        generation.on_text = lambda _text: self._text_released(entry)
        self.requests.add(entry)
        assert self._nursery is not None
        self._nursery.start_soon(self._run_infer, entry)

    def _text_released(self, entry: InferEntry) -> None:
        if entry.request.stream and not entry.chunk_pending:
            entry.chunk_pending = True
            self._put(entry)

    async def _stop(self, request: p.StopRequest) -> int:
        waiting = [scope for scope, r in self._loading.items() if r.matches_stop(request)]
        for scope in waiting:
            scope.cancel()
        matching = [e for e in self.requests if e.request.matches_stop(request)]
        # A request whose last update the engine has delivered is decided: too
        # late to stop (it keeps its outcome) and not counted as stopped.
        targets = [e for e in matching if not e.generation.decided]
        for entry in targets:
            entry.cancel_cause = "stop"
            entry.scope.cancel()
        # Every matching request's final frame goes out before this stop's
        # reply, the decided ones' too (their task may still be reading the
        # updates the engine delivered ahead of it).
        for entry in matching:
            await entry.done.wait()
        return len(targets) + len(waiting)

    # -- one infer ----------------------------------------------------------------

    async def _run_infer(self, entry: InferEntry) -> None:
        request = entry.request
        generation = entry.generation
        reply: p.Reply | None = None
        try:
            with entry.scope:
                try:
                    await generation.run()
                except InvalidGeneration as exc:
                    reply = infer_error(exc, request).reply()
                except Overloaded as exc:
                    reply = p.ProtocolError(
                        "overloaded", exc.message, action="infer", echoed=request.echoed
                    ).reply()
        except BaseException as exc:
            fatal, rest = split_cancellation(exc)
            if rest is not None:
                log.error(
                    "connection %s: infer %s failed",
                    self.peer,
                    short_repr(request.echoed.get("request_id")),
                    exc_info=rest,
                )
                reply = p.ProtocolError(
                    "internal",
                    "the server failed while generating this request",
                    action="infer",
                    echoed=request.echoed,
                ).reply()
            if fatal is not None:
                self._finish_infer(entry, reply)
                raise fatal from None
        self._finish_infer(entry, reply)

    def _finish_infer(self, entry: InferEntry, reply: p.Reply | None) -> None:
        """Queue the terminal frame (synchronous: it runs on cancellation too)."""
        generation = entry.generation
        try:
            with generation:
                if reply is None:
                    generation.end()
                    reply = entry.terminal_reply()
                if entry.unsent_chunk():
                    entry.chunk_pending = True
                    self._put(entry)
                self._put(p.encode_reply(reply))
                self.access.infer(entry.request, generation, reply, entry.cancel_cause)
        finally:
            entry.done.set()
            self.requests.discard(entry)


def _model_error(exc: ModelError, action: str, echoed: Mapping[str, Any]) -> p.ProtocolError:
    """A model that cannot serve a request: ``invalid_request`` naming
    ``$.model`` for one that does not exist, ``overloaded`` otherwise."""
    if exc.status == 404:
        return p.ProtocolError(
            "invalid_request", exc.message, field="$.model", action=action, echoed=echoed
        )
    return p.ProtocolError("overloaded", exc.message, action=action, echoed=echoed)


async def _acquire(
    models: Models,
    request: p.InferRequest | p.EstimateTokenRequest | p.LefttrimTokenRequest,
    client: Hashable | None = None,
) -> ServedModel:
    """The model a request names, loaded (waiting for its load; counted as
    one of ``client``'s requests meanwhile)."""
    action = p.action_name(request) or "infer"
    try:
        return await models.acquire(request.model, client)
    except Overloaded as exc:
        raise p.ProtocolError(
            "overloaded", exc.message, action=action, echoed=request.echoed
        ) from None
    except ModelError as exc:
        raise _model_error(exc, action, request.echoed) from None


async def _lefttrim(served: ServedModel, text: str, length: int) -> str:
    tokenizing = served.tokenizing
    ids = await tokenizing.encode(text)
    if len(ids) <= length:
        return text
    if length == 0:
        return ""
    return await tokenizing.decode(ids[-length:])


def _stopped_while_loading(request: p.InferRequest) -> p.ProtocolError:
    return p.ProtocolError(
        "overloaded",
        "stopped while its model was loading: nothing was generated",
        action="infer",
        echoed=request.echoed,
    )
