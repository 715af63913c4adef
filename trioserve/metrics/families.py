"""The metric families labelled by model: what an endpoint picker reads
(vLLM's names) and each model's own figures on a server of several models;
and the histograms' bucket edges. :class:`~trioserve.metrics.Metrics` holds
one of each."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

__all__ = ["EngineGauges", "ModelMetrics", "PickerMetrics", "Summed", "exposition"]

# Bucket edges, in seconds. Time to first token spans a short prompt on a GPU
# (milliseconds) to a long prefill on a CPU behind a queue (a minute); a step
# and the gap between tokens span a GPU's milliseconds to a CPU's large batch.
TTFT_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITL_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
)  # fmt: skip
QUEUE_BUCKETS: Final = (
    0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
STEP_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
)  # fmt: skip
BATCH_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DURATION_BUCKETS: Final = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)  # fmt: skip


class EngineGauges:
    """What the engines report of their memory and prefix caches (the CPU
    engine's figures; a server of several models sums its engines')."""

    def __init__(self, r: CollectorRegistry, ns: str) -> None:
        self.kv_bytes = Gauge(
            "engine_kv_cache_bytes",
            "Bytes the running jobs' keys and values hold (CPU engine).",
            namespace=ns,
            registry=r,
        )
        self.weight_bytes = Gauge(
            "engine_weight_bytes",
            "Bytes the model's weights hold in memory (CPU engine; a mapped table not counted).",
            namespace=ns,
            registry=r,
        )
        self.prefix_bytes = Gauge(
            "prefix_cache_bytes",
            "Bytes the prefix cache of finished prompts holds (CPU engine).",
            namespace=ns,
            registry=r,
        )
        self.prefix_capacity = Gauge(
            "prefix_cache_capacity_bytes",
            "The prefix cache's bound in bytes (CPU engine).",
            namespace=ns,
            registry=r,
        )
        self.prefix_lookups = Counter(
            "prefix_cache_lookups",
            "Prompts looked up in the prefix cache, by result (hit: at least one block reused).",
            ("result",),
            namespace=ns,
            registry=r,
        )
        self.prefix_evictions = Counter(
            "prefix_cache_evictions",
            "Prefix cache blocks evicted to stay within its bound.",
            namespace=ns,
            registry=r,
        )
        self.prefill_deferrals = Counter(
            "prefill_deferrals",
            "Engine steps that decoded alone while prompts waited, because prefill had had "
            "its share of the engine's time (--prefill-share).",
            namespace=ns,
            registry=r,
        )
        self.kv_capacity = Gauge(
            "engine_kv_cache_capacity_bytes",
            "Bytes the KV cache holds with the engine's largest batch of full contexts"
            " (CPU engine).",
            namespace=ns,
            registry=r,
        )


class PickerMetrics:
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
        self.declare(model)

    def declare(self, model: str) -> None:
        for metric in self._families():
            metric.labels(model)

    def _families(self) -> tuple[Gauge | Counter, ...]:
        return (
            self._picker_running,
            self._picker_waiting,
            self._picker_kv,
            self._picker_queries,
            self._picker_hits,
        )

    # ``model``: a model of a server of several, else the one model's name.

    def jobs(self, running: int, waiting: int, model: str | None = None) -> None:
        name = model or self._model_name
        self._picker_running.labels(name).set(running)
        self._picker_waiting.labels(name).set(waiting)

    def kv_cache(self, use: float, model: str | None = None) -> None:
        self._picker_kv.labels(model or self._model_name).set(use)

    def prompt(self, prompt_tokens: int, cached_tokens: int, model: str | None = None) -> None:
        name = model or self._model_name
        if prompt_tokens > 0:
            self._picker_queries.labels(name).inc(prompt_tokens)
            self._picker_hits.labels(name).inc(min(cached_tokens, prompt_tokens))


class ModelMetrics:
    """A server of several models (``--models-dir``): each model's status,
    loads, requests, tokens, queue and KV cache, labelled by its id (a name
    from the operator's folder)."""

    def __init__(self, r: CollectorRegistry, ns: str) -> None:
        self._progress = Gauge(
            "model_load_progress",
            "How far each model's load has come, 0 to 1 (1 once loaded, 0 when not loaded).",
            ("model",),
            namespace=ns,
            registry=r,
        )
        self._requests = Counter(
            "model_requests",
            "Generation requests answered, by model and outcome.",
            ("model", "outcome"),
            namespace=ns,
            registry=r,
        )
        self._prompt_tokens = Counter(
            "model_prompt_tokens",
            "Prompt tokens of finished or interrupted requests, by model.",
            ("model",),
            namespace=ns,
            registry=r,
        )
        self._generated_tokens = Counter(
            "model_generated_tokens",
            "Tokens generated, the stop token included, by model.",
            ("model",),
            namespace=ns,
            registry=r,
        )
        self._queue_wait = Histogram(
            "model_queue_wait_seconds",
            "Time a job waited in its model's queue before the engine took it, by model.",
            ("model",),
            buckets=QUEUE_BUCKETS,
            namespace=ns,
            registry=r,
        )
        self._running = Gauge(
            "model_jobs_running",
            "Jobs each model's engine is working on.",
            ("model",),
            namespace=ns,
            registry=r,
        )
        self._waiting = Gauge(
            "model_jobs_waiting",
            "Jobs queued for each model's engine.",
            ("model",),
            namespace=ns,
            registry=r,
        )
        self._kv_bytes = Gauge(
            "model_kv_cache_bytes",
            "Bytes each model's running jobs' keys and values hold (CPU engine).",
            ("model",),
            namespace=ns,
            registry=r,
        )
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
            buckets=DURATION_BUCKETS,
            namespace=ns,
            registry=r,
        )

    def declare(self, model: str) -> None:
        """``model``'s series, at 0."""
        for metric in (
            self._progress,
            self._prompt_tokens,
            self._generated_tokens,
            self._queue_wait,
            self._running,
            self._waiting,
            self._kv_bytes,
        ):
            metric.labels(model)

    def status(self, model: str, status: str, statuses: Iterable[str]) -> None:
        """``model`` is now ``status`` (one of ``statuses``)."""
        for each in statuses:
            self._status.labels(model, each).set(1 if each == status else 0)
        if status != "loading":
            self._progress.labels(model).set(1.0 if status == "loaded" else 0.0)

    def progress(self, model: str, fraction: float) -> None:
        """``model``'s load has come ``fraction`` (0 to 1) of the way."""
        self._progress.labels(model).set(fraction)

    def request(self, model: str, outcome: str, prompt_tokens: int, generated: int) -> None:
        self._requests.labels(model, outcome).inc()
        if prompt_tokens > 0:
            self._prompt_tokens.labels(model).inc(prompt_tokens)
        if generated > 0:
            self._generated_tokens.labels(model).inc(generated)

    def queue_wait(self, model: str, seconds: float) -> None:
        self._queue_wait.labels(model).observe(max(seconds, 0.0))

    def jobs(self, model: str, running: int, waiting: int) -> None:
        self._running.labels(model).set(running)
        self._waiting.labels(model).set(waiting)

    def kv_cache(self, model: str, size_bytes: int) -> None:
        self._kv_bytes.labels(model).set(size_bytes)

    def load(self, model: str, *, seconds: float | None, ok: bool) -> None:
        """A load of ``model`` ended (``seconds``: how long it took, when it did)."""
        self._loads.labels(model, "loaded" if ok else "failed").inc()
        if seconds is not None:
            self._load_time.labels(model).observe(seconds)


class Summed:
    """Gauges that show the sum of each source's latest figure (a server of
    several models has one source per model)."""

    def __init__(self) -> None:
        self._parts: dict[Gauge, dict[str, float]] = {}

    def set(self, source: str, gauge: Gauge, value: float) -> None:
        parts = self._parts.setdefault(gauge, {})
        parts[source] = value
        gauge.set(sum(parts.values()))

    def forget(self, source: str) -> None:
        """``source`` is gone: the sums go on without it."""
        for gauge, parts in self._parts.items():
            if parts.pop(source, None) is not None:
                gauge.set(sum(parts.values()))


def exposition(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """The exposition of ``registry``'s metrics and its content type: the
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
    body = encoder(registry)
    if "escaping=underscores" in content_type:
        # The scraper asked for it: the metadata lines follow the samples.
        body = _METADATA_COLON.sub(rb"\1vllm_", body)
    return body, content_type


#: The metadata lines of the vllm: families, whose samples an exposition
#: with underscore escaping names vllm_.
_METADATA_COLON: Final = re.compile(rb"^(# (?:HELP|TYPE|UNIT) )vllm:", re.MULTILINE)
