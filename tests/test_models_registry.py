"""A server of several models (trioserve/server/models.py) on scripted
engines: routing by name on both doors, load and unload through the router's
API, the LRU bound, autoload, a failed load, draining, sleeping, the admin
key, status events, and a storm of loads and unloads while clients stream.
The real model's folder is tests/test_models_e2e.py's."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.helpers import ScriptedEngine, raw_client, wait_until
from tests.http_helpers import connect, request
from trioserve.engine.catalog import Catalog
from trioserve.errors import ModelError
from trioserve.server import Listening, Server, ServerConfig
from trioserve.server.models import ModelError as RegistryError
from trioserve.server.models import Models, ModelSlot
from trioserve.server.server import model_settings

pytestmark = pytest.mark.unit


def _folder(root: Path, names: list[str]) -> Path:
    root.mkdir()
    for name in names:
        (root / name).mkdir()
        (root / name / "config.json").write_text("{}")
        (root / name / "tokenizer.json").write_text("{}")
        (root / name / "model.safetensors").write_bytes(b"\0")
    return root


class Engines:
    """Makes each model's engine: scripted, slow or broken by name."""

    def __init__(self, step_delay: float = 0.0) -> None:
        self.made: dict[str, list[ScriptedEngine]] = {}
        self.step_delay = step_delay
        self.load_delay = 0.0

    def loader_of(self, slot: ModelSlot) -> Callable[[], ScriptedEngine]:
        def load() -> ScriptedEngine:
            if self.load_delay:
                import time

                time.sleep(self.load_delay)
            if slot.id.startswith("broken"):
                raise ModelError(f"{slot.id}: config.json is not a model's config")
            engine = ScriptedEngine(max_batch=2, step_delay=self.step_delay)
            self.made.setdefault(slot.id, []).append(engine)
            return engine

        return load

    def live(self) -> dict[str, int]:
        return {k: sum(not e.closed for e in v) for k, v in self.made.items()}


@asynccontextmanager
async def several(
    tmp_path: Path,
    names: list[str],
    engines: Engines,
    *,
    config: dict[str, Any] | None = None,
    preset: str | None = None,
    **options: Any,
) -> AsyncIterator[tuple[Server, Listening]]:
    root = _folder(tmp_path / "models", names)
    preset_file = None
    if preset is not None:
        preset_file = tmp_path / "presets.toml"
        preset_file.write_text(preset)
    catalog = Catalog.scan(root, preset_file)
    server_config = ServerConfig(host="127.0.0.1", port=0, **(config or {}))
    models = Models.from_catalog(
        catalog, engines.loader_of, model_settings(server_config), **options
    )
    server = Server(config=server_config, models=models)
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(server.run)
        yield server, listening
        nursery.cancel_scope.cancel()


async def http(
    port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    data = b"" if body is None else json.dumps(body).encode()
    async with connect(port) as client:
        await client.send(request(method, path, {"Connection": "close", **(headers or {})}, data))
        reply = await client.response(method)
    assert reply is not None
    try:
        return reply.status, json.loads(reply.body)
    except ValueError:
        return reply.status, reply.body


async def statuses(port: int) -> dict[str, str]:
    status, body = await http(port, "GET", "/models")
    assert status == 200
    return {m["id"]: m["status"]["value"] for m in body["data"]}


async def until_status(port: int, name: str, value: str, within: float = 10.0) -> None:
    """Poll ``GET /models`` until ``name``'s status is ``value``."""
    with trio.fail_after(within):
        while (await statuses(port))[name] != value:  # noqa: ASYNC110
            await trio.sleep(0.02)


async def complete(port: int, model: str, prompt: str = "say:ok", **fields: Any) -> tuple[int, Any]:
    return await http(
        port,
        "POST",
        "/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": 8, **fields},
    )


async def test_each_door_reaches_the_model_it_names_loading_it_on_demand(tmp_path: Path) -> None:
    engines = Engines()
    async with several(tmp_path, ["alpha", "beta"], engines) as (_, listening):
        port = listening.port
        assert await statuses(port) == {"alpha": "unloaded", "beta": "unloaded"}
        status, body = await complete(port, "beta")
        assert status == 200 and body["model"] == "beta" and body["choices"][0]["text"] == "ok"
        assert await statuses(port) == {"alpha": "unloaded", "beta": "loaded"}
        async with raw_client(listening.url) as ws:
            frame = {"action": "infer", "request_id": 1, "text": "say:hi", "max_new_tokens": 8}
            final = await ws.request({**frame, "model": "alpha"})
            assert final["response"] == "hi"
            info = await ws.request({"action": "info"})
            assert {(m["id"], m["status"]) for m in info["models"]} == {
                ("alpha", "loaded"),
                ("beta", "loaded"),
            }
            # No name: the folder's first model.
            reply = await ws.request({"action": "estimate_token", "text": "abc"})
            assert reply["num_tokens"] == 3
            bad = await ws.request({**frame, "model": "../alpha"})
            assert bad["error"]["type"] == "invalid_request" and bad["error"]["field"] == "$.model"
        status, body = await complete(port, "gamma")
        assert status == 404 and body["error"]["code"] == "model_not_found"
        status, body = await http(
            port,
            "POST",
            "/v1/messages",
            {"model": "beta", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
        )
        assert status == 400  # the scripted model has no chat template: but it was found
        status, body = await http(port, "GET", "/v1/models")
        assert [m["id"] for m in body["data"]] == ["alpha", "beta"]
        assert all(m["status"]["value"] == "loaded" for m in body["data"])
        assert engines.live() == {"alpha": 1, "beta": 1}
        status, text = await http(port, "GET", "/metrics")
        assert status == 200
        scrape = text.decode() if isinstance(text, bytes) else str(text)
        assert 'trioserve_model_status{model="beta",status="loaded"} 1.0' in scrape
        assert 'trioserve_model_status{model="beta",status="unloaded"} 0.0' in scrape
        assert 'trioserve_model_loads_total{model="alpha",outcome="loaded"} 1.0' in scrape
        assert 'trioserve_model_load_seconds_count{model="alpha"} 1.0' in scrape


async def test_the_access_log_names_the_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with several(tmp_path, ["alpha", "beta"], Engines()) as (_, listening):
        with caplog.at_level("INFO", logger="trioserve.access"):
            assert (await complete(listening.port, "beta"))[0] == 200
            async with raw_client(listening.url) as ws:
                frame = {"action": "infer", "text": "say:x", "max_new_tokens": 4}
                await ws.request({**frame, "model": "alpha"})
    models = [getattr(r, "fields", {}).get("model") for r in caplog.records]
    assert "beta" in models and "alpha" in models


async def test_past_models_max_the_least_recently_used_is_unloaded_first(tmp_path: Path) -> None:
    engines = Engines()
    async with several(tmp_path, ["a", "b", "c"], engines, max_loaded=2) as (_, listening):
        port = listening.port
        for name in ("a", "b", "a", "c"):
            status, _ = await complete(port, name)
            assert status == 200
        # b was the least recently used when c came.
        assert await statuses(port) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert engines.live() == {"a": 1, "b": 0, "c": 1}
        assert engines.made["b"][0].closed


async def test_without_autoload_a_model_is_refused_until_loaded(tmp_path: Path) -> None:
    engines = Engines()
    async with several(tmp_path, ["a"], engines, autoload=False) as (_, listening):
        port = listening.port
        status, body = await complete(port, "a")
        assert status == 503 and body["error"]["code"] == "model_not_loaded"
        assert "POST /models/load" in body["error"]["message"]
        status, body = await http(port, "POST", "/models/load", {"model": "a"})
        assert status == 200 and body["success"] and body["model"] == "a"
        await wait_until(lambda: engines.live() == {"a": 1})
        await until_status(port, "a", "loaded")
        assert (await complete(port, "a"))[0] == 200


async def test_a_failed_load_is_named_and_the_other_models_serve(tmp_path: Path) -> None:
    engines = Engines()
    async with several(tmp_path, ["broken-one", "good"], engines) as (_, listening):
        port = listening.port
        status, body = await complete(port, "broken-one")
        assert status == 503 and body["error"]["code"] == "model_failed"
        assert "config.json is not a model's config" in body["error"]["message"]
        status, body = await http(port, "GET", "/models")
        broken = next(m for m in body["data"] if m["id"] == "broken-one")
        assert broken["status"]["value"] == "failed"
        assert "config.json" in broken["status"]["reason"]
        assert (await complete(port, "good"))[0] == 200
        # A failed model is not retried by requests; POST /models/load tries again.
        status, body = await http(port, "POST", "/models/load", {"model": "broken-one"})
        assert status == 200 and body["status"]["value"] == "loading"


async def test_unloading_drains_then_ends_what_is_left(tmp_path: Path) -> None:
    engines = Engines(step_delay=0.01)
    async with several(tmp_path, ["a", "b"], engines, unload_timeout=0.3) as (server, listening):
        port = listening.port
        async with raw_client(listening.url) as ws:
            await ws.send(
                {
                    "action": "infer",
                    "request_id": "long",
                    "model": "a",
                    "text": "go",
                    "max_new_tokens": 5000,
                    "stream": True,
                }
            )
            await ws.recv()  # its first chunk: it runs
            status, body = await http(port, "POST", "/models/unload", {"model": "a"})
            assert status == 200 and body["status"]["value"] == "unloading"
            frames = await ws.recv_until_final("long", within=30)
            final = frames[-1]
            assert final["response_type"] == "error"
            assert "the model 'a' was unloaded" in final["error"]["message"]
            assert len(frames) > 2  # what it generated before went out
        await until_status(port, "a", "unloaded")
        assert engines.live()["a"] == 0
        assert sum(server.models.in_flight.values()) == 0


async def test_a_request_during_an_unload_waits_and_loads_it_again(tmp_path: Path) -> None:
    engines = Engines(step_delay=0.01)
    async with several(tmp_path, ["a"], engines, unload_timeout=5) as (_, listening):
        port = listening.port
        async with raw_client(listening.url) as ws:
            await ws.send(
                {
                    "action": "infer",
                    "request_id": 1,
                    "model": "a",
                    "text": "say:" + "x" * 40,
                    "max_new_tokens": 60,
                    "stream": True,
                }
            )
            await ws.recv()
            await http(port, "POST", "/models/unload", {"model": "a"})
            async with trio.open_nursery() as nursery:
                results: list[tuple[int, Any]] = []

                async def later() -> None:
                    results.append(await complete(port, "a"))

                nursery.start_soon(later)
                frames = await ws.recv_until_final(1, within=30)
            # The running one finished within the timeout: whole.
            assert frames[-1]["response_type"] == "full"
            assert frames[-1]["response"] == "x" * 40
        ((status, body),) = results
        assert status == 200 and body["choices"][0]["text"] == "ok"
        assert len(engines.made["a"]) == 2 and engines.made["a"][0].closed
        assert (await statuses(port))["a"] == "loaded"


async def test_a_model_unloaded_while_idle_sleeps_and_wakes(tmp_path: Path) -> None:
    engines = Engines()
    async with several(tmp_path, ["a"], engines, sleep_idle_s=0.3) as (_, listening):
        port = listening.port
        assert (await complete(port, "a"))[0] == 200
        await until_status(port, "a", "sleeping")
        assert engines.live() == {"a": 0}
        assert (await complete(port, "a"))[0] == 200
        assert engines.live() == {"a": 1} and len(engines.made["a"]) == 2


async def test_loading_and_unloading_need_the_admin_key_where_there_is_one(
    tmp_path: Path,
) -> None:
    engines = Engines()
    config = {"api_key": "user-key", "admin_key": "admin-key"}
    async with several(tmp_path, ["a"], engines, config=config) as (_, listening):
        port = listening.port
        user = {"Authorization": "Bearer user-key"}
        status, body = await http(port, "POST", "/models/load", {"model": "a"}, user)
        assert status == 403 and "X-Admin-Key" in body["error"]["message"]
        status, _ = await http(
            port, "POST", "/models/load", {"model": "a"}, {"X-Admin-Key": "admin-key"}
        )
        assert status == 401  # the API key is still needed
        status, _ = await http(
            port, "POST", "/models/load", {"model": "a"}, {**user, "X-Admin-Key": "admin-key"}
        )
        assert status == 200
        status, _ = await http(port, "GET", "/models", headers=user)
        assert status == 200


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"null",
        b"[]",
        b'{"model": 5}',
        b'{"model": "../a"}',
        b'{"model": "/etc/passwd"}',
        b'{"model": "a\\u0000"}',
        b'{"model": "' + b"a" * 200 + b'"}',
        b"\xff\xfe",
        b'{"model": {"id": "a"}}',
    ],
)
async def test_a_bad_load_body_is_a_400_and_loads_nothing(tmp_path: Path, body: bytes) -> None:
    engines = Engines()
    async with several(tmp_path, ["a"], engines) as (_, listening):
        async with connect(listening.port) as client:
            await client.send(request("POST", "/models/load", {"Connection": "close"}, body))
            reply = await client.response("POST")
        assert reply is not None and reply.status == 400, reply
        assert json.loads(reply.body)["error"]["type"] == "invalid_request_error"
        assert await statuses(listening.port) == {"a": "unloaded"}
        assert engines.made == {}


async def test_an_unknown_model_to_load_is_a_404(tmp_path: Path) -> None:
    async with several(tmp_path, ["a"], Engines()) as (_, listening):
        status, body = await http(listening.port, "POST", "/models/unload", {"model": "nope"})
        assert status == 404 and body["error"]["type"] == "not_found_error"


async def test_status_events_follow_a_load_and_an_unload(tmp_path: Path) -> None:
    engines = Engines()
    async with several(tmp_path, ["a"], engines) as (_, listening):
        port = listening.port
        events: list[dict[str, Any]] = []
        async with trio.open_nursery() as nursery:

            async def listen() -> None:
                async with connect(port) as client:
                    await client.send(request("GET", "/models/sse"))
                    buffer = b""
                    while len(events) < 5:
                        data = await client.stream.receive_some(4096)
                        if not data:
                            return
                        buffer += data
                        while b"data: " in buffer and b"\n\n" in buffer.split(b"data: ", 1)[1]:
                            _, rest = buffer.split(b"data: ", 1)
                            line, buffer = rest.split(b"\n\n", 1)
                            events.append(json.loads(line))
                nursery.cancel_scope.cancel()

            nursery.start_soon(listen)
            await wait_until(lambda: len(events) >= 1)
            await http(port, "POST", "/models/load", {"model": "a"})
            await wait_until(lambda: engines.live() == {"a": 1})
            await until_status(port, "a", "loaded")
            await http(port, "POST", "/models/unload", {"model": "a"})
            await wait_until(lambda: len(events) >= 5)
        assert [e["status"]["value"] for e in events] == [
            "unloaded",
            "loading",
            "loaded",
            "unloading",
            "unloaded",
        ]


async def test_a_stop_reaches_an_infer_that_waits_for_its_model(tmp_path: Path) -> None:
    engines = Engines()
    engines.load_delay = 1.0
    async with several(tmp_path, ["a"], engines) as (_, listening):
        async with raw_client(listening.url) as ws:
            await ws.send(
                {"action": "infer", "request_id": 7, "model": "a", "text": "x", "max_new_tokens": 4}
            )
            await trio.sleep(0.1)
            echo = await ws.request({"action": "echo", "request_id": "e"})
            assert echo["request_id"] == "e"  # the reader is not held by the load
            await ws.send({"action": "stop", "request_id": "s"})
            frames = [await ws.recv(), await ws.recv()]
            by_action = {f["action"]: f for f in frames}
            assert by_action["stop"]["stopped"] == 1
            assert "stopped while its model was loading" in by_action["infer"]["error"]["message"]


async def test_a_storm_of_loads_and_unloads_loses_no_request(tmp_path: Path) -> None:
    """Clients stream on every model while others load and unload them at
    random: every request gets an answer (its text, or an error naming the
    model), never a 5xx other than 503, and nothing is left in flight."""
    engines = Engines(step_delay=0.002)
    names = ["a", "b", "c"]
    async with several(tmp_path, names, engines, max_loaded=2, unload_timeout=0.2) as (
        server,
        listening,
    ):
        port = listening.port
        outcomes: list[int] = []
        import random

        rng = random.Random(5)

        async def client(index: int) -> None:
            for _ in range(12):
                status, body = await complete(port, rng.choice(names), max_tokens=30)
                outcomes.append(status)
                assert status in (200, 503), body
                if status == 503:
                    # Named: unloading, was unloaded (cut short), or the room is taken.
                    assert any(f"'{n}'" in body["error"]["message"] for n in names), body

        async def storm() -> None:
            for _ in range(40):
                action = rng.choice(["load", "unload"])
                status, body = await http(
                    port, "POST", f"/models/{action}", {"model": rng.choice(names)}
                )
                assert status in (200, 503, 409), body
                await trio.sleep(rng.random() * 0.05)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for index in range(4):
                    nursery.start_soon(client, index)
                nursery.start_soon(storm)
        assert len(outcomes) == 48 and outcomes.count(200) > 0
        await wait_until(lambda: sum(server.models.in_flight.values()) == 0)
        settled = ("loaded", "unloaded", "failed", "sleeping")
        await wait_until(lambda: all(s.status in settled for s in server.models.slots.values()))
        await wait_until(lambda: sum(engines.live().values()) <= 2)
        loaded = [s for s in server.models.slots.values() if s.status in ("loaded", "loading")]
        assert len(loaded) <= 2
        # Every engine that is not serving was closed.
        live = sum(engines.live().values())
        assert live == sum(1 for s in server.models.slots.values() if s.served is not None)


async def test_a_trio_program_serves_models_it_names_and_loads_itself() -> None:
    """The embedding form: loaders by name, ``serve(models, config)``, and the
    host loading and unloading them (docs/embedding.md)."""
    from trioserve import Models, ServerConfig, serve

    made: list[ScriptedEngine] = []

    def loader() -> ScriptedEngine:
        made.append(ScriptedEngine())
        return made[-1]

    models = Models.from_loaders({"first": loader, "second": loader}, autoload=False)
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(serve, models, ServerConfig(host="127.0.0.1", port=0))
        status, body = await complete(listening.port, "second")
        assert status == 503 and body["error"]["code"] == "model_not_loaded"
        models.load("second")
        served = await models.acquire("second")
        assert served.id == "second" and len(made) == 1
        status, body = await complete(listening.port, "second")
        assert status == 200 and body["model"] == "second"
        assert (await complete(listening.port, "third"))[0] == 404
        models.unload("second")
        await until_status(listening.port, "second", "unloaded")
        assert made[0].closed
        nursery.cancel_scope.cancel()
    with pytest.raises(ValueError, match="models need names"):
        Models.from_loaders({"../x": loader})


async def _settle(models: Models) -> None:
    settled = ("loaded", "unloaded", "failed", "sleeping")
    await wait_until(lambda: all(s.status in settled for s in models.slots.values()))


@asynccontextmanager
async def registry(**options: Any) -> AsyncIterator[tuple[Models, list[ScriptedEngine]]]:
    """Models a, b, c on scripted engines, run in a nursery (no server)."""
    made: list[ScriptedEngine] = []

    def loader() -> ScriptedEngine:
        made.append(ScriptedEngine())
        return made[-1]

    models = Models.from_loaders({"a": loader, "b": loader, "c": loader}, **options)
    async with trio.open_nursery() as nursery:
        await nursery.start(models.run)
        yield models, made
        nursery.cancel_scope.cancel()


def _held(models: Models) -> list[str]:
    return [s.id for s in models.slots.values() if s.status in ("loaded", "loading", "unloading")]


async def test_loads_asked_for_at_once_never_hold_more_than_models_max() -> None:
    """A review's race: while one model unloaded, every new load was handed
    its end and all of them loaded."""
    async with registry(max_loaded=1) as (models, made):
        models.load("a")
        await models.acquire("a")
        models.load("b")
        models.load("c")
        peak = 0
        with trio.fail_after(20):
            while True:
                live = sum(not e.closed for e in made)
                peak = max(peak, live)
                statuses = {s.id: s.status for s in models.slots.values()}
                if list(statuses.values()).count("loaded") == 1 and all(
                    v in ("loaded", "unloaded") for v in statuses.values()
                ):
                    break
                await trio.sleep(0.001)
        assert peak <= 1, peak
        # Reloading one that is unloading counts against the bound too.
        (loaded,) = [s.id for s in models.slots.values() if s.status == "loaded"]
        other = "a" if loaded != "a" else "b"
        models.load(other)
        models.load(loaded)  # while it unloads for `other`
        with trio.fail_after(20):
            while True:
                peak = max(peak, sum(not e.closed for e in made))
                if len(_held(models)) <= 1 and {s.status for s in models.slots.values()} <= {
                    "loaded",
                    "unloaded",
                }:
                    break
                await trio.sleep(0.001)
        assert peak <= 1, peak


async def test_a_load_right_after_an_unload_is_not_undone() -> None:
    async with registry() as (models, _):
        await models.acquire("a")
        models.unload("a")
        models.load("a")  # before the unloading task has woken
        await _settle(models)
        assert models.slots["a"].status == "loaded"


async def test_a_load_after_an_unload_during_the_load_stays_loaded() -> None:
    async with registry() as (models, _):
        models.load("a")
        models.unload("a")  # while it loads
        models.load("a")  # taken back
        await _settle(models)
        assert models.slots["a"].status == "loaded"


async def test_waiting_for_a_load_ends_with_the_shutdown() -> None:
    made: list[ScriptedEngine] = []

    def slow() -> ScriptedEngine:
        import time

        time.sleep(0.5)
        made.append(ScriptedEngine())
        return made[-1]

    models = Models.from_loaders({"a": slow})
    draining = [False]
    models.is_draining = lambda: draining[0]
    async with trio.open_nursery() as nursery:
        await nursery.start(models.run)
        errors: list[RegistryError] = []

        async def wait() -> None:
            try:
                await models.acquire("a")
            except RegistryError as exc:
                errors.append(exc)

        nursery.start_soon(wait)
        await trio.sleep(0.05)
        draining[0] = True
        models.wake_waiters()
        await wait_until(lambda: bool(errors))
        assert errors[0].status == 503 and "shutting down" in errors[0].message
        nursery.cancel_scope.cancel()


async def test_status_watchers_that_left_are_dropped_at_the_next_watch() -> None:
    async with registry() as (models, _):
        for _ in range(50):
            models.watch().close()
        models.watch()
        assert len(models._watchers) == 1


async def test_a_websocket_infer_keeps_its_model_recently_used(tmp_path: Path) -> None:
    engines = Engines()
    async with several(tmp_path, ["a", "b", "c"], engines, max_loaded=2) as (server, listening):
        port = listening.port
        assert (await complete(port, "a"))[0] == 200
        assert (await complete(port, "b"))[0] == 200
        async with raw_client(listening.url) as ws:
            frame = {"action": "infer", "text": "say:x", "max_new_tokens": 4, "model": "a"}
            await ws.request(frame)  # a is now the most recently used
        assert (await complete(port, "c"))[0] == 200
        await _settle(server.models)
        assert {s.id: s.status for s in server.models.slots.values()} == {
            "a": "loaded",
            "b": "unloaded",
            "c": "loaded",
        }


async def test_a_deeply_nested_load_body_is_a_400(tmp_path: Path) -> None:
    async with several(tmp_path, ["a"], Engines()) as (_, listening):
        body = b"[" * 100_000 + b"]" * 100_000
        async with connect(listening.port) as client:
            await client.send(request("POST", "/models/load", {"Connection": "close"}, body))
            reply = await client.response("POST")
        assert reply is not None and reply.status == 400


async def test_models_show_their_path_inside_the_folder(tmp_path: Path) -> None:
    async with several(tmp_path, ["a"], Engines()) as (_, listening):
        _, body = await http(listening.port, "GET", "/models")
        assert body["data"][0]["path"] == "a"


async def test_requests_waiting_for_a_load_count_against_their_clients_limit(
    tmp_path: Path,
) -> None:
    """Three requests of one client (loopback, no key: one client) for a model
    that takes a while to load, under --max-requests-per-client 2: two wait
    for the load, the third is refused at once on each door; once loaded, the
    two are answered and the client's count is back to none."""
    engines = Engines()
    engines.load_delay = 1.0
    config = {"max_requests_per_client": 2}
    async with several(tmp_path, ["a"], engines, config=config) as (server, listening):
        port = listening.port
        answered: list[int] = []
        async with trio.open_nursery() as nursery:

            async def ask() -> None:
                answered.append((await complete(port, "a"))[0])

            nursery.start_soon(ask)
            nursery.start_soon(ask)
            await wait_until(lambda: sum(server.models.in_flight.values()) == 2)
            status, body = await complete(port, "a")
            assert status == 429 and "already has 2 requests in flight" in body["error"]["message"]
            status, body = await http(
                port,
                "POST",
                "/v1/messages",
                {"model": "a", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert status == 429, body
            async with raw_client(listening.url) as ws:
                frame = {
                    "action": "infer",
                    "request_id": 7,
                    "model": "a",
                    "text": "say:x",
                    "max_new_tokens": 4,
                }
                refused = await ws.request(frame)
                assert refused["response_type"] == "error"
                assert refused["error"]["type"] == "overloaded", refused
        assert answered == [200, 200]
        assert not server.models.in_flight
