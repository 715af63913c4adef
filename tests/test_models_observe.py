"""What a server of several models shows of them: each load's progress
(``GET /models``, ``/models/sse``, the load-progress metric; reported by the
loading code through trioserve/engine/progress.py) and the figures labelled
by model in ``/metrics`` (requests, tokens, queue, jobs, KV cache), on
scripted engines. The real model's load progress is
tests/test_models_e2e.py's."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.helpers import ScriptedEngine, raw_client, wait_until
from tests.http_helpers import connect, request
from tests.test_models_registry import Engines, complete, http, several, until_status
from tests.test_server_http import scrape, value
from trioserve import Models, ServerConfig, serve
from trioserve.engine import progress as load_progress

pytestmark = pytest.mark.unit


# -- the progress a loader reports -------------------------------------------------------


def test_a_span_maps_its_part_onto_the_whole_and_never_goes_back() -> None:
    progress = load_progress.LoadProgress()
    with load_progress.reporting_to(progress):
        with load_progress.span(0.0, 0.2):
            load_progress.report(1, 2)
            assert progress.fraction == pytest.approx(0.1)
        assert progress.fraction == pytest.approx(0.2)  # a span ends at its end
        with load_progress.span(0.2, 1.0), load_progress.span(0.5, 1.0):
            load_progress.report(0, 4)  # nested: 0.2 + 0.5 * 0.8
            assert progress.fraction == pytest.approx(0.6)
            load_progress.report(2, 4)
            assert progress.fraction == pytest.approx(0.8)
            load_progress.report(1, 4)  # out of order: no step back
            assert progress.fraction == pytest.approx(0.8)
            load_progress.report(9, 4)  # past the end: the span's end
            assert progress.fraction == pytest.approx(1.0)


def test_reports_without_a_listener_or_with_no_total_do_nothing() -> None:
    load_progress.report(1, 2)  # nobody listens on this thread
    progress = load_progress.LoadProgress()
    with load_progress.reporting_to(progress):
        load_progress.report(1, 0)
        load_progress.report(1, -3)
        assert progress.fraction == 0.0
    with pytest.raises(ValueError, match="0 <= start <= end <= 1"):
        with load_progress.span(0.5, 0.2):
            pass


def test_a_span_that_fails_leaves_the_progress_where_it_was() -> None:
    progress = load_progress.LoadProgress()

    def fail() -> None:
        with load_progress.span(0.0, 0.5):
            load_progress.report(1, 10)
            raise OSError("disk")

    with load_progress.reporting_to(progress), pytest.raises(OSError):
        fail()
    assert progress.fraction == pytest.approx(0.05)


def test_another_threads_reports_are_not_this_loads() -> None:
    progress = load_progress.LoadProgress()

    def elsewhere() -> None:
        load_progress.report(1, 1)

    with load_progress.reporting_to(progress):
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    assert progress.fraction == 0.0


async def test_a_loads_progress_shows_in_models_its_events_and_the_metric() -> None:
    """A loader that reports 30 %, then 70 %, held at each by the test: GET
    /models, the SSE stream and trioserve_model_load_progress follow it, and
    it ends loaded with no progress left in its status."""
    steps = [threading.Event(), threading.Event()]

    def slow() -> ScriptedEngine:
        load_progress.report(3, 10)
        steps[0].wait(30)
        load_progress.report(7, 10)
        steps[1].wait(30)
        return ScriptedEngine()

    models = Models.from_loaders({"slow": slow})
    events: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(serve, models, ServerConfig(host="127.0.0.1", port=0))
        port = listening.port

        async def listen() -> None:
            async with connect(port) as client:
                await client.send(request("GET", "/models/sse"))
                buffer = b""
                while True:
                    data = await client.stream.receive_some(4096)
                    if not data:
                        return
                    buffer += data
                    while b"\n\n" in buffer:
                        chunk, buffer = buffer.split(b"\n\n", 1)
                        for line in chunk.split(b"\n"):
                            if line.startswith(b"data: "):
                                events.append(json.loads(line[6:]))

        nursery.start_soon(listen)
        await wait_until(lambda: len(events) >= 1)
        try:
            status, body = await http(port, "POST", "/models/load", {"model": "slow"})
            assert status == 200 and body["status"] == {"value": "loading", "progress": 0.0}

            async def shown() -> tuple[dict[str, Any], float]:
                _, listed = await http(port, "GET", "/models")
                metric = value(await scrape(port), "trioserve_model_load_progress", model="slow")
                return listed["data"][0]["status"], metric

            # GET /models reads it at once; the metric and the events follow
            # within a look of the publisher (PROGRESS_INTERVAL).
            await until_shown(shown, 0.3)
            steps[0].set()
            await until_shown(shown, 0.7)
        finally:
            for step in steps:
                step.set()
        await until_status(port, "slow", "loaded")
        listed_status, metric = await shown()
        assert listed_status["value"] == "loaded" and "progress" not in listed_status
        assert metric == 1.0
        await wait_until(lambda: events[-1]["status"]["value"] == "loaded")
        nursery.cancel_scope.cancel()
    loading = [e["status"]["progress"] for e in events if e["status"]["value"] == "loading"]
    assert loading[0] == 0.0 and 0.3 in loading and 0.7 in loading
    assert loading == sorted(loading)


async def until_shown(shown: Any, fraction: float) -> None:
    """Poll until both the listed status and the metric show ``fraction``."""
    with trio.fail_after(10):
        while True:
            status, metric = await shown()
            if status.get("progress") == fraction and metric == pytest.approx(fraction):
                return
            await trio.sleep(0.05)


# -- figures by model ---------------------------------------------------------------------


async def test_requests_tokens_and_jobs_are_counted_by_model(tmp_path: Path) -> None:
    engines = Engines(step_delay=0.02)
    async with several(tmp_path, ["a", "b"], engines) as (_, listening):
        port = listening.port
        found = await scrape(port)
        # Every model's series is there at 0 before its first request.
        for model in ("a", "b"):
            assert ("trioserve_model_jobs_running", (("model", model),)) in found
            assert ("vllm:num_requests_running", (("model_name", model),)) in found
            assert value(found, "trioserve_model_load_progress", model=model) == 0.0
            assert value(found, "trioserve_model_status", model=model, status="unloaded") == 1
            assert value(found, "trioserve_model_status", model=model, status="loaded") == 0
        for _ in range(2):
            assert (await complete(port, "a", "say:one two"))[0] == 200
        assert (await complete(port, "b", "say:x"))[0] == 200
        found = await scrape(port)
        assert value(found, "trioserve_model_requests_total", model="a", outcome="eos") == 2
        assert value(found, "trioserve_model_requests_total", model="b", outcome="eos") == 1
        prompt = {m: value(found, "trioserve_model_prompt_tokens_total", model=m) for m in "ab"}
        generated = {
            m: value(found, "trioserve_model_generated_tokens_total", model=m) for m in "ab"
        }
        assert prompt["a"] > 0 and prompt["b"] > 0
        assert prompt["a"] + prompt["b"] == value(
            found, "trioserve_prompt_tokens_total", api="openai"
        )
        assert generated["a"] > generated["b"] > 0
        assert value(found, "vllm:prefix_cache_queries_total", model_name="b") == prompt["b"]
        assert value(found, "trioserve_model_load_progress", model="a") == 1.0

        # One long job on each model: each model's gauge shows its own, the
        # unlabelled gauge their sum (not the model that stepped last).
        async with raw_client(listening.url) as ws:
            for model in ("a", "b"):
                await ws.send(
                    {
                        "action": "infer",
                        "request_id": model,
                        "model": model,
                        "text": "go",
                        "max_new_tokens": 5000,
                        "stream": True,
                    }
                )
            await ws.recv()
            await ws.recv()
            with trio.fail_after(10):
                while True:
                    found = await scrape(port)
                    running = [value(found, "trioserve_model_jobs_running", model=m) for m in "ab"]
                    if running == [1, 1]:
                        break
                    await trio.sleep(0.05)
            assert value(found, "trioserve_jobs_running") == 2
            assert value(found, "vllm:num_requests_running", model_name="b") == 1
            status, _ = await http(port, "POST", "/models/unload", {"model": "a"})
            assert status == 200
            await ws.send({"action": "stop", "request_id": "b"})
            await until_status(port, "a", "unloaded")
            with trio.fail_after(10):
                while True:
                    found = await scrape(port)
                    if value(found, "trioserve_jobs_running") == 0:
                        break
                    await trio.sleep(0.05)
        assert value(found, "trioserve_model_jobs_running", model="a") == 0
        assert value(found, "vllm:num_requests_running", model_name="a") == 0
        assert value(found, "trioserve_model_load_progress", model="a") == 0.0


async def test_a_model_name_no_one_declared_never_becomes_a_label(tmp_path: Path) -> None:
    engines = Engines()
    async with several(tmp_path, ["a"], engines) as (_, listening):
        port = listening.port
        # A name that breaks out of a label, and one too long to be an id.
        assert (await complete(port, 'a"} 1\nevil{x="'))[0] == 404
        assert (await complete(port, "zzz" * 200))[0] == 400
        reply = await http(port, "GET", "/metrics")
        text = reply[1] if isinstance(reply[1], str) else reply[1].decode()
        assert "evil" not in text and "zzz" not in text
        labelled = {
            labels
            for (name, labels) in (await scrape(port))
            if name.startswith("trioserve_model_") or name.startswith("vllm:")
        }
        models = {dict(labels).get("model", dict(labels).get("model_name")) for labels in labelled}
        assert models == {"a"}


# -- a load gives way to the models serving -----------------------------------------------


class _Clock:
    """A stand-in for the progress module's ``time``: parts take what the
    test says, pauses are recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pauses: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def test_a_load_that_gives_way_pauses_after_each_part(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(load_progress, "time", clock)
    busy = [True]
    progress = load_progress.LoadProgress(give_way=lambda: busy[0])
    with load_progress.reporting_to(progress):
        load_progress.report(0, 4)  # the first report starts the clock
        for part, took in enumerate((0.01, 0.03, 10.0), start=1):
            clock.now += took
            load_progress.report(part, 4)
        busy[0] = False
        clock.now += 0.02
        load_progress.report(4, 4)
    give_way = load_progress.GIVE_WAY
    assert clock.pauses == pytest.approx([0.01 * give_way, 0.03 * give_way, 0.5])
    assert progress.fraction == 1.0
    # Without give_way, never a pause.
    clock.pauses.clear()
    with load_progress.reporting_to(load_progress.LoadProgress()):
        for part in range(3):
            clock.now += 0.1
            load_progress.report(part, 3)
    assert clock.pauses == []


async def test_a_load_gives_way_only_while_another_model_has_work() -> None:
    """The registry's ``give_way``, asked on the loading thread: False while
    the other model is idle, True while it generates."""
    asked: dict[str, bool] = {}

    def loader(name: str, step_delay: float = 0.0) -> Any:
        def load() -> ScriptedEngine:
            reporting = load_progress.here()[0]
            assert reporting is not None and reporting.give_way is not None
            asked[name] = reporting.give_way()
            return ScriptedEngine(step_delay=step_delay)

        return load

    models = Models.from_loaders(
        {"a": loader("a", step_delay=0.01), "b": loader("b"), "c": loader("c")}
    )
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(serve, models, ServerConfig(host="127.0.0.1", port=0))
        await models.acquire("a")
        await models.acquire("b")  # a is idle
        async with raw_client(listening.url) as ws:
            await ws.send(
                {
                    "action": "infer",
                    "request_id": 1,
                    "model": "a",
                    "text": "go",
                    "max_new_tokens": 5000,
                    "stream": True,
                }
            )
            await ws.recv()  # a generates
            await models.acquire("c")
            await ws.send({"action": "stop", "request_id": 1})
        nursery.cancel_scope.cancel()
    assert asked == {"a": False, "b": False, "c": True}


def test_the_observing_table_names_every_series_labelled_by_model() -> None:
    """docs/models.md's "Observing" table against the registry: every
    ``trioserve_model_*`` and ``vllm:`` family is in it, and it names none
    that does not exist."""
    import re

    from trioserve.metrics import Metrics

    text = (Path(__file__).parents[1] / "docs" / "models.md").read_text(encoding="utf-8")
    section = text.split("## Observing", 1)[1].split("\n## ", 1)[0]
    documented = {
        name.removesuffix("_total")
        for name in re.findall(r"`((?:trioserve_model_|vllm:)[a-z_:]+)(?:\{[^}]*\})?`", section)
    }
    metrics = Metrics(process=False)
    metrics.declare_models(["m"])
    families = {
        family.name
        for family in metrics.registry.collect()
        if family.name.startswith(("trioserve_model_", "vllm:"))
    }
    assert documented == families
