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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from trioserve import protocol as p
from trioserve.chat_template import ChatTemplateError
from trioserve.generation.generation import (
    Generation,
    GenerationRequest,
    InvalidGeneration,
    Overloaded,
)

if TYPE_CHECKING:
    from .server import Server

__all__ = ["Connection", "InferEntry", "Outbox", "OutboxOverflow"]

log = logging.getLogger("trioserve.server")

#: Messages longer than this (characters in all) are rendered in a worker thread.
_RENDER_INLINE_CHARS = 4096
access_log = logging.getLogger("trioserve.access")


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


@attrs.define(eq=False)
class InferEntry:
    """An ``infer`` in flight on one connection."""

    request: p.InferRequest
    generation: Generation
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    #: Set once the terminal frame is queued for the writer.
    done: trio.Event = attrs.Factory(trio.Event)
    #: A chunk marker for this request is in the outbox, not yet written.
    chunk_pending: bool = False
    #: Length of the response already sent in chunk frames.
    sent: int = 0
    #: Why the request was interrupted, for metrics: ``stop``, ``shutdown``,
    #: or (when nobody says) ``disconnect``.
    cancel_cause: str | None = None


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


class Connection:
    """One client: a reader, a writer, a keepalive and its infer tasks."""

    def __init__(self, server: Server, ws: WebSocketConnection, peer: str) -> None:
        self.server = server
        self.ws = ws
        self.peer = peer
        self.requests: set[InferEntry] = set()
        self.outbox = Outbox(server.config.max_output_bytes)
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
        with trio.move_on_after(self.server.config.close_timeout):
            await self._writer_done.wait()
        await self._close_ws(code, reason)

    async def _close_ws(self, code: int, reason: str) -> None:
        if self.close_code is None:
            self.close_code = code
        # A peer that does not read will not answer the close handshake
        # either; cancelling aclose closes the socket.
        with trio.move_on_after(self.server.config.close_timeout):
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
            with trio.move_on_after(self.server.config.close_timeout):
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
                frame = self._chunk_frame(item) if isinstance(item, InferEntry) else item
                if frame is None:
                    continue
                self._sending_since = trio.current_time()
                await self.ws.send_message(frame)
                self._sending_since = None
        except ConnectionClosed:
            self._cancel()
        finally:
            self._writer_done.set()

    def _chunk_frame(self, entry: InferEntry) -> str | None:
        """The chunk frame of everything ``entry`` released since its last one."""
        entry.chunk_pending = False
        generation = entry.generation
        chunk = generation.response[entry.sent :]
        if not chunk:
            return None
        entry.sent = len(generation.response)
        request = entry.request
        return p.encode_reply(
            p.InferChunk(
                chunk=chunk,
                util_text=None if request.compact_chunks else generation.util_text,
                response=generation.response if request.stream_full else None,
                echoed=request.echoed,
            )
        )

    async def _send_watchdog(self) -> None:
        """Wind down a client that accepts no byte of a frame for ``send_timeout``."""
        timeout = self.server.config.send_timeout
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
        config = self.server.config
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
        max_bytes = self.server.max_message_bytes
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
            self._log_request(request, error_type=error.error_type)
        except BaseException as exc:
            fatal, rest = split_cancellation(exc)
            if rest is not None:
                action = _action_name(request)
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
        server = self.server
        if isinstance(request, p.EchoRequest):
            self._reply(p.EchoReply(echoed=request.echoed))
            self._log_request(request, quiet=True)
        elif isinstance(request, p.EstimateTokenRequest):
            ids = await server.tokenizing.encode(request.text)
            self._reply(p.EstimateTokenReply(num_tokens=len(ids), echoed=request.echoed))
            self._log_request(request, prompt_tokens=len(ids))
        elif isinstance(request, p.LefttrimTokenRequest):
            text = await self._lefttrim(request.text, request.trimmed_length)
            self._reply(p.LefttrimTokenReply(trimmed_text=text, echoed=request.echoed))
            self._log_request(request)
        elif isinstance(request, p.InferRequest):
            self._start_infer(request)
        elif isinstance(request, p.StopRequest):
            stopped = await self._stop(request)
            self._reply(p.StopReply(stopped=stopped, echoed=request.echoed))
            self._log_request(request, stopped=stopped)
        elif isinstance(request, p.InfoRequest):
            self._reply(server.info_reply(request.echoed))
            self._log_request(request, quiet=True)
        else:  # pragma: no cover - decode_request returns only the above
            raise AssertionError(request)

    async def _lefttrim(self, text: str, length: int) -> str:
        tokenizing = self.server.tokenizing
        ids = await tokenizing.encode(text)
        if len(ids) <= length:
            return text
        if length == 0:
            return ""
        return await tokenizing.decode(ids[-length:])

    def _start_infer(self, request: p.InferRequest) -> None:
        server = self.server
        limit = server.config.max_requests_per_connection
        if len(self.requests) >= limit:
            raise p.ProtocolError(
                "overloaded",
                f"this connection already has {len(self.requests)} infer requests in flight "
                f"(the limit is {limit}); wait for one to finish",
                action="infer",
                echoed=request.echoed,
            )
        if server.draining:
            raise p.ProtocolError(
                "overloaded",
                "the server is shutting down and takes no new infer requests",
                action="infer",
                echoed=request.echoed,
            )
        info = server.engine.info
        p.validate_against_model(
            request,
            vocab_size=info.vocab_size,
            max_new_tokens=server.max_new_tokens,
            context_length=info.context_length,
            renders_messages=server.chat_template is not None,
        )
        generation = Generation(
            request=generation_request(request),
            received=trio.current_time(),
            owner=self,
            observer=server.metrics,
        )
        entry = InferEntry(request, generation)
        generation.on_text = lambda _text: self._text_released(entry)
        self.requests.add(entry)
        assert self._nursery is not None
        self._nursery.start_soon(self._run_infer, entry)

    async def _render(self, request: p.InferRequest) -> str:
        """The prompt of an ``infer`` with ``messages``: the model's chat template
        (in a worker thread when the messages are long)."""
        template = self.server.chat_template
        assert template is not None and request.messages is not None
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            if sum(len(m.content) for m in request.messages) > _RENDER_INLINE_CHARS:
                return await trio.to_thread.run_sync(
                    template.render, messages, limiter=self.server.tokenizing.limiter
                )
            return template.render(messages)
        except ChatTemplateError as exc:
            raise InvalidGeneration(str(exc), "$.messages") from None

    def _text_released(self, entry: InferEntry) -> None:
        if entry.request.stream and not entry.chunk_pending:
            entry.chunk_pending = True
            self._put(entry)

    async def _stop(self, request: p.StopRequest) -> int:
        targets = [
            e for e in self.requests if e.request.matches_stop(request) and not e.generation.decided
        ]
        for entry in targets:
            entry.cancel_cause = "stop"
            entry.scope.cancel()
        # Their final frames go out before this stop's reply.
        for entry in targets:
            await entry.done.wait()
        return len(targets)

    # -- one infer ----------------------------------------------------------------

    async def _run_infer(self, entry: InferEntry) -> None:
        request = entry.request
        generation = entry.generation
        server = self.server
        reply: p.Reply | None = None
        try:
            with entry.scope:
                try:
                    if request.messages is not None:
                        generation.request = attrs.evolve(
                            generation.request, text=await self._render(request)
                        )
                    await generation.run(
                        server.scheduler, server.tokenizing, max_new_tokens=server.max_new_tokens
                    )
                except InvalidGeneration as exc:
                    reply = p.ProtocolError(
                        "invalid_request",
                        exc.message,
                        field=exc.field,
                        action="infer",
                        echoed=request.echoed,
                    ).reply()
                except Overloaded as exc:
                    reply = p.ProtocolError(
                        "overloaded", str(exc), action="infer", echoed=request.echoed
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
            if reply is None:
                if generation.outcome is None:
                    generation.interrupt(self.server.scheduler)
                if generation.outcome == "failed":
                    reply = p.ProtocolError(
                        "internal",
                        generation.failure or "the engine failed",
                        action="infer",
                        echoed=entry.request.echoed,
                    ).reply()
                else:
                    reply = self._final(entry)
            elif generation.job is not None:
                self.server.scheduler.cancel(generation.job)
            if (
                entry.request.stream
                and not entry.chunk_pending
                and len(generation.response) > entry.sent
            ):
                entry.chunk_pending = True
                self._put(entry)
            self._put(p.encode_reply(reply))
            self._log_infer(entry, reply)
        finally:
            if generation.job is not None:
                self.server.scheduler.cancel(generation.job)
            entry.done.set()
            self.requests.discard(entry)

    def _final(self, entry: InferEntry) -> p.InferFinal:
        generation = entry.generation
        request = entry.request
        finished = generation.finished
        stop_reason: Any = "interrupted"
        eos_reason: Any = None
        stop_string = stop_token = None
        if finished is not None:
            if finished.reason == "max_new_tokens":
                stop_reason = "num_tokens"
            else:
                stop_reason = "eos"
                eos_reason = finished.reason
                stop_string = finished.stop_string
                stop_token = finished.stop_token
        first_token_s = generation.first_token_s
        return p.InferFinal(
            response=generation.response,
            util_text=generation.util_text or _prompt_of(request),
            stop_reason=stop_reason,
            eos_reason=eos_reason,
            stop_string=stop_string,
            stop_token=stop_token,
            usage=p.Usage(
                prompt_tokens=generation.prompt_tokens,
                trimmed_tokens=generation.trimmed_tokens,
                generated_tokens=generation.generated_tokens,
                cached_tokens=generation.cached_tokens,
            ),
            timing=p.Timing(
                queued_s=round(generation.queued_s, 6),
                first_token_s=None if first_token_s is None else round(first_token_s, 6),
                total_s=round(generation.total_s, 6),
            ),
            echoed=request.echoed,
        )

    # -- logs -----------------------------------------------------------------------

    def _log_infer(self, entry: InferEntry, reply: p.Reply) -> None:
        generation = entry.generation
        fields: dict[str, Any] = {
            "peer": self.peer,
            "api": "websocket",
            "action": "infer",
            "request_id": short_repr(entry.request.echoed.get("request_id")),
            "prompt_tokens": generation.prompt_tokens,
            "generated_tokens": generation.generated_tokens,
            "cached_tokens": generation.cached_tokens,
            "queue_s": round(generation.queued_s, 4),
            "ttft_s": None
            if generation.first_token_s is None
            else round(generation.first_token_s, 4),
            "tok_s": None
            if generation.tokens_per_second is None
            else round(generation.tokens_per_second, 1),
        }
        outcome: str = "internal"
        if isinstance(reply, p.InferFinal):
            fields["stop_reason"] = outcome = reply.stop_reason
        elif isinstance(reply, p.ErrorReply):
            fields["error_type"] = outcome = reply.error.type
        metrics = self.server.metrics
        metrics.request_finished(
            api="websocket",
            action="infer",
            outcome=outcome,
            prompt_tokens=generation.prompt_tokens,
            generated_tokens=generation.generated_tokens,
            cached_tokens=generation.cached_tokens,
            duration=generation.total_s,
        )
        if generation.job is not None and generation.job.started_at is not None:
            metrics.queue_wait(generation.queued_s)
        if outcome == "interrupted":
            metrics.cancelled(entry.cancel_cause or "disconnect")
        if self.server.config.log_prompts:
            fields["prompt"] = entry.generation.util_text or _prompt_of(entry.request)
        access_log.info("infer done", extra={"fields": fields})

    def _log_request(self, request: p.Request | None, *, quiet: bool = False, **extra: Any) -> None:
        """Count a quick action and log it (echo and info, which clients use
        as pings, at DEBUG; the others at INFO)."""
        self.server.metrics.request_finished(
            api="websocket",
            action=_action_name(request) or "unknown",
            outcome=extra.get("error_type", "ok"),
        )
        level = logging.DEBUG if quiet and "error_type" not in extra else logging.INFO
        if not access_log.isEnabledFor(level):
            return
        fields: dict[str, Any] = {
            "peer": self.peer,
            "api": "websocket",
            "action": _action_name(request),
            "request_id": short_repr(request.echoed.get("request_id"))
            if request is not None
            else None,
            **extra,
        }
        access_log.log(level, "%s done", fields["action"] or "request", extra={"fields": fields})


def _action_name(request: p.Request | None) -> str | None:
    if request is None:
        return None
    for name, cls in _ACTIONS.items():
        if isinstance(request, cls):
            return name
    return None


_ACTIONS: dict[str, type] = {
    "echo": p.EchoRequest,
    "estimate_token": p.EstimateTokenRequest,
    "lefttrim_token": p.LefttrimTokenRequest,
    "infer": p.InferRequest,
    "stop": p.StopRequest,
    "info": p.InfoRequest,
}


def _prompt_of(request: p.InferRequest) -> str:
    return request.custom_bos + (request.text or "")


def generation_request(request: p.InferRequest) -> GenerationRequest:
    """The transport-neutral part of an ``infer`` request."""
    return GenerationRequest(
        text=request.text or "",
        custom_bos=request.custom_bos,
        max_new_tokens=request.max_new_tokens,
        sampling=request.sampling_settings(),
        stop_strings=request.stop_strings,
        stop_token_ids=tuple(c for c in request.stop_conditions if isinstance(c, int)),
        banned_ids=tuple(request.bann_bann),
        token_healing=request.token_healing,
        text_field="$.text" if request.messages is None else "$.messages",
    )
