"""Anthropic's Messages API on the real embedded model over a real socket,
driven by Anthropic's own Python SDK (``anthropic``, unchanged): plain and
streamed messages, token counting, tools with a named ``tool_choice`` and
``tool_result`` turns, structured output through ``messages.parse``, stop
sequences, a prefill, the SDK's error classes, the prefix cache across
Claude Code's billing line, pings while a long prompt is read, and a client
that leaves mid-stream."""

from __future__ import annotations

import json
import re
import socket
from typing import TYPE_CHECKING, Any, Literal

import anthropic
import jsonschema
import pydantic
import pytest
import trio

from trioserve.server import anthropic_routes

from .helpers import running_server, serving

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ADD: dict[str, Any] = {
    "name": "add",
    "description": "Add two integers",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


def client(port: int, **options: Any) -> Any:
    # Any: the SDK's typed parameters are Anthropic's models, not ours.
    return anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{port}", api_key="unused", max_retries=0, **options
    )


async def test_the_sdk_creates_streams_and_counts(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening:

        def flow() -> None:
            sdk = client(listening.port)
            question = [{"role": "user", "content": "What is the capital of France?"}]
            whole = sdk.messages.create(
                model="smollm2", max_tokens=40, messages=question, extra_body=GREEDY
            )
            assert whole.id.startswith("msg_") and whole.role == "assistant"
            assert whole.stop_reason == "end_turn" and whole.stop_sequence is None
            (block,) = whole.content
            assert block.type == "text" and "Paris" in block.text
            assert whole.usage.output_tokens > 0
            # Counted as the generation read it, cache hits included.
            counted = sdk.messages.count_tokens(model="m", messages=question)
            usage = whole.usage
            assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
            # Streamed, greedy: the same text, event by event.
            with sdk.messages.stream(
                model="m", max_tokens=40, messages=question, extra_body=GREEDY
            ) as stream:
                pieces = list(stream.text_stream)
                final = stream.get_final_message()
            assert len(pieces) > 1 and "".join(pieces) == block.text
            assert final.content[0].text == block.text and final.stop_reason == "end_turn"
            assert final.usage.output_tokens == usage.output_tokens
            # The model list reads as Anthropic's too.
            (model,) = list(sdk.models.list())
            assert model.id == whole.model and model.type == "model"
            # max_tokens ends it as Anthropic says.
            short = sdk.messages.create(
                model="m", max_tokens=3, messages=question, extra_body=GREEDY
            )
            assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3

        await trio.to_thread.run_sync(flow)


async def test_tools_named_any_and_a_result_turn(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening:

        def flow() -> None:
            sdk = client(listening.port)
            schema = WEATHER["input_schema"]
            for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
                for seed in range(3):
                    answer = sdk.messages.create(
                        model="m",
                        max_tokens=80,
                        messages=QUESTION,
                        tools=[WEATHER, ADD],
                        tool_choice={**choice, "disable_parallel_tool_use": True},
                        extra_body={"temperature": 1.0, "seed": seed},
                    )
                    uses = [b for b in answer.content if b.type == "tool_use"]
                    assert answer.stop_reason == "tool_use" and len(uses) == 1
                    (use,) = uses
                    assert use.id.startswith("toolu_")
                    if choice["type"] == "tool":
                        assert use.name == "get_weather"
                    if use.name == "get_weather":
                        jsonschema.validate(use.input, schema)
                    else:
                        jsonschema.validate(use.input, ADD["input_schema"])
            # A keyword the constraint engine does not implement: left
            # unenforced, unless the tool is strict.
            named = {
                **WEATHER,
                "input_schema": {**WEATHER["input_schema"], "propertyNames": {"maxLength": 8}},
            }
            loose = sdk.messages.create(
                model="m",
                max_tokens=60,
                messages=QUESTION,
                tools=[named],
                tool_choice={"type": "any"},
                extra_body=GREEDY,
            )
            assert loose.stop_reason in ("tool_use", "max_tokens")
            assert {b.type for b in loose.content} == {"tool_use"}
            with pytest.raises(anthropic.BadRequestError, match=r"tools\[0\]\.input_schema"):
                sdk.messages.create(
                    model="m",
                    max_tokens=60,
                    messages=QUESTION,
                    tools=[{**named, "strict": True}],
                    tool_choice={"type": "any"},
                )
            # Streamed: the input in input_json_delta pieces.
            with sdk.messages.stream(
                model="m",
                max_tokens=80,
                messages=QUESTION,
                tools=[WEATHER],
                tool_choice={"type": "tool", "name": "get_weather"},
                extra_body={"temperature": 0.8, "seed": 4},
            ) as stream:
                kinds = [event.type for event in stream]
                first = stream.get_final_message()
            assert kinds.count("input_json") > 1
            (use,) = [b for b in first.content if b.type == "tool_use"]
            jsonschema.validate(use.input, schema)
            # The result goes back; the model answers in text.
            second = sdk.messages.create(
                model="m",
                max_tokens=40,
                messages=[
                    *QUESTION,
                    {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": use.id, "content": "21 C, sunny"}
                        ],
                    },
                ],
                tools=[WEATHER],
                tool_choice={"type": "none"},
                extra_body=GREEDY,
            )
            assert [b.type for b in second.content] == ["text"] and second.content[0].text
            assert second.stop_reason in ("end_turn", "max_tokens")

        await trio.to_thread.run_sync(flow)


class City(pydantic.BaseModel):
    # No maxLength: the SDK moves it into the description, as Anthropic's
    # structured outputs do not take it (then pydantic checks it after).
    name: str
    country: Literal["Italy", "France", "Spain"]
    population: int


async def test_structured_output_parse_and_schemas(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening:

        def flow() -> None:
            sdk = client(listening.port)
            ask = [{"role": "user", "content": "Name a city in Italy."}]
            # messages.parse with a pydantic model, greedy.
            parsed = sdk.messages.parse(
                model="m", max_tokens=100, messages=ask, output_format=City, extra_body=GREEDY
            )
            assert isinstance(parsed.parsed_output, City)
            assert parsed.stop_reason == "end_turn"
            # A schema with bounds the SDK's transform would drop, sampled at
            # temperature 1: every answer validates.
            schema = {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "region": {"enum": ["north", "centre", "south", "islands"]},
                },
                "required": ["name", "region"],
                "additionalProperties": False,
            }
            for seed in range(4):
                answer = sdk.messages.create(
                    model="m",
                    max_tokens=100,
                    messages=ask,
                    output_config={"format": {"type": "json_schema", "schema": schema}},
                    extra_body={"temperature": 1.0, "seed": seed},
                )
                assert answer.stop_reason == "end_turn"
                jsonschema.validate(json.loads(answer.content[0].text), schema)

        await trio.to_thread.run_sync(flow)


async def test_stop_sequences_and_a_prefill(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening:

        def flow() -> None:
            sdk = client(listening.port)
            question = [{"role": "user", "content": "Tell me about the city of Paris."}]
            free = sdk.messages.create(
                model="m", max_tokens=40, messages=question, extra_body=GREEDY
            )
            text = free.content[0].text
            words = text.split(" ")
            assert len(words) > 6
            # A word from the middle stops it there; the sequence is named.
            stop = " " + words[4]
            stopped = sdk.messages.create(
                model="m",
                max_tokens=40,
                messages=question,
                stop_sequences=[stop],
                extra_body=GREEDY,
            )
            assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
            assert stopped.content[0].text == text[: text.index(stop)]
            # A final assistant turn is continued, greedy: the rest of the same answer.
            prefill = " ".join(words[:3])
            continued = sdk.messages.create(
                model="m",
                max_tokens=20,
                messages=[*question, {"role": "assistant", "content": prefill}],
                extra_body=GREEDY,
            )
            assert text.startswith(prefill + continued.content[0].text[:10])

        await trio.to_thread.run_sync(flow)


async def test_errors_come_as_the_sdk_classes(cpu_engine: CpuEngine) -> None:
    async with running_server(
        cpu_engine, api_key="s3cret", max_requests_per_client=1, max_new_tokens=48
    ) as listening:

        def flow() -> None:
            port = listening.port
            with pytest.raises(anthropic.AuthenticationError) as auth:
                client(port).messages.create(model="m", max_tokens=4, messages=QUESTION)
            assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
            sdk: Any = anthropic.Anthropic(
                base_url=f"http://127.0.0.1:{port}", api_key="s3cret", max_retries=0
            )
            image = {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
            }
            with pytest.raises(anthropic.BadRequestError) as bad:
                sdk.messages.create(
                    model="m", max_tokens=4, messages=[{"role": "user", "content": [image]}]
                )
            assert "image blocks are not supported" in bad.value.message
            with pytest.raises(anthropic.BadRequestError) as long:
                sdk.messages.create(
                    model="m", max_tokens=64, messages=[{"role": "user", "content": "word " * 9000}]
                )
            assert "prompt is too long" in long.value.message
            assert re.search(r"prompt is too long: \d+ tokens > 8192 maximum", long.value.message)
            # max_tokens is an upper bound: past the server's cap (here 48;
            # the context's room by default) the reply ends there, with
            # max_tokens (Claude Code asks for 32,000).
            bounded = sdk.messages.create(
                model="m", max_tokens=20_000, messages=QUESTION, extra_body={"min_tokens": 60}
            )
            assert bounded.stop_reason == "model_context_window_exceeded"
            assert bounded.usage.output_tokens == 48
            with pytest.raises(anthropic.NotFoundError):
                sdk.get("/v1/messages/nope", cast_to=object)
            # One request in flight is this client's limit: the second is a 429.
            with sdk.messages.stream(
                model="m", max_tokens=200, messages=QUESTION, extra_body=GREEDY
            ) as stream:
                next(iter(stream))
                with pytest.raises(anthropic.RateLimitError):
                    sdk.messages.create(model="m", max_tokens=4, messages=QUESTION)
                # Counting is one of the client's requests too.
                with pytest.raises(anthropic.RateLimitError):
                    sdk.messages.count_tokens(model="m", messages=QUESTION)
            # The Bearer form works as well as X-Api-Key.
            bearer: Any = anthropic.Anthropic(
                base_url=f"http://127.0.0.1:{port}", auth_token="s3cret", max_retries=0
            )
            assert bearer.messages.create(
                model="m", max_tokens=2, messages=QUESTION, extra_body=GREEDY
            ).content

        await trio.to_thread.run_sync(flow)


SYSTEM = (
    "You are a coding agent. Read the files before you change them, keep the style of the code"
    " around, run the tests, and say what you did. " * 8
)


async def test_claude_codes_billing_line_does_not_defeat_the_prefix_cache(
    cpu_engine: CpuEngine,
) -> None:
    async with running_server(cpu_engine) as listening:

        def flow() -> None:
            sdk = client(listening.port)
            usages = []
            for cch in ("1a2b3", "9f8e7"):
                system = [
                    {
                        "type": "text",
                        "text": "x-anthropic-billing-header: cc_version=2.1.3.abc;"
                        f" cc_entrypoint=cli; cch={cch};",
                    },
                    {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
                ]
                usages.append(
                    sdk.messages.create(
                        model="m", max_tokens=2, system=system, messages=QUESTION
                    ).usage
                )
            first, second = usages
            total = second.input_tokens + second.cache_read_input_tokens
            assert first.input_tokens + first.cache_read_input_tokens == total
            # All of the prompt but its last block or two (the cache keeps
            # whole blocks of 32 tokens, and the last token is always run).
            assert first.cache_read_input_tokens == 0 and total > 200
            assert second.cache_read_input_tokens >= total - 64

        await trio.to_thread.run_sync(flow)


async def test_a_stream_pings_while_a_long_prompt_is_read(
    cpu_engine: CpuEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(anthropic_routes, "PING_SECONDS", 0.05)
    async with running_server(cpu_engine) as listening:
        body = json.dumps(
            {
                "model": "m",
                "max_tokens": 2,
                "temperature": 0,
                "stream": True,
                "messages": [{"role": "user", "content": "The tide comes in. " * 150}],
            }
        ).encode()
        stream = await trio.open_tcp_stream("127.0.0.1", listening.port)
        async with stream:
            await stream.send_all(
                b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )
            data = b""
            with trio.fail_after(120):
                while chunk := await stream.receive_some():
                    data += chunk
        names = [line[7:] for line in data.decode().splitlines() if line.startswith("event: ")]
        assert names[0] == "message_start" and names[-1] == "message_stop"
        first_block = names.index("content_block_start")
        assert "ping" in names[1:first_block]


async def test_a_client_that_leaves_mid_stream_frees_its_slot(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (server, listening):
        body = json.dumps(
            {"model": "m", "max_tokens": 2000, "stream": True, "messages": QUESTION, **GREEDY}
        ).encode()
        sock = socket.create_connection(("127.0.0.1", listening.port))
        try:
            sock.sendall(
                b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            seen = b""
            with trio.fail_after(60):
                while b"content_block_delta" not in seen:
                    seen += await trio.to_thread.run_sync(sock.recv, 65536)
        finally:
            sock.close()
        with trio.fail_after(30):
            while server.generations.in_flight(("address", "127.0.0.1")):  # noqa: ASYNC110
                await trio.sleep(0.05)
        # The server goes on serving.
        answer = await trio.to_thread.run_sync(
            lambda: client(listening.port).messages.create(
                model="m", max_tokens=4, messages=QUESTION, extra_body=GREEDY
            )
        )
        assert answer.usage.output_tokens == 4
