"""OpenAI's Responses API on the real embedded model over a real socket,
driven by OpenAI's own SDKs, unchanged: the ``openai`` SDK (plain and
streamed responses, tools with ``tool_choice`` required and named, a
``function_call_output`` turn, ``text.format`` json_schema validated over
several seeds at temperature 1, ``previous_response_id`` reading the
prefix cache, retrieve and delete, the SDK's error classes) and the OpenAI
Agents SDK on its default API (``Runner.run`` with a function tool, and
with a pydantic ``output_type``); and a client that leaves mid-stream."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import TYPE_CHECKING, Any

import agents
import jsonschema
import openai
import pydantic
import pytest
import trio

from .helpers import running_server, serving

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
ADD: dict[str, Any] = {
    "type": "function",
    "name": "add",
    "description": "Add two integers",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "strict": True,
}
#: A long enough system prompt that the prefix cache's whole blocks show.
INSTRUCTIONS = (
    "You are a concise assistant for a travel company. Answer in one short sentence. "
    "Never invent facts; say you do not know when you do not. "
) * 8


def body_of(error: openai.APIStatusError) -> dict[str, Any]:
    """The ``error`` object of an error reply, as the SDK keeps it."""
    assert isinstance(error.body, dict)
    return error.body


def client(port: int) -> Any:
    # Any: the SDK's typed parameters are OpenAI's models, not ours.
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)


async def test_the_sdk_creates_streams_continues_gets_and_deletes(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening:

        def flow() -> None:
            sdk = client(listening.port)
            question = "What is the capital of France?"
            first = sdk.responses.create(
                model="smollm2", instructions=INSTRUCTIONS, input=question, temperature=0
            )
            assert first.id.startswith("resp_") and first.status == "completed"
            assert "Paris" in first.output_text and first.output[0].type == "message"
            assert first.usage.input_tokens > 200 and first.usage.output_tokens > 0
            # Streamed, greedy: the same text, delta by delta.
            with sdk.responses.stream(
                model="m", instructions=INSTRUCTIONS, input=question, temperature=0
            ) as stream:
                deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
                final = stream.get_final_response()
            assert len(deltas) > 1 and "".join(deltas) == first.output_text
            assert final.output_text == first.output_text and final.status == "completed"
            # Continued: the stored conversation is the prompt's prefix, read
            # from the cache but for its last block or two.
            second = sdk.responses.create(
                model="m",
                instructions=INSTRUCTIONS,
                input="And of Italy?",
                previous_response_id=first.id,
                temperature=0,
            )
            assert second.previous_response_id == first.id and "Rome" in second.output_text
            cached = second.usage.input_tokens_details.cached_tokens
            assert second.usage.input_tokens > first.usage.input_tokens
            assert cached >= first.usage.input_tokens - 64
            # Retrieved whole, then deleted: gone for get and for continuing.
            got = sdk.responses.retrieve(second.id)
            assert got.output_text == second.output_text and got.usage == second.usage
            sdk.responses.delete(second.id)
            with pytest.raises(openai.NotFoundError):
                sdk.responses.retrieve(second.id)
            with pytest.raises(openai.NotFoundError) as missing:
                sdk.responses.create(model="m", input="Hi", previous_response_id=second.id)
            assert body_of(missing.value)["param"] == "previous_response_id"
            # store: false keeps nothing.
            unstored = sdk.responses.create(model="m", input="Hi", store=False, max_output_tokens=2)
            with pytest.raises(openai.NotFoundError):
                sdk.responses.retrieve(unstored.id)
            # max_output_tokens ends it incomplete, as OpenAI says.
            short = sdk.responses.create(
                model="m", input=question, max_output_tokens=3, temperature=0
            )
            assert short.status == "incomplete" and short.usage.output_tokens == 3
            assert short.incomplete_details.reason == "max_output_tokens"

        await trio.to_thread.run_sync(flow)


async def test_tools_required_named_and_an_output_turn(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening:

        def flow() -> None:
            sdk = client(listening.port)
            ask = "What is the weather in Paris?"
            # required: some tool is called, with arguments that validate.
            required = sdk.responses.create(
                model="m", input=ask, tools=[WEATHER, ADD], tool_choice="required", temperature=0
            )
            calls = [item for item in required.output if item.type == "function_call"]
            assert calls and required.status == "completed"
            for call in calls:
                schema = WEATHER if call.name == "get_weather" else ADD
                jsonschema.validate(json.loads(call.arguments), schema["parameters"])
            # Named: that tool, streamed, its arguments arriving in pieces.
            with sdk.responses.stream(
                model="m",
                input=ask,
                tools=[WEATHER, ADD],
                tool_choice={"type": "function", "name": "add"},
                parallel_tool_calls=False,
                temperature=1.0,
            ) as stream:
                pieces = [
                    e.delta for e in stream if e.type == "response.function_call_arguments.delta"
                ]
                named = stream.get_final_response()
            (call,) = [item for item in named.output if item.type == "function_call"]
            assert call.name == "add" and "".join(pieces) == call.arguments
            jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
            # The call's output, continuing the stored response: a text answer.
            answer = sdk.responses.create(
                model="m",
                previous_response_id=named.id,
                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "7"}],
                tools=[WEATHER, ADD],
                tool_choice="none",
                temperature=0,
                max_output_tokens=40,
            )
            assert answer.output and all(item.type == "message" for item in answer.output)
            assert answer.output_text

        await trio.to_thread.run_sync(flow)


async def test_json_schema_output_validates_over_seeds(cpu_engine: CpuEngine) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "region": {"enum": ["north", "centre", "south", "islands"]},
            "population": {"type": "integer", "minimum": 0},
        },
        "required": ["name", "region", "population"],
        "additionalProperties": False,
    }
    async with running_server(cpu_engine) as listening:

        def flow() -> None:
            sdk = client(listening.port)
            for seed in range(4):
                answer = sdk.responses.create(
                    model="m",
                    input="Name a city in Italy.",
                    text={
                        "format": {
                            "type": "json_schema",
                            "name": "city",
                            "schema": schema,
                            "strict": True,
                        }
                    },
                    temperature=1.0,
                    extra_body={"seed": seed},
                )
                assert answer.status == "completed"
                jsonschema.validate(json.loads(answer.output_text), schema)

        await trio.to_thread.run_sync(flow)


async def test_tools_beside_an_answer_format_give_calls_or_a_valid_answer(
    cpu_engine: CpuEngine,
) -> None:
    """OpenAI's structured output beside tools (what Codex CLI's
    ``--output-schema`` and an agent with tools and an output type send):
    with ``tool_choice`` auto, each reply is calls that validate, or an
    answer that does."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "report", "schema": schema, "strict": True}}
    async with running_server(cpu_engine) as listening:

        def flow() -> set[str]:
            sdk = client(listening.port)
            kinds = set()
            for seed in range(6):
                reply = sdk.responses.create(
                    model="m",
                    input="Is it sunny in Paris?",
                    tools=[WEATHER],
                    text=fmt,
                    temperature=1.0,
                    max_output_tokens=120,
                    extra_body={"seed": seed},
                )
                assert reply.status == "completed"
                for item in reply.output:
                    kinds.add(item.type)
                    if item.type == "function_call":
                        jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])
                    else:
                        jsonschema.validate(json.loads(reply.output_text), schema)
            return kinds

        kinds = await trio.to_thread.run_sync(flow)
        assert kinds <= {"function_call", "message"} and kinds


async def test_errors_come_as_the_sdk_classes(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening:

        def flow() -> None:
            sdk = client(listening.port)
            with pytest.raises(openai.BadRequestError) as bad:
                sdk.responses.create(model="m", input="Hi", temperature=7)
            assert body_of(bad.value)["param"] == "temperature"
            # A schema the constraint machinery refuses: checked before work.
            with pytest.raises(openai.BadRequestError) as schema:
                sdk.responses.create(
                    model="m",
                    input="Hi",
                    tools=[
                        {**ADD, "parameters": {"type": "object", "propertyNames": {"pattern": "a"}}}
                    ],
                )
            assert "tools[0].parameters" in str(body_of(schema.value)["param"])
            # The same schema in a tool that is not strict: enforced as far as
            # it can be, not refused.
            lenient = sdk.responses.create(
                model="m",
                input="Hi",
                max_output_tokens=2,
                temperature=0,
                tools=[
                    {
                        **ADD,
                        "strict": False,
                        "parameters": {"type": "object", "propertyNames": {"pattern": "a"}},
                    }
                ],
            )
            assert lenient.status == "incomplete"
            long = "word " * 9000
            with pytest.raises(openai.BadRequestError) as too_long:
                sdk.responses.create(model="m", input=long)
            assert body_of(too_long.value)["code"] == "context_length_exceeded"
            with pytest.raises(openai.NotFoundError):
                sdk.responses.retrieve("resp_" + "0" * 48)

        await trio.to_thread.run_sync(flow)


class City(pydantic.BaseModel):
    name: str
    country: str


async def test_the_agents_sdk_runs_on_its_default_api(cpu_engine: CpuEngine) -> None:
    """``openai-agents`` unchanged, on the Responses API (its default): a
    function tool called and its result read, and a typed final output."""
    async with running_server(cpu_engine) as listening:
        calls: list[str] = []

        @agents.function_tool
        def get_weather(city: str) -> str:
            """The current weather in a city."""
            calls.append(city)
            return f"The weather in {city} is sunny, 21 C."

        async def run() -> tuple[Any, Any]:
            # The Agents SDK runs on asyncio: in a thread of its own here.
            agents.set_tracing_disabled(True)  # traces would go to OpenAI's servers
            agents.set_default_openai_client(
                openai.AsyncOpenAI(
                    base_url=f"http://127.0.0.1:{listening.port}/v1", api_key="unused"
                ),
                use_for_tracing=False,
            )
            weather = agents.Agent(
                name="weather",
                instructions="Call get_weather, then answer with what it says.",
                tools=[get_weather],
                model="smollm2",
                model_settings=agents.ModelSettings(tool_choice="required", temperature=0),
            )
            called = await agents.Runner.run(weather, "What is the weather in Paris?", max_turns=4)
            typed = agents.Agent(
                name="typed",
                instructions="Answer in JSON.",
                model="smollm2",
                output_type=City,
                model_settings=agents.ModelSettings(temperature=0),
            )
            answered = await agents.Runner.run(
                typed, "Paris is in France. Give the city and country."
            )
            return called, answered

        called, answered = await trio.to_thread.run_sync(lambda: asyncio.run(run()))
        assert calls and all(isinstance(city, str) and city for city in calls)
        assert isinstance(called.final_output, str) and called.final_output
        kinds = {type(item).__name__ for item in called.new_items}
        assert {"ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"} <= kinds
        assert isinstance(answered.final_output, City) and answered.final_output.name


async def test_a_client_that_leaves_mid_stream_frees_its_slot(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (server, listening):
        body = json.dumps(
            {"model": "m", "input": "Tell me a long story.", "stream": True, "temperature": 0}
        ).encode()
        sock = socket.create_connection(("127.0.0.1", listening.port))
        try:
            sock.sendall(
                b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            seen = b""
            with trio.fail_after(60):
                while b"response.output_text.delta" not in seen:
                    seen += await trio.to_thread.run_sync(sock.recv, 65536)
        finally:
            sock.close()
        with trio.fail_after(30):
            while server.generations.in_flight(("address", "127.0.0.1")):  # noqa: ASYNC110
                await trio.sleep(0.05)
        # Nothing half-made is stored, and the server goes on serving.
        assert len(server.responses_store) == 0
        answer = await trio.to_thread.run_sync(
            lambda: client(listening.port).responses.create(
                model="m", input="Hi", max_output_tokens=4, temperature=0
            )
        )
        assert answer.usage.output_tokens == 4 and len(server.responses_store) == 1
