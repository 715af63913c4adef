"""The trio + trio-websocket shell: connections, dispatch, auth, limits, shutdown.

Task tree (see docs/design.md)::

    serve()
    └── server nursery (shielded: host cancellation starts a graceful shutdown)
        ├── generation task            Scheduler.run, the only owner of the engine
        ├── listener                   trio_websocket.serve_websocket
        └── connections nursery
              └── connection (one per client), its own nursery:
                    ├── reader          frames -> decode/validate -> dispatch
                    ├── writer          the only caller of ws.send_message
                    ├── keepalive       pings; closes a peer that stops answering
                    └── one task per infer, inside its own CancelScope

A request's stop is its cancel scope being cancelled; the cancelled task frees
its engine job synchronously and sends its ``interrupted`` final frame from
outside the cancelled scope. This module knows nothing of torch.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from . import protocol as p
from ._version import __version__
from .engine.base import Engine, Failed, Finished, GenerationSpec, TextUpdate
from .errors import ConfigError, ListenError
from .scheduler import Job, QueueFull, Scheduler, SchedulerClosed, SchedulerStatistics

__all__ = ["Listening", "Server", "ServerConfig", "ServerStatistics", "serve"]

log = logging.getLogger("trioserve.server")

MiB = 1024 * 1024
_LOOPBACK_ORIGIN = re.compile(r"^http://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?$")
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


def _leaf_oserror(error: BaseException) -> OSError | None:
    """The OSError inside nested exception groups, if that is all they hold."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error if isinstance(error, OSError) else None


def _positive(name: str) -> Any:
    def check(instance: object, attribute: object, value: float) -> None:
        if not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class ServerConfig:
    """Everything the server needs besides the engine; defaults are protocol.md's."""

    host: str = "127.0.0.1"
    #: 0 picks a free port (reported by ``serve``'s ``task_status``).
    port: int = 7862
    #: When set, every handshake must carry ``Authorization: Bearer <key>`` or
    #: ``?api_key=<key>``; otherwise it is answered with HTTP 401.
    api_key: str | None = None
    #: Origins a browser may connect from; None allows only loopback origins.
    allowed_origins: tuple[str, ...] | None = None
    max_message_bytes: int = attrs.field(default=8 * MiB, validator=_positive("max message bytes"))
    max_requests_per_connection: int = attrs.field(
        default=32, validator=_positive("max requests per connection")
    )
    max_waiting_jobs: int = attrs.field(default=256, validator=_positive("max waiting jobs"))
    #: None: the model's context length minus 1.
    max_new_tokens: int | None = None
    ping_interval: float = attrs.field(default=20.0, validator=_positive("ping interval"))
    ping_timeout: float = attrs.field(default=20.0, validator=_positive("ping timeout"))
    #: On shutdown, how long running jobs may go on before they are interrupted.
    shutdown_grace: float = 10.0
    #: Texts longer than this (characters) are tokenized in a worker thread.
    thread_tokenize_chars: int = 4096
    #: Whether log lines may carry prompts and generated text (``--log-prompts``).
    #: Off by default: prompts are user data. API keys are never logged.
    log_prompts: bool = False

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError(f"max new tokens must be >= 1, got {self.max_new_tokens!r}")
        if self.shutdown_grace < 0:
            raise ConfigError(f"shutdown grace must be >= 0, got {self.shutdown_grace!r}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api key must not be empty")


@attrs.frozen
class Listening:
    """Where a started server accepts connections."""

    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"ws://{host}:{self.port}/"


@attrs.frozen
class ServerStatistics:
    connections: int
    requests_in_flight: int
    scheduler: SchedulerStatistics


async def serve(
    engine: Engine,
    config: ServerConfig = ServerConfig(),
    *,
    task_status: trio.TaskStatus[Listening] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``engine`` over WebSocket until cancelled.

    Use it as ``listening = await nursery.start(serve, engine, config)``: it
    reports where it listens once the port is bound (``port=0`` picks one), or
    raises :class:`~trioserve.errors.ListenError` when it cannot bind.
    The caller owns ``engine`` and closes it after ``serve`` returns.

    Cancellation: cancelling ``serve`` starts a graceful shutdown rather than an
    abrupt one: the listener closes at once, running and queued jobs get up to
    ``config.shutdown_grace`` seconds to finish, then the rest are interrupted
    and their clients receive their final frames; connections are closed with
    code 1001 (going away). ``serve`` returns when all of that is done.
    """
    server = Server(engine, config)
    await server.run(task_status=task_status)


class Server:
    """One serving instance; :func:`serve` is the usual way to run it."""

    def __init__(self, engine: Engine, config: ServerConfig = ServerConfig()) -> None:
        self.engine = engine
        self.config = config
        info = engine.info
        self.max_new_tokens = min(
            config.max_new_tokens or info.context_length, info.context_length - 1
        )
        self.scheduler = Scheduler(engine, max_waiting=config.max_waiting_jobs)
        self._connections: set[Connection] = set()
        self._draining = False
        self._work = trio.CancelScope(shield=True)
        self._listener_scope = trio.CancelScope()
        self._grace_scope = trio.CancelScope()
        self._shutdown_requested = trio.Event()
        self._info_reply_parts = (
            p.ServerInfo(name="trioserve", version=__version__),
            p.ModelInfo(
                name=info.model_name,
                engine=info.engine,
                context_length=info.context_length,
                vocab_size=info.vocab_size,
                bos_token_id=info.bos_token_id,
                eos_token_ids=tuple(sorted(info.eos_token_ids)),
                max_batch=info.max_batch,
                batching=info.batching,
            ),
            p.Limits(
                max_message_bytes=config.max_message_bytes,
                max_requests_per_connection=config.max_requests_per_connection,
                max_waiting_jobs=config.max_waiting_jobs,
                max_new_tokens=self.max_new_tokens,
            ),
        )

    @property
    def draining(self) -> bool:
        return self._draining

    def statistics(self) -> ServerStatistics:
        return ServerStatistics(
            connections=len(self._connections),
            requests_in_flight=sum(len(c.requests) for c in self._connections),
            scheduler=self.scheduler.statistics(),
        )

    async def run(
        self, *, task_status: trio.TaskStatus[Listening] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run until cancelled, then shut down gracefully (see :func:`serve`)."""
        config = self.config
        if config.host not in _LOOPBACK_HOSTS and config.api_key is None:
            log.warning(
                "listening on %s without an API key: anyone who can reach this address "
                "can use the model (set --api-key or TRIOSERVE_API_KEY)",
                config.host,
            )
        started = False
        try:
            async with trio.open_nursery() as outer:
                # The work runs shielded from the host's cancellation, which only
                # this task sees: it turns it into a graceful shutdown.
                listening = await outer.start(self._run_work)
                started = True
                task_status.started(listening)
                try:
                    await trio.sleep_forever()
                finally:
                    self.begin_shutdown()
        except BaseExceptionGroup as group:
            cause = None if started else _leaf_oserror(group)
            if cause is None:
                raise
            raise ListenError(
                f"cannot listen on {config.host}:{config.port}: {cause.strerror or cause}"
            ) from group

    def begin_shutdown(self) -> None:
        """Stop accepting connections and start the graceful shutdown.

        Synchronous and idempotent, so it can run in a ``finally`` block.
        """
        self._draining = True
        self._listener_scope.cancel()
        self._shutdown_requested.set()

    def abort(self) -> None:
        """Interrupt everything now, without the grace period."""
        self.begin_shutdown()
        self._grace_scope.cancel()

    async def _run_work(self, *, task_status: trio.TaskStatus[Listening]) -> None:
        with self._work:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.scheduler.run)
                nursery.start_soon(self._shutdown_when_asked)
                ws_server = await nursery.start(self._run_listener, nursery)
                # A name such as "localhost" may bind several addresses (with
                # port 0, on different ports): report the first.
                listener = ws_server.listeners[0]
                task_status.started(Listening(host=str(listener.address), port=listener.port))

    async def _run_listener(
        self, handler_nursery: trio.Nursery, *, task_status: trio.TaskStatus[Any]
    ) -> None:
        # Connections run in the work nursery, not in the listener's own: closing
        # the listener must not cut the connections short.
        with self._listener_scope:
            await serve_websocket(
                self.handle_request,
                self.config.host,
                self.config.port,
                None,
                handler_nursery=handler_nursery,
                max_message_size=self.config.max_message_bytes,
                task_status=task_status,
            )

    async def _shutdown_when_asked(self) -> None:
        """Let jobs finish within the grace period, interrupt the rest, close."""
        await self._shutdown_requested.wait()
        with self._grace_scope:
            self._grace_scope.deadline = trio.current_time() + self.config.shutdown_grace
            await self.scheduler.wait_idle()
        for connection in list(self._connections):
            connection.interrupt_all()
        with trio.move_on_after(2.0):
            for connection in list(self._connections):
                await connection.wait_requests_done()
            async with trio.open_nursery() as nursery:
                for connection in list(self._connections):
                    nursery.start_soon(connection.close, 1001, "server shutting down")
        self._work.cancel()

    # -- handshake ----------------------------------------------------------------

    async def handle_request(self, request: WebSocketRequest) -> None:
        """trio-websocket handler: check the handshake, then run a connection."""
        headers = {name.lower(): value for name, value in request.headers}
        origin = headers.get(b"origin")
        if origin is not None and not self._origin_allowed(origin.decode("latin-1")):
            log.info("rejected handshake from origin %r", origin)
            await request.reject(403, body=b"origin not allowed\n")
            return
        if self.config.api_key is not None and not self._authorized(request.path, headers):
            await request.reject(
                401,
                extra_headers=[(b"WWW-Authenticate", b'Bearer realm="trioserve"')],
                body=b"missing or wrong api key\n",
            )
            return
        if self._draining:
            await request.reject(503, body=b"server shutting down\n")
            return
        ws = await request.accept()
        connection = Connection(self, ws)
        self._connections.add(connection)
        try:
            await connection.run()
        finally:
            self._connections.discard(connection)

    def _origin_allowed(self, origin: str) -> bool:
        origin = origin.rstrip("/").lower()
        allowed = self.config.allowed_origins
        if allowed is None:
            return _LOOPBACK_ORIGIN.match(origin) is not None
        return origin in {a.rstrip("/").lower() for a in allowed}

    def _authorized(self, path: str, headers: Mapping[bytes, bytes]) -> bool:
        assert self.config.api_key is not None
        expected = self.config.api_key.encode()
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), expected):
            return True
        for key in parse_qs(urlsplit(path).query).get("api_key", []):
            if hmac.compare_digest(key.encode(), expected):
                return True
        return False


@attrs.define(eq=False)
class InferEntry:
    """An ``infer`` in flight on one connection."""

    request: p.InferRequest
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    #: Set once the terminal frame is decided (a stop can no longer change it).
    decided: bool = False
    #: Set once the terminal frame is queued for the writer.
    done: trio.Event = attrs.Factory(trio.Event)


@attrs.define(eq=False)
class _Progress:
    """What one infer has produced so far, for its frames."""

    util_text: str = ""
    prompt_tokens: int = 0
    trimmed_tokens: int = 0
    response: str = ""
    #: Length of ``response`` already sent in chunk frames.
    sent: int = 0
    held: str = ""
    generated_tokens: int = 0
    first_token_at: float | None = None
    job: Job | None = None


class Connection:
    """One client: a reader, a writer, a keepalive and its infer tasks."""

    def __init__(self, server: Server, ws: WebSocketConnection) -> None:
        self.server = server
        self.ws = ws
        self.requests: set[InferEntry] = set()
        # Bounded: a client that does not read slows its own infer tasks down
        # (and then its reader), never the generation task or other clients.
        self._out_send, self._out_receive = trio.open_memory_channel[str](64)
        self._nursery: trio.Nursery | None = None
        self._closing = False
        self._writer_done = trio.Event()

    # -- lifecycle ----------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                nursery.start_soon(self._keepalive)
                await self._reader()
                nursery.cancel_scope.cancel()
        finally:
            # Disconnect: every infer of this connection was cancelled with the
            # nursery, and each freed its engine job in its own finally.
            self.requests.clear()

    def interrupt_all(self) -> None:
        for entry in self.requests:
            entry.scope.cancel()

    async def wait_requests_done(self) -> None:
        for entry in list(self.requests):
            await entry.done.wait()

    async def close(self, code: int, reason: str) -> None:
        """Send what is queued, then close the WebSocket."""
        self._closing = True
        self._out_send.close()
        with trio.move_on_after(1.0):
            await self._writer_done.wait()
        with trio.move_on_after(1.0):
            await self.ws.aclose(code, reason)

    async def _writer(self) -> None:
        try:
            async for frame in self._out_receive:
                await self.ws.send_message(frame)
        except ConnectionClosed:
            self._cancel()
        finally:
            self._writer_done.set()

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
                log.info("closing a connection that did not answer a ping")
                # A silent peer will not answer the close handshake either;
                # cancelling aclose closes the socket.
                with trio.move_on_after(1.0):
                    await self.ws.aclose(1011, "keepalive ping timeout")
                self._cancel()
                return

    def _cancel(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def _send(self, reply: p.Reply) -> None:
        # A closing connection loses what it cannot send any more.
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            await self._out_send.send(p.encode_reply(reply))

    # -- requests -----------------------------------------------------------------

    async def _reader(self) -> None:
        while True:
            try:
                message = await self.ws.get_message()
            except ConnectionClosed:
                return
            if self._closing:
                return
            await self._dispatch(message)

    async def _dispatch(self, message: str | bytes) -> None:
        try:
            request = p.decode_request(message)
            if isinstance(request, p.EchoRequest):
                await self._send(p.EchoReply(echoed=request.echoed))
            elif isinstance(request, p.EstimateTokenRequest):
                ids = await self._encode(request.text)
                await self._send(p.EstimateTokenReply(num_tokens=len(ids), echoed=request.echoed))
            elif isinstance(request, p.LefttrimTokenRequest):
                text = await self._lefttrim(request.text, request.trimmed_length)
                await self._send(p.LefttrimTokenReply(trimmed_text=text, echoed=request.echoed))
            elif isinstance(request, p.InferRequest):
                self._start_infer(request)
            elif isinstance(request, p.StopRequest):
                stopped = await self._stop(request)
                await self._send(p.StopReply(stopped=stopped, echoed=request.echoed))
            elif isinstance(request, p.InfoRequest):
                server, model, limits = self.server._info_reply_parts
                await self._send(
                    p.InfoReply(server=server, model=model, limits=limits, echoed=request.echoed)
                )
            else:  # pragma: no cover - decode_request returns only the above
                raise AssertionError(request)
        except p.ProtocolError as error:
            await self._send(error.reply())

    async def _encode(self, text: str) -> list[int]:
        engine = self.server.engine
        if len(text) > self.server.config.thread_tokenize_chars:
            return await trio.to_thread.run_sync(engine.encode, text)
        return engine.encode(text)

    async def _decode(self, ids: list[int]) -> str:
        engine = self.server.engine
        if len(ids) > self.server.config.thread_tokenize_chars // 4:
            return await trio.to_thread.run_sync(engine.decode, ids)
        return engine.decode(ids)

    async def _lefttrim(self, text: str, length: int) -> str:
        ids = await self._encode(text)
        if len(ids) <= length:
            return text
        if length == 0:
            return ""
        return await self._decode(ids[-length:])

    def _start_infer(self, request: p.InferRequest) -> None:
        if len(self.requests) >= self.server.config.max_requests_per_connection:
            raise p.ProtocolError(
                "overloaded",
                f"this connection already has {len(self.requests)} infer requests in flight "
                f"(the limit is {self.server.config.max_requests_per_connection}); "
                "wait for one to finish",
                action="infer",
                echoed=request.echoed,
            )
        if self.server.draining:
            raise p.ProtocolError(
                "overloaded",
                "the server is shutting down and takes no new infer requests",
                action="infer",
                echoed=request.echoed,
            )
        entry = InferEntry(request)
        self.requests.add(entry)
        assert self._nursery is not None
        self._nursery.start_soon(self._run_infer, entry)

    async def _stop(self, request: p.StopRequest) -> int:
        targets = [e for e in self.requests if e.request.matches_stop(request) and not e.decided]
        for entry in targets:
            entry.scope.cancel()
        # Their final frames go out before this stop's reply.
        for entry in targets:
            await entry.done.wait()
        return len(targets)

    # -- one infer ----------------------------------------------------------------

    async def _run_infer(self, entry: InferEntry) -> None:
        request = entry.request
        received = trio.current_time()
        progress = _Progress()
        reply: p.Reply | None = None
        try:
            with entry.scope:
                try:
                    reply = await self._generate(request, progress, received)
                except p.ProtocolError as error:
                    reply = error.reply()
            entry.decided = True
            if reply is None:
                # Stopped, by `stop`, a disconnect or the shutdown.
                if progress.job is not None:
                    self.server.scheduler.cancel(progress.job)
                reply = await self._interrupted(request, progress, received)
            await self._send(reply)
        finally:
            entry.decided = True
            if progress.job is not None:
                self.server.scheduler.cancel(progress.job)
            entry.done.set()
            self.requests.discard(entry)

    async def _generate(
        self, request: p.InferRequest, progress: _Progress, received: float
    ) -> p.Reply:
        spec = await self._prepare(request, progress)
        try:
            progress.job = job = self.server.scheduler.open_job(spec)
        except (QueueFull, SchedulerClosed) as exc:
            raise p.ProtocolError(
                "overloaded", str(exc), action="infer", echoed=request.echoed
            ) from None
        async for update in job.updates:
            if isinstance(update, TextUpdate):
                progress.held = update.held
                progress.generated_tokens = update.generated_tokens
                if progress.first_token_at is None and update.generated_tokens > 0:
                    progress.first_token_at = trio.current_time()
                await self._release(request, progress, update.text)
            elif isinstance(update, Finished):
                progress.held = ""
                progress.generated_tokens = update.generated_tokens
                if progress.first_token_at is None and update.generated_tokens > 0:
                    progress.first_token_at = trio.current_time()
                await self._release(request, progress, update.text)
                return self._final(request, progress, received, update)
            else:
                assert isinstance(update, Failed)
                raise p.ProtocolError(
                    "internal", update.message, action="infer", echoed=request.echoed
                )
        raise p.ProtocolError(  # pragma: no cover - the scheduler always ends a job
            "internal", "the job ended without a result", action="infer", echoed=request.echoed
        )

    async def _release(self, request: p.InferRequest, progress: _Progress, text: str) -> None:
        if not text:
            return
        progress.response += text
        if request.stream:
            await self._send_chunk(request, progress)

    async def _send_chunk(self, request: p.InferRequest, progress: _Progress) -> None:
        chunk = progress.response[progress.sent :]
        if not chunk:
            return
        await self._send(
            p.InferChunk(
                chunk=chunk,
                response=progress.response if request.stream_full else None,
                echoed=request.echoed,
            )
        )
        progress.sent = len(progress.response)

    async def _prepare(self, request: p.InferRequest, progress: _Progress) -> GenerationSpec:
        """Validate against the model, tokenize and trim: protocol.md 3.4."""
        server = self.server
        info = server.engine.info
        echoed = request.echoed

        def invalid(message: str, field: str) -> p.ProtocolError:
            return p.ProtocolError(
                "invalid_request", message, field=field, action="infer", echoed=echoed
            )

        if request.max_new_tokens > server.max_new_tokens:
            raise invalid(
                f"max_new_tokens must be at most {server.max_new_tokens} for this model "
                f"(context length {info.context_length}), got {request.max_new_tokens!r}",
                "$.max_new_tokens",
            )
        vocab = info.vocab_size
        stop_ids: set[int] = set(info.eos_token_ids)
        stop_strings: list[str] = []
        for index, condition in enumerate(request.stop_conditions):
            if isinstance(condition, str):
                stop_strings.append(condition)
            elif not 0 <= condition < vocab:
                raise invalid(
                    f"stop token ids must be in 0..{vocab - 1}, got {condition!r}",
                    f"$.stop_conditions[{index}]",
                )
            else:
                stop_ids.add(condition)
        for index, banned in enumerate(request.bann_bann):
            if not 0 <= banned < vocab:
                raise invalid(
                    f"banned token ids must be in 0..{vocab - 1}, got {banned!r}",
                    f"$.bann_bann[{index}]",
                )

        prompt = request.custom_bos + request.text
        ids = await self._encode(prompt)
        if not ids:
            raise invalid(
                "the prompt (customBos + text) must encode to at least one token", "$.text"
            )
        keep = info.context_length - request.max_new_tokens
        if len(ids) > keep:
            if request.custom_bos:
                kept = ids[:1] + ids[len(ids) - (keep - 1) :] if keep > 1 else ids[:1]
            else:
                kept = ids[len(ids) - keep :]
            progress.trimmed_tokens = len(ids) - len(kept)
            ids = kept
            progress.util_text = await self._decode(ids)
        else:
            progress.util_text = prompt
        progress.prompt_tokens = len(ids)
        return GenerationSpec(
            job_id=server.scheduler.new_job_id(),
            prompt_ids=tuple(ids),
            max_new_tokens=request.max_new_tokens,
            sampling=request.sampling_settings(),
            stop_token_ids=frozenset(stop_ids),
            stop_strings=tuple(stop_strings),
            banned_ids=frozenset(request.bann_bann),
            token_healing=request.token_healing,
        )

    def _final(
        self,
        request: p.InferRequest,
        progress: _Progress,
        received: float,
        finished: Finished | None,
    ) -> p.InferFinal:
        now = trio.current_time()
        job = progress.job
        if job is None:
            queued = now - received
        else:
            queued = (job.started_at if job.started_at is not None else now) - job.queued_at
        stop_reason: Any = "interrupted"
        eos_reason: Any = None
        stop_string = stop_token = None
        prompt_tokens = progress.prompt_tokens
        if finished is not None:
            prompt_tokens = finished.prompt_tokens
            if finished.reason == "max_new_tokens":
                stop_reason = "num_tokens"
            else:
                stop_reason = "eos"
                eos_reason = finished.reason
                stop_string = finished.stop_string
                stop_token = finished.stop_token
        return p.InferFinal(
            response=progress.response,
            util_text=progress.util_text or (request.custom_bos + request.text),
            stop_reason=stop_reason,
            eos_reason=eos_reason,
            stop_string=stop_string,
            stop_token=stop_token,
            usage=p.Usage(
                prompt_tokens=prompt_tokens,
                trimmed_tokens=progress.trimmed_tokens,
                generated_tokens=progress.generated_tokens,
            ),
            timing=p.Timing(
                queued_s=round(queued, 6),
                first_token_s=None
                if progress.first_token_at is None
                else round(progress.first_token_at - received, 6),
                total_s=round(now - received, 6),
            ),
            echoed=request.echoed,
        )

    async def _interrupted(
        self, request: p.InferRequest, progress: _Progress, received: float
    ) -> p.InferFinal:
        """The final frame of a stopped request: held text is flushed, not lost."""
        progress.response += progress.held
        progress.held = ""
        if request.stream:
            await self._send_chunk(request, progress)
        return self._final(request, progress, received, None)
