"""The server's HTTP routes over a real scheduler and a real socket, with the
official ``openai`` SDK as the client: first on the scripted engine (every
path, quickly), then on the real embedded model (what a user sees)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import openai
import pytest
import trio
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import ScriptedEngine, wait_until
from tests.http_helpers import get, running
from trioserve import openai as oa
from trioserve.chat_template import ChatTemplate, load_chat_template
from trioserve.engine.base import Engine, grammars_of
from trioserve.generation.scheduler import Scheduler
from trioserve.metrics import Metrics
from trioserve.server.doors import ClientIdentity
from trioserve.server.front_door import FrontDoor
from trioserve.server.http_types import AccessPolicy, HTTPLimits, Router
from trioserve.server.models import Models
from trioserve.server.routes import OpenAIRoutes, OpsRoutes, Readiness
from trioserve.server.served import ModelSettings

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

T = TypeVar("T")
KEY = "sk-routes"
#: The scripted engine answers "say:X" with exactly X: a template that puts
#: the last message's text after "say:" makes chat answers predictable.
SAY_TEMPLATE = (
    "{% for m in messages %}{% if loop.last %}say:{{ m['content'] }}{% endif %}{% endfor %}"
)


@attrs.define
class Served:
    port: int
    scheduler: Scheduler
    metrics: Metrics
    state: list[Readiness]

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(
            api_key=key, base_url=f"http://127.0.0.1:{self.port}/v1", max_retries=0, timeout=60
        )

    def sample(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)


@asynccontextmanager
async def serving(
    engine: Engine,
    *,
    template: ChatTemplate | None = None,
    max_waiting: int = 16,
    max_new_tokens: int = 10**6,
) -> AsyncIterator[Served]:
    metrics = Metrics(process=False)
    state: list[Readiness] = ["ready"]
    models = Models.single(
        engine,
        ModelSettings(max_new_tokens=max_new_tokens, max_waiting_jobs=max_waiting),
        metrics=metrics,
        is_draining=lambda: state[0] == "draining",
        chat_template=template,
    )
    served = models.default_served()
    assert served is not None
    scheduler = served.scheduler
    router = Router()
    OpsRoutes(readiness=lambda: state[0], metrics=metrics).install(router)
    OpenAIRoutes(models, ClientIdentity(keyed=True), metrics=metrics).install(router)
    door = FrontDoor(
        router, policy=AccessPolicy(api_key=KEY), limits=HTTPLimits(), observer=metrics
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(models.run)
        async with running(door) as port:
            yield Served(port, scheduler, metrics, state)
        nursery.cancel_scope.cancel()


async def in_thread(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


async def idle(scheduler: Scheduler) -> None:
    """Wait until the scheduler holds no job."""
    await wait_until(lambda: not (scheduler.statistics().running or scheduler.statistics().waiting))


async def post_json(port: int, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST ``body`` as JSON with the key; the status and the decoded answer."""
    import json

    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n"
        )
        await stream.send_all(head.encode() + data)
        received = b""
        while chunk := await stream.receive_some():
            received += chunk
    head_bytes, _, payload = received.partition(b"\r\n\r\n")
    return int(head_bytes.split()[1]), json.loads(payload)


def raised(fn: Callable[[], Any]) -> BaseException:
    try:
        fn()
    except Exception as exc:
        return exc
    raise AssertionError("no exception")


USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there!"}]


# -- on the scripted engine -----------------------------------------------------------------


async def test_health_ready_index_and_metrics() -> None:
    async with serving(ScriptedEngine()) as served:
        port = served.port
        assert (await get(port, "/health")).json() == {"status": "ok"}
        assert (await get(port, "/ready")).status == 200
        index = await get(port, "/", headers={"Authorization": f"Bearer {KEY}"})
        assert index.json()["name"] == "trioserve"
        served.state[0] = "draining"
        ready = await get(port, "/ready")
        assert (ready.status, ready.json()) == (503, {"status": "draining"})
        assert (await get(port, "/health")).status == 200
        assert (await get(port, "/metrics")).status == 401
        scrape = await get(port, "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert scrape.headers["content-type"].startswith("text/plain")
        names = {f.name for f in text_string_to_metric_families(scrape.body.decode())}
        assert "trioserve_requests" in names


async def test_models() -> None:
    async with serving(ScriptedEngine()) as served:
        sdk = served.client()
        models = await in_thread(lambda: list(sdk.models.list()))
        assert [m.id for m in models] == ["scripted-bytes"]
        model = await in_thread(lambda: sdk.models.retrieve("scripted-bytes"))
        assert model.id == "scripted-bytes"
        error = await in_thread(lambda: raised(lambda: sdk.models.retrieve("gpt-4")))
        assert isinstance(error, openai.NotFoundError)


async def test_completion_and_chat_on_the_scripted_engine() -> None:
    async with serving(ScriptedEngine(), template=ChatTemplate.from_string(SAY_TEMPLATE)) as served:
        sdk = served.client()
        done = await in_thread(
            lambda: sdk.completions.create(model="m", prompt="say:Bonjour", max_tokens=50)
        )
        assert done.choices[0].text == "Bonjour"
        assert done.choices[0].finish_reason == "stop"
        assert done.usage is not None
        assert done.usage.prompt_tokens == len("say:Bonjour")
        assert done.usage.completion_tokens == len("Bonjour") + 1  # the EOS counts
        echo = await in_thread(
            lambda: sdk.completions.create(model="m", prompt="say:ab", echo=True, max_tokens=5)
        )
        assert echo.choices[0].text == "say:abab"
        chat = await in_thread(
            lambda: sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi, you 🙂"}], max_tokens=3
            )
        )
        assert chat.choices[0].message.content == "Hi,"
        assert chat.choices[0].finish_reason == "length"
        stopped = await in_thread(
            lambda: sdk.chat.completions.create(model="m", messages=USER, stop=["there"])
        )
        assert stopped.choices[0].message.content == "Hello "
        assert stopped.choices[0].finish_reason == "stop"
    assert (
        served.sample(
            "trioserve_requests_total", api="openai", action="chat_completions", outcome="eos"
        )
        == 1
    )
    # Bonjour+EOS, ab+EOS, three of "Hi,", and "Hello there" up to the stop string.
    assert served.sample("trioserve_generated_tokens_total", api="openai") == 8 + 3 + 3 + 11


async def test_a_completion_without_max_tokens_takes_what_the_context_leaves() -> None:
    """OpenAI's default of 16 is an upper bound, not a value the user sent:
    where the context leaves 9 tokens it generates 9, and never answers an
    error about a max_tokens of 16."""
    async with serving(ScriptedEngine(context_length=40)) as served:
        sdk = served.client()
        short = await in_thread(lambda: sdk.completions.create(model="m", prompt="Tell"))
        assert short.usage is not None
        assert short.usage.completion_tokens == oa.COMPLETIONS_MAX_TOKENS
        assert short.choices[0].finish_reason == "length"
        long = await in_thread(lambda: sdk.completions.create(model="m", prompt="x" * 31))
        assert long.usage is not None
        assert (long.usage.prompt_tokens, long.usage.completion_tokens) == (31, 9)
        assert long.choices[0].finish_reason == "length"
        # A max_tokens the user did send is still held to the context.
        refused = await in_thread(
            lambda: raised(lambda: sdk.completions.create(model="m", prompt="x", max_tokens=50))
        )
        assert isinstance(refused, openai.BadRequestError)
        assert "got 50" in str(refused)


async def test_streams_match_whole_answers() -> None:
    template = ChatTemplate.from_string(SAY_TEMPLATE)
    async with serving(ScriptedEngine(), template=template) as served:
        sdk = served.client()
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "Ünïcode 日本語 🙂 text"}
        ]
        whole = await in_thread(lambda: sdk.chat.completions.create(model="m", messages=messages))

        def streamed() -> list[Any]:
            return list(
                sdk.chat.completions.create(
                    model="m",
                    messages=messages,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )

        chunks = await in_thread(streamed)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content == "Ünïcode 日本語 🙂 text"
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage == whole.usage
        completion_chunks = await in_thread(
            lambda: list(sdk.completions.create(model="m", prompt="say:xyz", stream=True))
        )
        assert "".join(c.choices[0].text for c in completion_chunks) == "xyz"
        assert completion_chunks[-1].choices[0].finish_reason == "stop"
    assert served.sample("trioserve_time_to_first_token_seconds_count", api="openai") == 3


async def test_a_client_that_leaves_mid_stream_frees_the_engine() -> None:
    engine = ScriptedEngine(step_delay=0.01)
    async with serving(engine) as served:
        sdk = served.client()

        def leave() -> str:
            stream = sdk.completions.create(model="m", prompt="go", max_tokens=5000, stream=True)
            text = ""
            for chunk in stream:
                text += chunk.choices[0].text
                if len(text) > 20:
                    break
            stream.close()
            return text

        assert len(await in_thread(leave)) > 20
        await idle(served.scheduler)
        # The engine drops the job at the step after the cancel.
        await wait_until(lambda: engine.running_jobs == 0)
        await wait_until(
            lambda: served.sample("trioserve_cancellations_total", cause="disconnect") == 1
        )
        outcome = {"api": "openai", "action": "completions", "outcome": "interrupted"}
        assert served.sample("trioserve_requests_total", **outcome) == 1


async def test_a_non_streamed_request_whose_client_leaves_is_cancelled() -> None:
    engine = ScriptedEngine(step_delay=0.01)
    async with serving(engine) as served:
        sdk = openai.OpenAI(
            api_key=KEY, base_url=f"http://127.0.0.1:{served.port}/v1", max_retries=0, timeout=0.5
        )
        error = await in_thread(
            lambda: raised(lambda: sdk.completions.create(model="m", prompt="go", max_tokens=5000))
        )
        assert isinstance(error, openai.APITimeoutError)
        await idle(served.scheduler)


@pytest.mark.slow
async def test_overload_is_503_with_retry_after() -> None:
    engine = ScriptedEngine(step_delay=0.02, max_batch=1)
    async with serving(engine, max_waiting=1) as served:
        sdk = served.client()
        results: list[Any] = []

        async def one() -> None:
            results.append(
                await in_thread(
                    lambda: (
                        raised(
                            lambda: sdk.completions.create(model="m", prompt="go", max_tokens=200)
                        )
                        if True
                        else None
                    )
                )
            )

        async def busy() -> None:
            await in_thread(lambda: sdk.completions.create(model="m", prompt="go", max_tokens=60))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(busy)
            nursery.start_soon(busy)
            await wait_until(lambda: served.scheduler.statistics().waiting >= 1)
            nursery.start_soon(one)
        [error] = results
        assert isinstance(error, openai.InternalServerError)
        assert error.status_code == 503
        assert error.response.headers["retry-after"] == "1"
        assert isinstance(error.body, dict) and error.body["code"] == "overloaded"


async def test_chat_needs_a_template() -> None:
    async with serving(ScriptedEngine()) as served:
        error = await in_thread(
            lambda: raised(
                lambda: served.client().chat.completions.create(model="m", messages=USER)
            )
        )
        assert isinstance(error, openai.BadRequestError)
        assert "has no chat template" in error.message
        assert isinstance(error.body, dict) and error.body["code"] == "no_chat_template"


async def test_a_template_that_refuses_is_400() -> None:
    template = ChatTemplate.from_string(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}"
        "{% endif %}"
    )
    async with serving(ScriptedEngine(), template=template) as served:
        error = await in_thread(
            lambda: raised(
                lambda: served.client().chat.completions.create(model="m", messages=USER)
            )
        )
        assert isinstance(error, openai.BadRequestError)
        assert "a system message first" in error.message


async def test_engine_failures() -> None:
    async with serving(ScriptedEngine()) as served:
        sdk = served.client()
        error = await in_thread(
            lambda: raised(lambda: sdk.completions.create(model="m", prompt="FAIL now"))
        )
        assert isinstance(error, openai.InternalServerError)
        assert "scripted failure" in error.message

        def streamed() -> BaseException:
            return raised(
                lambda: list(sdk.completions.create(model="m", prompt="FAIL now", stream=True))
            )

        assert isinstance(await in_thread(streamed), openai.APIError)
        outcome = {"api": "openai", "action": "completions", "outcome": "internal"}
        assert served.sample("trioserve_requests_total", **outcome) == 2


#: What docs/openai.md ("Refused unless they ask for nothing") lists, as sent:
#: each is answered 400 with code unsupported_parameter and the field as param.
UNSUPPORTED: list[tuple[str, dict[str, Any], str]] = [
    ("chat", {"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("chat", {"logprobs": True}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 2}, "logprobs"),  # an engine without them
    ("completions", {"logprobs": 2}, "logprobs"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"n": 2, "best_of": 3}, "best_of"),
    ("completions", {"prompt": ["one", "two"]}, "prompt"),
    ("chat", {"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    (
        "completions",
        {"structured_outputs": {"structural_tag": "t"}},
        "structured_outputs.structural_tag",
    ),
    ("completions", {"suffix": "end"}, "suffix"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
    ),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat", {"web_search_options": {}}, "web_search_options"),
    ("chat", {"moderation": True}, "moderation"),
]


async def test_unsupported_features_are_refused_as_the_docs_say() -> None:
    async with serving(ScriptedEngine(), template=ChatTemplate.from_string(SAY_TEMPLATE)) as served:
        for route, fields, param in UNSUPPORTED:
            body: dict[str, Any] = {"model": "m", **fields}
            if route == "chat":
                body.setdefault("messages", USER)
            else:
                body.setdefault("prompt", "x")
            path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
            status, answer = await post_json(served.port, path, body)
            assert status == 400, (fields, answer)
            error = answer["error"]
            assert (error["code"], error["param"]) == ("unsupported_parameter", param), fields


class GrammarsNone(ScriptedEngine):
    """An engine with the attribute but built without grammars (as CpuEngine
    and ExLlamaV2Engine say it when constructed so)."""

    @property
    def grammars(self) -> None:
        return None


def test_grammars_of_reads_the_engines_attribute() -> None:
    # The server asks grammars_of, not isinstance against a runtime-checkable
    # protocol: from Python 3.12 on that only looks the property up on the
    # class, so an engine whose grammars is None would pass it.
    assert grammars_of(ScriptedEngine()) is None
    assert grammars_of(GrammarsNone()) is None
    assert isinstance(ScriptedEngine(), Engine)
    assert isinstance(GrammarsNone(), Engine)


@pytest.mark.parametrize("engine_type", [ScriptedEngine, GrammarsNone], ids=["absent", "none"])
async def test_a_constraint_to_an_engine_without_grammars_is_a_400_naming_it(
    engine_type: type[ScriptedEngine],
) -> None:
    # An engine that enforces no constraint (no grammars attribute, or None):
    # the request is refused before any work, naming the field the client used.
    async with serving(engine_type(), template=ChatTemplate.from_string(SAY_TEMPLATE)) as served:
        body = {"model": "m", "messages": USER, "response_format": {"type": "json_object"}}
        status, answer = await post_json(served.port, "/v1/chat/completions", body)
        assert status == 400
        assert answer["error"]["param"] == "response_format"
        assert "does not enforce json_schema constraints" in answer["error"]["message"]


async def test_bad_requests_and_the_key() -> None:
    async with serving(ScriptedEngine()) as served:
        sdk = served.client()
        error = await in_thread(
            lambda: raised(lambda: sdk.completions.create(model="m", prompt="x", max_tokens=10**6))
        )
        assert isinstance(error, openai.BadRequestError)
        assert isinstance(error.body, dict) and error.body["param"] == "max_tokens"
        error = await in_thread(
            lambda: raised(lambda: sdk.completions.create(model="m", prompt="x", n=9))
        )
        assert isinstance(error, openai.BadRequestError)
        error = await in_thread(lambda: raised(lambda: served.client("nope").models.list()))
        assert isinstance(error, openai.AuthenticationError)
        outcome = {"api": "openai", "action": "completions", "outcome": "invalid_request"}
        assert served.sample("trioserve_requests_total", **outcome) == 2


# -- on the real embedded model ------------------------------------------------------------


async def test_openai_sdk_on_the_embedded_model(cpu_engine: CpuEngine, model_dir: Path) -> None:
    template = load_chat_template(model_dir)
    async with serving(cpu_engine, template=template) as served:
        sdk = served.client()
        models = await in_thread(lambda: list(sdk.models.list()))
        assert [m.id for m in models] == [cpu_engine.info.model_name]
        question: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "What is the capital of France?"}
        ]
        whole = await in_thread(
            lambda: sdk.chat.completions.create(
                model="smollm", messages=question, max_tokens=12, temperature=0
            )
        )
        answer = whole.choices[0].message.content
        assert answer is not None and "Paris" in answer
        assert whole.usage is not None
        prompt = template.render([dict(m) for m in question])
        assert whole.usage.prompt_tokens == len(cpu_engine.encode(prompt))

        def streamed() -> list[Any]:
            return list(
                sdk.chat.completions.create(
                    model="smollm",
                    messages=question,
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )

        chunks = await in_thread(streamed)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == answer
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

        # A stop sequence ends the completion before it, and says "stop".
        stopped = await in_thread(
            lambda: sdk.completions.create(
                model="smollm", prompt=prompt, max_tokens=12, temperature=0, stop=["Paris"]
            )
        )
        assert stopped.choices[0].finish_reason == "stop"
        assert "Paris" not in stopped.choices[0].text
        assert answer.startswith(stopped.choices[0].text)

        error = await in_thread(
            lambda: raised(
                lambda: sdk.completions.create(model="smollm", prompt="Hi", max_tokens=10**6)
            )
        )
        assert isinstance(error, openai.BadRequestError)

        def leave() -> None:
            stream = sdk.completions.create(
                model="smollm", prompt="Once upon a time", max_tokens=500, stream=True
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    break
            stream.close()

        await in_thread(leave)
        await idle(served.scheduler)
