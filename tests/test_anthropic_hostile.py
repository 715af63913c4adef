"""Hostile clients at Anthropic's Messages door (``POST /v1/messages`` and
``POST /v1/messages/count_tokens``), over a real loopback socket, against
the real embedded model.

What each test plays, and what it checks:

* every top-level field out of type and out of range, on both routes: a 4xx
  whose body is Anthropic's ``{"type": "error", "error": {"type", "message"}}``
  naming the field, never a 5xx, never a dropped connection;
* deep and huge inputs (nesting thousands deep, too many messages, blocks,
  stop sequences or tools, huge or pathological schemas, lone surrogates, a
  body at the size limit, a Content-Length that lies): a 4xx, quickly;
* the API key: missing, wrong, huge, or right beside a wrong one: 401 in
  Anthropic's shape before the body is read;
* a flood of bad requests over several connections while a well-behaved
  client streams and ``/health`` answers;
* streams that are never read, reset, half-closed or left before their first
  event: the engine slot is freed, nobody else waits.

Two tests here found bugs that are fixed: a schema llguidance gives up on a
few tokens in was answered as the engine's 500 (now the request's 400), and
a made-up Bearer token beside the right ``X-Api-Key`` made a new client. They
stay as regression tests.
"""

from __future__ import annotations

import array
import fcntl
import hashlib
import json
import socket
import struct
import termios
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import attrs
import pytest
import trio

from .helpers import serving
from .http_helpers import Reply, connect, get, request

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

MESSAGES: Final = "/v1/messages"
COUNT: Final = "/v1/messages/count_tokens"
ROUTES: Final = (MESSAGES, COUNT)
#: Every client here comes from loopback: a server without keys counts them
#: as one client, by address.
CLIENT: Final = ("address", "127.0.0.1")
QUESTION: Final = [{"role": "user", "content": "Hi"}]
JSON: Final = {"Content-Type": "application/json"}
#: An error body larger than this echoes too much of what the client sent.
MAX_ERROR_BYTES: Final = 4096
#: "Quickly" for a request refused before any work: not a benchmark (a
#: refusal takes milliseconds), only far below any timeout of the server.
QUICK_S: Final = 15.0
#: The error types Anthropic's API documents for these statuses.
DOCUMENTED_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
#: Leaves a field out of a request.
MISSING: Final[Any] = object()


def body_of(path: str, fields: dict[str, Any] | None = None, **more: Any) -> bytes:
    """A valid request of ``path`` for a two-token answer, with ``fields``
    set (or left out, as :data:`MISSING`)."""
    obj: dict[str, Any] = {"model": "m", "messages": QUESTION}
    if path == MESSAGES:
        obj["max_tokens"] = 2
    for name, value in {**(fields or {}), **more}.items():
        if value is MISSING:
            obj.pop(name, None)
        else:
            obj[name] = value
    return json.dumps(obj).encode()


async def post(
    port: int,
    path: str,
    body: bytes,
    headers: dict[str, str] | None = None,
    *,
    within: float = QUICK_S,
) -> Reply | None:
    """``body`` posted on a new connection; the reply, or None when the
    server closed without one."""
    async with connect(port) as client:
        await client.send(request("POST", path, {**JSON, **(headers or {})}, body))
        return await client.response("POST", within=within)


def anthropic_error(reply: Reply | None, status: int | None = None) -> str:
    """Check that ``reply`` is an error in Anthropic's shape (a 4xx unless
    ``status`` says which); its message."""
    assert reply is not None, "the server closed the connection without an answer"
    shown = f"{reply.status} {reply.body[:300]!r}"
    if status is None:
        assert 400 <= reply.status < 500, shown
    else:
        assert reply.status == status, shown
    assert reply.headers.get("content-type", "").startswith("application/json"), shown
    assert len(reply.body) <= MAX_ERROR_BYTES, f"an error body of {len(reply.body)} bytes"
    doc = reply.json()
    assert isinstance(doc, dict) and doc.get("type") == "error", shown
    assert set(doc) <= {"type", "error", "request_id"}, shown
    error = doc["error"]
    assert isinstance(error, dict) and set(error) == {"type", "message"}, shown
    assert isinstance(error["message"], str) and error["message"], shown
    if reply.status in DOCUMENTED_TYPES:
        assert error["type"] == DOCUMENTED_TYPES[reply.status], shown
    else:
        assert isinstance(error["type"], str) and error["type"].endswith("_error"), shown
    return error["message"]


def sse_events(body: bytes) -> list[str]:
    """The event names of a Server-Sent Events body."""
    return [line[7:] for line in body.decode().splitlines() if line.startswith("event: ")]


async def wait_for(predicate: Callable[[], bool], within: float, what: str) -> None:
    with trio.move_on_after(within):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.02)
        return
    raise AssertionError(f"{what}: not within {within} s")


def nested(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + closer * depth


# --------------------------------------------------------------------------
# 1. Every field out of type and out of range, on both routes


async def test_the_valid_requests_these_tests_start_from_are_served(cpu_engine: CpuEngine) -> None:
    """The control: what every other case changes one field of is served,
    so that a 400 below is about that field."""
    async with serving(cpu_engine) as (_, listening):
        reply = await post(listening.port, MESSAGES, body_of(MESSAGES), within=60)
        assert reply is not None and reply.status == 200, reply
        assert reply.json()["type"] == "message"
        reply = await post(listening.port, COUNT, body_of(COUNT), within=60)
        assert reply is not None and reply.status == 200, reply
        assert isinstance(reply.json()["input_tokens"], int)


IMAGE: Final = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
}
TOOL: Final = {"name": "t", "input_schema": {"type": "object"}}


def user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def call_and_result(use: dict[str, Any], result: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        *QUESTION,
        {"role": "assistant", "content": [{"type": "tool_use", **use}]},
        {"role": "user", "content": [{"type": "tool_result", **result}]},
    ]


GOOD_USE: Final = {"id": "toolu_1", "name": "t", "input": {}}

#: field -> bad values. Every one must get a 400 on both routes whose
#: message names the field (on count_tokens, the fields it does not take
#: are unknown fields: a 400 naming them as well).
BAD_FIELDS: Final[dict[str, list[Any]]] = {
    "model": [MISSING, None, 5, "", "m" * 257, ["m"], {"name": "m"}, True],
    "max_tokens": [
        MISSING,
        None,
        "10",
        0,
        -1,
        1.5,
        True,
        "1e400",
        [],
        {},
    ],
    "messages": [
        MISSING,
        None,
        [],
        "hi",
        {},
        [1],
        [None],
        [[]],
        [{"role": "system", "content": "x"}],
        [{"role": 5, "content": "x"}],
        [{"role": "user"}],
        user(5),
        user(None),
        user({"type": "text", "text": "x"}),
        [{"role": "user", "content": "x", "name": "n"}],
        user([5]),
        user([IMAGE]),
        user([{"text": "x"}]),
        user([{"type": "text"}]),
        user([{"type": "text", "text": 5}]),
        user([{"type": "text", "text": "x", "bogus": 1}]),
        user([{"type": "server_tool_use", "id": "x", "name": "n", "input": {}}]),
        user([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]),
        [{"role": "assistant", "content": "a lone prefill"}],
        call_and_result({**GOOD_USE, "id": ""}, {"tool_use_id": "toolu_1"}),
        call_and_result({**GOOD_USE, "id": "i" * 257}, {"tool_use_id": "toolu_1"}),
        call_and_result({**GOOD_USE, "name": "bad name"}, {"tool_use_id": "toolu_1"}),
        call_and_result({**GOOD_USE, "input": "{}"}, {"tool_use_id": "toolu_1"}),
        call_and_result(GOOD_USE, {"tool_use_id": "toolu_2"}),
        call_and_result(GOOD_USE, {"tool_use_id": 5}),
        call_and_result(GOOD_USE, {"tool_use_id": "toolu_1", "is_error": "yes"}),
        call_and_result(GOOD_USE, {"tool_use_id": "toolu_1", "content": [IMAGE]}),
        call_and_result(GOOD_USE, {"tool_use_id": "toolu_1", "content": 5}),
        [*QUESTION, {"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]}],
    ],
    "system": [
        5,
        True,
        {"type": "text", "text": "x"},
        [5],
        [{"type": "image"}],
        [{"type": "text"}],
        [{"type": "text", "text": 5}],
        [{"type": "text", "text": "x", "bogus": 1}],
    ],
    "tools": [
        "t",
        5,
        {},
        [5],
        [{}],
        [{"name": "bad name", "input_schema": {}}],
        [{"name": "t" * 129, "input_schema": {}}],
        [{"name": "t"}],
        [{"name": "t", "input_schema": "object"}],
        [{"name": "t", "input_schema": []}],
        [{"name": "t", "input_schema": {"type": "nonsense"}}],
        [{**TOOL, "description": 5}],
        [{**TOOL, "description": "d" * 131_073}],
        [{**TOOL, "bogus": 1}],
        [TOOL, TOOL],
        [{"type": 5, "name": "x"}],
        [{"type": "x" * 65, "name": "x"}],
    ],
    "tool_choice": [
        "auto",
        5,
        [],
        {},
        {"type": "bogus"},
        {"type": "any"},
        {"type": "tool", "name": "t"},
        {"type": "auto", "disable_parallel_tool_use": "yes"},
        {"type": "auto", "name": "t"},
        {"type": "auto", "bogus": 1},
    ],
    "stop_sequences": [5, [5], [""], [None], ["s" * 257], ["s"] * 65, {"s": 1}, ""],
    "temperature": ["hot", -0.1, 1.5, 2, [], {}],
    "top_p": ["x", -0.1, 1.5, []],
    "top_k": ["x", -1, 1.5, 2**64, []],
    "thinking": [
        "on",
        5,
        [],
        {},
        {"type": "bogus"},
        {"type": "enabled"},
        {"type": "enabled", "budget_tokens": 0},
        {"type": "enabled", "budget_tokens": "many"},
        {"type": "disabled", "bogus": 1},
    ],
    "output_config": [
        "json",
        5,
        [],
        {"bogus": 1},
        {"effort": "extreme"},
        {"effort": 5},
        {"format": "json"},
        {"format": {"type": "regex", "schema": {}}},
        {"format": {"type": "json_schema"}},
        {"format": {"type": "json_schema", "schema": "object"}},
        {"format": {"type": "json_schema", "schema": {}, "bogus": 1}},
        {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}},
    ],
    "output_format": [
        "json",
        5,
        {"type": "json_schema"},
        {"type": "text"},
        {"type": "json_schema", "schema": 5},
    ],
    "stream": ["yes", 1, 0, [], {}],
    # Sampler settings beyond Anthropic's, under the engine's names.
    "rep_pen": [-1, "x"],
    "seed": ["x", 1.5],
    "min_tokens": [-1, "x"],
    "logit_bias": [5, "x"],
    # Refused features, and fields nobody knows.
    "container": [{"id": "c"}, "c"],
    "mcp_servers": [[{"type": "url", "url": "http://x"}]],
    "bogus": [1, None, {}],
    "x" * 10_000: [1],
}
#: Schemas are compiled for a generation only: count_tokens does not see
#: that one is unusable.
GENERATION_ONLY: Final = {
    ("tools", 10),
    ("output_config", 11),
}


@pytest.mark.parametrize("field", list(BAD_FIELDS), ids=lambda f: f[:20])
async def test_each_field_out_of_type_or_range_gets_400_in_anthropics_shape(
    cpu_engine: CpuEngine, field: str
) -> None:
    problems: list[str] = []
    async with serving(cpu_engine) as (server, listening):
        for index, value in enumerate(BAD_FIELDS[field]):
            for path in ROUTES:
                # count_tokens takes no max_tokens.
                valid_there = field == "max_tokens" and value is MISSING
                if path == COUNT and (valid_there or (field, index) in GENERATION_ONLY):
                    continue
                shown = "(missing)" if value is MISSING else json.dumps(value)[:60]
                case = f"{path} {field[:20]}={shown}"
                reply = await post(listening.port, path, body_of(path, {field: value}))
                try:
                    message = anthropic_error(reply, 400)
                    assert field[:20] in message, f"the message does not name it: {message!r}"
                except AssertionError as exc:
                    problems.append(f"{case}: {exc}")
        assert server.generations.in_flight(CLIENT) == 0
    assert not problems, "\n".join(problems)


NOT_OBJECTS: Final[list[bytes]] = [
    b"",
    b" ",
    b"null",
    b"[]",
    b"5",
    b'"messages"',
    b"{",
    b'{"model": "m",}',
    b"\xff\xfe{}",
    b"\xef\xbb\xbf{}",
    b'{"model": NaN}',
    b'{"model": "m", "max_tokens": Infinity}',
    b'{"model": "m"} {"model": "m"}',
    b"{'model': 'm'}",
    b'{"model": "\x00"',
    b"{}",
    # Numbers Python will not read: 5000 digits, and past a double's range.
    b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b', "messages": []}',
    b'{"model": "m", "max_tokens": 1e400, "messages": []}',
]


async def test_a_body_that_is_not_a_request_object_gets_400(cpu_engine: CpuEngine) -> None:
    problems: list[str] = []
    async with serving(cpu_engine) as (_, listening):
        for body in NOT_OBJECTS:
            for path in ROUTES:
                reply = await post(listening.port, path, body)
                try:
                    anthropic_error(reply, 400)
                except AssertionError as exc:
                    problems.append(f"{path} {body[:40]!r}: {exc}")
    assert not problems, "\n".join(problems)


async def test_ignored_fields_of_any_shape_cost_nothing(cpu_engine: CpuEngine) -> None:
    """``metadata``, ``cache_control``, ``service_tier`` and the like are
    accepted and ignored (trioserve/anthropic/requests.py): whatever they
    hold (within the body's bounds) is answered, never with a 5xx. (Anthropic's
    own API refuses a ``metadata`` that is not ``{"user_id": str}``: see the
    report.)"""
    odd: list[Any] = [5, "x", [], None, {"user_id": 5}, json.loads(nested(60))]
    async with serving(cpu_engine) as (_, listening):
        ignored = ("metadata", "cache_control", "service_tier", "context_management")
        for field in ignored:
            for value in odd:
                for path in ROUTES:
                    reply = await post(listening.port, path, body_of(path, {field: value}))
                    assert reply is not None, (path, field, value)
                    assert reply.status in (200, 400), (path, field, value, reply)
                    if reply.status == 400:
                        anthropic_error(reply, 400)


# --------------------------------------------------------------------------
# 2. Deep and huge inputs


def blocks(count: int) -> list[dict[str, str]]:
    return [{"type": "text", "text": "b"}] * count


def deep_object(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


#: name -> (route, body): each must get a 400 in Anthropic's shape, quickly.
DEEP_AND_HUGE: Final[dict[str, tuple[str, bytes]]] = {
    "arrays 5000 deep": (MESSAGES, nested(5000).encode()),
    "objects 5000 deep": (MESSAGES, deep_object(5000).encode()),
    "content 5000 deep": (
        MESSAGES,
        b'{"model":"m","max_tokens":2,"messages":[{"role":"user","content":'
        + nested(5000).encode()
        + b"}]}",
    ),
    "metadata 100000 deep": (
        COUNT,
        b'{"model":"m","messages":[],"metadata":' + nested(100_000).encode() + b"}",
    ),
    "2049 messages": (
        COUNT,
        body_of(COUNT, messages=[{"role": "user", "content": "x"}] * 2049),
    ),
    "1025 content blocks": (MESSAGES, body_of(MESSAGES, messages=user(blocks(1025)))),
    "8000 content blocks": (COUNT, body_of(COUNT, messages=user(blocks(8000)))),
    "1025 system blocks": (COUNT, body_of(COUNT, system=blocks(1025))),
    "1025 tool_result blocks": (
        COUNT,
        body_of(
            COUNT,
            messages=call_and_result(GOOD_USE, {"tool_use_id": "toolu_1", "content": blocks(1025)}),
            tools=[TOOL],
        ),
    ),
    "10000 stop_sequences": (MESSAGES, body_of(MESSAGES, stop_sequences=["s"] * 10_000)),
    "129 tools": (
        MESSAGES,
        body_of(MESSAGES, tools=[{**TOOL, "name": f"t{i}"} for i in range(129)]),
    ),
    "a 70 KB input_schema": (
        MESSAGES,
        body_of(
            MESSAGES,
            tools=[{"name": "t", "input_schema": {"enum": [f"v{i:06d}" for i in range(7000)]}}],
        ),
    ),
    "a 70 KB output schema": (
        MESSAGES,
        body_of(
            MESSAGES,
            output_config={"format": {"type": "json_schema", "schema": {"enum": ["v" * 9] * 7000}}},
        ),
    ),
    "a 100 KB unknown key": (COUNT, body_of(COUNT, {"k" * 100_000: 1})),
    "a 200 KB model name": (COUNT, body_of(COUNT, model="m" * 200_000)),
    "a lone surrogate in text": (MESSAGES, body_of(MESSAGES, messages=user("a\ud800b"))),
    "a lone low surrogate in text": (COUNT, body_of(COUNT, messages=user("\udfff"))),
    "a lone surrogate in system": (
        COUNT,
        body_of(COUNT, system=[{"type": "text", "text": "\ud800"}]),
    ),
    "a lone surrogate in a key": (COUNT, body_of(COUNT, {"\ud800": 1})),
    "a lone surrogate in a stop sequence": (MESSAGES, body_of(MESSAGES, stop_sequences=["\udbff"])),
    "a lone surrogate in a tool schema": (
        MESSAGES,
        body_of(MESSAGES, tools=[{"name": "t", "input_schema": {"enum": ["\ud800"]}}]),
    ),
    "a reversed surrogate pair": (COUNT, body_of(COUNT, messages=user("\ude00\ud83d"))),
    "a raw utf-8 surrogate": (
        COUNT,
        b'{"model":"m","messages":[{"role":"user","content":"\xed\xa0\x80"}]}',
    ),
    "an overlong utf-8 encoding": (
        COUNT,
        b'{"model":"m","messages":[{"role":"user","content":"\xc0\xaf"}]}',
    ),
}


@pytest.mark.parametrize("case", list(DEEP_AND_HUGE))
async def test_deep_and_huge_inputs_get_400_quickly(cpu_engine: CpuEngine, case: str) -> None:
    path, body = DEEP_AND_HUGE[case]
    async with serving(cpu_engine) as (server, listening):
        assert len(body) < server.max_message_bytes, "the case must be within the body limit"
        started = time.perf_counter()
        reply = await post(listening.port, path, body)
        anthropic_error(reply, 400)
        assert time.perf_counter() - started < QUICK_S
        assert server.generations.in_flight(CLIENT) == 0
        # The server goes on serving.
        reply = await post(listening.port, COUNT, body_of(COUNT))
        assert reply is not None and reply.status == 200


async def test_a_surrogate_pair_escape_is_text_not_an_error(cpu_engine: CpuEngine) -> None:
    """The control of the lone-surrogate cases: a well-formed pair
    (``\\ud83d\\ude00``, an emoji) is read as the character it encodes."""
    async with serving(cpu_engine) as (_, listening):
        body = json.dumps({"model": "m", "messages": user("smile \U0001f600")}).encode()
        assert b"\\ud83d\\ude00" in body
        reply = await post(listening.port, COUNT, body)
        assert reply is not None and reply.status == 200, reply


def nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def one_property(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"v": schema}, "required": ["v"]}


#: Schemas that are valid JSON within every size bound, and costly or
#: impossible to enforce. Each must be answered (200, or a 400 that says
#: why), quickly, never with a 5xx.
PATHOLOGICAL_SCHEMAS: Final[dict[str, dict[str, Any]]] = {
    "nested 29 deep": nested_schema(29),
    "an enum of 5000": one_property({"enum": [f"value{i:05d}" for i in range(5000)]}),
    "a backtracking pattern": one_property({"type": "string", "pattern": "^(a+)+b$"}),
    "a million-state pattern": one_property({"type": "string", "pattern": "^(a{1000}){1000}$"}),
    "minItems of a billion": one_property(
        {"type": "array", "items": {"type": "integer"}, "minItems": 10**9}
    ),
    "a self reference": one_property({"$ref": "#"}),
    "a reference loop": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        **one_property({"$ref": "#/$defs/a"}),
    },
}


@pytest.mark.parametrize("where", ["input_schema", "output_config"])
@pytest.mark.parametrize("schema", list(PATHOLOGICAL_SCHEMAS))
async def test_a_pathological_schema_is_answered_never_with_a_5xx(
    cpu_engine: CpuEngine, schema: str, where: str
) -> None:
    """Some of these compile and pass their first mask, and llguidance gives
    up on them a few tokens in ("a million-state pattern", "a self
    reference", "a reference loop"): the job fails, and that failure is the
    request's (400 ``invalid_request_error``), not the engine's 500 (it was,
    until the failure's cause was carried from the engine to the reply)."""
    body: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": QUESTION, "temperature": 0}
    if where == "input_schema":
        body["tools"] = [{"name": "t", "input_schema": PATHOLOGICAL_SCHEMAS[schema]}]
        body["tool_choice"] = {"type": "any"}
    else:
        body["output_config"] = {
            "format": {"type": "json_schema", "schema": PATHOLOGICAL_SCHEMAS[schema]}
        }
    async with serving(cpu_engine) as (server, listening):
        reply = await post(listening.port, MESSAGES, json.dumps(body).encode(), within=60)
        assert reply is not None, "no answer"
        assert reply.status < 500, f"{reply.status} {reply.body[:300]!r}"
        if reply.status != 200:
            anthropic_error(reply)
        assert server.generations.in_flight(CLIENT) == 0


async def test_an_unusable_tool_schema_is_named_as_the_client_wrote_it(
    cpu_engine: CpuEngine,
) -> None:
    """The 400 for a tool's unusable ``input_schema`` names the field as an
    Anthropic request has it, not OpenAI's ``tools[0].function.parameters``
    (the message comes from the constraint code both doors share; it named
    OpenAI's field until 4ad66df)."""
    async with serving(cpu_engine) as (_, listening):
        tools = [{"name": "t", "input_schema": {"type": "nonsense"}}]
        reply = await post(listening.port, MESSAGES, body_of(MESSAGES, tools=tools))
        message = anthropic_error(reply, 400)
        assert "tools[0].input_schema" in message, message
        assert "function.parameters" not in message, message


async def test_a_body_at_the_size_limit_is_read(cpu_engine: CpuEngine) -> None:
    """Exactly the limit is a body the server reads: the JSON is parsed and
    the prompt tokenized (too long for the context: 400, quickly), and one
    padded with whitespace to the limit is served."""
    async with serving(cpu_engine) as (server, listening):
        limit = server.max_message_bytes
        empty = body_of(MESSAGES, messages=user(""))
        text = "The tide comes in. " * (limit // 19)
        body = body_of(MESSAGES, messages=user(text[: limit - len(empty)]))
        assert len(body) == limit
        started = time.perf_counter()
        message = anthropic_error(await post(listening.port, MESSAGES, body), 400)
        assert "prompt is too long" in message
        assert time.perf_counter() - started < QUICK_S
        padded = body_of(MESSAGES, max_tokens=1)
        padded += b" " * (limit - len(padded))
        reply = await post(listening.port, MESSAGES, padded, within=60)
        assert reply is not None and reply.status == 200, reply


async def send_head_then(
    port: int, head: bytes, then: Callable[[trio.SocketStream], Awaitable[None]] | None = None
) -> tuple[Reply | None, bool]:
    """Send ``head`` (and what ``then`` sends); the reply to it and whether
    the server closed the connection afterwards."""
    from .http_helpers import RawClient

    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        client = RawClient(stream)
        await client.send(head)
        if then is not None:
            await then(stream)
        reply = await client.response("POST", within=QUICK_S)
        closed = await client.closed(within=QUICK_S)
    return reply, closed


def post_head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunked(body: bytes, size: int = 60_000) -> bytes:
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


@pytest.mark.parametrize(
    "case", ["one byte over", "a Content-Length over", "chunked over", "a body that stalls"]
)
async def test_the_front_doors_body_refusals_come_in_anthropics_shape(
    cpu_engine: CpuEngine, case: str
) -> None:
    """A body refused while it is read (413 too large, 408 too slow) is
    answered at once (before the body when Content-Length says too much),
    with a close, and in Anthropic's shape on Anthropic's paths (until
    1beb0bf, ``FrontDoor._serve`` answered these without the request's head,
    so in the server's own shape)."""
    async with serving(cpu_engine) as (server, listening):
        limit = server.max_message_bytes
        over = body_of(MESSAGES, max_tokens=1)
        over += b" " * (limit + 1 - len(over))
        then: Callable[[trio.SocketStream], Awaitable[None]] | None = None
        if case == "one byte over":
            head, status = post_head(MESSAGES, {"Content-Length": str(len(over))}), 413

            async def send_body(stream: trio.SocketStream) -> None:
                await stream.send_all(over)

            then = send_body
        elif case == "a Content-Length over":
            # Only the head is sent: the answer cannot wait for the body.
            head, status = post_head(MESSAGES, {"Content-Length": str(10**12)}), 413
        elif case == "chunked over":
            head, status = post_head(COUNT, {"Transfer-Encoding": "chunked"}), 413

            async def send_chunks(stream: trio.SocketStream) -> None:
                await stream.send_all(chunked(over))

            then = send_chunks
        else:
            # A Content-Length that promises more than comes: the body
            # deadline answers (a second here, a minute by default).
            server.front_door.limits = attrs.evolve(server.front_door.limits, body_timeout=1.0)
            body = body_of(MESSAGES)
            head, status = post_head(MESSAGES, {"Content-Length": str(len(body) + 100)}), 408

            async def send_short(stream: trio.SocketStream) -> None:
                await stream.send_all(body)

            then = send_short
        started = time.perf_counter()
        reply, closed = await send_head_then(listening.port, head, then)
        assert reply is not None and reply.status == status, reply
        assert time.perf_counter() - started < QUICK_S
        assert closed, "the connection stays open after a refused body"
        anthropic_error(reply, status)


async def test_a_content_length_shorter_than_the_body_harms_no_one(cpu_engine: CpuEngine) -> None:
    """The body is cut where Content-Length says (invalid JSON: 400 in
    Anthropic's shape); the rest is read as the next request (garbage: a
    400 and a close). No 5xx, and the server goes on serving."""
    async with serving(cpu_engine) as (_, listening):
        body = body_of(MESSAGES)
        head = post_head(MESSAGES, {"Content-Length": str(len(body) - 10)})
        async with connect(listening.port) as client:
            await client.send(head + body)
            anthropic_error(await client.response("POST"), 400)
            # The rest ends as a head would: a request line of garbage.
            await client.send(b"\r\n\r\n")
            second = await client.response("POST")
            assert second is None or 400 <= second.status < 500, second
        # Conflicting or malformed framing: refused before any work.
        for headers in (
            {"Content-Length": "abc"},
            {"Content-Length": "-1"},
            {"Content-Length": "5, 6"},
            {"Content-Length": "5", "Transfer-Encoding": "chunked"},
            {"Transfer-Encoding": "gzip, chunked"},
        ):
            reply, closed = await send_head_then(
                listening.port, post_head(MESSAGES, headers) + b"{}\r\n\r\n"
            )
            assert reply is None or 400 <= reply.status < 500, (headers, reply)
            assert closed, headers
        reply = await post(listening.port, COUNT, body_of(COUNT))
        assert reply is not None and reply.status == 200


# --------------------------------------------------------------------------
# 3. The API key

KEY: Final = "k"


async def test_a_missing_or_wrong_key_gets_401_in_anthropics_shape(cpu_engine: CpuEngine) -> None:
    wrong: list[dict[str, str]] = [
        {},
        {"X-Api-Key": "wrong"},
        {"X-Api-Key": ""},
        {"X-Api-Key": "kk"},
        {"X-Api-Key": "K"},
        {"X-Api-Key": "\xff" + KEY},
        {"X-Api-Key": "x" * 15_000},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"Authorization": "Bearer " + "x" * 15_000},
        {"Authorization": "Bearer wrong", "X-Api-Key": "wrong"},
    ]
    problems: list[str] = []
    async with serving(cpu_engine, api_key=KEY) as (_, listening):
        for headers in wrong:
            for path in ROUTES:
                reply = await post(listening.port, path, body_of(path), headers)
                try:
                    anthropic_error(reply, 401)
                except AssertionError as exc:
                    problems.append(f"{path} {str(headers)[:60]}: {exc}")
        # The key in the query string opens WebSocket handshakes only.
        reply = await post(listening.port, f"{MESSAGES}?api_key={KEY}", body_of(MESSAGES))
        anthropic_error(reply, 401)
        # The controls: the right key, either way, is served.
        for headers in ({"X-Api-Key": KEY}, {"Authorization": f"Bearer {KEY}"}):
            reply = await post(listening.port, COUNT, body_of(COUNT), headers)
            assert reply is not None and reply.status == 200, (headers, reply)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("length", [200_000, 10**12])
async def test_a_refused_key_does_not_make_the_server_read_the_body(
    cpu_engine: CpuEngine, length: int
) -> None:
    """Only the head is sent, announcing a large body: the 401 comes at once
    (a server that read the body first would wait for it until its body
    deadline, a minute), and the connection closes (the unread body cannot
    be taken for the next request)."""
    async with serving(cpu_engine, api_key=KEY) as (_, listening):
        head = post_head(MESSAGES, {"Content-Length": str(length), "X-Api-Key": "wrong"})
        started = time.perf_counter()
        reply, closed = await send_head_then(listening.port, head)
        anthropic_error(reply, 401)
        assert time.perf_counter() - started < QUICK_S
        assert closed
        assert reply is not None and reply.headers.get("connection") == "close"


async def test_a_key_header_over_the_head_limit_is_refused_and_closed(
    cpu_engine: CpuEngine,
) -> None:
    """A head over 16 KiB is refused (431) before any route is looked up, so
    in the server's own shape (no path is known yet), and closed."""
    async with serving(cpu_engine, api_key=KEY) as (_, listening):
        for headers in ({"X-Api-Key": "x" * 20_000}, {"X-Api-Key": KEY, "X-Pad": "p" * 20_000}):
            head = post_head(MESSAGES, {**headers, "Content-Length": "2"})
            reply, closed = await send_head_then(listening.port, head + b"{}")
            assert reply is not None and reply.status == 431, reply
            assert closed
        reply = await post(listening.port, COUNT, body_of(COUNT), {"X-Api-Key": KEY})
        assert reply is not None and reply.status == 200


async def open_stream(port: int, body: bytes, headers: dict[str, str]) -> trio.SocketStream:
    """A streamed request whose first text event has arrived (the generation
    holds its engine slot); the caller reads or closes the rest."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(request("POST", MESSAGES, {**JSON, **headers}, body))
    seen = b""
    with trio.fail_after(60):
        while b"content_block_delta" not in seen:
            data = await stream.receive_some(65536)
            assert data, f"the stream ended early: {seen[-300:]!r}"
            seen += data
    assert seen.startswith(b"HTTP/1.1 200"), seen[:300]
    return stream


#: A stream that runs for as long as the test needs: no EOS before 1500 tokens.
LONG: Final = {"max_tokens": 1500, "min_tokens": 1500, "stream": True, "temperature": 0}


async def test_a_bogus_bearer_beside_the_right_key_cannot_evade_the_client_limit(
    cpu_engine: CpuEngine,
) -> None:
    """With keys, a client is its key, and its requests share
    ``max_requests_per_client``. A request authorized by the right
    ``X-Api-Key`` that also carries ``Authorization: Bearer <anything>`` was
    counted as the client ``<anything>`` (a fresh client per made-up token);
    now an admitted request is the server key's holder
    (``ClientIdentity.of``, trioserve/server/doors.py)."""
    async with serving(cpu_engine, api_key=KEY, max_requests_per_client=1) as (_, listening):
        port = listening.port
        holder = await open_stream(port, body_of(MESSAGES, LONG), {"X-Api-Key": KEY})
        async with holder:
            # The control: the same client's second request is over its limit.
            reply = await post(port, MESSAGES, body_of(MESSAGES), {"X-Api-Key": KEY})
            anthropic_error(reply, 429)
            assert reply is not None and reply.headers.get("retry-after") == "1"
            spoofed = {"X-Api-Key": KEY, "Authorization": "Bearer someone-else"}
            reply = await post(port, MESSAGES, body_of(MESSAGES), spoofed, within=60)
            assert reply is not None
            assert reply.status == 429, (
                f"{reply.status}: a made-up Bearer token beside the right X-Api-Key"
                " was served past the client's limit"
            )
        # The holder left: its slot comes back.
        with trio.fail_after(30):
            while True:
                reply = await post(port, COUNT, body_of(COUNT), {"X-Api-Key": KEY})
                assert reply is not None
                if reply.status == 200:
                    break
                await trio.sleep(0.05)


async def test_a_forwarded_for_header_cannot_evade_the_client_limit(
    cpu_engine: CpuEngine,
) -> None:
    """Without keys a client is its address; ``X-Forwarded-For`` from a peer
    that is not a trusted proxy names no one: the header does not make a
    new client past ``max_requests_per_client``."""
    async with serving(cpu_engine, max_requests_per_client=1) as (server, listening):
        port = listening.port
        holder = await open_stream(port, body_of(MESSAGES, LONG), {})
        async with holder:
            for headers in ({}, {"X-Forwarded-For": "203.0.113.9"}, {"Forwarded": "for=1.2.3.4"}):
                reply = await post(port, MESSAGES, body_of(MESSAGES), headers)
                anthropic_error(reply, 429)
        await wait_for(lambda: server.generations.in_flight(CLIENT) == 0, 30, "still held")


async def test_odd_anthropic_headers_are_harmless(cpu_engine: CpuEngine) -> None:
    """``anthropic-version`` and ``anthropic-beta`` are accepted whatever
    they say: long, empty, repeated or not ASCII, they cost nothing."""
    odd: list[list[tuple[str, str]]] = [
        [("anthropic-version", "v" * 8000)],
        [("anthropic-version", "")],
        [("anthropic-beta", ",".join(["x"] * 3000))],
        [("anthropic-beta", "\xff\xfe")],
        [("anthropic-version", "1"), ("anthropic-version", "2"), ("anthropic-beta", "b")],
    ]
    async with serving(cpu_engine) as (_, listening):
        for headers in odd:
            lines = [f"POST {COUNT} HTTP/1.1", "Host: test", "Content-Type: application/json"]
            body = body_of(COUNT)
            lines += [f"{name}: {value}" for name, value in headers]
            lines.append(f"Content-Length: {len(body)}")
            head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
            async with connect(listening.port) as client:
                await client.send(head + body)
                reply = await client.response("POST")
            assert reply is not None and reply.status == 200, (headers[0][0], reply)


# --------------------------------------------------------------------------
# 4. A flood of bad requests while others are served


@attrs.define
class Tally:
    statuses: list[int] = attrs.Factory(list)
    failures: list[str] = attrs.Factory(list)

    def add(self, what: str, reply: Reply | None) -> None:
        if reply is None:
            self.failures.append(f"{what}: no answer")
            return
        self.statuses.append(reply.status)
        if not 400 <= reply.status < 500:
            self.failures.append(f"{what}: {reply.status} {reply.body[:200]!r}")


FLOOD_BODIES: Final[list[tuple[str, bytes]]] = [
    (MESSAGES, nested(20_000).encode()),
    (COUNT, deep_object(3000).encode()),
    (MESSAGES, body_of(MESSAGES, temperature="hot")),
    (COUNT, body_of(COUNT, messages=user(blocks(1025)))),
    (MESSAGES, body_of(MESSAGES, stop_sequences=["s"] * 10_000)),
    (MESSAGES, body_of(MESSAGES, messages=user("\ud800"))),
    (COUNT, body_of(COUNT, tools=[{**TOOL, "name": f"t{i}"} for i in range(129)])),
    (MESSAGES, body_of(MESSAGES, max_tokens=0)),
    (MESSAGES, b"\xff" * 1000),
]


async def attacker(port: int, rounds: int, tally: Tally, serial: int, done: trio.Event) -> None:
    """``rounds`` rounds of bad requests at least, and on until ``done``."""
    round_ = -1
    while (round_ := round_ + 1) < rounds or not done.is_set():
        kind = (round_ + serial) % 3
        if kind == 0:
            # Several bad requests pipelined on one kept-alive connection.
            async with connect(port) as client:
                batch = [FLOOD_BODIES[(round_ + i) % len(FLOOD_BODIES)] for i in range(8)]
                await client.send(b"".join(request("POST", p, JSON, b) for p, b in batch))
                for path, _ in batch:
                    tally.add(f"pipelined {path}", await client.response("POST", within=60))
        elif kind == 1:
            path, body = FLOOD_BODIES[round_ % len(FLOOD_BODIES)]
            tally.add(f"single {path}", await post(port, path, body, within=60))
        else:
            # A head announcing a body over the limit, the body never sent.
            async with connect(port) as client:
                await client.send(post_head(MESSAGES, {"Content-Length": str(10**9)}))
                tally.add("oversized", await client.response("POST", within=60))


async def test_a_flood_of_bad_requests_starves_no_one(cpu_engine: CpuEngine) -> None:
    """Four attackers send about 600 bad requests (pipelined, one per
    connection, oversized heads) while a well-behaved client streams three
    messages to their ``message_stop`` and ``/health`` keeps answering."""
    tally = Tally()
    health: list[int] = []
    streams: list[list[str]] = []
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        flooding = True

        async def probe_health() -> None:
            while flooding:
                reply = await get(port, "/health")
                health.append(reply.status)
                await trio.sleep(0.02)

        streamed = trio.Event()

        async def stream_well() -> None:
            # Once the attack is under way.
            await wait_for(lambda: len(tally.statuses) > 20, 30, "no attack")
            for serial in range(3):
                body = body_of(
                    MESSAGES,
                    max_tokens=16,
                    stream=True,
                    temperature=0,
                    messages=user(f"Tell me a story, number {serial}."),
                )
                reply = await post(port, MESSAGES, body, within=60)
                assert reply is not None and reply.status == 200, reply
                streams.append(sse_events(reply.body))
            streamed.set()

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(probe_health)
                async with trio.open_nursery() as attack:
                    for serial in range(4):
                        attack.start_soon(attacker, port, 45, tally, serial, streamed)
                    attack.start_soon(stream_well)
                flooding = False
        assert server.generations.in_flight(CLIENT) == 0
    assert not tally.failures, tally.failures[:10]
    assert len(tally.statuses) > 500, len(tally.statuses)
    assert len(streams) == 3
    for events in streams:
        assert events[0] == "message_start" and events[-1] == "message_stop", events
        assert "error" not in events and events.count("content_block_delta") > 1, events
    assert len(health) >= 2 and set(health) == {200}, sorted(set(health))


# --------------------------------------------------------------------------
# 5. Streams that are not read, or left


def small_window_socket(port: int) -> socket.socket:
    """A blocking socket whose receive buffer is as small as the kernel
    allows: a client that reads nothing stops the server's writes soon."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", port))
    return sock


def queued(sock: socket.socket) -> int:
    """Bytes the kernel holds for ``sock``, unread (Linux's FIONREAD)."""
    count = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    return count[0]


async def window_closed(sock: socket.socket, within: float = 30.0) -> None:
    """Wait until the unread bytes of ``sock`` stop growing: its receive
    window is full, and the peer's writes wait."""
    last, since = -1, trio.current_time()
    with trio.fail_after(within):
        while True:
            now = queued(sock)
            if now != last or now == 0:
                last, since = now, trio.current_time()
            elif trio.current_time() - since > 0.5:
                return
            await trio.sleep(0.05)


def read_all(sock: socket.socket, within: float) -> bytes:
    sock.settimeout(within)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


async def test_a_client_that_never_reads_is_cut_off_and_stalls_no_one(
    cpu_engine: CpuEngine,
) -> None:
    """A stream of 1500 tokens to a client that reads nothing through a
    tiny window: while the server's writes wait on it, another client's
    stream completes and ``/health`` answers; after ``send_timeout`` the
    server gives up on it by itself (the slot is freed while the socket is
    still open and unread), and what the client finds later is a stream cut
    short, with no ``message_stop``."""
    async with serving(cpu_engine, send_timeout=3.0) as (server, listening):
        port = listening.port
        sock = await trio.to_thread.run_sync(small_window_socket, port)
        try:
            body = body_of(MESSAGES, LONG, messages=user("Write a long story about a dragon."))
            head = request("POST", MESSAGES, JSON, body)
            await trio.to_thread.run_sync(sock.sendall, head)
            await wait_for(lambda: server.generations.in_flight(CLIENT) == 1, 30, "no job")
            await window_closed(sock)
            # The server's write to it waits now; others are served meanwhile.
            reply = await post(
                port,
                MESSAGES,
                body_of(MESSAGES, max_tokens=12, stream=True, temperature=0),
                within=60,
            )
            assert reply is not None and reply.status == 200, reply
            events = sse_events(reply.body)
            assert events[0] == "message_start" and events[-1] == "message_stop", events
            assert (await get(port, "/health")).status == 200
            await wait_for(
                lambda: server.generations.in_flight(CLIENT) == 0,
                60,
                "the reader-less stream still holds its slot",
            )
            # With the window this small, what the kernel still holds would
            # come only with its zero-window probes (seconds apart).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            data = await trio.to_thread.run_sync(read_all, sock, 10.0)
        finally:
            sock.close()
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
        assert b"content_block_delta" in data
        assert b"message_stop" not in data, "the stream was not cut: it fit in the buffers"


def reset(stream: trio.SocketStream) -> None:
    """Close with a TCP reset instead of a FIN (SO_LINGER 0)."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.parametrize("how", ["reset", "half_close", "before_the_first_event"])
async def test_a_client_that_leaves_a_stream_frees_its_slot(
    cpu_engine: CpuEngine, how: str
) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        if how == "before_the_first_event":
            # A long prompt: the client is gone while it is still being read.
            body = body_of(MESSAGES, LONG, messages=user("The tide comes in and goes out. " * 700))
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(request("POST", MESSAGES, JSON, body))
            await wait_for(lambda: server.generations.in_flight(CLIENT) == 1, 30, "no job")
            reset(stream)
            await stream.aclose()
            rest = b""
        else:
            stream = await open_stream(port, body_of(MESSAGES, LONG), {})
            if how == "reset":
                reset(stream)
                await stream.aclose()
                rest = b""
            else:
                # Half-closed: the client sends nothing more; it counts as gone.
                await stream.send_eof()
                rest = b""
                with trio.fail_after(30):
                    while data := await stream.receive_some(65536):
                        rest += data
                await stream.aclose()
        await wait_for(
            lambda: server.generations.in_flight(CLIENT) == 0, 30, "the slot is still held"
        )
        assert b"message_stop" not in rest, "the stream ran to its end"
        # The server goes on serving.
        reply = await post(
            port, MESSAGES, body_of(MESSAGES, max_tokens=3, temperature=0), within=60
        )
        assert reply is not None and reply.status == 200, reply
        assert reply.json()["usage"]["output_tokens"] == 3


async def test_a_never_read_stream_does_not_hold_a_slot_from_a_newcomer(
    cpu_engine: CpuEngine,
) -> None:
    """A keyed client with one request in flight allowed holds it with a
    stream it never reads; its key gets 429 meanwhile, then, once
    ``send_timeout`` cut the stream, the key is served again without the
    stalled client having closed anything."""
    async with serving(cpu_engine, api_key=KEY, max_requests_per_client=1, send_timeout=2.0) as (
        server,
        listening,
    ):
        port = listening.port
        client = ("key", hashlib.sha256(KEY.encode()).hexdigest()[:16])
        sock = await trio.to_thread.run_sync(small_window_socket, port)
        try:
            body = body_of(MESSAGES, LONG)
            head = request("POST", MESSAGES, {**JSON, "X-Api-Key": KEY}, body)
            await trio.to_thread.run_sync(sock.sendall, head)
            await wait_for(lambda: server.generations.in_flight(client) == 1, 30, "no job")
            # Counting is one of the client's requests too: at its limit, refused.
            reply = await post(port, COUNT, body_of(COUNT), {"X-Api-Key": KEY})
            anthropic_error(reply, 429)
            reply = await post(port, MESSAGES, body_of(MESSAGES), {"X-Api-Key": KEY})
            anthropic_error(reply, 429)
            await wait_for(lambda: server.generations.in_flight(client) == 0, 60, "still held")
            reply = await post(port, MESSAGES, body_of(MESSAGES), {"X-Api-Key": KEY}, within=60)
            assert reply is not None and reply.status == 200, reply
        finally:
            sock.close()
