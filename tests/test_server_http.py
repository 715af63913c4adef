"""The server's HTTP side on its one port: health, readiness through a drain,
metrics that move as WebSocket and HTTP clients are served, and both
protocols interleaved (scripted engine; the real model is in test_openai_http.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio_websocket
from prometheus_client.parser import text_string_to_metric_families

from trioserve.server import Listening, Server, ServerConfig

from .helpers import ScriptedEngine, raw_client, wait_until
from .http_helpers import connect as http_connect
from .http_helpers import get, request

pytestmark = pytest.mark.unit


@asynccontextmanager
async def server_in_scope(
    engine: ScriptedEngine, **options: Any
) -> AsyncIterator[tuple[Server, Listening, trio.CancelScope]]:
    """A server whose own cancel scope the test may cancel (a shutdown) while
    the test body goes on."""
    server = Server(engine, ServerConfig(host="127.0.0.1", port=0, **options))
    scope = trio.CancelScope()

    async def run(*, task_status: trio.TaskStatus[Listening]) -> None:
        with scope:
            await server.run(task_status=task_status)

    async with trio.open_nursery() as nursery:
        listening = await nursery.start(run)
        yield server, listening, scope
        nursery.cancel_scope.cancel()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, keyed by name and sorted labels."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reply = await get(port, "/metrics")
    assert reply.status == 200
    return samples(reply.body.decode())


def value(found: dict[Any, float], name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_health_ready_and_the_info_page() -> None:
    async with server_in_scope(ScriptedEngine()) as (_, listening, _scope):
        port = listening.port
        assert (await get(port, "/health")).json() == {"status": "ok"}
        ready = await get(port, "/ready")
        assert ready.status == 200 and ready.json() == {"status": "ready"}
        page = (await get(port, "/")).json()
        assert page["name"] == "trioserve" and page["model"] == "scripted-bytes"
        missing = await get(port, "/nothing-here")
        assert missing.status == 404


async def test_readiness_turns_false_first_in_a_drain() -> None:
    engine = ScriptedEngine(step_delay=0.01)
    async with server_in_scope(engine, shutdown_grace=10) as (_, listening, scope):
        port = listening.port
        async with raw_client(listening.url) as ws:
            await ws.send({"action": "infer", "text": "long", "max_new_tokens": 60})
            await wait_until(lambda: engine.steps > 0)
            scope.cancel()  # the shutdown starts; the job has its grace period
            # Readiness is false at once, liveness stays true, and the
            # running job still finishes normally.
            ready = await get(port, "/ready")
            assert ready.status == 503 and ready.json() == {"status": "draining"}
            assert (await get(port, "/health")).status == 200
            (final,) = await ws.recv_until_final()
            assert final["stop_reason"] == "num_tokens"


async def test_websocket_and_http_interleave_on_one_port_and_metrics_move() -> None:
    # A slow model: the long answer takes 50 s unless stopped, so the stop
    # reaches it however loaded the machine is (without a delay it could finish
    # its 500 tokens before the stop arrived, and did on a busy 2-core machine).
    async with server_in_scope(ScriptedEngine(step_delay=0.01)) as (_, listening, _scope):
        port = listening.port
        before = await scrape(port)
        async with raw_client(listening.url) as ws, http_connect(port) as http:
            # One kept-alive HTTP connection and one WebSocket, in turns.
            for i in range(3):
                await http.send(request(path="/health"))
                reply = await http.response()
                assert reply is not None and reply.status == 200
                await ws.send({"action": "infer", "text": f"say:hi{i}", "max_new_tokens": 20})
                (final,) = await ws.recv_until_final()
                assert final["response"] == f"hi{i}"
            assert await ws.request({"action": "echo"}) == {"action": "echo"}
            await ws.send(
                {"action": "infer", "text": "long", "max_new_tokens": 5000, "stream": True}
            )
            assert (await ws.recv())["response_type"] == "chunk"
            await ws.send({"action": "stop"})
            frames = await ws.recv_until_final()
            assert frames[-1]["stop_reason"] == "interrupted"
            assert (await ws.recv())["action"] == "stop"
        with pytest.raises(trio_websocket.ConnectionRejected):
            async with raw_client(
                listening.url, extra_headers=[(b"Origin", b"https://evil.example")]
            ):
                pass
        after = await scrape(port)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    requests = "trioserve_requests_total"
    assert moved(requests, api="websocket", action="infer", outcome="eos") == 3
    assert moved(requests, api="websocket", action="infer", outcome="interrupted") == 1
    assert moved(requests, api="websocket", action="echo", outcome="ok") == 1
    assert moved(requests, api="websocket", action="stop", outcome="ok") == 1
    assert moved("trioserve_cancellations_total", cause="stop") == 1
    assert moved("trioserve_rejected_handshakes_total", reason="origin") == 1
    assert moved("trioserve_time_to_first_token_seconds_count", api="websocket") == 4
    assert moved("trioserve_generated_tokens_total", api="websocket") >= 3 * 4
    assert moved("trioserve_engine_steps_total") >= 4
    assert moved("trioserve_queue_wait_seconds_count") == 4
    assert value(after, "trioserve_connections_total", protocol="websocket") >= 1


async def test_a_disconnect_counts_as_a_disconnect_cancellation() -> None:
    engine = ScriptedEngine(step_delay=0.005)
    async with server_in_scope(engine) as (server, listening, _scope):
        async with raw_client(listening.url) as ws:
            await ws.send({"action": "infer", "text": "long", "max_new_tokens": 500})
            await wait_until(lambda: server.scheduler.statistics().running == 1)
        await wait_until(lambda: server.scheduler.statistics().running == 0)
        found = await scrape(listening.port)
    assert value(found, "trioserve_cancellations_total", cause="disconnect") == 1


async def test_the_api_key_guards_every_route_but_health() -> None:
    key = "s3cret"
    async with server_in_scope(ScriptedEngine(), api_key=key) as (_, listening, _scope):
        port = listening.port
        assert (await get(port, "/health")).status == 200
        assert (await get(port, "/ready")).status == 200
        for path in ("/metrics", "/v1/models", "/"):
            assert (await get(port, path)).status == 401, path
            ok = await get(port, path, headers={"Authorization": f"Bearer {key}"})
            assert ok.status == 200, path
        models = await get(port, "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert [m["id"] for m in json.loads(models.body)["data"]] == ["scripted-bytes"]


async def test_public_metrics_opens_metrics_alone() -> None:
    key = "s3cret"
    async with server_in_scope(ScriptedEngine(), api_key=key, public_metrics=True) as (
        _,
        listening,
        _scope,
    ):
        port = listening.port
        metrics = await get(port, "/metrics")
        assert metrics.status == 200 and b"vllm:num_requests_waiting" in metrics.body
        for path in ("/v1/models", "/model_info", "/", "/metrics/x"):
            assert (await get(port, path)).status == 401, path
