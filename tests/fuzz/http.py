"""Fuzzing the OpenAI door: hostile request bodies, every one answered as a
client mistake or a real answer, never as a server fault.

Each body starts as a valid completion or chat request and is mutated: a
field's value replaced by one of a pool of hostile values (edges of every
range, wrong types, huge numbers, lone surrogates, deep nesting, long
strings), unknown and misspelt keys added, required keys removed, the whole
body replaced by a non-object or by bytes that are not JSON. Every answer
must be 200 (a whole answer, or a stream that ends with ``[DONE]``), 400 /
404 / 413 / 429 with OpenAI's error shape naming what was wrong, or 503 while
the server is full; a 500, a broken stream or a dropped connection is a
failure. Generation stays short: every valid ``max_tokens`` in the pools is
small, and the large ones are beyond any context (400).
"""

from __future__ import annotations

import collections
import json
import random
from typing import Any

import attrs
import trio

from tests.http_helpers import RawClient, request

__all__ = ["HttpFuzzReport", "http_body", "run_http_fuzz"]

HOSTILE: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    3,
    0.5,
    -0.0,
    1e308,
    -1e308,
    2**31,
    2**63,
    2**64 + 1,
    -(2**63) - 1,
    10**400,
    "",
    "1",
    "nan",
    "\ud800",
    "\u0000",
    "x" * 5000,
    [],
    [1],
    ["a", 1, None],
    list(range(300)),
    {},
    {"a": 1},
    {"5": 1},
    {"1000000000": -100},
    {"5": 1e308},
    [[[[[[[[1]]]]]]]],
]

SAMPLER_KEYS = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "typical",
    "top_a",
    "skew",
    "rep_pen",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_range",
    "dry_sequence_breakers",
    "xtc_probability",
    "xtc_threshold",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "min_temp",
    "max_temp",
    "temp_exponent",
    "smoothing_factor",
    "temperature_last",
    "logit_bias",
]
OTHER_KEYS = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stream",
    "stream_options",
    "echo",
    "n",
    "logprobs",
    "tools",
    "tool_choice",
    "response_format",
    "json_schema",
    "grammar",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "regex_pattern",
    "grammar_string",
    "bann_bann",
    "stop_token_ids",
    "token_healing",
    "user",
    "suffix",
    "prompt",
    "messages",
]


#: Constraints, good and bad, in every shape the constraint fields take.
CONSTRAINTS: list[Any] = [
    {"type": "object"},
    {"type": "strnig"},
    {"$ref": "#/$defs/missing"},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"enum": list(range(5000))},
    {"type": "text"},
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}}},
    {"type": "json_schema", "json_schema": {"schema": {"type": "strnig"}}},
    {"json": {"type": "boolean"}, "regex": "a"},
    {"choice": ["yes", "no"]},
    {"regex": "(a|aa)*" * 20 + "b"},
    "(a",
    "[a-z]{1,3}",
    "[^\\s\\S]",
    'root ::= "a" | "b"',
    "root ::= undefined",
    "start: /[0-9]+/",
    ["yes", "no"],
    ["", "x"],
    '{"type": "object"}',
]


def _valid(rng: random.Random) -> tuple[str, dict[str, Any]]:
    fields: dict[str, Any] = {"max_tokens": rng.choice([1, 2, 3]), "temperature": 0}
    if rng.random() < 0.5:
        fields["stream"] = True
        if rng.random() < 0.5:
            fields["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/completions", {"prompt": rng.choice(["Hi", "The sky is", ""]), **fields}
    messages = [{"role": "user", "content": rng.choice(["Hi", "Why?", ""])}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "Be brief."})
    return "/v1/chat/completions", {"messages": messages, **fields}


def http_body(rng: random.Random) -> tuple[str, bytes]:
    """A route and a fuzzed body for it."""
    path, body = _valid(rng)
    roll = rng.random()
    if roll < 0.05:
        return path, rng.choice([b"", b"{", b"null", b"[]", b'"x"', b"\xff\xfe", b"{}" * 3])
    if roll < 0.1:
        return path, json.dumps(rng.choice(HOSTILE)).encode()
    for _ in range(rng.randint(1, 4)):
        action = rng.random()
        if action < 0.6:
            key = rng.choice(SAMPLER_KEYS + OTHER_KEYS)
            body[key] = rng.choice(HOSTILE + CONSTRAINTS)
        elif action < 0.75:
            body[rng.choice(["max_token", "temprature", "", "\u00e9", "x" * 300])] = 1
        elif action < 0.9 and body:
            del body[rng.choice(sorted(body))]
        elif "messages" in body:
            body["messages"] = rng.choice(
                [
                    [{"role": "tool", "content": "x"}],
                    [{"role": "user"}],
                    [{"role": "user", "content": [{"type": "image_url"}]}],
                    [{"role": "user", "content": "x", "extra": 1}],
                    [{"role": "user", "content": "x"}] * 5000,
                ]
            )
    try:
        data = json.dumps(body, allow_nan=False).encode("utf-8", "surrogatepass")
    except (ValueError, OverflowError):
        data = b"{"
    return path, data


@attrs.define
class HttpFuzzReport:
    requests: int = 0
    statuses: collections.Counter[int] = attrs.Factory(collections.Counter)
    failures: list[str] = attrs.Factory(list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def format(self) -> str:
        lines = [
            f"{self.requests} requests, statuses {dict(sorted(self.statuses.items()))}",
            *self.failures[:20],
        ]
        return "\n".join(lines)


def _check(path: str, data: bytes, status: int, body: bytes, report: HttpFuzzReport) -> None:
    shown = data[:200]
    if status == 200:
        text = body.decode("utf-8", "replace")
        if text.startswith("data:"):
            if not text.rstrip().endswith("data: [DONE]"):
                report.failures.append(f"{path} {shown!r}: a stream without [DONE]")
        else:
            answer = json.loads(body)
            if not answer.get("choices"):
                report.failures.append(f"{path} {shown!r}: 200 without choices")
        return
    if status not in (400, 404, 413, 429, 503):
        report.failures.append(f"{path} {shown!r}: status {status}: {body[:300]!r}")
        return
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        report.failures.append(f"{path} {shown!r}: {status} without an error body: {body[:200]!r}")
        return
    if not isinstance(error.get("message"), str) or not error["message"]:
        report.failures.append(f"{path} {shown!r}: {status} without a message")


async def run_http_fuzz(
    host: str, port: int, *, requests: int, seed: int, connections: int = 4
) -> HttpFuzzReport:
    """Send ``requests`` fuzzed bodies from ``connections`` clients at once."""
    rng = random.Random(seed)
    work = [http_body(rng) for _ in range(requests)]
    report = HttpFuzzReport()

    async def worker(index: int) -> None:
        for path, data in work[index::connections]:
            headers = {"Content-Type": "application/json"}
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError as exc:
                report.failures.append(f"cannot connect: {exc!r}")
                return
            async with stream:
                client = RawClient(stream)
                await client.send(request("POST", path, headers, body=data))
                try:
                    reply = await client.response("POST", within=120)
                except trio.TooSlowError:
                    report.failures.append(f"{path} {data[:200]!r}: no answer in 120 s")
                    continue
            report.requests += 1
            if reply is None:
                report.failures.append(f"{path} {data[:200]!r}: closed without an answer")
                continue
            report.statuses[reply.status] += 1
            _check(path, data, reply.status, reply.body, report)

    async with trio.open_nursery() as nursery:
        for index in range(connections):
            nursery.start_soon(worker, index)
    return report
