"""The trio shell: the listener, handshakes, connections, and shutdown.

Task tree (see docs/design.md)::

    serve()
    └── server nursery (shielded: host cancellation starts a graceful shutdown)
        ├── generation task            Scheduler.run; its step loop runs on the engine thread
        ├── listener                   trio.serve_tcp; closed first on shutdown
        └── connections nursery        one task per TCP connection, each an exception boundary:
              handshake (bounded in time; rejected with 401/403/503 as plain HTTP)
              └── Connection           connection.py: reader, writer, keepalive, infer tasks

A request's stop is its cancel scope being cancelled; the cancelled task frees
its engine job synchronously and queues its ``interrupted`` final frame from
outside the cancelled scope. This module knows nothing of torch.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import trio
from trio_websocket import WebSocketConnection

from trioserve import protocol as p
from trioserve._version import __version__
from trioserve.chat_template import ChatTemplate
from trioserve.engine.base import Engine
from trioserve.errors import ConfigError, ListenError
from trioserve.generation import Generations, Tokenizing
from trioserve.generation.engine_thread import EngineThread, open_loaded_engine
from trioserve.generation.scheduler import Scheduler, SchedulerStatistics
from trioserve.metrics import Metrics
from trioserve.openai import OpenAILimits
from trioserve.responses import ResponseStore
from trioserve.vocabulary.tools import TOOL_FORMATS

from .anthropic_routes import AnthropicRoutes, api_error_body
from .connection import Connection, ConnectionServices, ConnectionSettings
from .doors import ClientIdentity
from .front_door import FrontDoor, serve_front_door
from .http_types import AccessPolicy, HTTPLimits, Reject, RequestHead, Router, parse_networks
from .model_routes import ModelRoutes
from .models import STATUSES, Models
from .responses_routes import ResponsesRoutes
from .routes import OpenAIRoutes, OpsRoutes, Readiness
from .served import ModelSettings, ServedModel
from .tokenizer_routes import TokenizerRoutes

__all__ = ["Listening", "Server", "ServerConfig", "ServerStatistics", "serve"]

log = logging.getLogger("trioserve.server")

KiB = 1024
MiB = 1024 * 1024
#: The context the frame limit and the token cap are sized for when a
#: server serves several models (each model's own cap still applies).
SEVERAL_MODELS_CONTEXT = 32768
_LOOPBACK_ORIGIN = re.compile(r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?$")
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


def _leaf_oserror(error: BaseException) -> OSError | None:
    """The OSError inside nested exception groups, if that is all they hold."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error if isinstance(error, OSError) else None


def _not_negative(name: str) -> Any:
    def check(instance: object, attribute: object, value: float) -> None:
        if not value >= 0:
            raise ConfigError(f"{name} must be >= 0, got {value!r}")

    return check


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
    api_key: str | None = attrs.field(default=None, repr=False)
    #: When set, loading and unloading models (``POST /models/load`` and
    #: ``/models/unload``) needs this key too (``X-Admin-Key``), besides the
    #: API key. With autoload on, requests still load the models they name.
    admin_key: str | None = attrs.field(default=None, repr=False)
    #: Origins a browser may connect from, besides the loopback origins
    #: (``http``/``https`` on localhost, 127.0.0.1 or [::1], any port); ``"*"``
    #: allows every origin.
    allowed_origins: tuple[str, ...] = ()
    #: Whether loopback origins are allowed (``--allowed-origin none`` clears it).
    allow_loopback_origins: bool = True
    #: Largest frame (or HTTP body) a client may send, in bytes (UTF-8 for
    #: text frames). None: 16 bytes per token of the model's context, at least
    #: 256 KiB (a full 8,192-token context is about 40 KB of English text):
    #: parsing and tokenizing a frame holds the GIL for a moment that grows
    #: with its size, and every other client waits that moment.
    max_message_bytes: int | None = None
    max_requests_per_connection: int = attrs.field(
        default=32, validator=_positive("max requests per connection")
    )
    #: Generations one client may have in flight, over all its WebSocket
    #: connections and HTTP requests. A client is its API key when the server
    #: has one, else its address (see ``trusted_proxies``).
    max_requests_per_client: int = attrs.field(
        default=64, validator=_positive("max requests per client")
    )
    #: Choices one OpenAI request may ask for (``n``); each is a generation
    #: of its client, counted against ``max_requests_per_client`` (which
    #: caps ``n`` too when it is lower).
    max_n: int = attrs.field(default=8, validator=_positive("max n"))
    #: MiB the stored responses of ``/v1/responses`` may take (0: none is
    #: stored; ``previous_response_id`` then finds nothing).
    responses_store_mib: int = attrs.field(
        default=64, validator=_not_negative("responses store mib")
    )
    #: Seconds a stored response is kept after its last use.
    responses_ttl: float = attrs.field(default=24 * 3600.0, validator=_positive("responses ttl"))
    #: Engine slots one client may hold while others wait; None: all but
    #: one of the engine's slots (so a newcomer always finds one).
    max_running_per_client: int | None = None
    #: Proxies (CIDRs) whose ``X-Forwarded-For`` names the client's address;
    #: any other peer's header is ignored.
    trusted_proxies: tuple[str, ...] = ()
    max_waiting_jobs: int = attrs.field(default=256, validator=_positive("max waiting jobs"))
    #: Open connections (handshakes included); more are answered 503.
    max_connections: int = attrs.field(default=2048, validator=_positive("max connections"))
    #: Unsent output one connection may hold before it is closed (1008).
    max_output_bytes: int = attrs.field(default=16 * MiB, validator=_positive("max output bytes"))
    #: None: the model's context length minus 1.
    max_new_tokens: int | None = None
    ping_interval: float = attrs.field(default=20.0, validator=_positive("ping interval"))
    ping_timeout: float = attrs.field(default=20.0, validator=_positive("ping timeout"))
    #: A client that accepts no byte of a frame for this long is closed (1008).
    send_timeout: float = attrs.field(default=30.0, validator=_positive("send timeout"))
    #: A peer must complete its WebSocket handshake within this time.
    handshake_timeout: float = attrs.field(default=10.0, validator=_positive("handshake timeout"))
    #: How long a close handshake may take before the socket is dropped.
    close_timeout: float = attrs.field(default=2.0, validator=_positive("close timeout"))
    #: On shutdown, how long running jobs may go on before they are interrupted.
    shutdown_grace: float = 10.0
    #: Log prompts in the per-request log lines (off: prompts are private).
    log_prompts: bool = False
    #: With a models folder: models loaded at once (None: no bound); loading
    #: one more unloads the least recently used.
    models_max: int | None = None
    #: With a models folder: a request for a model that is not loaded loads it.
    models_autoload: bool = True
    #: Seconds an unloading model's running requests may take to finish.
    unload_timeout: float = attrs.field(default=30.0, validator=_not_negative("unload timeout"))
    #: With a models folder: a model idle this long is unloaded until its
    #: next request (None: never).
    sleep_idle_seconds: float | None = None
    #: ``/metrics`` without the API key (an endpoint picker, a scraper that
    #: sends none); the other routes keep needing it.
    public_metrics: bool = False
    #: How the model writes tool calls: ``auto`` (from its chat template) or
    #: one of ``hermes``, ``llama3``, ``mistral`` (docs/openai.md, "Tool calls").
    tool_call_format: str = "auto"
    #: A thinking template's reasoning: ``auto`` keeps it apart from the
    #: answer (``reasoning_content``, ``reasoning`` items, ``thinking``
    #: blocks), ``none`` leaves it in the answer (docs/reasoning.md).
    reasoning_format: str = "auto"
    #: A Jinja chat template file used instead of the model's own.
    chat_template: str | None = None
    #: At most this many tokens of a thinking template's reasoning per reply,
    #: then its section is closed (None: no bound but the request's).
    reasoning_budget: int | None = None

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port!r}")
        if self.max_message_bytes is not None and self.max_message_bytes < 1:
            raise ConfigError(f"max message bytes must be > 0, got {self.max_message_bytes!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError(f"max new tokens must be >= 1, got {self.max_new_tokens!r}")
        if self.tool_call_format not in ("auto", *TOOL_FORMATS):
            raise ConfigError(
                f"tool call format must be auto or one of {', '.join(TOOL_FORMATS)},"
                f" got {self.tool_call_format!r}"
            )
        if self.reasoning_budget is not None and self.reasoning_budget < 0:
            raise ConfigError(f"reasoning budget must be >= 0, got {self.reasoning_budget!r}")
        if self.reasoning_format not in ("auto", "none"):
            raise ConfigError(
                f"reasoning format must be auto or none, got {self.reasoning_format!r}"
            )
        if self.max_running_per_client is not None and self.max_running_per_client < 1:
            raise ConfigError(
                f"max running per client must be >= 1, got {self.max_running_per_client!r}"
            )
        for cidr in self.trusted_proxies:
            try:
                parse_networks([cidr])
            except ValueError:
                raise ConfigError(
                    f"trusted proxies must be addresses or networks (CIDR), got {cidr!r}"
                ) from None
        if self.shutdown_grace < 0:
            raise ConfigError(f"shutdown grace must be >= 0, got {self.shutdown_grace!r}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api key must not be empty")
        if self.admin_key is not None and not self.admin_key:
            raise ConfigError("admin key must not be empty")
        if self.models_max is not None and self.models_max < 1:
            raise ConfigError(f"models max must be >= 1, got {self.models_max!r}")
        if self.sleep_idle_seconds is not None and not self.sleep_idle_seconds > 0:
            raise ConfigError(f"sleep idle seconds must be > 0, got {self.sleep_idle_seconds!r}")
        for origin in self.allowed_origins:
            if origin != "*" and not re.match(r"^[a-z][a-z0-9+.-]*://[^/\s]+$", origin, re.I):
                raise ConfigError(
                    "allowed origins must look like scheme://host[:port] (or be '*'), "
                    f"got {origin!r}"
                )


def default_max_message_bytes(context_length: int) -> int:
    """The frame limit for a model of ``context_length`` tokens (see
    :attr:`ServerConfig.max_message_bytes`)."""
    return max(256 * KiB, 16 * context_length)


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


EngineLoader = Callable[[], Engine]


async def serve(
    engine: Engine | EngineLoader | Models,
    config: ServerConfig = ServerConfig(),
    *,
    task_status: trio.TaskStatus[Listening] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an engine over WebSocket until cancelled.

    Use it as ``listening = await nursery.start(serve, engine, config)``: it
    reports where it listens once the port is bound (``port=0`` picks one), or
    raises :class:`~trioserve.errors.ListenError` when it cannot bind.

    ``engine`` is an :class:`~trioserve.engine.base.Engine` (the caller owns
    it and closes it after ``serve`` returns), a
    :class:`~trioserve.server.models.Models` of several (each loaded on
    demand, on a thread of its own, and closed when unloaded or when ``serve``
    returns), or a function that loads one engine:
    then ``serve`` calls it on the engine thread, so that the model is loaded,
    stepped and closed on one thread (faster on a CPU, required by CUDA), and
    closes the engine before it returns.

    Cancellation: cancelling ``serve`` starts a graceful shutdown rather than an
    abrupt one: ``/ready`` answers 503 at once and new WebSocket upgrades and
    generation requests are refused (503, or ``overloaded`` on open
    connections), running and queued jobs get up to ``config.shutdown_grace``
    seconds to finish, then the rest are interrupted and their clients receive
    their final frames; then the listener closes and connections are closed
    with code 1001 (going away). ``serve`` returns when all of that is done.
    """
    if isinstance(engine, Models):
        await Server(config=config, models=engine).run(task_status=task_status)
        return
    if isinstance(engine, Engine):
        await Server(engine, config).run(task_status=task_status)
        return
    async with open_loaded_engine(engine) as (loaded, thread):
        await Server(loaded, config, engine_thread=thread).run(task_status=task_status)


class Server:
    """One serving instance; :func:`serve` is the usual way to run it.

    ``engine``: the one model it serves (under any name a request gives);
    ``engine_thread``: the thread that loaded it, which then also steps it
    (without one, the server starts an engine thread of its own). Or
    ``models``: a registry of several (:meth:`Models.from_catalog`), loaded
    on demand.
    """

    def __init__(
        self,
        engine: Engine | None = None,
        config: ServerConfig = ServerConfig(),
        *,
        engine_thread: EngineThread | None = None,
        models: Models | None = None,
    ) -> None:
        self.config = config
        self.engine_thread = engine_thread
        self.metrics = Metrics()
        settings = model_settings(config)
        if models is None:
            if engine is None:
                raise TypeError("Server needs an engine or models")
            models = Models.single(
                engine,
                settings,
                engine_thread=engine_thread,
                metrics=self.metrics,
                is_draining=lambda: self._draining,
            )
        else:
            # The server's settings shape each model it loads (a host's
            # Models.from_loaders has none of its own).
            models.settings = settings
            models.metrics = self.metrics
            models.is_draining = lambda: self._draining
        self.models = models
        default = models.default_served()
        if default is not None:
            info = default.info
            self.metrics.set_model(model=info.model_name, engine=info.engine)
            context = info.context_length
        else:
            self.metrics.set_model(model=models.default_id, engine="several")
        if models.several:
            self.metrics.declare_models(models.slots)
            for slot in models.slots.values():
                self.metrics.models.status(slot.id, slot.status, STATUSES)
            context = SEVERAL_MODELS_CONTEXT
        self.max_new_tokens = min(config.max_new_tokens or context, context - 1)
        self.max_message_bytes = config.max_message_bytes or default_max_message_bytes(context)
        self.identity = ClientIdentity(
            keyed=config.api_key is not None,
            trusted_proxies=parse_networks(config.trusted_proxies),
            key=config.api_key,
        )
        self._limits = p.Limits(
            max_message_bytes=self.max_message_bytes,
            max_requests_per_connection=config.max_requests_per_connection,
            max_waiting_jobs=config.max_waiting_jobs,
            max_new_tokens=self.max_new_tokens,
        )
        self._connection_services = ConnectionServices(
            models=self.models,
            metrics=self.metrics,
            info_reply=self.info_reply,
            settings=ConnectionSettings(
                max_message_bytes=self.max_message_bytes,
                max_requests=config.max_requests_per_connection,
                max_output_bytes=config.max_output_bytes,
                send_timeout=config.send_timeout,
                close_timeout=config.close_timeout,
                ping_interval=config.ping_interval,
                ping_timeout=config.ping_timeout,
                log_prompts=config.log_prompts,
            ),
        )
        router = Router()
        OpsRoutes(readiness=self.readiness, metrics=self.metrics, info=self._info_page).install(
            router
        )
        self._openai_routes = OpenAIRoutes(
            self.models,
            self.identity,
            limits=OpenAILimits(max_n=min(config.max_n, config.max_requests_per_client)),
            metrics=self.metrics,
            model_limits=attrs.asdict(self._limits),
        )
        self._openai_routes.install(router)
        TokenizerRoutes(self.models).install(router)
        AnthropicRoutes(self.models, self.identity, metrics=self.metrics).install(router)
        self.responses_store = ResponseStore(
            max_bytes=config.responses_store_mib << 20, ttl_s=config.responses_ttl
        )
        ResponsesRoutes(
            self.models, self.identity, store=self.responses_store, metrics=self.metrics
        ).install(router)
        if self.models.several:
            ModelRoutes(self.models, admin_key=config.admin_key).install(router)
        self.front_door = FrontDoor(
            router,
            policy=AccessPolicy(
                api_key=config.api_key,
                allowed_origins=config.allowed_origins,
                allow_loopback_origins=config.allow_loopback_origins,
                public_paths=frozenset(
                    {"/health", "/ready", *(["/metrics"] if config.public_metrics else [])}
                ),
            ),
            limits=HTTPLimits(
                max_body_bytes=self.max_message_bytes,
                max_connections=config.max_connections,
                head_timeout=config.handshake_timeout,
                websocket_handshake_timeout=config.handshake_timeout,
                send_timeout=config.send_timeout,
            ),
            websocket_handler=self._run_websocket,
            admit_websocket=self._admit_websocket,
            observer=self.metrics,
            max_message_bytes=self.max_message_bytes,
            error_body=api_error_body,
        )
        self._connections: set[Connection] = set()
        self._draining = False
        self._ready = False
        self._work = trio.CancelScope(shield=True)
        self._listener_scope = trio.CancelScope()
        self._grace_scope = trio.CancelScope()
        self._shutdown_requested = trio.Event()
        self._server_info = p.ServerInfo(name="trioserve", version=__version__)

    # -- the one model (a server of one model, as tests and embedders use it) ----------

    def _single(self) -> ServedModel:
        served = self.models.default_served()
        if served is None:
            raise AttributeError("this server serves several models: see server.models")
        return served

    @property
    def engine(self) -> Engine:
        return self._single().engine

    @property
    def scheduler(self) -> Scheduler:
        return self._single().scheduler

    @property
    def generations(self) -> Generations:
        return self._single().generations

    @property
    def tokenizing(self) -> Tokenizing:
        return self._single().tokenizing

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._single().chat_template

    @property
    def draining(self) -> bool:
        return self._draining

    def statistics(self) -> ServerStatistics:
        loaded = self.models.loaded()
        if len(loaded) == 1:
            scheduler = loaded[0].scheduler.statistics()
        else:
            scheduler = _summed([served.scheduler.statistics() for served in loaded])
        return ServerStatistics(
            connections=len(self._connections),
            requests_in_flight=sum(len(c.requests) for c in self._connections),
            scheduler=scheduler,
        )

    def info_reply(self, echoed: Mapping[str, Any]) -> p.InfoReply:
        stats = self.statistics()
        status = p.Status(
            connections=stats.connections,
            requests_in_flight=stats.requests_in_flight,
            running_jobs=stats.scheduler.running,
            waiting_jobs=stats.scheduler.waiting,
        )
        default = self.models.default_served()
        model = default.model_info() if default is not None else _unloaded_info(self.models)
        models = (
            tuple(p.ModelEntry.of(slot.describe()) for slot in self.models.slots.values())
            if self.models.several
            else None
        )
        return p.InfoReply(
            server=self._server_info,
            model=model,
            limits=self._limits,
            status=status,
            echoed=echoed,
            models=models,
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
        if "*" in config.allowed_origins and config.api_key is None:
            log.warning(
                "every origin is allowed and there is no API key: any web page a user of "
                "this machine visits can drive the model"
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
        """Start the graceful shutdown: readiness false, no new work.

        Synchronous and idempotent, so it can run in a ``finally`` block.
        """
        self._draining = True
        self.models.wake_waiters()
        # The listener stays open during the drain: /ready answers 503 and new
        # WebSocket upgrades 503, so that a load balancer takes this instance
        # out of its rotation before the port goes away.
        self.front_door.drain()
        self._shutdown_requested.set()

    def abort(self) -> None:
        """Interrupt everything now, without the grace period."""
        self.begin_shutdown()
        self._grace_scope.cancel()

    async def _run_work(self, *, task_status: trio.TaskStatus[Listening]) -> None:
        with self._work:
            # Without the thread that loaded the engine, the scheduler opens
            # one of its own.
            await self._serve_all(task_status)

    async def _serve_all(self, task_status: trio.TaskStatus[Listening]) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.models.run)
            nursery.start_soon(self._shutdown_when_asked, nursery.cancel_scope)
            # Connections live in a nursery of their own (the front door gives
            # each an exception boundary), so that closing the listener does
            # not cut them short.
            async with trio.open_nursery() as connections:
                listeners = await nursery.start(self._run_listener, connections)
                # A name such as "localhost" may bind several addresses (with
                # port 0, on different ports): report the first.
                host, port = listeners[0].socket.getsockname()[:2]
                self._ready = True
                task_status.started(Listening(host=str(host), port=int(port)))
                await self._shutdown_requested.wait()

    async def _run_listener(
        self, connections: trio.Nursery, *, task_status: trio.TaskStatus[Any]
    ) -> None:
        with self._listener_scope:
            await serve_front_door(
                self.front_door,
                self.config.host,
                self.config.port,
                handler_nursery=connections,
                task_status=task_status,
            )

    async def _shutdown_when_asked(self, work: trio.CancelScope) -> None:
        """Let jobs finish within the grace period, interrupt the rest, close."""
        await self._shutdown_requested.wait()
        self.front_door.drain()
        with self._grace_scope:
            self._grace_scope.deadline = trio.current_time() + self.config.shutdown_grace
            await self.models.wait_idle()
        for connection in list(self._connections):
            connection.interrupt_all()
        with trio.move_on_after(self.config.close_timeout):
            for connection in list(self._connections):
                await connection.wait_requests_done()
        self._listener_scope.cancel()
        with trio.move_on_after(2 * self.config.close_timeout):
            async with trio.open_nursery() as nursery:
                for connection in list(self._connections):
                    nursery.start_soon(connection.close, 1001, "server shutting down")
                await self.front_door.wait_http_closed()
        work.cancel()

    # -- the front door's parts -------------------------------------------------------

    def readiness(self) -> Readiness:
        """``/ready``: ready once listening, until the shutdown begins."""
        if self._draining:
            return "draining"
        return "ready" if self._ready else "starting"

    def _admit_websocket(self, head: RequestHead) -> Reject | None:
        if len(self._connections) >= self.config.max_connections:
            return Reject(
                503, "too many connections", "capacity", (("Retry-After", "1"),), "overloaded"
            )
        return None

    async def _run_websocket(self, ws: WebSocketConnection, head: RequestHead) -> None:
        """Serve one accepted WebSocket connection until it ends."""
        connection = Connection(
            self._connection_services, ws, head.peer, client=self.identity.of(head)
        )
        self._connections.add(connection)
        try:
            await connection.run()
        finally:
            self._connections.discard(connection)

    def _info_page(self) -> dict[str, Any]:
        default = self.models.default_served()
        if default is None or self.models.several:
            return {"models": list(self.models.slots), "engine": "several: GET /models"}
        info = default.info
        return {"model": info.model_name, "engine": info.engine}


def model_settings(config: ServerConfig) -> ModelSettings:
    """What of ``config`` shapes each model's pipeline."""
    return ModelSettings(
        max_new_tokens=config.max_new_tokens,
        max_waiting_jobs=config.max_waiting_jobs,
        max_running_per_client=config.max_running_per_client,
        max_requests_per_client=config.max_requests_per_client,
        tool_call_format=config.tool_call_format,
        reasoning_format=config.reasoning_format,
        reasoning_budget=config.reasoning_budget,
        chat_template=config.chat_template,
    )


def _summed(stats: list[SchedulerStatistics]) -> SchedulerStatistics:
    """Every loaded model's scheduler statistics, added up."""
    fields = [field.name for field in attrs.fields(SchedulerStatistics)]
    return SchedulerStatistics(**{name: sum(getattr(s, name) for s in stats) for name in fields})


def _unloaded_info(models: Models) -> p.ModelInfo:
    """The ``info`` reply's model while the default model is not loaded."""
    return p.ModelInfo(
        name=models.default_id,
        engine="unloaded",
        context_length=0,
        vocab_size=0,
        bos_token_id=None,
        eos_token_ids=(),
        max_batch=0,
        batching=False,
        constraints=(),
        kernels=None,
    )
