"""Prometheus metrics of one server, through ``prometheus_client``.

:class:`Metrics` owns a registry of its own (never the process-global one, so
that two servers in one process, or a host application's own metrics, do not
collide) and offers methods with plain arguments for the places that observe
something: the server calls :meth:`Metrics.request_finished`,
:meth:`Metrics.first_token`, :meth:`Metrics.cancelled`, ...; the scheduler calls
:meth:`Metrics.step` and :meth:`Metrics.jobs`; the HTTP front door calls
:meth:`Metrics.connection_opened`, :meth:`Metrics.handshake_rejected` and
:meth:`Metrics.http_response`. :meth:`Metrics.render` gives the exposition for
``GET /metrics`` (text format, or OpenMetrics when the scraper asks for it).

Label values are a closed set per label: a value that is not in it is counted
under ``other`` (or ``unknown`` for actions). A client's own strings (an
unknown action's name, a path) therefore never become a label, and a
scraper's series count stays bounded whatever clients send.

Every method is thread-safe (prometheus_client locks internally) and cheap:
a few dict lookups and a lock, no I/O. Nothing here knows trio or torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from trioserve._version import __version__

from .families import (
    BATCH_BUCKETS,
    DURATION_BUCKETS,
    ITL_BUCKETS,
    QUEUE_BUCKETS,
    STEP_BUCKETS,
    TTFT_BUCKETS,
    EngineGauges,
    ModelMetrics,
    PickerMetrics,
    Summed,
    exposition,
)

__all__ = [
    "ACTIONS",
    "APIS",
    "CANCEL_CAUSES",
    "HANDSHAKE_REJECTIONS",
    "OUTCOMES",
    "PROTOCOLS",
    "Metrics",
]

#: Where a request came from.
APIS: Final = ("websocket", "openai", "anthropic")
#: What it asked for: the WebSocket protocol's actions, the OpenAI routes and
#: Anthropic's Messages route.
ACTIONS: Final = (
    "echo",
    "estimate_token",
    "lefttrim_token",
    "infer",
    "stop",
    "info",
    "completions",
    "chat_completions",
    "models",
    "messages",
    "responses",
)
#: How it ended. Generation ends ``eos`` (a stop token or stop string),
#: ``num_tokens`` (max tokens reached) or ``interrupted``; any request may end
#: with one of the protocol's error types; other actions end ``ok``.
OUTCOMES: Final = (
    "ok",
    "eos",
    "num_tokens",
    "interrupted",
    "invalid_json",
    "invalid_request",
    "unknown_action",
    "overloaded",
    "internal",
    "unauthorized",
    "not_found",
    "too_large",
)
#: Why a job was cancelled before it finished.
CANCEL_CAUSES: Final = ("stop", "disconnect", "shutdown")
#: Structured output: the constraint kinds, and how a request's constraint
#: was had (``compiled``, ``cached``) or not (``refused``: it does not compile).
CONSTRAINT_KINDS: Final = ("json_schema", "regex", "choice", "grammar")
CONSTRAINT_OUTCOMES: Final = ("compiled", "cached", "refused")
#: Connection kinds on the one port.
PROTOCOLS: Final = ("http", "websocket")
#: Why a WebSocket handshake was refused.
HANDSHAKE_REJECTIONS: Final = ("origin", "auth", "draining", "capacity", "invalid")

_OTHER: Final = "other"


def _pick(value: str, allowed: Iterable[str], fallback: str = _OTHER) -> str:
    return value if value in allowed else fallback


class Metrics:
    """The server's metrics and their registry.

    ``process`` adds the standard ``process_*`` (CPU, memory, open files) and
    ``python_info`` collectors to this registry, as a Prometheus client
    library's default registry would.
    """

    def __init__(self, *, namespace: str = "trioserve", process: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ns = namespace
        self._info = Info(
            "build", "trioserve version and the model it serves", namespace=ns, registry=r
        )
        self._info.info({"version": __version__, "model": "", "engine": ""})

        self._requests = Counter(
            "requests",
            "Requests answered, by API, action and outcome.",
            ("api", "action", "outcome"),
            namespace=ns,
            registry=r,
        )
        self._request_duration = Histogram(
            "request_duration_seconds",
            "Time from a generation request's arrival to its last frame or byte.",
            ("api",),
            namespace=ns,
            registry=r,
            buckets=DURATION_BUCKETS,
        )
        self._ttft = Histogram(
            "time_to_first_token_seconds",
            "Time from a generation request's arrival to its first generated token.",
            ("api",),
            namespace=ns,
            registry=r,
            buckets=TTFT_BUCKETS,
        )
        self._itl = Histogram(
            "inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request.",
            namespace=ns,
            registry=r,
            buckets=ITL_BUCKETS,
        )
        self._queue_wait = Histogram(
            "queue_wait_seconds",
            "Time a job waited in the queue before the engine took it.",
            namespace=ns,
            registry=r,
            buckets=QUEUE_BUCKETS,
        )
        self._running = Gauge(
            "jobs_running", "Jobs the engine is working on.", namespace=ns, registry=r
        )
        self._waiting = Gauge(
            "jobs_waiting", "Jobs queued for the engine.", namespace=ns, registry=r
        )
        self._steps = Counter("engine_steps", "Engine steps run.", namespace=ns, registry=r)
        self._step_time = Histogram(
            "engine_step_duration_seconds",
            "Wall time of one engine step (prefill chunks and one batched decode).",
            namespace=ns,
            registry=r,
            buckets=STEP_BUCKETS,
        )
        self._step_batch = Histogram(
            "engine_step_batch_size",
            "Jobs in one engine step.",
            namespace=ns,
            registry=r,
            buckets=BATCH_BUCKETS,
        )
        self._engine = EngineGauges(r, ns)
        # The engines report running totals; the counters advance by the
        # change, per engine (a server of several models has one each).
        self._engine_totals: dict[tuple[str, str], int] = {}
        # The gauges a server of several models sums: each model's latest figure.
        self._sums = Summed()
        self._model_ids: frozenset[str] = frozenset()
        #: A server of several models: each one's status and loads.
        self.models = ModelMetrics(r, ns)
        self._picker = PickerMetrics(r)
        self._prompt_tokens = Counter(
            "prompt_tokens",
            "Prompt tokens of finished or interrupted requests.",
            ("api",),
            namespace=ns,
            registry=r,
        )
        self._generated_tokens = Counter(
            "generated_tokens",
            "Tokens generated, the stop token included.",
            ("api",),
            namespace=ns,
            registry=r,
        )
        self._cached_tokens = Counter(
            "cached_prompt_tokens",
            "Prompt tokens served from the engine's cache instead of computed.",
            ("api",),
            namespace=ns,
            registry=r,
        )
        self._constraints = Counter(
            "constraints",
            "Requests with a constraint, by kind and by how it was compiled.",
            ("kind", "outcome"),
            namespace=ns,
            registry=r,
        )
        self._constraint_compile = Histogram(
            "constraint_compile_seconds",
            "Time to compile a constraint (cache misses), in a worker thread.",
            namespace=ns,
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )
        self._cancellations = Counter(
            "cancellations",
            "Jobs cancelled before they finished, by cause.",
            ("cause",),
            namespace=ns,
            registry=r,
        )
        self._connections = Gauge(
            "open_connections",
            "Open client connections, by protocol.",
            ("protocol",),
            namespace=ns,
            registry=r,
        )
        self._connections_total = Counter(
            "connections",
            "Client connections accepted, by protocol (every connection starts as HTTP; "
            "an upgraded one counts under websocket too).",
            ("protocol",),
            namespace=ns,
            registry=r,
        )
        self._rejected = Counter(
            "rejected_handshakes",
            "WebSocket handshakes refused, by reason.",
            ("reason",),
            namespace=ns,
            registry=r,
        )
        self._http = Counter(
            "http_responses",
            "HTTP responses, by route and status code.",
            ("route", "code"),
            namespace=ns,
            registry=r,
        )
        # Series of the closed label sets exist from the start, at 0, so that
        # rate() and absent-series alerts work before the first event.
        for api in APIS:
            self._request_duration.labels(api)
            self._ttft.labels(api)
            self._prompt_tokens.labels(api)
            self._generated_tokens.labels(api)
            self._cached_tokens.labels(api)
        for result in ("hit", "miss"):
            self._engine.prefix_lookups.labels(result)
        for cause in CANCEL_CAUSES:
            self._cancellations.labels(cause)
        for protocol in PROTOCOLS:
            self._connections.labels(protocol)
            self._connections_total.labels(protocol)
        for reason in HANDSHAKE_REJECTIONS:
            self._rejected.labels(reason)
        if process:
            ProcessCollector(namespace="", registry=r)
            PlatformCollector(registry=r)

    # -- what is served ---------------------------------------------------------------

    def set_model(self, *, model: str, engine: str) -> None:
        """Name the served model in ``trioserve_build_info``."""
        self._info.info({"version": __version__, "model": model, "engine": engine})
        self._picker.set_model(model)

    def request_finished(
        self,
        *,
        api: str,
        action: str,
        outcome: str,
        prompt_tokens: int = 0,
        generated_tokens: int = 0,
        cached_tokens: int = 0,
        duration: float | None = None,
        model: str | None = None,
    ) -> None:
        """One request answered. For generation requests, also their token
        counts and their duration (arrival to last frame or byte); ``model``:
        the model that served it, on a server of several models."""
        api = _pick(api, APIS)
        outcome = _pick(outcome, OUTCOMES)
        self._requests.labels(api, _pick(action, ACTIONS, "unknown"), outcome).inc()
        model = self._model_label(model)
        if model is not None:
            self.models.request(model, outcome, prompt_tokens, generated_tokens)
        if prompt_tokens > 0:
            self._prompt_tokens.labels(api).inc(prompt_tokens)
        if generated_tokens > 0:
            self._generated_tokens.labels(api).inc(generated_tokens)
        if cached_tokens > 0:
            self._cached_tokens.labels(api).inc(cached_tokens)
        self._picker.prompt(prompt_tokens, cached_tokens, model)
        if duration is not None:
            self._request_duration.labels(api).observe(max(duration, 0.0))

    def first_token(self, seconds: float, *, api: str) -> None:
        """A generation request got its first token ``seconds`` after arrival."""
        self._ttft.labels(_pick(api, APIS)).observe(max(seconds, 0.0))

    def tokens(self, seconds: float, count: int = 1) -> None:
        """``count`` more tokens of one request arrived ``seconds`` after its
        previous ones: ``count`` gaps of ``seconds / count`` each (an engine
        step may produce several tokens of one job at once)."""
        if count < 1:
            return
        gap = max(seconds, 0.0) / count
        for _ in range(count):
            self._itl.observe(gap)

    def constraint(self, kind: str, outcome: str, seconds: float = 0.0) -> None:
        """A request's constraint of ``kind`` was ``compiled`` (in ``seconds``),
        found ``cached``, or ``refused``."""
        self._constraints.labels(
            _pick(kind, CONSTRAINT_KINDS), _pick(outcome, CONSTRAINT_OUTCOMES)
        ).inc()
        if outcome != "cached":
            self._constraint_compile.observe(max(seconds, 0.0))

    def queue_wait(self, seconds: float, *, model: str | None = None) -> None:
        """A job (of ``model``, on a server of several) left the queue for
        the engine after ``seconds``."""
        self._queue_wait.observe(max(seconds, 0.0))
        model = self._model_label(model)
        if model is not None:
            self.models.queue_wait(model, seconds)

    def cancelled(self, cause: str) -> None:
        """A job was cancelled: ``stop``, ``disconnect`` or ``shutdown``."""
        self._cancellations.labels(_pick(cause, CANCEL_CAUSES)).inc()

    # -- the engine ---------------------------------------------------------------------

    def step(self, duration: float, batch: int) -> None:
        """One engine step of ``duration`` seconds over ``batch`` jobs."""
        self._steps.inc()
        self._step_time.observe(max(duration, 0.0))
        if batch > 0:
            self._step_batch.observe(batch)

    def jobs(self, *, running: int, waiting: int, source: str = "") -> None:
        """A scheduler's current running and waiting job counts (``source``:
        its model; the unlabelled gauges sum every model's)."""
        self._sums.set(source, self._running, running)
        self._sums.set(source, self._waiting, waiting)
        model = self._model_label(source)
        if model is not None:
            self.models.jobs(model, running, waiting)
        self._picker.jobs(running, waiting, model)

    def engine_memory(
        self,
        *,
        kv_cache_bytes: int,
        weight_bytes: int,
        kv_cache_capacity_bytes: int = 0,
        source: str = "",
    ) -> None:
        """What an engine's KV cache and weights hold now, and what its KV
        cache can hold (0: unknown); ``source``: its model (the unlabelled
        gauges sum every model's)."""
        self._sums.set(source, self._engine.kv_bytes, kv_cache_bytes)
        self._sums.set(source, self._engine.weight_bytes, weight_bytes)
        self._sums.set(source, self._engine.kv_capacity, kv_cache_capacity_bytes)
        use = kv_cache_bytes / kv_cache_capacity_bytes if kv_cache_capacity_bytes > 0 else 0.0
        model = self._model_label(source)
        if model is not None:
            self.models.kv_cache(model, kv_cache_bytes)
        self._picker.kv_cache(min(use, 1.0), model)

    def prefix_cache(
        self,
        *,
        size_bytes: int,
        capacity_bytes: int,
        hits: int,
        misses: int,
        evictions: int,
        source: str = "",
    ) -> None:
        """The prefix cache now: its size, and its running totals since it was
        made (the counters advance by their change; ``source`` tells the
        engines of several models apart)."""
        self._sums.set(source, self._engine.prefix_bytes, size_bytes)
        self._sums.set(source, self._engine.prefix_capacity, capacity_bytes)
        self._advance(source, "hits", hits, self._engine.prefix_lookups.labels("hit"))
        self._advance(source, "misses", misses, self._engine.prefix_lookups.labels("miss"))
        self._advance(source, "evictions", evictions, self._engine.prefix_evictions)

    def prefill_deferrals(self, total: int, source: str = "") -> None:
        """The engine's running total of deferred prefill steps."""
        self._advance(source, "prefill_deferrals", total, self._engine.prefill_deferrals)

    def _advance(self, source: str, key: str, total: int, counter: Counter) -> None:
        last = self._engine_totals.get((source, key), 0)
        if total > last:
            counter.inc(total - last)
        # A total that went down belongs to a new engine: count from it.
        self._engine_totals[(source, key)] = total

    # -- several models -----------------------------------------------------------------

    def declare_models(self, ids: Iterable[str]) -> None:
        """A server of several models: from now on the figures of a request,
        a queue and a KV cache are also counted under their model's id (the
        ``trioserve_model_*`` series and the ``vllm:`` ones' ``model_name``),
        each there at 0 from the start."""
        self._model_ids = frozenset(ids)
        for model in sorted(self._model_ids):
            self.models.declare(model)
            self._picker.declare(model)

    def model_unloaded(self, model: str) -> None:
        """``model``'s engine is gone: its gauges go to 0 and leave the sums,
        and its engine's running totals are forgotten (a new engine counts
        from 0)."""
        self._sums.forget(model)
        for key in [key for key in self._engine_totals if key[0] == model]:
            del self._engine_totals[key]
        if self._model_label(model) is not None:
            self.models.jobs(model, 0, 0)
            self.models.kv_cache(model, 0)
            self._picker.jobs(0, 0, model)
            self._picker.kv_cache(0.0, model)

    def _model_label(self, model: str | None) -> str | None:
        """``model`` when it is one of :meth:`declare_models`' ids (a closed
        set: a request's string never becomes a label), else None."""
        return model if model is not None and model in self._model_ids else None

    # -- connections ----------------------------------------------------------------

    def connection_opened(self, protocol: str) -> None:
        protocol = _pick(protocol, PROTOCOLS)
        self._connections.labels(protocol).inc()
        self._connections_total.labels(protocol).inc()

    def connection_closed(self, protocol: str) -> None:
        self._connections.labels(_pick(protocol, PROTOCOLS)).dec()

    def handshake_rejected(self, reason: str) -> None:
        self._rejected.labels(_pick(reason, HANDSHAKE_REJECTIONS)).inc()

    def http_response(self, route: str, status: int) -> None:
        """An HTTP response. ``route`` is the matched route's pattern (a
        closed set chosen by the server), never a client's path."""
        self._http.labels(route, str(status)).inc()

    # -- exposition -----------------------------------------------------------------

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition of every metric and its content type: the
        Prometheus text format, or OpenMetrics when ``accept`` (the scrape's
        Accept header) asks for it."""
        return exposition(self.registry, accept)
