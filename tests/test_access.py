"""The access log (trioserve/server/access.py): one line per request, plain
values in both formats, the same action and id whether a frame was served
or refused; over a real socket, on the scripted engine."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest

from trioserve.logs import JsonFormatter, TextFormatter
from trioserve.server.access import MAX_VALUE_CHARS, plain_value

from .helpers import ScriptedEngine, raw_client, running_server

pytestmark = pytest.mark.unit


class Captured:
    def __init__(self) -> None:
        self.text = io.StringIO()
        self.json = io.StringIO()

    def pairs(self) -> list[dict[str, str]]:
        return [
            dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line.partition(" done")[2]))
            for line in self.text.getvalue().splitlines()
        ]

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.json.getvalue().splitlines()]


@pytest.fixture
def access() -> Iterator[Captured]:
    logger = logging.getLogger("trioserve.access")
    captured = Captured()
    handlers = [logging.StreamHandler(captured.text), logging.StreamHandler(captured.json)]
    handlers[0].setFormatter(TextFormatter())
    handlers[1].setFormatter(JsonFormatter())
    saved = logger.level
    logger.setLevel(logging.DEBUG)
    for handler in handlers:
        logger.addHandler(handler)
    yield captured
    for handler in handlers:
        logger.removeHandler(handler)
    logger.setLevel(saved)


LONG = "x" * 500


async def test_ids_are_logged_as_sent_and_refused_frames_keep_theirs(access: Captured) -> None:
    infer = {"action": "infer", "text": "x", "max_new_tokens": 2}
    async with running_server(ScriptedEngine()) as server, raw_client(server.url) as ws:
        await ws.request({**infer, "request_id": "q1"})
        await ws.request(infer)
        await ws.request({**infer, "request_id": 7})
        # Refused by the protocol (unknown field), and by the pipeline (token id).
        await ws.request({**infer, "top_q": 1, "request_id": 3})
        await ws.request({**infer, "bann_bann": [1, 300], "request_id": "r"})
        await ws.request({"action": "echo", "request_id": "-"})
        await ws.request({"action": "echo", "request_id": LONG})
        await ws.request({"action": "echo", "request_id": [1, "a"]})
        await ws.request({"action": "dance"})
    text = access.pairs()
    records = access.records()
    assert [(p["action"], p["request_id"]) for p in text] == [
        ("infer", "q1"),
        ("infer", "-"),
        ("infer", "7"),
        ("infer", "3"),
        ("infer", "r"),
        ("echo", '"-"'),
        ("echo", f"{LONG[: MAX_VALUE_CHARS - 3]}..."),
        ("echo", '"[1,\\"a\\"]"'),
        ("dance", "-"),
    ]
    assert [(r["action"], r["request_id"]) for r in records] == [
        ("infer", "q1"),
        ("infer", None),
        ("infer", 7),
        ("infer", 3),
        ("infer", "r"),
        ("echo", "-"),
        ("echo", f"{LONG[: MAX_VALUE_CHARS - 3]}..."),
        ("echo", [1, "a"]),
        ("dance", None),
    ]
    # Every infer line has the same keys, an outcome among them.
    infers = [r for r in records if r["action"] == "infer"]
    assert len({tuple(sorted(r)) for r in infers}) == 1
    assert [r["outcome"] for r in infers] == ["num_tokens"] * 3 + ["invalid_request"] * 2
    assert [r["error_type"] for r in infers] == [None] * 3 + ["invalid_request"] * 2
    assert "'" not in access.text.getvalue()
    assert "None" not in access.text.getvalue() + access.json.getvalue()


def test_plain_values_are_json_values() -> None:
    assert plain_value(None) is None
    assert plain_value("q1") == "q1"
    assert plain_value(3) == 3
    assert plain_value({"a": [1]}) == {"a": [1]}
    assert plain_value({"a": LONG}) == '{"a":"' + LONG[: MAX_VALUE_CHARS - 9] + "..."
