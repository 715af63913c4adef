"""Hostile clients at OpenAI's Responses door (``POST /v1/responses``,
``GET`` and ``DELETE /v1/responses/{id}``), over a real loopback socket,
against the real embedded model.

What each test plays, and what it checks:

* every top-level field out of type and out of range (refused features and
  unknown fields too): a 4xx whose body is OpenAI's ``{"error": {"message",
  "type", "param", "code"}}`` with ``param`` naming the field, never a 5xx,
  never a dropped connection (a huge ``max_output_tokens`` is a bound, as
  documented: served);
* hostile input items (nesting thousands deep, too many items or parts, lone
  surrogates, outputs that answer no call, references, built-in tools'
  items, media in the last item), huge or pathological schemas, a body at the
  size limit, a Content-Length that lies, bytes that are not a JSON object:
  a 4xx, quickly;
* the store: ids unknown, made up, deleted, expired, odd (percent-encoded
  slashes, NULs, 10 KB) or another client's, on ``GET``, ``DELETE`` and as
  ``previous_response_id``: a 404 that tells nothing of another's responses;
  one client's flood of stored responses stays within ``responses_store_mib``
  and evicts its own responses, not another client's;
* a flood of bad requests over several connections while a well-behaved
  client streams and ``/health`` answers;
* streams that are never read, reset, half-closed or left before their first
  event: the engine slot is freed, nobody else waits.

The field test found a bug that is fixed: where ``include[i]``,
``tools[i].type``, ``input[i].type``, a content part's ``type`` or
``reasoning.effort``/``summary`` takes a string, a JSON array or object was
looked up in a frozenset (``TypeError: unhashable type``) and answered 500
(trioserve/responses/requests.py and items.py now check for a string
first). The cases stay as regression tests (``UNHASHABLE``).
"""

from __future__ import annotations

import array
import fcntl
import json
import re
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
from .http_helpers import RawClient, Reply, connect, get, request

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

RESPONSES: Final = "/v1/responses"
#: Every client here comes from loopback: a server without keys and without
#: trusted proxies counts them as one client, by address.
CLIENT: Final = ("address", "127.0.0.1")
JSON: Final = {"Content-Type": "application/json"}
#: An error body larger than this echoes too much of what the client sent.
MAX_ERROR_BYTES: Final = 4096
#: "Quickly" for a request refused before any work: not a benchmark (a
#: refusal takes milliseconds), only far below any timeout of the server.
QUICK_S: Final = 15.0
#: OpenAI's ``error.type`` for the statuses these tests meet.
DOCUMENTED_TYPES: Final = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
#: Leaves a field out of a request.
MISSING: Final[Any] = object()
#: A server on which ``X-Forwarded-For`` (sent by the test, as a proxy on
#: loopback would) names the client: two addresses are two clients.
PROXIED: Final = {"trusted_proxies": ("127.0.0.1/32",)}
ALICE: Final = {"X-Forwarded-For": "203.0.113.1"}
MALLORY: Final = {"X-Forwarded-For": "203.0.113.2"}


def body_of(fields: dict[str, Any] | None = None, **more: Any) -> bytes:
    """A valid request for a two-token answer, with ``fields`` set (or left
    out, as :data:`MISSING`)."""
    obj: dict[str, Any] = {"model": "m", "input": "Hi", "max_output_tokens": 2}
    for name, value in {**(fields or {}), **more}.items():
        if value is MISSING:
            obj.pop(name, None)
        else:
            obj[name] = value
    return json.dumps(obj).encode()


async def post(
    port: int,
    body: bytes,
    headers: dict[str, str] | None = None,
    *,
    path: str = RESPONSES,
    within: float = QUICK_S,
) -> Reply | None:
    """``body`` posted on a new connection; the reply, or None when the
    server closed without one."""
    async with connect(port) as client:
        await client.send(request("POST", path, {**JSON, **(headers or {})}, body))
        return await client.response("POST", within=within)


async def call(
    port: int, method: str, path: str, headers: dict[str, str] | None = None
) -> Reply | None:
    """A request without a body (``GET``, ``DELETE``) on a new connection."""
    async with connect(port) as client:
        await client.send(request(method, path, headers))
        return await client.response(method, within=QUICK_S)


def openai_error(
    reply: Reply | None, status: int | None = None, *, param: Any = MISSING
) -> dict[str, Any]:
    """Check that ``reply`` is an error in OpenAI's shape (a 4xx unless
    ``status`` says which, naming ``param`` when given); its ``error``."""
    assert reply is not None, "the server closed the connection without an answer"
    shown = f"{reply.status} {reply.body[:300]!r}"
    if status is None:
        assert 400 <= reply.status < 500, shown
    else:
        assert reply.status == status, shown
    assert reply.headers.get("content-type", "").startswith("application/json"), shown
    assert len(reply.body) <= MAX_ERROR_BYTES, f"an error body of {len(reply.body)} bytes"
    doc = reply.json()
    assert isinstance(doc, dict) and set(doc) == {"error"}, shown
    error = doc["error"]
    assert isinstance(error, dict), shown
    assert set(error) == {"message", "type", "param", "code"}, shown
    assert isinstance(error["message"], str) and error["message"], shown
    assert error["param"] is None or isinstance(error["param"], str), shown
    assert error["code"] is None or isinstance(error["code"], str), shown
    if reply.status in DOCUMENTED_TYPES:
        assert error["type"] == DOCUMENTED_TYPES[reply.status], shown
    if param is not MISSING:
        assert error["param"] == param, shown
    return error


def names(param: str | None, field: str) -> bool:
    """Whether ``param`` is ``field`` or a path inside it."""
    return param is not None and (
        param == field or param.startswith(f"{field}.") or param.startswith(f"{field}[")
    )


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


async def create(port: int, headers: dict[str, str] | None = None, **fields: Any) -> str:
    """A response stored for the client of ``headers``; its id."""
    reply = await post(port, body_of(fields), headers, within=60)
    assert reply is not None and reply.status == 200, reply
    doc = reply.json()
    assert doc["object"] == "response" and doc["store"] is True, doc
    return str(doc["id"])


# --------------------------------------------------------------------------
# 1. Every field out of type and out of range


async def test_the_valid_requests_these_tests_start_from_are_served(cpu_engine: CpuEngine) -> None:
    """The control: what every other case changes one field of is served
    (and stored, and read back, and deleted), so that a 4xx below is about
    that field."""
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        reply = await post(port, body_of(), within=60)
        assert reply is not None and reply.status == 200, reply
        doc = reply.json()
        assert doc["object"] == "response" and doc["status"] in ("completed", "incomplete")
        assert doc["usage"]["output_tokens"] <= 2
        stored = await call(port, "GET", f"{RESPONSES}/{doc['id']}")
        assert stored is not None and stored.status == 200, stored
        assert stored.json()["id"] == doc["id"]
        reply = await post(port, body_of(previous_response_id=doc["id"]), within=60)
        assert reply is not None and reply.status == 200, reply
        deleted = await call(port, "DELETE", f"{RESPONSES}/{doc['id']}")
        assert deleted is not None and deleted.status == 200, deleted
        assert deleted.json() == {"id": doc["id"], "object": "response", "deleted": True}
        reply = await post(port, body_of(stream=True), within=60)
        assert reply is not None and reply.status == 200, reply
        events = sse_events(reply.body)
        assert events[0] == "response.created", events
        assert events[-1] in ("response.completed", "response.incomplete"), events
        assert server.generations.in_flight(CLIENT) == 0


@attrs.frozen
class With:
    """A bad value of the field under test, sent with other fields (those
    that make it bad, or the rest of the request valid)."""

    value: Any
    others: dict[str, Any] = attrs.field(hash=False)


def with_(value: Any, **others: Any) -> With:
    return With(value, others)


TOOL: Final = {"type": "function", "name": "t"}
TOOLS: Final = [TOOL]


def user(content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def part(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


CALL: Final = {"type": "function_call", "call_id": "call_1", "name": "t", "arguments": "{}"}
OUTPUT: Final = {"type": "function_call_output", "call_id": "call_1", "output": "42"}
ASKED: Final = {"role": "user", "content": "What is it?"}

#: Values of a string-valued key that are JSON arrays or objects: each was
#: looked up in a frozenset, and ``TypeError: unhashable type`` made a 500.
UNHASHABLE: Final[dict[str, list[Any]]] = {
    "include": [[[]], [{}]],
    "tools": [[{"type": []}], [{"type": {}}]],
    "input": [
        [{"type": []}],
        [{"type": {"a": 1}, "role": "user"}],
        user([{"type": []}]),
        user([{"type": {}}]),
    ],
    "reasoning": [{"effort": []}, {"summary": {}}, {"generate_summary": []}],
}

#: field -> bad values. Every one must get a 400 whose ``param`` names the
#: field (or a path inside it).
BAD_FIELDS: Final[dict[str, list[Any]]] = {
    "model": [MISSING, None, 5, "", "m" * 257, ["m"], {"name": "m"}, True],
    "input": [
        MISSING,
        None,
        5,
        True,
        {},
        [],
        [5],
        [None],
        [[]],
        ["Hi"],
        [{"role": "user"}],
        user(5),
        user(None),
        user({"type": "input_text", "text": "x"}),
        [{"role": "bogus", "content": "x"}],
        [{"role": "tool", "content": "x"}],
        [{"role": 5, "content": "x"}],
        [{"role": "system", "content": "only a system turn"}],
        [{"role": "developer", "content": "only a developer turn"}],
        [{"type": "message", "role": "user", "content": "x", "bogus": 1}],
        user([5]),
        user([part("input_text")]),
        user([part("input_text", text=5)]),
        user([part("input_text", text="x", bogus=1)]),
        user([part("bogus", text="x")]),
        user([part("refusal", refusal="a user does not refuse")]),
        user([{"text": "x"}]),
        user([part("input_image", image_url="data:image/png;base64,AA==")]),
        user([part("input_file", file_id="file_1")]),
        user([part("input_audio", input_audio={"data": "AA==", "format": "wav"})]),
        [{"type": "bogus"}],
        [{"type": 5}],
        [{"type": None}],
        [{"type": "item_reference", "id": "msg_1"}],
        [{"type": "web_search_call", "id": "ws_1", "status": "completed"}],
        [{"type": "file_search_call", "id": "fs_1", "queries": [], "status": "completed"}],
        [{"type": "computer_call_output", "call_id": "c", "output": {}}],
        [{"type": "mcp_call", "id": "mcp_1"}],
        [{"type": "local_shell_call", "id": "ls_1"}],
        [{"type": "custom_tool_call", "call_id": "c", "name": "t", "input": "x"}],
        # Calls and their outputs.
        [ASKED, OUTPUT],
        [ASKED, {**OUTPUT, "call_id": "call_never_made"}],
        [ASKED, CALL, {**OUTPUT, "call_id": 5}],
        [ASKED, CALL, {**OUTPUT, "call_id": ""}],
        [ASKED, CALL, {**OUTPUT, "call_id": "c" * 257}],
        [ASKED, CALL, {k: v for k, v in OUTPUT.items() if k != "output"}],
        [ASKED, CALL, {**OUTPUT, "output": 5}],
        [ASKED, CALL, {**OUTPUT, "output": [part("input_image", image_url="x")]}],
        [ASKED, CALL, {**OUTPUT, "bogus": 1}],
        [ASKED, CALL, CALL, OUTPUT],
        [ASKED, {**CALL, "call_id": None}, OUTPUT],
        [ASKED, {**CALL, "name": "bad name"}, OUTPUT],
        [ASKED, {**CALL, "name": "t" * 129}, OUTPUT],
        [ASKED, {**CALL, "arguments": {}}, OUTPUT],
        [ASKED, {**CALL, "bogus": 1}, OUTPUT],
        [ASKED, {"type": "reasoning", "summary": [], "bogus": 1}],
        *UNHASHABLE["input"],
    ],
    "instructions": [5, True, [], {}, ["x"]],
    "max_output_tokens": [
        "10",
        0,
        -1,
        -(2**64),
        1.5,
        True,
        False,
        "1e400",
        [],
        {},
    ],
    "stream": ["yes", 1, 0, [], {}],
    "store": ["yes", 1, 0, [], {}],
    "previous_response_id": [5, True, [], {}, ["resp_1"], "r" * 257],
    "metadata": [
        5,
        "x",
        [],
        {str(i): "v" for i in range(17)},
        {"k": "v" * 513},
        {"k" * 65: "v"},
        {"k": 5},
        {"k": None},
        {"k": True},
        {"k": ["v"]},
        {"k": {"a": "b"}},
    ],
    "tools": [
        "t",
        5,
        {},
        TOOL,
        [5],
        [[]],
        [{}],
        [{"type": "bogus", "name": "t"}],
        [{"type": 5}],
        [{"type": "function"}],
        [{"type": "function", "name": ""}],
        [{"type": "function", "name": "bad name"}],
        [{"type": "function", "name": "t" * 65}],
        [{"type": "function", "name": 5}],
        [TOOL, TOOL],
        [TOOL, {"type": "function", "name": "u"}, TOOL],
        [{**TOOL, "parameters": "object"}],
        [{**TOOL, "parameters": []}],
        [{**TOOL, "parameters": {"type": "nonsense"}}],
        [{**TOOL, "description": 5}],
        [{**TOOL, "description": "d" * 131_073}],
        [{**TOOL, "strict": "yes"}],
        [{**TOOL, "bogus": 1}],
        [{**TOOL, "function": {"name": "t"}}],
        [{"type": "function", "function": {"name": "t"}}],
        [{**TOOL, "name": f"t{i}"} for i in range(129)],
        *UNHASHABLE["tools"],
    ],
    "tool_choice": [
        5,
        True,
        [],
        "bogus",
        "any",
        {},
        {"type": "bogus"},
        {"type": []},
        {"type": "tool", "name": "t"},
        {"type": "web_search"},
        {"type": "web_search_preview"},
        {"type": "mcp", "server_label": "x"},
        # Naming a function the request does not have.
        "required",
        {"type": "function", "name": "t"},
        with_({"type": "function"}, tools=TOOLS),
        with_({"type": "function", "name": "u"}, tools=TOOLS),
        with_({"type": "function", "name": 5}, tools=TOOLS),
        with_({"type": "function", "name": "t", "bogus": 1}, tools=TOOLS),
        with_({"type": "function", "function": {"name": "t"}}, tools=TOOLS),
        # allowed_tools, abused.
        with_({"type": "allowed_tools", "mode": "bogus", "tools": []}, tools=TOOLS),
        with_({"type": "allowed_tools", "mode": [], "tools": []}, tools=TOOLS),
        with_({"type": "allowed_tools", "tools": [TOOL]}, tools=TOOLS),
        with_({"type": "allowed_tools", "mode": "auto"}, tools=TOOLS),
        with_({"type": "allowed_tools", "mode": "auto", "tools": TOOL}, tools=TOOLS),
        with_({"type": "allowed_tools", "mode": "auto", "tools": [5]}, tools=TOOLS),
        with_({"type": "allowed_tools", "mode": "auto", "tools": [{"name": "t"}]}, tools=TOOLS),
        with_(
            {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": 5}]},
            tools=TOOLS,
        ),
        with_(
            {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "u"}]},
            tools=TOOLS,
        ),
        with_({"type": "allowed_tools", "mode": "auto", "tools": [TOOL] * 18}, tools=TOOLS),
        with_(
            {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "web_search"}]},
            tools=TOOLS,
        ),
        with_({"type": "allowed_tools", "mode": "required", "tools": []}, tools=TOOLS),
        with_({"type": "allowed_tools", "mode": "auto", "tools": [], "bogus": 1}, tools=TOOLS),
        with_("required", tools=[{"type": "web_search"}]),
    ],
    "parallel_tool_calls": ["yes", 1, 0, [], {}],
    "text": [
        5,
        "json",
        [],
        {"bogus": 1},
        {"verbosity": "extreme"},
        {"verbosity": []},
        {"format": "json"},
        {"format": 5},
        {"format": {}},
        {"format": {"type": "regex"}},
        {"format": {"type": []}},
        {"format": {"type": "text", "bogus": 1}},
        {"format": {"type": "json_object", "schema": {}}},
        {"format": {"type": "json_schema", "schema": {}}},
        {"format": {"type": "json_schema", "name": "bad name", "schema": {}}},
        {"format": {"type": "json_schema", "name": 5, "schema": {}}},
        {"format": {"type": "json_schema", "name": "x"}},
        {"format": {"type": "json_schema", "name": "x", "schema": "object"}},
        {"format": {"type": "json_schema", "name": "x", "schema": []}},
        {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}},
        {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": "yes"}},
        {"format": {"type": "json_schema", "name": "x", "schema": {}, "description": 5}},
        {"format": {"type": "json_schema", "name": "x", "schema": {}, "bogus": 1}},
        {"format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
    ],
    "reasoning": [
        5,
        "high",
        [],
        {"effort": "extreme"},
        {"effort": 5},
        {"summary": "verbose"},
        {"generate_summary": 5},
        {"bogus": 1},
        *UNHASHABLE["reasoning"],
    ],
    "include": [
        "reasoning.encrypted_content",
        5,
        {},
        [5],
        [None],
        ["bogus"],
        ["message.output_text.logprobs"],
        ["reasoning.encrypted_content", "message.output_text.logprobs"],
        ["reasoning.encrypted_content"] * 17,
        *UNHASHABLE["include"],
    ],
    "temperature": ["hot", -0.1, 2.1, 1e308, [], {}],
    "top_p": ["x", -0.1, 1.5, []],
    "top_logprobs": [1, 20, -1, "x", []],
    "background": [True, "yes", 1, []],
    "conversation": ["conv_1", {"id": "conv_1"}, 5],
    "prompt": [{"id": "pmpt_1"}, "p", 5],
    "truncation": ["auto", "bogus", 5, True],
    "moderation": [True, "x", {}],
    # Sampler settings beyond OpenAI's, under the server's names.
    "min_tokens": [-1, "x", 3],
    "seed": ["x", 1.5],
    "top_k": ["x", -2, 1.5, 2**64],
    "logit_bias": [5, "x", {"x": 1}],
    "frequency_penalty": ["x", []],
    # Fields of other APIs, and fields nobody knows.
    "messages": [[{"role": "user", "content": "Hi"}]],
    "max_tokens": [2],
    "max_completion_tokens": [2],
    "n": [2],
    "logprobs": [True],
    "response_format": [{"type": "json_object"}],
    "functions": [[TOOL]],
    "bogus": [1, None, {}],
}
#: An unknown key too long for ``param`` to name.
NOT_A_FIELD: Final = "x" * 10_000


def case_body(field: str, value: Any) -> bytes:
    if isinstance(value, With):
        return body_of({field: value.value, **value.others})
    return body_of({field: value})


def shown(value: Any) -> str:
    if value is MISSING:
        return "(missing)"
    if isinstance(value, With):
        return f"{json.dumps(value.value)[:60]} with {sorted(value.others)}"
    return json.dumps(value)[:60]


@pytest.mark.parametrize("field", list(BAD_FIELDS))
async def test_each_field_out_of_type_or_range_gets_400_naming_it(
    cpu_engine: CpuEngine, field: str
) -> None:
    problems: list[str] = []
    async with serving(cpu_engine) as (server, listening):
        for value in BAD_FIELDS[field]:
            case = f"{field}={shown(value)}"
            reply = await post(listening.port, case_body(field, value))
            try:
                error = openai_error(reply, 400)
                assert names(error["param"], field), f"param {error['param']!r} is not {field}"
            except AssertionError as exc:
                problems.append(f"{case}: {exc}")
        assert server.generations.in_flight(CLIENT) == 0
        # The server goes on serving.
        reply = await post(listening.port, body_of(), within=60)
        assert reply is not None and reply.status == 200, reply
    assert not problems, "\n".join(problems)


async def test_an_unknown_field_too_long_to_name_is_refused_without_echoing_it(
    cpu_engine: CpuEngine,
) -> None:
    """A 10,000-character key: 400 ``unknown_parameter``; ``param`` cannot
    name it (null), the message shows a bounded part of it."""
    async with serving(cpu_engine) as (_, listening):
        reply = await post(listening.port, body_of({NOT_A_FIELD: 1}))
        error = openai_error(reply, 400, param=None)
        assert error["code"] == "unknown_parameter"
        assert "xxxxxxxxxx" in error["message"] and len(error["message"]) < 300


async def test_refused_features_are_named_as_unsupported(cpu_engine: CpuEngine) -> None:
    """What this server does not have is a 400 ``unsupported_parameter``
    naming it (not a silent difference): background responses, stored
    conversations and prompts, ``truncation: "auto"``, logprobs, OpenAI's
    built-in tool items, item references, media in the question."""
    cases: list[tuple[dict[str, Any], str]] = [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 5}, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice.type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
        ({"input": user([part("input_image", image_url="x")])}, "input[0].content[0].type"),
    ]
    async with serving(cpu_engine) as (_, listening):
        for fields, param in cases:
            error = openai_error(await post(listening.port, body_of(fields)), 400, param=param)
            assert error["code"] == "unsupported_parameter", (fields, error)


async def test_ignored_and_null_fields_of_any_shape_cost_nothing(cpu_engine: CpuEngine) -> None:
    """Fields that change nothing here (docs: ``service_tier``,
    ``prompt_cache_key``, ``client_metadata``, ...) whatever they hold, and
    the refused features asking for nothing (null, ``background: false``,
    ``truncation: "disabled"``), are answered, never with a 5xx; OpenAI's
    built-in tools are skipped."""
    odd: list[Any] = [5, "x", [], None, {"a": 5}, json.loads(nested(60))]
    ignored = ("service_tier", "prompt_cache_key", "client_metadata", "stream_options")
    fine: list[dict[str, Any]] = [
        {"background": False},
        {"background": None},
        {"truncation": "disabled"},
        {"top_logprobs": 0},
        {"conversation": None},
        {"prompt": None},
        {"tools": [{"type": "web_search"}, {"type": "image_generation"}]},
        {"tools": [{"type": "web_search"}], "tool_choice": "auto"},
        {"include": ["reasoning.encrypted_content", "web_search_call.results"]},
        {"reasoning": {"effort": "high", "summary": "auto"}},
        {"text": {"format": {"type": "text"}, "verbosity": "low"}},
        {"metadata": {f"k{i}": "v" * 512 for i in range(16)}},
        {"input": [{"type": "reasoning", "summary": []}, {"role": "user", "content": "Hi"}]},
    ]
    async with serving(cpu_engine) as (server, listening):
        for field in ignored:
            for value in odd:
                reply = await post(listening.port, body_of({field: value}), within=60)
                assert reply is not None, (field, value)
                assert reply.status in (200, 400), (field, value, reply)
                if reply.status == 400:
                    openai_error(reply, 400)
        for fields in fine:
            reply = await post(listening.port, body_of(fields), within=60)
            assert reply is not None and reply.status == 200, (fields, reply)
        assert server.generations.in_flight(CLIENT) == 0


@pytest.mark.parametrize("bound", [10**12, 2**64, 10**400])
async def test_a_huge_max_output_tokens_is_a_bound_not_an_error(
    cpu_engine: CpuEngine, bound: int
) -> None:
    """``max_output_tokens`` is an upper bound here (docs/responses.md): a
    huge one is accepted and the context bounds the answer; it overflows
    nothing (a 5xx, a reply that cannot be written). The stream is left at
    its first delta: its slot comes back."""
    async with serving(cpu_engine) as (server, listening):
        body = body_of(max_output_tokens=bound, stream=True, temperature=0)
        stream = await open_stream(listening.port, body, {})
        async with stream:
            head = stream.seen.decode()
            assert f'"max_output_tokens":{bound}' in head, head[:600]
        await wait_for(lambda: server.generations.in_flight(CLIENT) == 0, 30, "still held")


# --------------------------------------------------------------------------
# 2. Hostile input items, deep and huge inputs


def parts(count: int) -> list[dict[str, str]]:
    return [part("input_text", text="b")] * count


def deep_object(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def raw(prefix: str, inner: str) -> bytes:
    """A request whose ``input`` is ``inner``, spliced in as it is."""
    return f'{{"model":"m","max_output_tokens":2,{prefix}"input":{inner}}}'.encode()


#: name -> body: each must get a 400 in OpenAI's shape naming ``param``
#: (None: the body as a whole), quickly.
DEEP_AND_HUGE: Final[dict[str, tuple[bytes, str | None]]] = {
    "arrays 5000 deep": (nested(5000).encode(), None),
    "objects 5000 deep": (deep_object(5000).encode(), None),
    "input 5000 deep": (raw("", nested(5000)), None),
    "content 5000 deep": (raw("", '[{"role":"user","content":' + nested(5000) + "}]"), None),
    "metadata 100000 deep": (
        b'{"model":"m","input":"Hi","metadata":' + nested(100_000).encode() + b"}",
        None,
    ),
    "2049 items": (body_of(input=[{"role": "user", "content": "x"}] * 2049), "input"),
    "8000 items": (body_of(input=[{"type": "bogus"}] * 8000), "input"),
    "1025 content parts": (body_of(input=user(parts(1025))), "input[0].content"),
    "6000 content parts": (body_of(input=user(parts(6000))), "input[0].content"),
    "a function_call_output of 1025 parts": (
        body_of(input=[ASKED, CALL, {**OUTPUT, "output": parts(1025)}]),
        "input[2].output",
    ),
    "129 tools": (body_of(tools=[{**TOOL, "name": f"t{i}"} for i in range(129)]), "tools"),
    "17 metadata keys of 512": (
        body_of(metadata={f"k{i}": "v" * 512 for i in range(17)}),
        "metadata",
    ),
    "a 70 KB parameters schema": (
        body_of(tools=[{**TOOL, "parameters": {"enum": [f"v{i:06d}" for i in range(7000)]}}]),
        "tools[0].parameters",
    ),
    "a 70 KB text.format schema": (
        body_of(
            text={
                "format": {"type": "json_schema", "name": "x", "schema": {"enum": ["v" * 9] * 7000}}
            }
        ),
        "text.format.schema",
    ),
    "a 100 KB unknown key": (body_of({"k" * 100_000: 1}), None),
    "a 200 KB model name": (body_of(model="m" * 200_000), "model"),
    "a 200 KB previous_response_id": (
        body_of(previous_response_id="r" * 200_000),
        "previous_response_id",
    ),
    "a 100 KB call_id": (
        body_of(input=[ASKED, {**CALL, "call_id": "c" * 100_000}, OUTPUT]),
        "input[1].call_id",
    ),
    "a lone surrogate in input": (body_of(input="a\ud800b"), None),
    "a lone low surrogate in a part": (
        body_of(input=user([part("input_text", text="\udfff")])),
        None,
    ),
    "a lone surrogate in instructions": (body_of(instructions="\ud800"), None),
    "a lone surrogate in a metadata value": (body_of(metadata={"k": "\udbff"}), None),
    "a lone surrogate in a metadata key": (body_of(metadata={"\ud800": "v"}), None),
    "a lone surrogate in a key": (body_of({"\ud800": 1}), None),
    "a lone surrogate in a tool name": (body_of(tools=[{**TOOL, "name": "\ud800"}]), None),
    "a lone surrogate in a schema": (
        body_of(tools=[{**TOOL, "parameters": {"enum": ["\ud800"]}}]),
        None,
    ),
    "a lone surrogate in a call's arguments": (
        body_of(input=[ASKED, {**CALL, "arguments": "\ud800"}, OUTPUT]),
        None,
    ),
    "a reversed surrogate pair": (body_of(input="\ude00\ud83d"), None),
    "a raw utf-8 surrogate": (b'{"model":"m","input":"\xed\xa0\x80"}', None),
    "an overlong utf-8 encoding": (b'{"model":"m","input":"\xc0\xaf"}', None),
}


@pytest.mark.parametrize("case", list(DEEP_AND_HUGE))
async def test_deep_and_huge_inputs_get_400_quickly(cpu_engine: CpuEngine, case: str) -> None:
    body, param = DEEP_AND_HUGE[case]
    async with serving(cpu_engine) as (server, listening):
        assert len(body) < server.max_message_bytes, "the case must be within the body limit"
        started = time.perf_counter()
        reply = await post(listening.port, body)
        error = openai_error(reply, 400)
        # None: the body as a whole, or a key too long to name.
        assert error["param"] == param, error
        assert time.perf_counter() - started < QUICK_S
        assert server.generations.in_flight(CLIENT) == 0
        # The server goes on serving.
        reply = await post(listening.port, body_of(), within=60)
        assert reply is not None and reply.status == 200


async def test_a_surrogate_pair_escape_is_text_not_an_error(cpu_engine: CpuEngine) -> None:
    """The control of the lone-surrogate cases: a well-formed pair
    (``\\ud83d\\ude00``, an emoji) is read as the character it encodes."""
    async with serving(cpu_engine) as (_, listening):
        body = body_of(input="smile \U0001f600", metadata={"k": "\U0001f600"})
        assert b"\\ud83d\\ude00" in body
        reply = await post(listening.port, body, within=60)
        assert reply is not None and reply.status == 200, reply
        assert reply.json()["metadata"] == {"k": "\U0001f600"}


MEDIA: Final[dict[str, dict[str, Any]]] = {
    "input_image": part("input_image", image_url="data:image/png;base64,AA==", detail="auto"),
    "input_file": part("input_file", file_id="file_1"),
    "input_audio": part("input_audio", input_audio={"data": "AA==", "format": "wav"}),
}


@pytest.mark.parametrize("kind", list(MEDIA))
async def test_media_in_the_last_item_is_refused_and_earlier_stands_as_a_placeholder(
    cpu_engine: CpuEngine, kind: str
) -> None:
    """An image, a file or audio in the last item is what the question is
    about: 400 ``unsupported_parameter`` naming the part (this model reads
    text only). In an earlier item (an agent's history, a tool that returned
    a screenshot) it stands as a placeholder and the request is served."""
    media = MEDIA[kind]
    refused = [
        ([{"role": "user", "content": [part("input_text", text="what is this?"), media]}], 1),
        ([ASKED, CALL, {**OUTPUT, "output": [media]}], None),
    ]
    accepted = [
        [{"role": "user", "content": [media]}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": [media]}, {"role": "assistant", "content": "A"}, ASKED],
        [ASKED, CALL, {**OUTPUT, "output": [media]}, {"role": "user", "content": "And?"}],
    ]
    async with serving(cpu_engine) as (server, listening):
        for items, index in refused:
            where = (
                f"input[0].content[{index}].type"
                if index is not None
                else "input[2].output[0].type"
            )
            error = openai_error(await post(listening.port, body_of(input=items)), 400, param=where)
            assert error["code"] == "unsupported_parameter", error
            assert kind in error["message"], error
        for items in accepted:
            reply = await post(listening.port, body_of(input=items, tools=TOOLS), within=60)
            assert reply is not None and reply.status == 200, (items, reply)
        assert server.generations.in_flight(CLIENT) == 0


async def test_a_conversation_past_the_item_limit_with_its_previous_response_is_refused(
    cpu_engine: CpuEngine,
) -> None:
    """``input`` within the item limit, but the stored conversation it
    continues makes it longer than that: 400 naming ``input``, before any
    tokenizing."""
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        previous = await create(port)
        # 2048 items (the limit), none joined to the next: 2050 turns with
        # the previous response's question and answer.
        turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}] * 1024
        body = body_of(input=turns, previous_response_id=previous)
        started = time.perf_counter()
        error = openai_error(await post(port, body), 400, param="input")
        assert "previous response" in error["message"], error
        assert time.perf_counter() - started < QUICK_S
        assert server.generations.in_flight(CLIENT) == 0


def nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def one_property(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"v": schema},
        "required": ["v"],
        "additionalProperties": False,
    }


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


@pytest.mark.parametrize("where", ["parameters", "text.format"])
@pytest.mark.parametrize("schema", list(PATHOLOGICAL_SCHEMAS))
async def test_a_pathological_schema_is_answered_never_with_a_5xx(
    cpu_engine: CpuEngine, schema: str, where: str
) -> None:
    """A schema the constraint machinery gives up on (at compile time, or a
    few tokens in) is the request's failure: 400 (or, a stream, a
    ``response.failed`` event), not the engine's 500."""
    fields: dict[str, Any] = {"max_output_tokens": 8, "temperature": 0}
    if where == "parameters":
        fields["tools"] = [{**TOOL, "parameters": PATHOLOGICAL_SCHEMAS[schema], "strict": False}]
        fields["tool_choice"] = "required"
    else:
        fields["text"] = {
            "format": {"type": "json_schema", "name": "x", "schema": PATHOLOGICAL_SCHEMAS[schema]}
        }
    async with serving(cpu_engine) as (server, listening):
        reply = await post(listening.port, body_of(fields), within=60)
        assert reply is not None, "no answer"
        assert reply.status < 500, f"{reply.status} {reply.body[:300]!r}"
        if reply.status != 200:
            error = openai_error(reply)
            # A tool's schema is in the prompt too: it may make it too long.
            # The schema refused, or the prompt it is part of too long (a
            # tool's schema is in the prompt), or the constraint given up
            # on a few tokens in (the request's failure, not the engine's).
            field = "tools" if where == "parameters" else "text"
            assert (
                names(error["param"], field)
                or error["code"] == "context_length_exceeded"
                or (error["param"] is None and error["code"] == "constraint_failed")
            ), error
        else:
            assert reply.json()["status"] in ("completed", "incomplete"), reply.body[:300]
        assert server.generations.in_flight(CLIENT) == 0


NOT_OBJECTS: Final[list[bytes]] = [
    b"",
    b" ",
    b"null",
    b"[]",
    b"5",
    b'"input"',
    b"{",
    b'{"model": "m",}',
    b"\xff\xfe{}",
    b"\xef\xbb\xbf{}",
    b'{"model": NaN, "input": "Hi"}',
    b'{"model": "m", "input": "Hi", "temperature": Infinity}',
    b'{"model": "m", "input": "Hi"} {"model": "m", "input": "Hi"}',
    b"{'model': 'm', 'input': 'Hi'}",
    b"{}",
    b'{"input": "Hi"}',
    b'{"model": "\x00", "input": "Hi"}',
    b'{"model": "m", "input": "H\x01i"}',
    # Numbers Python will not read: 5000 digits, and past a double's range.
    b'{"model": "m", "input": "Hi", "max_output_tokens": ' + b"9" * 5000 + b"}",
    b'{"model": "m", "input": "Hi", "temperature": 1e400}',
    # Served (the last "input" wins): two tokens, or a slow CPU would take minutes.
    b'{"model": "m", "max_output_tokens": 2, "model": "m", "input": "Hi"'
    + b', "input": "x"' * 10_000
    + b"}",
    '{"model": "m", "input": "Hi"}'.encode("utf-16"),
]


async def test_a_body_that_is_not_a_request_object_gets_400(cpu_engine: CpuEngine) -> None:
    problems: list[str] = []
    async with serving(cpu_engine) as (_, listening):
        for body in NOT_OBJECTS:
            reply = await post(listening.port, body)
            try:
                if reply is not None and reply.status == 200:
                    # Repeated keys: JSON takes the last one; nothing else is.
                    assert body.count(b'"input"') > 1, "served"
                    continue
                openai_error(reply, 400)
            except AssertionError as exc:
                problems.append(f"{body[:40]!r}: {exc}")
    assert not problems, "\n".join(problems)


async def test_a_body_at_the_size_limit_is_read(cpu_engine: CpuEngine) -> None:
    """Exactly the limit is a body the server reads: the JSON is parsed and
    the prompt tokenized (too long for the context: 400
    ``context_length_exceeded``, quickly), and one padded with whitespace to
    the limit is served."""
    async with serving(cpu_engine) as (server, listening):
        limit = server.max_message_bytes
        empty = body_of(input="")
        text = "The tide comes in. " * (limit // 19)
        body = body_of(input=text[: limit - len(empty)])
        assert len(body) == limit
        started = time.perf_counter()
        error = openai_error(await post(listening.port, body), 400)
        assert error["code"] == "context_length_exceeded", error
        assert names(error["param"], "input"), error
        assert time.perf_counter() - started < QUICK_S
        padded = body_of(max_output_tokens=1)
        padded += b" " * (limit - len(padded))
        reply = await post(listening.port, padded, within=60)
        assert reply is not None and reply.status == 200, reply


async def send_head_then(
    port: int, head: bytes, then: Callable[[trio.SocketStream], Awaitable[None]] | None = None
) -> tuple[Reply | None, bool]:
    """Send ``head`` (and what ``then`` sends); the reply to it and whether
    the server closed the connection afterwards."""
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
async def test_the_front_doors_body_refusals_come_in_openais_shape(
    cpu_engine: CpuEngine, case: str
) -> None:
    """A body refused while it is read (413 too large, 408 too slow) is
    answered at once (before the body when Content-Length says too much),
    with a close, in OpenAI's shape."""
    async with serving(cpu_engine) as (server, listening):
        limit = server.max_message_bytes
        over = body_of(max_output_tokens=1)
        over += b" " * (limit + 1 - len(over))
        then: Callable[[trio.SocketStream], Awaitable[None]] | None = None
        if case == "one byte over":
            head, status = post_head(RESPONSES, {"Content-Length": str(len(over))}), 413

            async def send_body(stream: trio.SocketStream) -> None:
                await stream.send_all(over)

            then = send_body
        elif case == "a Content-Length over":
            # Only the head is sent: the answer cannot wait for the body.
            head, status = post_head(RESPONSES, {"Content-Length": str(10**12)}), 413
        elif case == "chunked over":
            head, status = post_head(RESPONSES, {"Transfer-Encoding": "chunked"}), 413

            async def send_chunks(stream: trio.SocketStream) -> None:
                await stream.send_all(chunked(over))

            then = send_chunks
        else:
            # A Content-Length that promises more than comes: the body
            # deadline answers (a second here, a minute by default).
            server.front_door.limits = attrs.evolve(server.front_door.limits, body_timeout=1.0)
            body = body_of()
            head, status = post_head(RESPONSES, {"Content-Length": str(len(body) + 100)}), 408

            async def send_short(stream: trio.SocketStream) -> None:
                await stream.send_all(body)

            then = send_short
        started = time.perf_counter()
        reply, closed = await send_head_then(listening.port, head, then)
        openai_error(reply, status)
        assert time.perf_counter() - started < QUICK_S
        assert closed, "the connection stays open after a refused body"
        assert server.generations.in_flight(CLIENT) == 0


async def test_a_content_length_shorter_than_the_body_harms_no_one(cpu_engine: CpuEngine) -> None:
    """The body is cut where Content-Length says (invalid JSON: 400 in
    OpenAI's shape); the rest is read as the next request (garbage: a 400
    and a close). No 5xx, and the server goes on serving."""
    async with serving(cpu_engine) as (server, listening):
        body = body_of()
        head = post_head(RESPONSES, {"Content-Length": str(len(body) - 10)})
        async with connect(listening.port) as client:
            await client.send(head + body)
            openai_error(await client.response("POST"), 400, param=None)
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
                listening.port, post_head(RESPONSES, headers) + b"{}\r\n\r\n"
            )
            assert reply is None or 400 <= reply.status < 500, (headers, reply)
            assert closed, headers
        assert server.generations.in_flight(CLIENT) == 0
        reply = await post(listening.port, body_of(), within=60)
        assert reply is not None and reply.status == 200


# --------------------------------------------------------------------------
# 3. The store


#: Ids that name nothing stored, as a path segment: each is a 404 on GET and
#: DELETE (or no route at all), in OpenAI's shape, that echoes a bounded part.
ODD_IDS: Final[list[str]] = [
    "resp_" + "0" * 48,
    "resp_" + "f" * 48,
    "msg_1",
    "x",
    "a%2Fb",
    "..%2F..%2Fhealth",
    "%2E%2E",
    "%00",
    "%ff",
    "%E2%82",
    "%",
    "%zz",
    "%F0%9F%98%80",
    "resp_%0d%0aSet-Cookie:%20x=1",
    "x" * 10_000,
    "%2F" * 3000,
    "a/b",
    "",
    "?stream=false",
]


async def test_unknown_made_up_and_odd_ids_are_404_in_openais_shape(
    cpu_engine: CpuEngine,
) -> None:
    problems: list[str] = []
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        mine = await create(port)
        for id in ODD_IDS:
            for method in ("GET", "DELETE"):
                reply = await call(port, method, f"{RESPONSES}/{id}")
                try:
                    error = openai_error(reply, 404, param=None)
                    assert error["code"] == "not_found", error
                    assert reply is not None and "set-cookie" not in reply.headers, reply
                except AssertionError as exc:
                    problems.append(f"{method} {id[:40]}: {exc}")
            # The same ids as previous_response_id.
            unquoted = id.replace("%2F", "/").replace("%00", "\x00")
            reply = await post(port, body_of(previous_response_id=unquoted))
            try:
                if len(unquoted) > 256:
                    openai_error(reply, 400, param="previous_response_id")
                else:
                    error = openai_error(reply, 404, param="previous_response_id")
                    assert error["code"] == "previous_response_not_found", error
            except AssertionError as exc:
                problems.append(f"previous_response_id {id[:40]}: {exc}")
        # A stored response is not a stream: its events are not replayed.
        reply = await call(port, "GET", f"{RESPONSES}/{mine}?stream=true")
        openai_error(reply, 400, param="stream")
        # None of it touched the one stored response.
        reply = await call(port, "GET", f"{RESPONSES}/{mine}")
        assert reply is not None and reply.status == 200, reply
        assert len(server.responses_store) == 1
    assert not problems, "\n".join(problems)


async def test_another_clients_response_is_as_unknown_as_a_made_up_one(
    cpu_engine: CpuEngine,
) -> None:
    """Behind a trusted proxy, two addresses are two clients. Mallory knows
    Alice's response id: ``GET``, ``DELETE`` and ``previous_response_id``
    are 404 exactly as for a made-up id (no hint that it exists), and her
    ``DELETE`` deletes nothing. Mallory's own ``X-Forwarded-For`` claim of
    Alice's address (which the proxy keeps, appending Mallory's real one)
    does not make her Alice; nor does the proxy itself, without the header."""
    async with serving(cpu_engine, **PROXIED) as (server, listening):
        port = listening.port
        alices = await create(port, ALICE, metadata={"secret": "alice's"})
        made_up = "resp_" + "0" * 48
        alice = ALICE["X-Forwarded-For"]
        claims: list[dict[str, str]] = [
            MALLORY,
            # Mallory's own header, the proxy's hop appended: to it, as a
            # second header line, or after a thousand claims.
            {"X-Forwarded-For": f"{alice}, 203.0.113.2"},
            {"X-Forwarded-For": alice, "x-forwarded-for": "203.0.113.2"},
            {"X-Forwarded-For": ", ".join([alice] * 1000 + ["203.0.113.2"])},
            # Not an address: nothing beyond it is trusted (the proxy's own).
            {"X-Forwarded-For": f"{alice}, unknown"},
            {},
        ]
        for headers in claims:
            for method in ("GET", "DELETE"):
                theirs = await call(port, method, f"{RESPONSES}/{alices}", headers)
                unknown = await call(port, method, f"{RESPONSES}/{made_up}", headers)
                error = openai_error(theirs, 404, param=None)
                assert error == {
                    **openai_error(unknown, 404, param=None),
                    "message": error["message"],
                }
                assert (
                    error["message"].replace(alices, made_up)
                    == (openai_error(unknown, 404)["message"])
                ), "the 404 of another's id tells that it exists"
                assert theirs is not None and b"alice's" not in theirs.body
            reply = await post(port, body_of(previous_response_id=alices), headers)
            error = openai_error(reply, 404, param="previous_response_id")
            assert error["code"] == "previous_response_not_found", error
        # Alice's response is still there, and hers only.
        reply = await call(port, "GET", f"{RESPONSES}/{alices}", ALICE)
        assert reply is not None and reply.status == 200, reply
        assert reply.json()["metadata"] == {"secret": "alice's"}
        reply = await post(port, body_of(previous_response_id=alices), ALICE, within=60)
        assert reply is not None and reply.status == 200, reply
        assert reply.json()["previous_response_id"] == alices
        # Deleted: gone for everyone, Alice included, on every route.
        reply = await call(port, "DELETE", f"{RESPONSES}/{alices}", ALICE)
        assert reply is not None and reply.status == 200, reply
        for method in ("GET", "DELETE"):
            openai_error(await call(port, method, f"{RESPONSES}/{alices}", ALICE), 404)
        reply = await post(port, body_of(previous_response_id=alices), ALICE)
        openai_error(reply, 404, param="previous_response_id")
        assert server.generations.in_flight(("address", "203.0.113.1")) == 0


async def test_a_response_made_with_store_false_is_not_kept(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        reply = await post(port, body_of(store=False), within=60)
        assert reply is not None and reply.status == 200, reply
        id = reply.json()["id"]
        openai_error(await call(port, "GET", f"{RESPONSES}/{id}"), 404)
        openai_error(await post(port, body_of(previous_response_id=id)), 404)
        assert len(server.responses_store) == 0


KEY: Final = "k"


async def test_with_an_api_key_the_store_opens_only_to_the_key(cpu_engine: CpuEngine) -> None:
    """With a key, a client is its key: no key, a wrong one or the key in
    the query string is a 401 before any store lookup, on every route;
    ``X-Forwarded-For`` (trusted proxy or not) does not split the key's
    holder in two, nor does a made-up Bearer beside the right
    ``X-Api-Key``."""
    async with serving(cpu_engine, api_key=KEY, **PROXIED) as (_, listening):
        port = listening.port
        right = {"Authorization": f"Bearer {KEY}"}
        id = await create(port, {**right, **ALICE})
        wrong: list[dict[str, str]] = [
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Bearer"},
            {"Authorization": f"Basic {KEY}"},
            {"Authorization": "Bearer " + "x" * 10_000},
            {"X-Api-Key": "wrong", **ALICE},
        ]
        for headers in wrong:
            for method in ("GET", "DELETE"):
                openai_error(await call(port, method, f"{RESPONSES}/{id}", headers), 401)
            reply = await post(port, body_of(previous_response_id=id), headers)
            openai_error(reply, 401)
        openai_error(await call(port, "GET", f"{RESPONSES}/{id}?api_key={KEY}"), 401)
        # The key's holder, whatever else the request says.
        for headers in (
            right,
            {**right, **MALLORY},
            {"X-Api-Key": KEY},
            {"X-Api-Key": KEY, "Authorization": "Bearer someone-else"},
        ):
            reply = await call(port, "GET", f"{RESPONSES}/{id}", headers)
            assert reply is not None and reply.status == 200, (headers, reply)
        reply = await call(port, "DELETE", f"{RESPONSES}/{id}", right)
        assert reply is not None and reply.status == 200, reply


async def test_an_expired_response_is_gone(cpu_engine: CpuEngine) -> None:
    """``responses_ttl`` after its last use, a stored response is 404 on
    every route, as if it had never been."""
    async with serving(cpu_engine, responses_ttl=0.5) as (server, listening):
        port = listening.port
        id = await create(port)
        await trio.sleep(1.2)
        openai_error(await call(port, "GET", f"{RESPONSES}/{id}"), 404, param=None)
        reply = await post(port, body_of(previous_response_id=id))
        openai_error(reply, 404, param="previous_response_id")
        openai_error(await call(port, "DELETE", f"{RESPONSES}/{id}"), 404, param=None)
        # A new one is stored, the expired one dropped.
        await create(port)
        assert len(server.responses_store) == 1


def big_response(serial: int) -> dict[str, Any]:
    """Fields that make a stored response about 70 KB: its echoed schema
    (within the 64 KiB bound) and metadata at its bounds."""
    schema = {"type": "object", "description": f"{serial}" + "d" * 63_000}
    return {
        "metadata": {f"k{i}": "v" * 512 for i in range(16)},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
    }


async def test_one_clients_flood_of_stored_responses_stays_bounded_and_evicts_its_own(
    cpu_engine: CpuEngine,
) -> None:
    """With a 1 MiB store, Mallory stores 30 responses of about 70 KB (two
    MiB): the store stays within its bytes, her oldest are evicted (404 to
    her), her newest kept, and Alice's one response, made before the flood,
    survives it."""
    async with serving(cpu_engine, responses_store_mib=1, **PROXIED) as (server, listening):
        port = listening.port
        store = server.responses_store
        alices = await create(port, ALICE)
        floods: list[str] = []
        high = 0
        for serial in range(30):
            floods.append(await create(port, MALLORY, **big_response(serial)))
            high = max(high, store.nbytes)
            assert store.nbytes <= 1 << 20, store.nbytes
        assert high > (1 << 20) * 3 // 4, "the flood did not fill the store"
        assert store.evicted > 0 and len(store) < 31, (store.evicted, len(store))
        reply = await call(port, "GET", f"{RESPONSES}/{alices}", ALICE)
        assert reply is not None and reply.status == 200, "the flood evicted another client's"
        openai_error(await call(port, "GET", f"{RESPONSES}/{floods[0]}", MALLORY), 404)
        reply = await post(port, body_of(previous_response_id=floods[0]), MALLORY)
        openai_error(reply, 404, param="previous_response_id")
        reply = await call(port, "GET", f"{RESPONSES}/{floods[-1]}", MALLORY)
        assert reply is not None and reply.status == 200, reply
        assert len(reply.body) > 60_000
        kept = [(await call(port, "GET", f"{RESPONSES}/{id}", MALLORY)) for id in floods]
        statuses = [r.status if r is not None else 0 for r in kept]
        # Least recently used first: what is kept is a tail of the flood.
        assert statuses == sorted(statuses, reverse=True), statuses
        assert set(statuses) == {200, 404}, statuses


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


FLOOD: Final[list[tuple[str, str, bytes]]] = [
    ("POST", RESPONSES, nested(20_000).encode()),
    ("POST", RESPONSES, deep_object(3000).encode()),
    ("POST", RESPONSES, body_of(temperature="hot")),
    ("POST", RESPONSES, body_of(input=user(parts(1025)))),
    ("POST", RESPONSES, body_of(include=[[]])),
    ("POST", RESPONSES, body_of(input="\ud800")),
    ("POST", RESPONSES, body_of(tools=[{**TOOL, "name": f"t{i}"} for i in range(129)])),
    ("POST", RESPONSES, body_of(max_output_tokens=0)),
    ("POST", RESPONSES, body_of(previous_response_id="resp_" + "0" * 48)),
    ("POST", RESPONSES, body_of(input=[ASKED, OUTPUT])),
    ("POST", RESPONSES, b"\xff" * 1000),
    ("GET", f"{RESPONSES}/resp_made_up", b""),
    ("DELETE", f"{RESPONSES}/{'%2F' * 500}", b""),
]


async def attacker(port: int, rounds: int, tally: Tally, serial: int, done: trio.Event) -> None:
    """``rounds`` rounds of bad requests at least, and on until ``done``."""
    round_ = -1
    while (round_ := round_ + 1) < rounds or not done.is_set():
        kind = (round_ + serial) % 3
        if kind == 0:
            # Several bad requests pipelined on one kept-alive connection.
            async with connect(port) as client:
                batch = [FLOOD[(round_ + i) % len(FLOOD)] for i in range(8)]
                await client.send(
                    b"".join(request(m, p, JSON if b else {}, b) for m, p, b in batch)
                )
                for method, path, _ in batch:
                    reply = await client.response(method, within=60)
                    tally.add(f"pipelined {method} {path[:30]}", reply)
        elif kind == 1:
            method, path, body = FLOOD[round_ % len(FLOOD)]
            if method == "POST":
                tally.add(f"single {path[:30]}", await post(port, body, within=60))
            else:
                tally.add(f"single {method} {path[:30]}", await call(port, method, path))
        else:
            # A head announcing a body over the limit, the body never sent.
            async with connect(port) as client:
                await client.send(post_head(RESPONSES, {"Content-Length": str(10**9)}))
                tally.add("oversized", await client.response("POST", within=60))


async def test_a_flood_of_bad_requests_starves_no_one(cpu_engine: CpuEngine) -> None:
    """Four attackers send about 600 bad requests (pipelined, one per
    connection, oversized heads, lookups of made-up ids) while a
    well-behaved client streams three responses to their end, continuing
    each from the last, and ``/health`` keeps answering."""
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
            previous: str | None = None
            for serial in range(3):
                body = body_of(
                    max_output_tokens=16,
                    stream=True,
                    temperature=0,
                    input=f"Tell me a story, number {serial}.",
                    previous_response_id=previous,
                )
                reply = await post(port, body, within=60)
                assert reply is not None and reply.status == 200, reply
                streams.append(sse_events(reply.body))
                previous = response_id(reply.body)
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
        assert len(server.responses_store) == 3
    assert not tally.failures, tally.failures[:10]
    assert len(tally.statuses) > 500, len(tally.statuses)
    assert len(streams) == 3
    for events in streams:
        assert events[0] == "response.created", events
        assert events[-1] in ("response.completed", "response.incomplete"), events
        assert "response.failed" not in events, events
        assert events.count("response.output_text.delta") > 1, events
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


#: A stream that runs for as long as the test needs: no EOS before 1500 tokens.
LONG: Final = {"max_output_tokens": 1500, "min_tokens": 1500, "stream": True, "temperature": 0}


def response_id(data: bytes) -> str:
    """The id of the response a stream (or a part of one) is about."""
    found = re.search(rb'"id":"(resp_[0-9a-f]+)"', data)
    assert found is not None, data[:300]
    return found.group(1).decode()


@attrs.define
class OpenStream:
    """A streamed request whose first text delta has arrived."""

    stream: trio.SocketStream
    seen: bytes

    async def __aenter__(self) -> trio.SocketStream:
        return self.stream

    async def __aexit__(self, *exc: object) -> None:
        await self.stream.aclose()


async def open_stream(port: int, body: bytes, headers: dict[str, str]) -> OpenStream:
    """A streamed request whose first text delta has arrived (the generation
    holds its engine slot); the caller reads or closes the rest."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(request("POST", RESPONSES, {**JSON, **headers}, body))
    seen = b""
    with trio.fail_after(60):
        while b"response.output_text.delta" not in seen:
            data = await stream.receive_some(65536)
            assert data, f"the stream ended early: {seen[-300:]!r}"
            seen += data
    assert seen.startswith(b"HTTP/1.1 200"), seen[:300]
    return OpenStream(stream, seen)


async def test_a_client_that_never_reads_is_cut_off_and_stalls_no_one(
    cpu_engine: CpuEngine,
) -> None:
    """A stream of 1500 tokens to a client that reads nothing through a tiny
    window: while the server's writes wait on it, another client's stream
    completes and ``/health`` answers; after ``send_timeout`` the server
    gives up on it by itself (the slot is freed while the socket is still
    open and unread). What the client finds later is a stream cut short, no
    ``response.completed``, and its response is not stored (only a response
    that ends is)."""
    async with serving(cpu_engine, send_timeout=3.0) as (server, listening):
        port = listening.port
        sock = await trio.to_thread.run_sync(small_window_socket, port)
        try:
            body = body_of(LONG, input="Write a long story about a dragon.")
            await trio.to_thread.run_sync(sock.sendall, request("POST", RESPONSES, JSON, body))
            await wait_for(lambda: server.generations.in_flight(CLIENT) == 1, 30, "no job")
            await window_closed(sock)
            # The server's write to it waits now; others are served meanwhile.
            reply = await post(
                port, body_of(max_output_tokens=12, stream=True, temperature=0), within=60
            )
            assert reply is not None and reply.status == 200, reply
            events = sse_events(reply.body)
            assert events[0] == "response.created", events
            assert events[-1] in ("response.completed", "response.incomplete"), events
            assert (await get(port, "/health")).status == 200
            await wait_for(
                lambda: server.generations.in_flight(CLIENT) == 0,
                60,
                "the reader-less stream still holds its slot",
            )
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            data = await trio.to_thread.run_sync(read_all, sock, 10.0)
        finally:
            sock.close()
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
        assert b"response.output_text.delta" in data
        assert b"response.completed" not in data, "the stream was not cut: it fit in the buffers"
        id = response_id(data)
        openai_error(await call(port, "GET", f"{RESPONSES}/{id}"), 404)


def reset(stream: trio.SocketStream) -> None:
    """Close with a TCP reset instead of a FIN (SO_LINGER 0)."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.parametrize("how", ["reset", "half_close", "before_the_first_event"])
async def test_a_client_that_leaves_a_stream_frees_its_slot(
    cpu_engine: CpuEngine, how: str
) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        rest = b""
        if how == "before_the_first_event":
            # A long prompt: the client is gone while it is still being read.
            body = body_of(LONG, input="The tide comes in and goes out. " * 700)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(request("POST", RESPONSES, JSON, body))
            await wait_for(lambda: server.generations.in_flight(CLIENT) == 1, 30, "no job")
            reset(stream)
            await stream.aclose()
        else:
            opened = await open_stream(port, body_of(LONG), {})
            async with opened as stream:
                if how == "reset":
                    reset(stream)
                else:
                    # Half-closed: the client sends nothing more; it counts as gone.
                    await stream.send_eof()
                    with trio.fail_after(30):
                        while data := await stream.receive_some(65536):
                            rest += data
        await wait_for(
            lambda: server.generations.in_flight(CLIENT) == 0, 30, "the slot is still held"
        )
        assert b"response.completed" not in rest, "the stream ran to its end"
        assert len(server.responses_store) == 0, "a response left half-written was stored"
        # The server goes on serving.
        reply = await post(port, body_of(max_output_tokens=3, temperature=0), within=60)
        assert reply is not None and reply.status == 200, reply
        assert reply.json()["usage"]["output_tokens"] == 3


async def test_a_never_read_stream_does_not_hold_a_slot_from_a_newcomer(
    cpu_engine: CpuEngine,
) -> None:
    """A client with one request in flight allowed holds it with a stream it
    never reads: its next requests get 429 in OpenAI's shape
    (``rate_limit_error``, ``Retry-After``) meanwhile, then, once
    ``send_timeout`` cut the stream, it is served again without the stalled
    client having closed anything. Reading its own stored responses is no
    generation: the store answers meanwhile."""
    async with serving(cpu_engine, max_requests_per_client=1, send_timeout=2.0) as (
        server,
        listening,
    ):
        port = listening.port
        earlier = await create(port)
        sock = await trio.to_thread.run_sync(small_window_socket, port)
        try:
            body = body_of(LONG)
            await trio.to_thread.run_sync(sock.sendall, request("POST", RESPONSES, JSON, body))
            await wait_for(lambda: server.generations.in_flight(CLIENT) == 1, 30, "no job")
            reply = await post(port, body_of())
            error = openai_error(reply, 429, param=None)
            assert error["code"] == "rate_limit_exceeded", error
            assert reply is not None and reply.headers.get("retry-after") == "1"
            reply = await post(port, body_of(previous_response_id=earlier))
            openai_error(reply, 429)
            reply = await call(port, "GET", f"{RESPONSES}/{earlier}")
            assert reply is not None and reply.status == 200, reply
            await wait_for(lambda: server.generations.in_flight(CLIENT) == 0, 60, "still held")
            reply = await post(port, body_of(), within=60)
            assert reply is not None and reply.status == 200, reply
        finally:
            sock.close()
