"""Tool calls: the request's tools and history read with their bounds, the
grammar of each call format, the streaming reader, and agents' flows on the
real model over a real socket (the ``openai`` SDK, pydantic-ai)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import jsonschema
import openai
import pydantic
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve.engine.grammars import Grammars
from trioserve.openai import OpenAIError, parse_chat_request
from trioserve.vocabulary.constraint import Constraint
from trioserve.vocabulary.tools import (
    TOOL_FORMATS,
    CallArguments,
    CallEnd,
    CallStart,
    Content,
    Tool,
    ToolCall,
    ToolCallReader,
    ToolUse,
    format_for,
    prompt_messages,
    tool_grammar,
)

from .helpers import running_server

if TYPE_CHECKING:
    from pathlib import Path

    from trioserve.engine.cpu.engine import CpuEngine

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(**fields: Any) -> Any:
    fields.setdefault("messages", USER)
    return parse_chat_request(json.dumps(fields).encode())


def refused(**fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        chat(**fields)
    assert info.value.status == 400
    return info.value


# --------------------------------------------------------------------------
# Reading the request


def test_tools_and_choices_are_read() -> None:
    use = chat(tools=[WEATHER, ADD]).tools
    assert use is not None
    assert [t.name for t in use.tools] == ["get_weather", "add"]
    assert (use.choice, use.named, use.parallel) == ("auto", None, True)
    named = chat(
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False,
    ).tools
    assert (named.choice, named.named, named.parallel) == ("required", "add", False)
    legacy = chat(functions=[WEATHER["function"]], function_call={"name": "get_weather"}).tools
    assert (legacy.tools[0].name, legacy.named) == ("get_weather", "get_weather")
    assert chat(tools=[]).tools is None
    assert chat(tools=[WEATHER], tool_choice="none").tools.calls_allowed is False


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [WEATHER] * 2}, "tools[1].function.name", "given twice"),
        (
            {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(10_000)]},
            "tools",
            "at most 128",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "big", "parameters": {"enum": ["x" * 1000] * 1000}},
                    }
                ]
            },
            "tools[0].function.parameters",
            "65536 bytes",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools[0].function.name",
            "letters",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "object"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not one of the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "no tools"),
        (
            {"tools": [WEATHER], "parallel_tool_calls": "yes"},
            "parallel_tool_calls",
            "true or false",
        ),
        ({"tools": [WEATHER], "functions": [ADD["function"]]}, "functions", "not both"),
        (
            {
                "messages": [
                    *USER,
                    {"role": "tool", "content": "21", "tool_call_id": "call_unknown"},
                ]
            },
            "messages[1].tool_call_id",
            "answers no tool call",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    error = refused(**fields)
    assert error.param == param
    assert words in error.message


def test_a_history_of_calls_and_results_is_read() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    }
    request = chat(
        tools=[ADD],
        messages=[
            {"role": "user", "content": "1 + 2?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "3", "tool_call_id": "call_1"},
        ],
    )
    history = request.template_messages()
    assert history[1]["tool_calls"] == (ToolCall("call_1", "add", '{"a": 1, "b": 2}'),)
    assert (history[2]["tool_call_id"], history[2]["name"]) == ("call_1", "add")
    # A template without tools reads it as Hermes text; one with tools, as
    # Hugging Face templates expect (the arguments as an object).
    plain, tools = prompt_messages(history, request.tools, native=False)
    assert tools is None
    assert "<tools>" in plain[0]["content"] and plain[0]["role"] == "system"
    assert (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        in plain[2]["content"]
    )
    assert plain[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    native, tools = prompt_messages(history, request.tools, native=True)
    assert tools == [ADD] or tools == [{**ADD, "function": {**ADD["function"]}}]
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}


def test_the_format_follows_the_template() -> None:
    assert format_for("{{ '<tool_call>' }}").name == "hermes"
    assert format_for("[TOOL_CALLS] {{ x }}").name == "mistral"
    assert format_for("<|python_tag|>{{ x }}").name == "llama3"
    assert format_for(None).name == "hermes"
    assert format_for("<tool_call>", forced="mistral").name == "mistral"


# --------------------------------------------------------------------------
# The grammar and the reader, for every format


TOOLS = (
    Tool("get_weather", None, WEATHER["function"]["parameters"]),
    Tool("add", None, ADD["function"]["parameters"]),
)
CALLS = [
    ToolCall("1", "add", '{"a": 1, "b": 2}'),
    ToolCall("2", "get_weather", '{"city": "Paris", "unit": "celsius"}'),
]


@pytest.fixture(scope="module")
def grammars(model_dir: Path) -> Grammars:
    return Grammars.for_model(model_dir, vocab_size=49152, eos_ids=[2])


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
@pytest.mark.parametrize(
    ("choice", "named", "prefix", "calls", "accepted"),
    [
        ("required", None, "", CALLS, True),
        ("required", None, "Sure. ", CALLS, False),  # text before calls: not when required
        ("auto", None, "Let me check. ", CALLS, True),
        ("auto", None, "No call at all.", [], True),
        ("auto", "add", "", CALLS[:1], True),
        ("auto", "add", "", CALLS[1:], False),  # another function than the named one
    ],
)
def test_the_grammar_takes_exactly_valid_calls(
    grammars: Grammars,
    fmt: str,
    choice: Any,
    named: str | None,
    prefix: str,
    calls: list[ToolCall],
    accepted: bool,
) -> None:
    form = TOOL_FORMATS[fmt]
    grammar = tool_grammar(ToolUse(TOOLS, choice, named), form)
    assert grammar is not None
    matcher = grammars.compile(Constraint("grammar", grammar)).matcher()
    text = prefix + (form.calls_text(calls) if calls else "")
    took = matcher.consume_tokens(grammars.tokenizer.tokenize_str(text))
    assert (took and matcher.is_accepting()) == accepted, (text, matcher.get_error())
    # Arguments that break a tool's schema are never taken.
    bad = form.calls_text([ToolCall("3", "add", '{"a": "one", "b": 2}')])
    wrong = grammars.compile(Constraint("grammar", grammar)).matcher()
    assert not (
        wrong.consume_tokens(grammars.tokenizer.tokenize_str(prefix + bad)) and wrong.is_accepting()
    )


@settings(max_examples=200, deadline=None)
@given(
    fmt=st.sampled_from(sorted(TOOL_FORMATS)),
    prefix=st.sampled_from(["", "Let me look that up. ", "<tool", "{", "[TOOL"]),
    cuts=st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=200),
    count=st.integers(min_value=1, max_value=2),
)
def test_the_reader_gives_the_same_calls_however_the_text_is_cut(
    fmt: str, prefix: str, cuts: list[int], count: int
) -> None:
    form = TOOL_FORMATS[fmt]
    text = prefix + form.calls_text(CALLS[:count])
    reader = ToolCallReader(form)
    events = []
    at = 0
    for cut in cuts:
        events += reader.feed(text[at : at + cut])
        at += cut
    events += reader.feed(text[at:]) + reader.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    assert content == prefix
    assert [(c.name, c.arguments) for c in reader.calls] == [
        (c.name, c.arguments) for c in CALLS[:count]
    ]
    for index, call in enumerate(reader.calls):
        pieces = "".join(
            e.text for e in events if isinstance(e, CallArguments) and e.index == index
        )
        assert pieces == call.arguments
        starts = [e for e in events if isinstance(e, CallStart) and e.index == index]
        ends = [e for e in events if isinstance(e, CallEnd) and e.index == index]
        assert len(starts) == len(ends) == 1 and starts[0].id == call.id


# --------------------------------------------------------------------------
# Over the socket, with clients no one here wrote


async def test_the_openai_sdk_runs_a_tool_flow(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening:
        base = f"http://127.0.0.1:{listening.port}/v1"

        def flow() -> None:
            # Any: the SDK's typed parameters are OpenAI's models, not ours.
            client: Any = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            schema = WEATHER["function"]["parameters"]
            for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
                for seed in range(2):
                    answer = client.chat.completions.create(
                        model="m",
                        messages=USER,
                        tools=[WEATHER, ADD],
                        tool_choice=choice,
                        parallel_tool_calls=False,
                        temperature=1.0,
                        seed=seed,
                        max_tokens=80,
                    )
                    message = answer.choices[0].message
                    assert answer.choices[0].finish_reason == "tool_calls"
                    assert message.content is None and message.tool_calls
                    (call,) = message.tool_calls
                    if isinstance(choice, dict):
                        assert call.function.name == "get_weather"
                    arguments = json.loads(call.function.arguments)
                    if call.function.name == "get_weather":
                        jsonschema.validate(arguments, schema)
            # Streamed: the same call in pieces, its id and name first.
            stream = client.chat.completions.create(
                model="m",
                messages=USER,
                tools=[WEATHER],
                tool_choice="required",
                parallel_tool_calls=False,
                temperature=0.8,
                seed=4,
                max_tokens=80,
                stream=True,
            )
            ids, names, pieces, reasons = [], [], [], []
            for chunk in stream:
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                assert not delta.content  # no marker text leaks into the content
                for tool in delta.tool_calls or ():
                    if tool.id:
                        ids.append(tool.id)
                        names.append(tool.function.name)
                    elif tool.function and tool.function.arguments:
                        pieces.append(tool.function.arguments)
                if chunk.choices[0].finish_reason:
                    reasons.append(chunk.choices[0].finish_reason)
            assert names == ["get_weather"] and len(ids) == 1 and reasons == ["tool_calls"]
            assert len(pieces) > 1
            arguments = json.loads("".join(pieces))
            jsonschema.validate(arguments, WEATHER["function"]["parameters"])
            # The second turn: the call and its result go back; the model answers.
            first = client.chat.completions.create(
                model="m",
                messages=USER,
                tools=[WEATHER],
                tool_choice="required",
                parallel_tool_calls=False,
                temperature=0.8,
                seed=4,
                max_tokens=80,
            )
            call = first.choices[0].message.tool_calls[0]
            history = [
                *USER,
                first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
            ]
            second = client.chat.completions.create(
                model="m",
                messages=history,
                tools=[WEATHER],
                tool_choice="none",
                temperature=0,
                max_tokens=40,
            )
            assert second.choices[0].message.content
            assert second.choices[0].message.tool_calls is None

        await trio.to_thread.run_sync(flow)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)


async def test_pydantic_ai_runs_an_agent_to_the_end(cpu_engine: CpuEngine) -> None:
    """pydantic-ai, unchanged: a function tool and a structured output type
    (which it asks for as a tool call). What the 135M model decides is not
    judged; the run ends with a City."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async with running_server(cpu_engine) as listening:

        def run() -> Any:
            provider = OpenAIProvider(
                base_url=f"http://127.0.0.1:{listening.port}/v1", api_key="unused"
            )
            agent = Agent(
                OpenAIChatModel("smol", provider=provider),
                output_type=City,
                model_settings={"temperature": 0.5, "max_tokens": 120, "seed": 3},
            )

            @agent.tool_plain
            def population(city: str) -> int:
                """The population of a city."""
                return 2_100_000

            return agent.run_sync("Which city is the capital of France?")

        result = await trio.to_thread.run_sync(run)
    assert isinstance(result.output, City)


# --------------------------------------------------------------------------
# The property: every call validates


_PARAMETERS = st.dictionaries(
    st.text(alphabet="abcxyz_", min_size=1, max_size=6),
    st.sampled_from(
        [
            {"type": "integer", "minimum": -5, "maximum": 500},
            {"type": "string", "maxLength": 10},
            {"type": "boolean"},
            {"enum": ["red", "green"]},
            {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        ]
    ),
    min_size=1,
    max_size=3,
).map(lambda props: {"type": "object", "properties": props, "required": sorted(props)})


@pytest.mark.slow
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    schemas=st.lists(_PARAMETERS, min_size=1, max_size=3),
    seed=st.integers(0, 2**32),
    stream=st.booleans(),
)
def test_every_call_validates_against_its_tool(
    cpu_engine: CpuEngine, schemas: list[dict[str, Any]], seed: int, stream: bool
) -> None:
    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "parameters": schema}}
        for i, schema in enumerate(schemas)
    ]
    calls, reason = trio.run(_calls, cpu_engine, tools, seed, stream)
    if reason != "tool_calls":
        assert reason == "length"  # cut short by max_tokens: not judged
        return
    assert calls
    for name, arguments in calls:
        index = int(name.removeprefix("tool_"))
        jsonschema.validate(json.loads(arguments), schemas[index])


async def _calls(
    engine: CpuEngine, tools: list[dict[str, Any]], seed: int, stream: bool
) -> tuple[list[tuple[str, str]], str | None]:
    async with running_server(engine) as listening:

        def ask() -> tuple[list[tuple[str, str]], str | None]:
            client: Any = openai.OpenAI(
                base_url=f"http://127.0.0.1:{listening.port}/v1", api_key="k", max_retries=0
            )
            kwargs: dict[str, Any] = {
                "model": "m",
                "messages": [{"role": "user", "content": "Use the tools."}],
                "tools": tools,
                "tool_choice": "required",
                "temperature": 1.0,
                "seed": seed,
                "max_tokens": 160,
            }
            if not stream:
                answer = client.chat.completions.create(**kwargs)
                found = answer.choices[0].message.tool_calls or []
                return [(c.function.name, c.function.arguments) for c in found], answer.choices[
                    0
                ].finish_reason
            names: dict[int, str] = {}
            arguments: dict[int, str] = {}
            reason = None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                if not chunk.choices:
                    continue
                for tool in chunk.choices[0].delta.tool_calls or ():
                    if tool.function and tool.function.name:
                        names[tool.index] = tool.function.name
                    if tool.function and tool.function.arguments:
                        arguments[tool.index] = (
                            arguments.get(tool.index, "") + tool.function.arguments
                        )
                reason = chunk.choices[0].finish_reason or reason
            return [(names[i], arguments.get(i, "")) for i in sorted(names)], reason

        return await trio.to_thread.run_sync(ask)


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
def test_a_call_cut_short_keeps_only_its_arguments(fmt: str) -> None:
    form = TOOL_FORMATS[fmt]
    whole = form.calls_text([CALLS[0]])
    for cut in range(len(whole) - len(form.end) - len(form.close) - 1, len(whole)):
        reader = ToolCallReader(form)
        reader.feed(whole[:cut])
        reader.finish()
        (call,) = reader.calls
        # Never the wrapper's brace or the end marker, even when they are cut.
        assert call.arguments in ('{"a": 1, "b": 2}', '{"a": 1, "b": 2')
