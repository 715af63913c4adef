"""The error tables of the docs, asserted on the wire: for each row, a test
sends the input the row names to a server on the real model and checks the
documented error type (protocol.md section 4) or HTTP status (openai.md).
A row that cannot be triggered on demand names the test that covers it, and
a test checks that every row of both tables is one or the other."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio_websocket

from .helpers import running_server
from .http_helpers import connect, request

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

ROOT = Path(__file__).resolve().parent.parent

HI = {"action": "infer", "text": "Hi", "max_new_tokens": 4}

#: protocol.md section 4: (row, what the "when" column names, frame, type, field).
WS_ROWS: list[Any] = [
    ("invalid_json", "a binary frame", b'{"action":"echo"}', None),
    ("invalid_json", "text that is not JSON", "hello", None),
    ("invalid_json", "JSON that is not an object", "[1, 2, 3]", None),
    (
        "invalid_json",
        "nested deeper than 64",
        '{"action":"echo","request_id":' + "[" * 65 + "]" * 65 + "}",
        None,
    ),
    ("invalid_json", "NaN", '{"action":"echo","request_id":NaN}', None),
    ("invalid_json", "Infinity", '{"action":"echo","request_id":Infinity}', None),
    (
        "invalid_json",
        "a number too large for a float",
        '{"action":"echo","request_id":1e999}',
        None,
    ),
    (
        "invalid_json",
        "an escaped unpaired surrogate",
        '{"action":"echo","request_id":"\\ud800"}',
        None,
    ),
    (
        "invalid_request",
        "a missing field",
        {"action": "lefttrim_token", "text": "Hi"},
        "$.trimmed_length",
    ),
    ("invalid_request", "an unknown field", {**HI, "temprature": 0.5}, "$.temprature"),
    ("invalid_request", "an ill-typed field", {**HI, "top_k": "5"}, "$.top_k"),
    ("invalid_request", "an out-of-range field", {**HI, "top_k": -1}, "$.top_k"),
    (
        "invalid_request",
        "a value over a limit",
        {**HI, "stop_conditions": ["x"] * 65},
        "$.stop_conditions",
    ),
    (
        "invalid_request",
        "max_new_tokens beyond the context",
        {**HI, "max_new_tokens": 100000},
        "$.max_new_tokens",
    ),
    (
        "invalid_request",
        "a token id beyond the vocabulary",
        {**HI, "bann_bann": [49152]},
        "$.bann_bann[0]",
    ),
    ("invalid_request", "an empty prompt", {**HI, "text": ""}, "$.text"),
    ("unknown_action", "an unknown action", {"action": "generate"}, "$.action"),
]

#: protocol.md section 4's rows that no frame sent here triggers on demand:
#: (type, when, why not here, the test that covers it).
WS_ELSEWHERE = [
    (
        "invalid_json",
        "a raw unpaired surrogate",
        "a UTF-8 text frame cannot carry one (the peer closes with 1007)",
        "tests/test_protocol.py::test_frames_that_are_not_json_objects_are_invalid_json",
    ),
    (
        "invalid_request",
        "messages without a chat template",
        "the embedded model has a chat template",
        "tests/test_chat_template.py::test_a_model_without_a_template_gets_a_clear_error",
    ),
    (
        "overloaded",
        "a limit of section 1 is full",
        "it needs a request in flight",
        "tests/test_doc_errors.py::test_overloaded_on_the_wire",
    ),
    (
        "internal",
        "the engine failed for this request",
        "a healthy engine does not fail on demand",
        "tests/test_server.py::test_a_failing_job_answers_internal_and_others_go_on",
    ),
]


@pytest.mark.parametrize(
    ("error_type", "when", "frame", "field"), WS_ROWS, ids=[r[1] for r in WS_ROWS]
)
async def test_protocol_error_table_on_the_wire(
    cpu_engine: CpuEngine, error_type: str, when: str, frame: Any, field: str | None
) -> None:
    async with running_server(cpu_engine) as listening:
        async with trio_websocket.open_websocket_url(listening.url) as ws:
            await ws.send_message(frame if isinstance(frame, str | bytes) else json.dumps(frame))
            with trio.fail_after(30):
                reply = json.loads(await ws.get_message())
            # The connection stays open.
            await ws.send_message('{"action":"echo","request_id":"after"}')
            with trio.fail_after(30):
                assert json.loads(await ws.get_message())["request_id"] == "after"
    assert reply["response_type"] == "error", when
    assert reply["error"]["type"] == error_type, (when, reply)
    assert reply["error"].get("field") == field, (when, reply)


async def test_overloaded_on_the_wire(cpu_engine: CpuEngine) -> None:
    """protocol.md: `overloaded` when a limit is full (here the connection's)."""
    async with running_server(cpu_engine, max_requests_per_connection=1) as listening:
        async with trio_websocket.open_websocket_url(listening.url) as ws:
            for rid in ("a", "b"):
                await ws.send_message(json.dumps({**HI, "request_id": rid}))
            with trio.fail_after(60):
                replies = [json.loads(await ws.get_message()) for _ in range(2)]
    by_id = {r["request_id"]: r for r in replies}
    assert by_id["b"]["error"]["type"] == "overloaded"
    assert by_id["a"]["response_type"] == "full"


CHAT = "/v1/chat/completions"
BODY = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()

#: openai.md's status table: (status, when, method, path, headers, body, server options, check).
HTTP_ROWS: list[Any] = [
    (
        400,
        "a bad field",
        "POST",
        CHAT,
        {},
        json.dumps({"messages": [], "max_tokens": -1}).encode(),
        {},
    ),
    (400, "bad JSON", "POST", CHAT, {}, b"{", {}),
    (
        400,
        "context exceeded",
        "POST",
        CHAT,
        {},
        json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8191}).encode(),
        {},
    ),
    (401, "a missing API key", "POST", CHAT, {}, BODY, {"api_key": "k"}),
    (401, "a wrong API key", "POST", CHAT, {"Authorization": "Bearer x"}, BODY, {"api_key": "k"}),
    (
        403,
        "an Origin that is not allowed",
        "POST",
        CHAT,
        {"Origin": "https://evil.example"},
        BODY,
        {},
    ),
    (404, "no such route", "GET", "/v1/nope", {}, b"", {}),
    (404, "no such model", "GET", "/v1/models/other", {}, b"", {}),
    (405, "a route without that method", "GET", CHAT, {}, b"", {}),
    (413, "a body larger than the limit", "POST", CHAT, {}, b"x" * (256 * 1024 + 1), {}),
    (431, "a head larger than 16 KiB", "GET", "/v1/models", {"X-Big": "x" * 17000}, b"", {}),
]

#: openai.md's status rows that no request sent here triggers on demand:
#: (status, why not here, the test that covers it).
HTTP_ELSEWHERE = [
    (
        408,
        "it takes the 10 s head timeout",
        "tests/test_http.py::test_slowloris_gets_408_while_others_are_served",
    ),
    (
        429,
        "it needs requests in flight",
        "tests/test_doors.py::test_one_key_is_one_client_on_both_doors_through_the_cli",
    ),
    (503, "it needs a full queue", "tests/test_routes.py::test_overload_is_503_with_retry_after"),
    (
        500,
        "a healthy engine does not fail on demand",
        "tests/test_http.py::test_a_failing_handler_costs_a_500_not_the_connection",
    ),
]


@pytest.mark.parametrize(
    ("status", "when", "method", "path", "headers", "body", "options"),
    HTTP_ROWS,
    ids=[f"{r[0]} {r[1]}" for r in HTTP_ROWS],
)
async def test_openai_status_table_on_the_wire(
    cpu_engine: CpuEngine,
    status: int,
    when: str,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes,
    options: dict[str, Any],
) -> None:
    async with running_server(cpu_engine, **options) as listening:
        async with connect(listening.port) as client:
            head = {"Content-Type": "application/json", "Connection": "close", **headers}
            await client.send(request(method, path, head, body))
            reply = await client.response(method, within=60)
    assert reply is not None, when
    assert reply.status == status, (when, reply)
    if status == 401:
        assert reply.headers["www-authenticate"].startswith("Bearer")
    if status == 405:
        assert "allow" in reply.headers
    if status != 431:
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, when
    if when == "context exceeded":
        assert reply.json()["error"]["code"] == "context_length_exceeded"
    if when == "no such model":
        assert reply.json()["error"]["code"] == "model_not_found"


def _table(path: str, first: str) -> str:
    """The Markdown table of ``path`` whose header row starts with ``first``."""
    text = (ROOT / path).read_text(encoding="utf-8")
    start = text.index(f"\n| {first} |") + 1
    end = text.find("\n\n", start)
    return text[start : end if end >= 0 else len(text)]


def _exists(node: str) -> bool:
    path, _, name = node.partition("::")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    return callable(getattr(module, name, None))


def test_every_row_is_sent_here_or_covered_by_a_named_test() -> None:
    """Each error type of protocol.md's table and each status of openai.md's
    is triggered by a row here or names the test that triggers it (which
    must exist), and a row covered elsewhere is one the table lists."""
    ws_table = _table("docs/protocol.md", "type")
    ws_types = set(re.findall(r"^\| `([a-z_]+)` \|", ws_table, flags=re.MULTILINE))
    assert ws_types == {row[0] for row in WS_ROWS} | {row[0] for row in WS_ELSEWHERE}
    for error_type, when, _, node in WS_ELSEWHERE:
        line = next(ln for ln in ws_table.splitlines() if ln.startswith(f"| `{error_type}` |"))
        assert when.split()[-1] in line, (error_type, when)
        assert _exists(node), node
    http_table = _table("docs/openai.md", "status")
    statuses = {int(n) for n in re.findall(r"^\| (\d{3}) \|", http_table, flags=re.MULTILINE)}
    assert statuses == {row[0] for row in HTTP_ROWS} | {row[0] for row in HTTP_ELSEWHERE}
    for _, _, node in HTTP_ELSEWHERE:
        assert _exists(node), node
