"""``n`` choices of one OpenAI request: admission, streaming by index,
usage, failures and disconnects on the scripted engine (every path,
quickly); then on the real embedded model over a real socket with the
``openai`` SDK: seeds per choice, one prefill, greedy exactness, and
constraints, tools and logprobs per choice."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema
import openai
import pytest
import trio

from tests.helpers import ScriptedEngine, serving, wait_until
from trioserve.generation import GenerationRequest, Generations
from trioserve.generation.request import with_seed_offset

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine
    from trioserve.server.server import Server


#: How the server knows the tests' client (no API key: its address).
ME = ("address", "127.0.0.1")


def client(port: int, key: str = "unused") -> Any:
    # Any: the SDK's typed parameters are OpenAI's models, not ours.
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120
    )


def idle(server: Server) -> bool:
    stats = server.generations.scheduler.statistics()
    return not (stats.running or stats.waiting)


def by_index(chunks: list[Any]) -> tuple[dict[int, str], dict[int, list[str]]]:
    """A chat stream's text and finish reasons per choice index."""
    texts: dict[int, str] = defaultdict(str)
    reasons: dict[int, list[str]] = defaultdict(list)
    for chunk in chunks:
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            text = delta.content if delta is not None else choice.text
            texts[choice.index] += text or ""
            if choice.finish_reason:
                reasons[choice.index].append(choice.finish_reason)
    return dict(texts), dict(reasons)


# --------------------------------------------------------------------------
# The pure part


def test_each_choice_moves_the_seed_on_and_wraps_within_its_range() -> None:
    from trioserve.vocabulary.sampling import SamplingSettings

    plain = GenerationRequest(text="x", max_new_tokens=1)
    assert with_seed_offset(plain, 3) is plain  # no seed: each job draws its own
    seeded = GenerationRequest(text="x", max_new_tokens=1, sampling=SamplingSettings(seed=7))
    assert with_seed_offset(seeded, 2).sampling.seed == 9
    top = GenerationRequest(text="x", max_new_tokens=1, sampling=SamplingSettings(seed=2**64 - 1))
    assert with_seed_offset(top, 1).sampling.seed == 0
    low = GenerationRequest(text="x", max_new_tokens=1, sampling=SamplingSettings(seed=-(2**63)))
    assert with_seed_offset(low, 5).sampling.seed == -(2**63) + 5


# --------------------------------------------------------------------------
# Scripted engine: the protocol of n choices


async def test_a_generation_ends_however_its_block_is_left() -> None:
    """``with generation:`` is the lifecycle's guarantee: left by a
    cancellation mid-stream it interrupts (nothing generated is lost) and
    frees the engine job and the client's count; left normally it keeps the
    real outcome."""
    async with serving(ScriptedEngine(step_delay=0.01)) as (server, _):
        generations = server.generations
        request = GenerationRequest(text="say:" + "abcdefgh" * 8, max_new_tokens=64)
        generation = generations.open(request, client="me")
        assert generations.in_flight("me") == 1
        with trio.move_on_after(0.2) as scope, generation:
            await generation.run()
        assert scope.cancelled_caught
        assert generation.outcome == "interrupted"
        assert 0 < len(generation.response) < 64
        assert generations.in_flight("me") == 0
        await wait_until(lambda: idle(server))
        whole = generations.open(GenerationRequest(text="say:ok", max_new_tokens=8), client="me")
        with whole:
            await whole.run()
        assert (whole.outcome, whole.response) == ("finished", "ok")
        assert generations.in_flight("me") == 0
        assert whole.end() is False  # idempotent: already ended


async def test_n_choices_whole_and_streamed_on_both_routes() -> None:
    async with serving(ScriptedEngine()) as (server, listening):
        sdk = client(listening.port)

        def calls() -> None:
            whole = sdk.completions.create(model="m", prompt="say:abc", n=3, max_tokens=10)
            assert [c.index for c in whole.choices] == [0, 1, 2]
            assert [c.text for c in whole.choices] == ["abc"] * 3
            # The prompt is counted once; every choice's tokens are counted
            # (3 characters and the stop token each).
            assert whole.usage.prompt_tokens == len("say:abc")
            assert whole.usage.completion_tokens == 3 * 4
            echoed = sdk.completions.create(
                model="m", prompt="say:ab", n=2, max_tokens=10, echo=True
            )
            assert [c.text for c in echoed.choices] == ["say:abab"] * 2

            stream = sdk.completions.create(
                model="m",
                prompt="say:hello",
                n=4,
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
            texts, reasons = by_index([c for c in chunks if c.choices])
            assert texts == dict.fromkeys(range(4), "hel")
            assert reasons == {i: ["length"] for i in range(4)}
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

        await trio.to_thread.run_sync(calls)
        await wait_until(lambda: idle(server))


async def test_n_choices_of_a_chat_stream_each_start_with_the_role(tmp_path: Path) -> None:
    # The last message's content is the prompt: "say:hi!" is answered "hi!".
    (tmp_path / "chat_template.jinja").write_text("{{ messages[-1]['content'] }}")
    engine = ScriptedEngine(model_dir=str(tmp_path))
    async with serving(engine) as (server, listening):
        sdk = client(listening.port)

        def calls() -> None:
            user = [{"role": "user", "content": "say:hi!"}]
            whole = sdk.chat.completions.create(model="m", messages=user, n=2)
            assert [c.message.content for c in whole.choices] == ["hi!", "hi!"]
            assert [c.finish_reason for c in whole.choices] == ["stop", "stop"]
            chunks = list(sdk.chat.completions.create(model="m", messages=user, n=3, stream=True))
            roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role]
            assert sorted(roles) == [0, 1, 2]
            texts, reasons = by_index(chunks)
            assert texts == dict.fromkeys(range(3), "hi!")
            assert reasons == {i: ["stop"] for i in range(3)}

        await trio.to_thread.run_sync(calls)
        await wait_until(lambda: idle(server))


async def test_n_is_bounded_and_counts_against_the_clients_limit() -> None:
    engine = ScriptedEngine(step_delay=0.02)
    async with serving(engine, max_requests_per_client=4) as (server, listening):
        sdk = client(listening.port)

        def too_many() -> None:
            # The client's limit caps n (4 here, below the default cap of 8).
            with pytest.raises(openai.BadRequestError) as info:
                sdk.completions.create(model="m", prompt="say:x", n=5)
            body: Any = info.value.body
            assert body["param"] == "n"
            assert "1..4" in body["message"]

        await trio.to_thread.run_sync(too_many)
        async with trio.open_nursery() as nursery:
            # Three requests in flight (long ones), then n=2 goes past 4: 429,
            # and nothing of it was queued.
            def long() -> None:
                sdk.completions.create(model="m", prompt="say:" + "x" * 200, max_tokens=200)

            for _ in range(3):
                nursery.start_soon(trio.to_thread.run_sync, long)
            await wait_until(lambda: server.generations.in_flight(ME) == 3)

            def refused() -> None:
                with pytest.raises(openai.RateLimitError) as info:
                    sdk.completions.create(model="m", prompt="say:y", n=2)
                body: Any = info.value.body
                assert "asks for 2 choices" in body["message"]

            await trio.to_thread.run_sync(refused)
            assert server.generations.in_flight(ME) == 3
        await wait_until(lambda: idle(server))


async def test_the_choices_are_jobs_of_one_client() -> None:
    # The scheduler's guarantee holds for n: one client never holds every
    # engine slot, so 4 choices run at most 3 at a time on a 4-slot engine.
    engine = ScriptedEngine(max_batch=4, step_delay=0.01)
    async with serving(engine) as (server, listening):
        sdk = client(listening.port)
        seen: list[int] = []

        async def watch() -> None:
            while True:
                seen.append(server.generations.scheduler.statistics().running)
                await trio.sleep(0.005)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            whole = await trio.to_thread.run_sync(
                lambda: sdk.completions.create(model="m", prompt="say:" + "z" * 30, n=4)
            )
            nursery.cancel_scope.cancel()
        assert [c.text for c in whole.choices] == ["z" * 16] * 4
        assert max(seen) == 3


async def test_a_disconnect_frees_every_choice() -> None:
    engine = ScriptedEngine(step_delay=0.01)
    async with serving(engine) as (server, listening):
        sdk = client(listening.port)

        def read_some() -> None:
            stream = sdk.completions.create(
                model="m", prompt="say:" + "q" * 500, n=3, max_tokens=400, stream=True
            )
            for count, _ in enumerate(stream):
                if count == 10:
                    stream.close()
                    return

        await trio.to_thread.run_sync(read_some)
        await wait_until(lambda: idle(server) and server.generations.in_flight(ME) == 0)


async def test_a_failed_choice_fails_the_request_once() -> None:
    async with serving(ScriptedEngine()) as (server, listening):
        sdk = client(listening.port)

        def failing() -> None:
            with pytest.raises(openai.InternalServerError):
                sdk.completions.create(model="m", prompt="say:FAIL", n=3)
            stream = sdk.completions.create(model="m", prompt="say:FAIL", n=3, stream=True)
            with pytest.raises(openai.APIError):
                list(stream)

        await trio.to_thread.run_sync(failing)
        await wait_until(lambda: idle(server) and server.generations.in_flight(ME) == 0)
        # The first choice failed before the others were submitted: they never ran.
        stats = server.generations.scheduler.statistics()
        assert (stats.failed, stats.cancelled, stats.served) == (2, 0, 0)


# --------------------------------------------------------------------------
# The real embedded model, over a real socket, with the openai SDK

QUESTION = [
    {
        "role": "user",
        "content": (
            "Here is a list of fruits: apple, banana, cherry, date, elderberry, fig, grape, "
            "honeydew, kiwi, lemon, mango, nectarine, orange, papaya, quince, raspberry. "
            "Which one is yellow?"
        ),
    }
]


async def test_greedy_choices_are_the_greedy_answer_and_share_one_prefill(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine) as (_, listening):
        sdk = client(listening.port)
        before = cpu_engine.statistics().prefix_cache

        def calls() -> tuple[Any, Any]:
            many = sdk.chat.completions.create(
                model="m", messages=QUESTION, n=3, temperature=0, max_tokens=12
            )
            one = sdk.chat.completions.create(
                model="m", messages=QUESTION, temperature=0, max_tokens=12
            )
            return many, one

        many, one = await trio.to_thread.run_sync(calls)
        answer = one.choices[0].message.content
        assert [c.message.content for c in many.choices] == [answer] * 3
        prompt = many.usage.prompt_tokens
        assert prompt > 64  # longer than a prefix-cache block
        assert many.usage.completion_tokens == sum(
            len(cpu_engine.encode(c.message.content)) for c in many.choices
        ) + sum(c.finish_reason == "stop" for c in many.choices)
        # The two later choices started from the first's prefilled prompt:
        # two hits of at least the prompt's whole blocks each.
        after = cpu_engine.statistics().prefix_cache
        blocks = prompt - 1 - (prompt - 1) % 64
        assert after.hits - before.hits >= 2
        assert after.hit_tokens - before.hit_tokens >= 2 * blocks


async def test_seeded_choices_are_the_seeds_answers_streamed_or_not(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine) as (_, listening):
        sdk = client(listening.port)

        def calls() -> None:
            fields = {"model": "m", "messages": QUESTION, "temperature": 1.0, "max_tokens": 16}
            many = sdk.chat.completions.create(**fields, n=3, seed=40)
            texts = [c.message.content for c in many.choices]
            alone = [
                sdk.chat.completions.create(**fields, seed=40 + i).choices[0].message.content
                for i in range(3)
            ]
            assert texts == alone
            assert len(set(texts)) > 1  # each choice drew its own stream
            streamed, reasons = by_index(
                list(sdk.chat.completions.create(**fields, n=3, seed=40, stream=True))
            )
            assert streamed == dict(enumerate(texts))
            assert reasons == {i: [c.finish_reason] for i, c in enumerate(many.choices)}

        await trio.to_thread.run_sync(calls)


SCHEMA = {
    "type": "object",
    "properties": {
        "fruit": {"type": "string", "maxLength": 20},
        "yellow": {"type": "boolean"},
    },
    "required": ["fruit", "yellow"],
    "additionalProperties": False,
}

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


async def test_each_choice_keeps_the_constraint_tools_and_logprobs(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine) as (_, listening):
        sdk = client(listening.port)

        def calls() -> None:
            shaped = sdk.chat.completions.create(
                model="m",
                messages=QUESTION,
                n=3,
                temperature=1.0,
                seed=1,
                max_tokens=60,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "fruit", "schema": SCHEMA},
                },
            )
            for choice in shaped.choices:
                assert choice.finish_reason == "stop"
                jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            called = sdk.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                n=2,
                tools=[WEATHER],
                tool_choice="required",
                parallel_tool_calls=False,
                temperature=1.0,
                seed=2,
                max_tokens=100,
            )
            ids = set()
            for choice in called.choices:
                assert choice.finish_reason == "tool_calls"
                (call,) = choice.message.tool_calls
                jsonschema.validate(
                    json.loads(call.function.arguments), WEATHER["function"]["parameters"]
                )
                ids.add(call.id)
            assert len(ids) == 2
            scored = sdk.chat.completions.create(
                model="m",
                messages=QUESTION,
                n=2,
                temperature=1.0,
                seed=3,
                max_tokens=8,
                logprobs=True,
                top_logprobs=2,
            )
            for choice in scored.choices:
                entries = choice.logprobs.content
                assert "".join(e.token for e in entries) == choice.message.content
                assert all(len(e.top_logprobs) == 2 for e in entries)

        await trio.to_thread.run_sync(calls)


def test_open_choices_refuses_n_below_one() -> None:
    with pytest.raises(ValueError, match="n must be >= 1"):
        Generations.open_choices(
            None,  # type: ignore[arg-type]
            GenerationRequest(text="x", max_new_tokens=1),
            0,
            client="c",
        )


async def test_many_choices_starve_no_other_connection() -> None:
    """The largest ``n`` on the HTTP door beside the same client's WebSocket
    stream: the choices are the client's jobs, so they wait their turn for
    its slots and never take the stream's; its chunk rate holds, and a
    disconnect frees all 8 choices."""
    from tests.helpers import raw_client

    engine = ScriptedEngine(max_batch=4, step_delay=0.004)
    async with serving(engine) as (server, listening):
        async with raw_client(listening.url) as victim:
            frame = {"action": "infer", "text": "say:" + "v" * 3000, "max_new_tokens": 3000}
            await victim.send({**frame, "stream": True, "request_id": "v"})
            await victim.recv()

            async def rate(window: float = 0.5) -> float:
                start, count = time.perf_counter(), 0
                with trio.move_on_after(window):
                    while True:
                        assert (await victim.recv())["response_type"] == "chunk"
                        count += 1
                return count / (time.perf_counter() - start)

            before = await rate()
            sdk = client(listening.port)
            readers: list[Any] = []  # kept: a dropped reader closes its response

            def attack() -> None:
                stream = sdk.completions.create(
                    model="m", prompt="say:" + "a" * 3000, n=8, max_tokens=3000, stream=True
                )
                readers.extend((stream, iter(stream)))
                next(readers[1])

            await trio.to_thread.run_sync(attack)
            stats = server.generations.scheduler.statistics()
            # All but one slot for the client: the stream and two choices run,
            # the other six wait their turn.
            assert stats.running == 3 and stats.waiting == 6
            during = await rate()
            assert during >= 0.7 * before, (before, during)
            await trio.to_thread.run_sync(readers[0].close)  # the response: a disconnect
            await wait_until(lambda: server.generations.in_flight(ME) == 1)
            await victim.send({"action": "stop"})
            await victim.until("stop")
        await wait_until(lambda: idle(server))
