"""Structured output on the real model over real sockets: every kind of
constraint through both doors, streamed and not, with the ``openai`` SDK's
own parse helper, and a property test whose outputs must all validate."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import jsonschema
import openai
import pydantic
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .helpers import raw_client, running_server
from .http_helpers import get
from .serverproc import open_server_process

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine


def chat(prompt: str) -> str:
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
GBNF = 'root ::= "The answer is " ("yes" | "no") "."'
LARK = 'start: "colour: " COLOUR\nCOLOUR: "red" | "green" | "blue"'


def _valid(kind: str, value: Any, text: str) -> bool:
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), value)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(value, text) is not None
    if kind == "choice":
        return text in value
    if value == GBNF:
        return re.fullmatch(r"The answer is (yes|no)\.", text) is not None
    return re.fullmatch(r"colour: (red|green|blue)", text) is not None


CASES = [
    ("json_schema", PERSON, "Describe a person as JSON."),
    ("regex", DATE, "When was the first moon landing?"),
    ("choice", ["Paris", "London", "Rome"], "What is the capital of France?"),
    ("grammar", GBNF, "Is the sky blue?"),
    ("grammar", LARK, "Name a colour."),
]


@pytest.mark.parametrize("stream", [False, True])
async def test_every_kind_over_the_websocket(cpu_engine: CpuEngine, stream: bool) -> None:
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        await ws.send({"action": "info", "request_id": "i"})
        info = await ws.recv()
        assert info["model"]["constraints"] == ["json_schema", "regex", "choice", "grammar"]
        for n, (kind, value, question) in enumerate(CASES):
            for seed in range(3):
                rid = f"{n}-{seed}"
                await ws.send(
                    {
                        "action": "infer",
                        "request_id": rid,
                        "text": chat(question),
                        "max_new_tokens": 120,
                        "temperature": 1.0,
                        "seed": seed,
                        "stream": stream,
                        kind: value,
                    }
                )
                frames = await ws.recv_until_final(request_id=rid)
                final = frames[-1]
                assert final["response_type"] == "full", final
                text = final["response"]
                if stream:
                    assert "".join(f["chunk"] for f in frames[:-1]) == text
                assert final["stop_reason"] == "eos", final
                assert final["eos_reason"] in ("constraint", "stop_token")
                assert _valid(kind, value, text), (kind, text)
        scrape = (await get(listening.port, "/metrics")).body.decode()
        # Each distinct constraint was compiled at most once and then served
        # from the cache (the engine is shared by the module's tests).
        assert 'trioserve_constraints_total{kind="grammar",outcome="cached"}' in scrape


async def test_limits_and_stops_work_as_without_a_constraint(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        # max_new_tokens cuts a value short: num_tokens, and a prefix.
        await ws.send(
            {
                "action": "infer",
                "request_id": "cut",
                "text": chat("Describe a person as JSON."),
                "max_new_tokens": 4,
                "temperature": 0,
                "json_schema": PERSON,
            }
        )
        (final,) = await ws.recv_until_final(request_id="cut")
        assert final["stop_reason"] == "num_tokens"
        assert final["response"].startswith('{"name": "')
        # A stop string inside the value still stops it.
        await ws.send(
            {
                "action": "infer",
                "request_id": "stop",
                "text": chat("Describe a person as JSON."),
                "max_new_tokens": 100,
                "temperature": 0,
                "json_schema": PERSON,
                "stop_conditions": ['"age"'],
            }
        )
        (final,) = await ws.recv_until_final(request_id="stop")
        assert (final["eos_reason"], final["stop_string"]) == ("stop_string", '"age"')
        assert final["response"].startswith('{"name": "') and '"age"' not in final["response"]


@pytest.mark.parametrize(
    ("frame", "field", "words"),
    [
        ({"regex": "(a"}, "$.regex", "cannot be used"),
        ({"json_schema": {"type": "strnig"}}, "$.json_schema", "strnig"),
        ({"grammar": "root ::= nothing"}, "$.grammar", "nothing"),
        ({"regex": "a", "token_healing": True}, "$.token_healing", "token_healing"),
        ({"regex": "a", "choice": ["b"]}, "$.choice", "regex and choice"),
    ],
)
async def test_bad_constraints_are_named_and_the_connection_goes_on(
    cpu_engine: CpuEngine, frame: dict[str, Any], field: str, words: str
) -> None:
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        await ws.send(
            {"action": "infer", "request_id": 1, "text": "x", "max_new_tokens": 4, **frame}
        )
        error = await ws.recv()
        assert error["response_type"] == "error"
        assert error["error"]["type"] == "invalid_request"
        assert error["error"]["field"] == field
        assert words in error["error"]["message"]
        await ws.send({"action": "echo", "request_id": 2})
        assert (await ws.recv())["request_id"] == 2


#: A schema llguidance takes at first and gives up on a few tokens in (each
#: ``v`` is an object that must hold another ``v``).
ENDLESS = {"type": "object", "properties": {"v": {"$ref": "#"}}, "required": ["v"]}


async def test_a_constraint_that_breaks_down_is_the_requests_error(cpu_engine: CpuEngine) -> None:
    """Its failure is a 400 (invalid_request) on every door, not the
    engine's 500, and the server goes on."""
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        await ws.send(
            {
                "action": "infer",
                "request_id": 1,
                "text": "x",
                "max_new_tokens": 200,
                "json_schema": ENDLESS,
            }
        )
        error = await ws.recv(within=120)
        assert error["response_type"] == "error", error
        assert error["error"]["type"] == "invalid_request"
        assert "the constraint" in error["error"]["message"]

        def openai_side() -> Any:
            base = f"http://127.0.0.1:{listening.port}/v1"
            client: Any = openai.OpenAI(base_url=base, api_key="k", max_retries=0)
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=200,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "v", "schema": ENDLESS},
                    },
                )
            return caught.value

        caught = await trio.to_thread.run_sync(openai_side)
        assert caught.code == "constraint_failed" and "the constraint" in caught.message
        await ws.send({"action": "echo", "request_id": 2})
        assert (await ws.recv())["request_id"] == 2


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)
    likes_cats: bool


async def test_the_openai_sdk_parses_structured_answers(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening:
        base = f"http://127.0.0.1:{listening.port}/v1"

        def use_the_sdk() -> None:
            client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            messages: Any = [{"role": "user", "content": "Describe a person."}]
            for seed in range(3):
                parsed = client.chat.completions.parse(
                    model="m",
                    messages=messages,
                    response_format=Person,
                    temperature=1.0,
                    seed=seed,
                    max_tokens=100,
                )
                choice = parsed.choices[0]
                assert choice.finish_reason == "stop"
                assert isinstance(choice.message.parsed, Person)
            # json_object, streamed: the pieces are one JSON object.
            stream = client.chat.completions.create(
                model="m",
                messages=messages,
                response_format={"type": "json_object"},
                temperature=0.7,
                seed=1,
                max_tokens=400,
                stream=True,
            )
            parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
            assert isinstance(json.loads("".join(parts)), dict)
            # vLLM's and TabbyAPI's fields pass through the SDK's extra_body.
            for extra in (
                {"guided_choice": ["yes", "no"]},
                {"structured_outputs": {"choice": ["yes", "no"]}},
                {"regex_pattern": "(yes|no)"},
            ):
                answer = client.completions.create(
                    model="m", prompt="Is water wet? Answer:", max_tokens=5, extra_body=extra
                )
                assert answer.choices[0].text in ("yes", "no")
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(
                    model="m",
                    messages=messages,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}},
                    },
                )
            body = info.value.body
            assert isinstance(body, dict)
            assert body["param"] == "response_format.json_schema.schema"
            assert "missing" in body["message"]

        await trio.to_thread.run_sync(use_the_sdk)


@pytest.mark.slow
async def test_every_kind_on_both_doors_through_the_cli() -> None:
    """``python -m trioserve`` as users run it: each kind of constraint through
    the WebSocket and the OpenAI door, and a bad schema refused on both."""
    async with open_server_process(["--context-length", "1024"]) as server:
        async with raw_client(server.url) as ws:
            for n, (kind, value, question) in enumerate(CASES):
                await ws.send(
                    {
                        "action": "infer",
                        "request_id": n,
                        "messages": [{"role": "user", "content": question}],
                        "max_new_tokens": 120,
                        "temperature": 0.8,
                        "seed": n,
                        kind: value,
                    }
                )
                (final,) = await ws.recv_until_final(request_id=n)
                assert final["stop_reason"] == "eos", final
                assert _valid(kind, value, final["response"]), (kind, final["response"])
            await ws.send({"action": "infer", "text": "x", "max_new_tokens": 3, "regex": "(a"})
            error = await ws.recv()
            assert (error["error"]["type"], error["error"]["field"]) == (
                "invalid_request",
                "$.regex",
            )
        base = f"http://127.0.0.1:{server.port}/v1"

        def through_the_sdk() -> None:
            client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            openai_names = {
                "json_schema": "json_schema",
                "regex": "regex_pattern",
                "choice": "guided_choice",
                "grammar": "grammar",
            }
            for n, (kind, value, question) in enumerate(CASES):
                answer = client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": question}],
                    max_tokens=120,
                    temperature=0.8,
                    seed=n,
                    extra_body={openai_names[kind]: value},
                )
                choice = answer.choices[0]
                assert choice.finish_reason == "stop"
                assert _valid(kind, value, choice.message.content or ""), (kind, choice)
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(
                    model="m", prompt="x", extra_body={"guided_grammar": "root ::= undefined"}
                )
            assert isinstance(info.value.body, dict)
            assert info.value.body["param"] == "guided_grammar"

        await trio.to_thread.run_sync(through_the_sdk)


# --------------------------------------------------------------------------
# The property: every output that ended validates


_NAMES = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)
_LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(min_value=0, max_value=12)),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(min_value=-50, max_value=50),
        st.integers(min_value=0, max_value=1000),
    ),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(
        st.text(alphabet="xyz ", min_size=1, max_size=5), min_size=1, max_size=4, unique=True
    ).map(lambda values: {"enum": values}),
    st.builds(
        lambda pattern: {"type": "string", "pattern": pattern},
        st.sampled_from(["^[a-z]{1,5}$", "^[0-9]{3}$", "^(ab|cd)+$"]),
    ),
)


def _schemas(leaf: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(
            lambda items, n: {"type": "array", "items": items, "maxItems": n},
            leaf,
            st.integers(min_value=0, max_value=3),
        ),
        st.dictionaries(_NAMES, leaf, min_size=1, max_size=3).flatmap(
            lambda props: st.builds(
                lambda required, closed: {
                    "type": "object",
                    "properties": props,
                    "required": required,
                    **({"additionalProperties": False} if closed else {}),
                },
                st.just(sorted(props)) | st.just([]),
                st.booleans(),
            )
        ),
        st.lists(leaf, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
    )


SCHEMAS = st.recursive(_LEAVES, _schemas, max_leaves=6).map(
    lambda s: (
        s
        if s.get("type") == "object"
        else {"type": "object", "properties": {"v": s}, "required": ["v"]}
    )
)
# A $ref to $defs, as pydantic writes nested models.
SCHEMAS = st.one_of(
    SCHEMAS,
    SCHEMAS.map(
        lambda inner: {
            "$defs": {"Inner": inner},
            "type": "object",
            "properties": {"inner": {"$ref": "#/$defs/Inner"}},
            "required": ["inner"],
        }
    ),
)
_PIECES = st.sampled_from(
    ["[a-z]{1,4}", "[0-9]{2}", "(cat|dog)", "x?", "[A-Z][a-z]{0,3}", " ", "-", "(ab){1,2}", "[.!?]"]
)
REGEXES = st.lists(_PIECES, min_size=1, max_size=5).map("".join)
SAMPLERS = st.fixed_dictionaries(
    {"temperature": st.sampled_from([0.7, 1.0, 1.3]), "seed": st.integers(0, 2**32)},
    optional={
        "top_k": st.sampled_from([0, 5, 40]),
        "top_p": st.sampled_from([0.5, 0.9, 1.0]),
        "min_p": st.sampled_from([0.0, 0.05]),
        "typical": st.sampled_from([0.0, 0.9]),
        "rep_pen": st.sampled_from([1.0, 1.1, 1.3]),
        "dry_multiplier": st.sampled_from([0.0, 0.8]),
        "xtc_probability": st.sampled_from([0.0, 0.5]),
        "mirostat": st.booleans(),
        "temperature_last": st.booleans(),
    },
)
CONSTRAINTS = st.one_of(
    st.tuples(st.just("json_schema"), SCHEMAS),
    st.tuples(st.just("regex"), REGEXES),
    st.tuples(
        st.just("choice"),
        st.lists(
            st.text(alphabet="abc xyz", min_size=1, max_size=8), min_size=1, max_size=5, unique=True
        ),
    ),
)


class _Tally:
    ended = 0
    cut = 0


@pytest.mark.slow
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    constraint=CONSTRAINTS,
    samplers=SAMPLERS,
    door=st.sampled_from(["websocket", "openai"]),
    stream=st.booleans(),
)
def test_every_output_that_ends_validates(
    cpu_engine: CpuEngine,
    constraint: tuple[str, Any],
    samplers: dict[str, Any],
    door: str,
    stream: bool,
) -> None:
    kind, value = constraint
    text, ended = trio.run(_generate, cpu_engine, kind, value, samplers, door, stream)
    if ended:
        _Tally.ended += 1
        assert _valid(kind, value, text), (kind, value, text)
    else:
        _Tally.cut += 1


def test_the_property_saw_outputs_end() -> None:
    # Run after the property in file order: it must not have passed only
    # because every output was cut by max_new_tokens.
    if _Tally.ended + _Tally.cut:
        assert _Tally.ended >= (_Tally.ended + _Tally.cut) // 2


async def _generate(
    engine: CpuEngine, kind: str, value: Any, samplers: dict[str, Any], door: str, stream: bool
) -> tuple[str, bool]:
    prompt = chat("Answer in the required format.")
    async with running_server(engine) as listening:
        if door == "websocket":
            async with raw_client(listening.url) as ws:
                await ws.send(
                    {
                        "action": "infer",
                        "request_id": 1,
                        "text": prompt,
                        "max_new_tokens": 200,
                        "stream": stream,
                        kind: value,
                        **samplers,
                    }
                )
                frames = await ws.recv_until_final(request_id=1)
            final = frames[-1]
            assert final["response_type"] == "full", final
            if stream:
                assert "".join(f["chunk"] for f in frames[:-1]) == final["response"]
            return final["response"], final["stop_reason"] == "eos"
        field = {
            "json_schema": "guided_json",
            "regex": "guided_regex",
            "choice": "guided_choice",
        }[kind]
        body = {"prompt": prompt, "max_tokens": 200, "stream": stream, field: value, **samplers}
        return await trio.to_thread.run_sync(_openai_completion, listening.port, body)


def _openai_completion(port: int, body: dict[str, Any]) -> tuple[str, bool]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
    extra = {
        k: v
        for k, v in body.items()
        if k not in ("prompt", "max_tokens", "stream", "seed", "temperature", "top_p")
    }
    kwargs: dict[str, Any] = {
        "model": "m",
        "prompt": body["prompt"],
        "max_tokens": body["max_tokens"],
        "seed": body["seed"],
        "temperature": min(body["temperature"], 2.0),
        "extra_body": extra,
    }
    if "top_p" in body:
        kwargs["top_p"] = body["top_p"]
    if body["stream"]:
        pieces, reason = [], None
        for chunk in client.completions.create(stream=True, **kwargs):
            pieces.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(pieces), reason == "stop"
    answer = client.completions.create(**kwargs)
    return answer.choices[0].text, answer.choices[0].finish_reason == "stop"
