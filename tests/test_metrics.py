"""Metrics: the exposition parsed with prometheus_client's own parser, and the
counters moving as the server's hooks are called."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from trioserve.metrics import CANCEL_CAUSES, Metrics

pytestmark = pytest.mark.unit


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(body.decode("utf-8")):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted(labels.items())))]


def test_request_counters_and_token_counters_move() -> None:
    metrics = Metrics()
    metrics.request_finished(
        api="openai",
        action="chat_completions",
        outcome="eos",
        prompt_tokens=12,
        generated_tokens=5,
        cached_tokens=4,
        duration=0.3,
    )
    metrics.request_finished(api="websocket", action="infer", outcome="num_tokens", prompt_tokens=3)
    metrics.request_finished(api="websocket", action="echo", outcome="ok")
    key = {"api": "openai", "action": "chat_completions", "outcome": "eos"}
    assert value(metrics, "trioserve_requests_total", **key) == 1
    assert value(metrics, "trioserve_prompt_tokens_total", api="openai") == 12
    assert value(metrics, "trioserve_prompt_tokens_total", api="websocket") == 3
    assert value(metrics, "trioserve_generated_tokens_total", api="openai") == 5
    assert value(metrics, "trioserve_cached_prompt_tokens_total", api="openai") == 4
    assert value(metrics, "trioserve_request_duration_seconds_count", api="openai") == 1
    assert value(metrics, "trioserve_request_duration_seconds_count", api="websocket") == 0
    assert (
        value(metrics, "trioserve_requests_total", api="websocket", action="echo", outcome="ok")
        == 1
    )


def test_histograms_put_observations_in_buckets() -> None:
    metrics = Metrics()
    metrics.first_token(0.2, api="websocket")
    metrics.queue_wait(0.0007)
    metrics.tokens(0.06, count=3)  # three gaps of 20 ms
    s = samples(metrics)
    ttft = "trioserve_time_to_first_token_seconds_bucket"
    assert s[(ttft, (("api", "websocket"), ("le", "0.1")))] == 0
    assert s[(ttft, (("api", "websocket"), ("le", "0.25")))] == 1
    assert s[("trioserve_queue_wait_seconds_bucket", (("le", "0.001"),))] == 1
    assert s[("trioserve_queue_wait_seconds_bucket", (("le", "0.0005"),))] == 0
    itl = "trioserve_inter_token_latency_seconds"
    assert s[(f"{itl}_count", ())] == 3
    assert s[(f"{itl}_bucket", (("le", "0.02"),))] == 3
    assert s[(f"{itl}_bucket", (("le", "0.01"),))] == 0
    assert abs(s[(f"{itl}_sum", ())] - 0.06) < 1e-9


def test_engine_steps_and_job_gauges() -> None:
    metrics = Metrics()
    metrics.step(0.03, batch=4)
    metrics.step(0.01, batch=0)
    metrics.jobs(running=4, waiting=7)
    assert value(metrics, "trioserve_engine_steps_total") == 2
    assert value(metrics, "trioserve_engine_step_duration_seconds_count") == 2
    # An empty step (only cancellations) is not a batch.
    assert value(metrics, "trioserve_engine_step_batch_size_count") == 1
    assert value(metrics, "trioserve_jobs_running") == 4
    assert value(metrics, "trioserve_jobs_waiting") == 7
    metrics.jobs(running=0, waiting=0)
    assert value(metrics, "trioserve_jobs_waiting") == 0


def test_the_engines_totals_advance_the_counters_by_their_change() -> None:
    metrics = Metrics()
    metrics.engine_memory(kv_cache_bytes=4096, weight_bytes=10**8)
    assert value(metrics, "trioserve_engine_kv_cache_bytes") == 4096
    assert value(metrics, "trioserve_engine_weight_bytes") == 10**8
    assert value(metrics, "trioserve_prefix_cache_lookups_total", result="hit") == 0
    for hits, misses in ((0, 3), (2, 3), (2, 3), (5, 4)):
        metrics.prefix_cache(
            size_bytes=hits * 64, capacity_bytes=1024, hits=hits, misses=misses, evictions=1
        )
    assert value(metrics, "trioserve_prefix_cache_lookups_total", result="hit") == 5
    assert value(metrics, "trioserve_prefix_cache_lookups_total", result="miss") == 4
    assert value(metrics, "trioserve_prefix_cache_evictions_total") == 1
    assert value(metrics, "trioserve_prefix_cache_bytes") == 320
    assert value(metrics, "trioserve_prefix_cache_capacity_bytes") == 1024
    metrics.prefill_deferrals(7)
    metrics.prefill_deferrals(2)  # a new engine counts from 0: only growth counts
    metrics.prefill_deferrals(3)
    assert value(metrics, "trioserve_prefill_deferrals_total") == 8


def test_connections_rejections_cancellations_http() -> None:
    metrics = Metrics()
    for cause in CANCEL_CAUSES:
        assert value(metrics, "trioserve_cancellations_total", cause=cause) == 0
    metrics.cancelled("disconnect")
    metrics.cancelled("disconnect")
    metrics.cancelled("stop")
    assert value(metrics, "trioserve_cancellations_total", cause="disconnect") == 2
    assert value(metrics, "trioserve_cancellations_total", cause="stop") == 1
    metrics.connection_opened("websocket")
    metrics.connection_opened("http")
    metrics.connection_opened("http")
    metrics.connection_closed("http")
    assert value(metrics, "trioserve_open_connections", protocol="http") == 1
    assert value(metrics, "trioserve_open_connections", protocol="websocket") == 1
    assert value(metrics, "trioserve_connections_total", protocol="http") == 2
    metrics.handshake_rejected("auth")
    assert value(metrics, "trioserve_rejected_handshakes_total", reason="auth") == 1
    assert value(metrics, "trioserve_rejected_handshakes_total", reason="origin") == 0
    metrics.http_response("/health", 200)
    metrics.http_response("/health", 200)
    metrics.http_response("unmatched", 404)
    assert value(metrics, "trioserve_http_responses_total", route="/health", code="200") == 2
    assert value(metrics, "trioserve_http_responses_total", route="unmatched", code="404") == 1


def test_client_strings_never_become_labels() -> None:
    metrics = Metrics()
    metrics.request_finished(api="websocket", action="x" * 1000, outcome="unknown_action")
    metrics.request_finished(api="gopher", action="infer", outcome="weird")
    metrics.cancelled("cosmic ray")
    metrics.handshake_rejected("because")
    s = samples(metrics)
    labels = {value for (_, pairs) in s for (_, value) in pairs}
    assert "x" * 1000 not in labels
    assert not {"gopher", "weird", "cosmic ray", "because"} & labels
    key = {"api": "websocket", "action": "unknown", "outcome": "unknown_action"}
    assert value(metrics, "trioserve_requests_total", **key) == 1
    key = {"api": "other", "action": "infer", "outcome": "other"}
    assert value(metrics, "trioserve_requests_total", **key) == 1
    assert value(metrics, "trioserve_cancellations_total", cause="other") == 1
    assert value(metrics, "trioserve_rejected_handshakes_total", reason="other") == 1


def test_each_instance_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()
    a.cancelled("stop")
    assert value(a, "trioserve_cancellations_total", cause="stop") == 1
    assert value(b, "trioserve_cancellations_total", cause="stop") == 0
    # The process-global registry is left alone.
    assert REGISTRY.get_sample_value("trioserve_cancellations_total", {"cause": "stop"}) is None


def test_build_info_names_the_model() -> None:
    metrics = Metrics()
    metrics.set_model(model="SmolLM2-135M-Instruct", engine="cpu")
    s = samples(metrics)
    [info] = [pairs for (name, pairs) in s if name == "trioserve_build_info"]
    assert ("model", "SmolLM2-135M-Instruct") in info
    assert ("engine", "cpu") in info


def test_process_collectors_are_optional() -> None:
    with_process = {name for name, _ in samples(Metrics())}
    without = {name for name, _ in samples(Metrics(process=False))}
    assert "python_info" in with_process
    assert "python_info" not in without


def test_openmetrics_when_the_scraper_asks() -> None:
    metrics = Metrics()
    metrics.cancelled("shutdown")
    body, content_type = metrics.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    text = body.decode("utf-8")
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in openmetrics_families(text)}  # type: ignore[no-untyped-call]
    cancellations = families["trioserve_cancellations"]
    [shutdown] = [
        s
        for s in cancellations.samples
        if s.name == "trioserve_cancellations_total" and s.labels == {"cause": "shutdown"}
    ]
    assert shutdown.value == 1
    # A plain scraper (curl, an old Prometheus) gets the text format.
    assert metrics.render("*/*")[1].startswith("text/plain")


def test_constraints_are_counted_by_kind_and_outcome() -> None:
    metrics = Metrics(process=False)
    metrics.constraint("json_schema", "compiled", 0.004)
    metrics.constraint("json_schema", "cached")
    metrics.constraint("regex", "refused", 0.002)
    metrics.constraint("bogus", "weird")  # unknown labels are bounded, not new series
    assert value(metrics, "trioserve_constraints_total", kind="json_schema", outcome="cached") == 1
    assert value(metrics, "trioserve_constraints_total", kind="regex", outcome="refused") == 1
    assert value(metrics, "trioserve_constraints_total", kind="other", outcome="other") == 1
    # A cache hit compiles nothing: three observations of the four requests.
    assert value(metrics, "trioserve_constraint_compile_seconds_count") == 3


def test_the_engines_of_several_models_advance_the_counters_each_by_its_own_change() -> None:
    """Two models' prefix caches report running totals alternately: each
    advances the counter by its own change, never by the other's."""
    metrics = Metrics(process=False)

    def hits() -> float:
        value = metrics.registry.get_sample_value(
            "trioserve_prefix_cache_lookups_total", {"result": "hit"}
        )
        return value or 0.0

    for source, total in (("a", 100), ("b", 5), ("a", 101), ("b", 7), ("a", 101)):
        metrics.prefix_cache(
            size_bytes=0, capacity_bytes=1, hits=total, misses=0, evictions=0, source=source
        )
    assert hits() == 101 + 7


def test_a_reloaded_model_counts_from_its_new_engines_zero() -> None:
    """A model unloaded and loaded again has a new engine whose running
    totals start at 0: every one of its hits counts, and its gauges left
    the sums while it was gone."""
    metrics = Metrics(process=False)
    metrics.declare_models(["a", "b"])

    def cache(model: str, hits: int, size: int) -> None:
        metrics.prefix_cache(
            size_bytes=size, capacity_bytes=1000, hits=hits, misses=0, evictions=0, source=model
        )

    cache("a", 1000, 300)
    cache("b", 5, 200)
    metrics.jobs(running=2, waiting=1, source="a")
    metrics.jobs(running=1, waiting=0, source="b")
    assert value(metrics, "trioserve_prefix_cache_lookups_total", result="hit") == 1005
    assert value(metrics, "trioserve_prefix_cache_bytes") == 500
    assert value(metrics, "trioserve_jobs_running") == 3
    metrics.model_unloaded("a")
    assert value(metrics, "trioserve_prefix_cache_bytes") == 200
    assert value(metrics, "trioserve_jobs_running") == 1
    assert value(metrics, "trioserve_model_jobs_running", model="a") == 0
    assert value(metrics, "vllm:num_requests_running", model_name="a") == 0
    cache("a", 40, 50)  # the reloaded engine's first step
    assert value(metrics, "trioserve_prefix_cache_lookups_total", result="hit") == 1045
    assert value(metrics, "trioserve_prefix_cache_bytes") == 250
    # A model that was never declared gets no series of its own.
    metrics.jobs(running=7, waiting=0, source="zzz")
    assert ("trioserve_model_jobs_running", (("model", "zzz"),)) not in samples(metrics)
