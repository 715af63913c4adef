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

import re
from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import choose_encoder
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from trioserve._version import __version__

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

# Bucket edges, in seconds. Time to first token spans a short prompt on a GPU
# (milliseconds) to a long prefill on a CPU behind a queue (a minute); a step
# and the gap between tokens span a GPU's milliseconds to a CPU's large batch.
_TTFT_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_ITL_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
)  # fmt: skip
_QUEUE_BUCKETS: Final = (
    0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
_STEP_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
)  # fmt: skip
_BATCH_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_DURATION_BUCKETS: Final = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)  # fmt: skip


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
            buckets=_DURATION_BUCKETS,
        )
        self._ttft = Histogram(
            "time_to_first_token_seconds",
            "Time from a generation request's arrival to its first generated token.",
            ("api",),
            namespace=ns,
            registry=r,
            buckets=_TTFT_BUCKETS,
        )
        self._itl = Histogram(
            "inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request.",
            namespace=ns,
            registry=r,
            buckets=_ITL_BUCKETS,
        )
        self._queue_wait = Histogram(
            "queue_wait_seconds",
            "Time a job waited in the queue before the engine took it.",
            namespace=ns,
            registry=r,
            buckets=_QUEUE_BUCKETS,
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
            buckets=_STEP_BUCKETS,
        )
        self._step_batch = Histogram(
            "engine_step_batch_size",
            "Jobs in one engine step.",
            namespace=ns,
            registry=r,
            buckets=_BATCH_BUCKETS,
        )
        self._kv_bytes = Gauge(
            "engine_kv_cache_bytes",
            "Bytes the running jobs' keys and values hold (CPU engine).",
            namespace=ns,
            registry=r,
        )
        self._weight_bytes = Gauge(
            "engine_weight_bytes",
            "Bytes the model's weights hold in memory (CPU engine; a mapped table not counted).",
            namespace=ns,
            registry=r,
        )
        self._prefix_bytes = Gauge(
            "prefix_cache_bytes",
            "Bytes the prefix cache of finished prompts holds (CPU engine).",
            namespace=ns,
            registry=r,
        )
        self._prefix_capacity = Gauge(
            "prefix_cache_capacity_bytes",
            "The prefix cache's bound in bytes (CPU engine).",
            namespace=ns,
            registry=r,
        )
        self._prefix_lookups = Counter(
            "prefix_cache_lookups",
            "Prompts looked up in the prefix cache, by result (hit: at least one block reused).",
            ("result",),
            namespace=ns,
            registry=r,
        )
        self._prefix_evictions = Counter(
            "prefix_cache_evictions",
            "Prefix cache blocks evicted to stay within its bound.",
            namespace=ns,
            registry=r,
        )
        self._prefill_deferrals = Counter(
            "prefill_deferrals",
            "Engine steps that decoded alone while prompts waited, because prefill had had "
            "its share of the engine's time (--prefill-share).",
            namespace=ns,
            registry=r,
        )
        self._kv_capacity = Gauge(
            "engine_kv_cache_capacity_bytes",
            "Bytes the KV cache holds with the engine's largest batch of full contexts"
            " (CPU engine).",
            namespace=ns,
            registry=r,
        )
        # The engines report running totals; the counters advance by the
        # change, per engine (a server of several models has one each).
        self._engine_totals: dict[tuple[str, str], int] = {}
        #: A server of several models: each one's status and loads.
        self.models = _ModelMetrics(r, ns)
        self._picker = _PickerMetrics(r)
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
            self._prefix_lookups.labels(result)
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
    ) -> None:
        """One request answered. For generation requests, also their token
        counts and their duration (arrival to last frame or byte)."""
        api = _pick(api, APIS)
        self._requests.labels(
            api, _pick(action, ACTIONS, "unknown"), _pick(outcome, OUTCOMES)
        ).inc()
        if prompt_tokens > 0:
            self._prompt_tokens.labels(api).inc(prompt_tokens)
        if generated_tokens > 0:
            self._generated_tokens.labels(api).inc(generated_tokens)
        if cached_tokens > 0:
            self._cached_tokens.labels(api).inc(cached_tokens)
        self._picker.prompt(prompt_tokens, cached_tokens)
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

    def queue_wait(self, seconds: float) -> None:
        """A job left the queue for the engine after ``seconds``."""
        self._queue_wait.observe(max(seconds, 0.0))

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

    def jobs(self, *, running: int, waiting: int) -> None:
        """The scheduler's current running and waiting job counts."""
        self._running.set(running)
        self._waiting.set(waiting)
        self._picker.jobs(running, waiting)

    def engine_memory(
        self, *, kv_cache_bytes: int, weight_bytes: int, kv_cache_capacity_bytes: int = 0
    ) -> None:
        """What the engine's KV cache and weights hold now, and what the KV
        cache can hold (0: unknown)."""
        self._kv_bytes.set(kv_cache_bytes)
        self._weight_bytes.set(weight_bytes)
        self._kv_capacity.set(kv_cache_capacity_bytes)
        use = kv_cache_bytes / kv_cache_capacity_bytes if kv_cache_capacity_bytes > 0 else 0.0
        self._picker.kv_cache(min(use, 1.0))

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
        self._prefix_bytes.set(size_bytes)
        self._prefix_capacity.set(capacity_bytes)
        self._advance(source, "hits", hits, self._prefix_lookups.labels("hit"))
        self._advance(source, "misses", misses, self._prefix_lookups.labels("miss"))
        self._advance(source, "evictions", evictions, self._prefix_evictions)

    def prefill_deferrals(self, total: int, source: str = "") -> None:
        """The engine's running total of deferred prefill steps."""
        self._advance(source, "prefill_deferrals", total, self._prefill_deferrals)

    def _advance(self, source: str, key: str, total: int, counter: Counter) -> None:
        last = self._engine_totals.get((source, key), 0)
        if total > last:
            counter.inc(total - last)
        # A total that went down belongs to a new engine: count from it.
        self._engine_totals[(source, key)] = total

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
        accept = accept or ""
        if "openmetrics" in accept and "escaping=" not in accept:
            # prometheus_client escapes names with underscores by default,
            # colons included (legal in OpenMetrics 1.0): the vllm: samples
            # would lose their names while their HELP and TYPE lines keep
            # them. allow-utf-8 leaves every name here as it is.
            accept = ",".join(part + ";escaping=allow-utf-8" for part in accept.split(","))
        encoder, content_type = choose_encoder(accept)
        body = encoder(self.registry)
        if "escaping=underscores" in content_type:
            # The scraper asked for it: the metadata lines follow the samples.
            body = _METADATA_COLON.sub(rb"\1vllm_", body)
        return body, content_type


#: The metadata lines of the vllm: families, whose samples an exposition
#: with underscore escaping names vllm_.
_METADATA_COLON: Final = re.compile(rb"^(# (?:HELP|TYPE|UNIT) )vllm:", re.MULTILINE)


class _PickerMetrics:
    """The figures an endpoint picker reads, under the names it reads them
    by: the model server protocol of Kubernetes' Gateway API Inference
    Extension (llm-d's endpoint picker) names vLLM's. Labelled by model, as
    vLLM's are, and there at 0 from the start (a picker reads them before
    the first request)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self._model_name = ""
        self._picker_running = Gauge(
            "vllm:num_requests_running",
            "Jobs the engine is working on (trioserve_jobs_running, in vLLM's name).",
            ("model_name",),
            registry=r,
        )
        self._picker_waiting = Gauge(
            "vllm:num_requests_waiting",
            "Jobs queued for the engine (trioserve_jobs_waiting, in vLLM's name).",
            ("model_name",),
            registry=r,
        )
        self._picker_kv = Gauge(
            "vllm:kv_cache_usage_perc",
            "The KV cache's use, 0 to 1: its size now (grown in blocks for the running jobs)"
            " over its capacity (CPU engine; 0 where the engine does not report it).",
            ("model_name",),
            registry=r,
        )
        self._picker_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens of finished requests, each looked up in the prefix cache.",
            ("model_name",),
            registry=r,
        )
        self._picker_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens served from the prefix cache (hits / queries is its hit rate).",
            ("model_name",),
            registry=r,
        )

    def set_model(self, model: str) -> None:
        self._model_name = model
        for metric in (
            self._picker_running,
            self._picker_waiting,
            self._picker_kv,
            self._picker_queries,
            self._picker_hits,
        ):
            metric.labels(model)

    def jobs(self, running: int, waiting: int) -> None:
        self._picker_running.labels(self._model_name).set(running)
        self._picker_waiting.labels(self._model_name).set(waiting)

    def kv_cache(self, use: float) -> None:
        self._picker_kv.labels(self._model_name).set(use)

    def prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        if prompt_tokens > 0:
            self._picker_queries.labels(self._model_name).inc(prompt_tokens)
            self._picker_hits.labels(self._model_name).inc(min(cached_tokens, prompt_tokens))


class _ModelMetrics:
    """A server of several models (``--models-dir``): each model's status and
    its loads, labelled by its id (a name from the operator's folder)."""

    def __init__(self, r: CollectorRegistry, ns: str) -> None:
        self._status = Gauge(
            "model_status",
            "1 for each model's current status (a server of several models: unloaded, "
            "loading, loaded, unloading, sleeping, failed), else 0.",
            ("model", "status"),
            namespace=ns,
            registry=r,
        )
        self._loads = Counter(
            "model_loads",
            "Model loads ended, by model and outcome (loaded, failed).",
            ("model", "outcome"),
            namespace=ns,
            registry=r,
        )
        self._load_time = Histogram(
            "model_load_seconds",
            "Seconds a model's load took (its engine built and warmed up), by model.",
            ("model",),
            buckets=_DURATION_BUCKETS,
            namespace=ns,
            registry=r,
        )

    def status(self, model: str, status: str, statuses: Iterable[str]) -> None:
        """``model`` is now ``status`` (one of ``statuses``)."""
        for each in statuses:
            self._status.labels(model, each).set(1 if each == status else 0)

    def load(self, model: str, *, seconds: float | None, ok: bool) -> None:
        """A load of ``model`` ended (``seconds``: how long it took, when it did)."""
        self._loads.labels(model, "loaded" if ok else "failed").inc()
        if seconds is not None:
            self._load_time.labels(model).observe(seconds)
