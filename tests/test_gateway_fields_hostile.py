"""Hostile clients at vLLM's and SGLang's request fields
(trioserve/openai/extensions.py: ``ignore_eos``, ``skip_special_tokens``,
``no_stop_trim`` / ``include_stop_str_in_output``, ``continue_final_message``
with ``add_generation_prompt``, ``separate_reasoning``, ``stream_reasoning``,
``return_hidden_states``, ``priority``; ``top_k: -1``; ``repetition_penalty``
on ``/v1/responses``), at ``GET /model_info`` and ``/server_info``, and at the
``vllm:`` series of ``/metrics``, over real loopback sockets against the real
embedded model.

What each test plays, and what it checks:

* every field out of type (numbers, floats, strings, lists, objects, huge
  and negative integers for a boolean; booleans and floats for ``priority``),
  at a value that is refused, on a route that does not read it, two aliases
  that disagree, names near these (NUL, spaces, zero-width, case, dashes):
  a 400 in OpenAI's shape whose ``param`` names the field, nothing queued;
  ``null`` everywhere and the gateway's defaults are served as the plain
  request;
* ``continue_final_message`` with a final message that is a tool call, the
  user's, content parts, empty, huge, alone; with ``n`` 2, streamed, with
  tools, a named or required tool, ``response_format``, a stop string the
  prefix holds;
* stop strings that straddle token (and so chunk) boundaries, several at
  once, with ``no_stop_trim`` and its vLLM alias, streamed and not; a stop
  that is a special token's text;
* ``ignore_eos`` without ``max_tokens`` (bounded by the server's cap), with
  ``n`` and ``logprobs``, with tools, with a thinking budget, while another
  client is served; ``skip_special_tokens`` false with ``logprobs`` and a
  stream;
* ``stream_reasoning`` false with ``n`` 2 and a stream left mid-thinking;
  ``separate_reasoning`` false under the server's budget;
* ``/model_info`` with every method, a body, no key or a wrong one, odd
  paths; ``/metrics``' ``vllm:`` series whatever ``model`` clients send, in
  the text format and in OpenMetrics.

After every hostile request, a control request (the same every time, greedy)
must get its usual answer.

The defects this file found, each now a plain test: special tokens' text
skipped by default made a stop string of it never match and the logprobs
disagree with the text; ``no_stop_trim``'s logprobs left out the stop;
``ignore_eos`` stopped at the EOS token under tools or a thinking budget;
``separate_reasoning: false`` lifted the server's thinking budget;
``continue_final_message`` with a thinking template continued inside the
thought; the ``vllm:`` series were torn apart in OpenMetrics; and, older
than the fields, a lone surrogate in a field name was a 500 and a bad
``repetition_penalty`` was named ``rep_pen`` on the chat routes.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs
import trio
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from trioserve.openai.extensions import EXTENSIONS

from .helpers import serving
from .http_helpers import Reply, connect, request

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine
    from trioserve.server.server import Server

CHAT: Final = "/v1/chat/completions"
COMPLETIONS: Final = "/v1/completions"
RESPONSES: Final = "/v1/responses"
DOORS: Final = (CHAT, COMPLETIONS, RESPONSES)
#: Every client here comes from loopback: one client, by address.
CLIENT: Final = ("address", "127.0.0.1")
JSON: Final = {"Content-Type": "application/json"}
TEMPLATE: Final = str(Path(__file__).parent / "templates" / "chatml_thinking.jinja")
QUESTION: Final = [{"role": "user", "content": "What is the capital of France?"}]
#: The model ends its turn after about 24 tokens, then (with ignore_eos)
#: opens a turn of its own: ``<|im_end|>\n<|im_start|>user\n...``.
GREETING: Final = [{"role": "user", "content": "Say hi"}]
PREFIX: Final = "The capital of France is"
MAX_ERROR_BYTES: Final = 4096
QUICK_S: Final = 15.0
SERVED_NAME: Final = "SmolLM2-135M-Instruct"
CITY: Final = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER: Final = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather", "parameters": CITY},
}
#: A tool call in an assistant message.
CALL: Final = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
#: The control: the same greedy request after each hostile one.
CONTROL: Final = {"model": "m", "prompt": PREFIX, "max_tokens": 1, "temperature": 0}


# --------------------------------------------------------------------------
# Helpers


def encode(obj: Any) -> bytes:
    """JSON as a client writes it (lone surrogates as ``\\ud800`` escapes)."""
    return obj if isinstance(obj, bytes) else json.dumps(obj).encode()


async def post(
    port: int,
    path: str,
    obj: Any,
    headers: dict[str, str] | None = None,
    *,
    within: float = 60.0,
) -> Reply:
    async with connect(port) as client:
        await client.send(request("POST", path, {**JSON, **(headers or {})}, encode(obj)))
        reply = await client.response("POST", within=within)
    assert reply is not None, f"{path}: the server closed the connection without an answer"
    return reply


async def call(
    port: int,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
) -> Reply:
    async with connect(port) as client:
        await client.send(request(method, path, headers, body))
        reply = await client.response(method, within=QUICK_S)
    assert reply is not None, f"{method} {path}: closed without an answer"
    return reply


def ok(reply: Reply) -> Any:
    assert reply.status == 200, f"{reply.status} {reply.body[:500]!r}"
    return reply.json()


def refused(reply: Reply, param: Any = None, *, status: int = 400) -> dict[str, Any]:
    """Check that ``reply`` is an error in OpenAI's shape, with ``status``
    and (when given) naming ``param``; its ``error``."""
    shown = f"{reply.status} {reply.body[:400]!r}"
    assert reply.status == status, shown
    assert reply.headers.get("content-type", "").startswith("application/json"), shown
    assert len(reply.body) <= MAX_ERROR_BYTES, f"an error body of {len(reply.body)} bytes"
    doc = reply.json()
    assert isinstance(doc, dict) and set(doc) == {"error"}, shown
    error = doc["error"]
    assert set(error) == {"message", "type", "param", "code"}, shown
    assert isinstance(error["message"], str) and error["message"], shown
    assert error["type"] == "invalid_request_error", shown
    if param is not None:
        assert error["param"] == param, shown
    out: dict[str, Any] = error
    return out


def sse_data(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def streamed_chat(raw: bytes) -> dict[int, dict[str, Any]]:
    """A chat stream's choices: each one's content, reasoning chunks, kinds
    of delta in order (``r`` reasoning, ``c`` content), finish reason and
    logprobs tokens."""
    choices: dict[int, dict[str, Any]] = {}
    for event in sse_data(raw):
        for choice in event.get("choices", []):
            seen = choices.setdefault(
                choice["index"],
                {"content": "", "reasoning": [], "kinds": "", "finish": None, "tokens": []},
            )
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                seen["reasoning"].append(delta["reasoning_content"])
                seen["kinds"] += "r"
            if delta.get("content"):
                seen["content"] += delta["content"]
                seen["kinds"] += "c"
            if choice.get("finish_reason"):
                seen["finish"] = choice["finish_reason"]
            if choice.get("logprobs"):
                seen["tokens"] += [t["token"] for t in choice["logprobs"]["content"] or ()]
    return choices


def streamed_completion(raw: bytes) -> tuple[str, str | None]:
    text, finish = "", None
    for event in sse_data(raw):
        for choice in event.get("choices", []):
            text += choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


def body_for(path: str, **fields: Any) -> dict[str, Any]:
    """A valid request of ``path`` for a two-token answer, with ``fields``."""
    obj: dict[str, Any] = {"model": "m", "temperature": 0}
    if path == CHAT:
        obj.update(messages=GREETING, max_tokens=2)
    elif path == COMPLETIONS:
        obj.update(prompt=PREFIX, max_tokens=2)
    else:
        obj.update(input="Say hi", max_output_tokens=2)
    obj.update(fields)
    return obj


def text_of(path: str, doc: Any) -> str:
    if path == CHAT:
        return str(doc["choices"][0]["message"]["content"])
    if path == COMPLETIONS:
        return str(doc["choices"][0]["text"])
    return "".join(
        part["text"]
        for item in doc["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


async def wait_for(predicate: Callable[[], bool], within: float, what: str) -> None:
    with trio.move_on_after(within):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.02)
        return
    raise AssertionError(f"{what}: not within {within} s")


@attrs.define
class Control:
    """The server still answers a normal request, correctly, with nothing
    of the hostile client's left in flight."""

    server: Server
    port: int
    headers: dict[str, str] = attrs.field(factory=dict)

    async def check(self, after: Any = "") -> dict[str, Any]:
        await wait_for(
            lambda: self.server.generations.in_flight(CLIENT) == 0, 30, f"in flight after {after}"
        )
        doc = ok(await post(self.port, COMPLETIONS, CONTROL, self.headers, within=QUICK_S))
        assert doc["choices"][0]["text"] == " Paris", (after, doc)
        usage: dict[str, Any] = doc["usage"]
        return usage


# --------------------------------------------------------------------------
# 1. Every field out of type, refused, on the wrong route, aliases at odds

#: What a boolean field must refuse: numbers (1.0 and 0 too), strings,
#: containers, huge and negative integers.
NOT_BOOLEANS: Final[tuple[Any, ...]] = (
    1,
    0,
    1.0,
    0.0,
    "true",
    "false",
    "",
    [],
    [True],
    {"value": True},
    -1,
    2**64,
)
#: What ``priority`` (an integer) must refuse as a type.
NOT_INTEGERS: Final[tuple[Any, ...]] = (True, False, 1.0, 0.0, -0.0, "0", [0], {})
#: What it must refuse as a value (only 0 means nothing here).
PRIORITIES: Final = (1, -1, 2**63, -(10**100))
#: What ``repetition_penalty`` must refuse.
BAD_PENALTIES: Final[tuple[Any, ...]] = (True, "1.1", 0, -1, 10**6, [], {})
DOOR_NAMES: Final = {CHAT: "chat", COMPLETIONS: "completions", RESPONSES: "responses"}


def _refusal_cases() -> list[tuple[str, dict[str, Any], tuple[str, ...]]]:
    """(path, fields, the params the refusal may name)."""
    cases: list[tuple[str, dict[str, Any], tuple[str, ...]]] = []
    for path in DOORS:
        door = DOOR_NAMES[path]
        for extension in EXTENSIONS:
            name = extension.name
            bad = NOT_INTEGERS if extension.integer else NOT_BOOLEANS
            cases += [(path, {name: value}, (name,)) for value in bad]
            if door not in extension.doors:
                # On a route that does not read it, even its default is refused.
                cases.append((path, {name: extension.default}, (name,)))
        cases += [(path, {"priority": value}, ("priority",)) for value in PRIORITIES]
        cases.append((path, {"return_hidden_states": True}, ("return_hidden_states",)))
        both = ("no_stop_trim", "include_stop_str_in_output")
        cases.append((path, {"no_stop_trim": True, "include_stop_str_in_output": False}, both))
        cases.append((path, {"include_stop_str_in_output": True, "no_stop_trim": False}, both))
        cases += [
            (path, {"top_k": value}, ("top_k",)) for value in (-1.0, -2, "-1", True, [-1], 2**31)
        ]
        cases.append(
            (path, {"repetition_penalty": 1.1, "rep_pen": 1.2}, ("repetition_penalty", "rep_pen"))
        )
    # On /v1/responses (new here) the alias is named; on the chat routes see
    # test_a_bad_repetition_penalty_is_named_as_sent.
    cases += [
        (RESPONSES, {"repetition_penalty": value}, ("repetition_penalty",))
        for value in BAD_PENALTIES
    ]
    cases += [
        (CHAT, {"add_generation_prompt": False}, ("add_generation_prompt",)),
        (
            CHAT,
            {"add_generation_prompt": False, "continue_final_message": False},
            ("add_generation_prompt",),
        ),
        (
            CHAT,
            {"add_generation_prompt": False, "continue_final_message": None},
            ("add_generation_prompt",),
        ),
    ]
    return cases


REFUSALS: Final = _refusal_cases()


def meaningless(fields: dict[str, Any]) -> bool:
    """Whether ``fields`` is one no-op field at a value of the right type
    that means something this server does not do (not a malformed one)."""
    if len(fields) != 1:
        return False
    [(name, value)] = fields.items()
    if name == "return_hidden_states":
        return value is True
    return name == "priority" and type(value) is int and value != 0


async def test_each_field_out_of_type_refused_or_misplaced_is_a_400_naming_it(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        await control.check("start")
        for path, fields, params in REFUSALS:
            reply = await post(port, path, body_for(path, **fields), within=QUICK_S)
            error = refused(reply)
            assert error["param"] in params, (path, fields, error)
            assert error["param"] in error["message"], (path, fields, error)
            if meaningless(fields):
                assert error["code"] == "unsupported_parameter", (fields, error)
            await control.check((path, fields))


async def test_a_bad_repetition_penalty_is_named_as_sent(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        errors = []
        for path in (CHAT, COMPLETIONS):
            for value in BAD_PENALTIES:
                body = body_for(path, repetition_penalty=value)
                errors.append(refused(await post(port, path, body, within=QUICK_S)))
                await control.check((path, value))
        for error in errors:
            assert error["param"] == "repetition_penalty", error
            assert "repetition_penalty" in error["message"], error


#: Names near the fields': each is an unknown field, refused by name.
NEAR_NAMES: Final = (
    "ignore_eos\u0000",
    "ignore_eos ",
    " ignore_eos",
    "IGNORE_EOS",
    "Ignore_Eos",
    "ignore-eos",
    "ignoreEos",
    "ignore_eos\u200b",
    "\ufeffignore_eos",
    "\u0131gnore_eos",
    "ignore_eos\n",
    "skip_special_token",
    "no_stop_trim\t",
    "include_stop_str",
    "continue_final_messages",
    "priority\u0000",
    "vllm:ignore_eos",
)


async def test_names_near_the_fields_are_unknown_fields_refused_by_name(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        for path in DOORS:
            for name in NEAR_NAMES:
                reply = await post(port, path, body_for(path, **{name: True}), within=QUICK_S)
                error = refused(reply, name)
                assert error["code"] == "unknown_parameter", (path, repr(name), error)
                # The name is shown escaped: no raw control character in the message.
                assert "\u0000" not in error["message"] and "\n" not in error["message"]
                await control.check((path, name))
        # The Anthropic door takes none of them: refused, not silently ignored.
        for name in ("ignore_eos", "skip_special_tokens", "continue_final_message"):
            messages = {"model": "m", "messages": GREETING, "max_tokens": 2, name: True}
            reply = await post(port, "/v1/messages", messages, within=QUICK_S)
            assert reply.status == 400 and name in reply.json()["error"]["message"], reply.body
            await control.check(("/v1/messages", name))


async def test_a_lone_surrogate_in_a_field_name_is_a_400(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        replies = []
        for path in DOORS:
            for name in ("ignore_eos\ud800", "\udfff", "skip_special_tokens\udc00"):
                replies.append(await post(port, path, body_for(path, **{name: True})))
                await control.check((path, repr(name)))
        for reply in replies:
            refused(reply)


async def test_null_everywhere_and_the_gateways_defaults_are_the_plain_request(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        nulls = {extension.name: None for extension in EXTENSIONS}
        nulls.update(top_k=None, repetition_penalty=None)
        for path in DOORS:
            size = {"max_output_tokens": 2} if path == RESPONSES else {"max_tokens": 6}
            plain = text_of(path, ok(await post(port, path, body_for(path, **size))))
            door = DOOR_NAMES[path]
            defaults = {
                e.name: e.default for e in EXTENSIONS if door in e.doors and e.name != "priority"
            }
            odd: list[dict[str, Any]] = [
                nulls,
                {**defaults, "priority": 0, "top_k": -1},
                {"priority": -0, "return_hidden_states": False, "top_k": -1},
                {"no_stop_trim": True, "include_stop_str_in_output": True},
                {"no_stop_trim": None, "include_stop_str_in_output": False},
                {"repetition_penalty": 1.0, "rep_pen": 1.0},
            ]
            for fields in odd:
                doc = ok(await post(port, path, body_for(path, **fields, **size)))
                assert text_of(path, doc) == plain, (path, fields)
                await control.check((path, fields))


# --------------------------------------------------------------------------
# 2. continue_final_message


def continued(final: Any, **fields: Any) -> dict[str, Any]:
    """A chat request that continues ``final`` (a message, or its content)."""
    message = final if isinstance(final, dict) else {"role": "assistant", "content": final}
    return {
        "model": "m",
        "messages": [*QUESTION, message],
        "max_tokens": 6,
        "temperature": 0,
        "continue_final_message": True,
        "add_generation_prompt": False,
        **fields,
    }


async def test_continue_final_message_refuses_what_it_cannot_continue_by_name(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        named = {"type": "function", "function": {"name": "get_weather"}}
        schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
        cases: list[tuple[dict[str, Any], Callable[[str | None], bool]]] = [
            # The final message is a tool call, the user's, the system's, a tool result.
            (
                continued({"role": "assistant", "content": None, "tool_calls": [CALL]}),
                lambda p: p == "messages[1]",
            ),
            (
                continued({"role": "assistant", "content": "It is", "tool_calls": [CALL]}),
                lambda p: p == "messages[1]",
            ),
            (continued({"role": "user", "content": "And Spain?"}), lambda p: p == "messages[1]"),
            (continued({"role": "system", "content": "Be brief."}), lambda p: p == "messages[1]"),
            (
                {
                    **continued(""),
                    "messages": [
                        *QUESTION,
                        {"role": "assistant", "content": None, "tool_calls": [CALL]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                    ],
                    "tools": [WEATHER],
                },
                lambda p: p == "messages[2]",
            ),
            # A constraint the answer must start with.
            (
                continued(PREFIX, tools=[WEATHER], tool_choice="required"),
                lambda p: p == "continue_final_message",
            ),
            (
                continued(PREFIX, tools=[WEATHER], tool_choice=named),
                lambda p: p == "continue_final_message",
            ),
            (
                continued(PREFIX, response_format={"type": "json_object"}),
                lambda p: p == "continue_final_message",
            ),
            (continued(PREFIX, response_format=schema), lambda p: p == "continue_final_message"),
            (continued(PREFIX, guided_regex="[a-z]+"), lambda p: p == "continue_final_message"),
            # Out of type, and its partner at odds.
            (
                continued(PREFIX, continue_final_message="true"),
                lambda p: p == "continue_final_message",
            ),
            (
                continued(PREFIX, continue_final_message=1),
                lambda p: p == "continue_final_message",
            ),
            (
                continued(PREFIX, add_generation_prompt=0),
                lambda p: p == "add_generation_prompt",
            ),
            # Content the model cannot read, or text that is not unicode.
            (
                continued([{"type": "image_url", "image_url": {"url": "http://x"}}]),
                lambda p: p is not None and p.startswith("messages[1]"),
            ),
            (continued("It is \ud800"), lambda p: p is not None and p.startswith("messages[1]")),
        ]
        for obj, names in cases:
            reply = await post(port, CHAT, obj, within=QUICK_S)
            error = refused(reply)
            assert names(error["param"]), (obj, error)
            await control.check(obj)
        # A final message longer than the context: the context's 400, not a 500.
        huge = await post(port, CHAT, continued("word " * 12000), within=60)
        error = refused(huge)
        assert error["code"] == "context_length_exceeded", error
        await control.check("huge")
        # One over the body limit: refused at once.
        over = await post(port, CHAT, continued("x" * 400_000), within=QUICK_S)
        assert over.status in (400, 413), over.body[:300]
        await control.check("over the limit")


async def test_continue_final_message_serves_the_odd_cases(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        whole = ok(await post(port, CHAT, continued(PREFIX)))
        said = whole["choices"][0]["message"]["content"]
        assert "Paris" in said and not said.startswith(PREFIX), said
        plain = ok(await post(port, CHAT, continued(PREFIX, add_generation_prompt=None)))
        assert plain["choices"][0]["message"]["content"] == said
        # n=2: each choice continues (greedy: the same words).
        two = ok(await post(port, CHAT, continued(PREFIX, n=2)))
        assert [c["message"]["content"] for c in two["choices"]] == [said, said]
        # Streamed: the same text, in chunks, and the usage.
        raw = await post(
            port,
            CHAT,
            continued(PREFIX, stream=True, n=2, stream_options={"include_usage": True}),
        )
        assert raw.status == 200, raw.body[:300]
        choices = streamed_chat(raw.body)
        assert [choices[i]["content"] for i in (0, 1)] == [said, said]
        usage = [e["usage"] for e in sse_data(raw.body) if e.get("usage")]
        assert usage and usage[-1]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
        await control.check("stream")
        # The prefix's words are not the generation's: a stop they hold does not cut it,
        # and no_stop_trim keeps only a stop the generation wrote.
        stopped = ok(await post(port, CHAT, continued(PREFIX, stop=["capital", "France"])))
        assert "Paris" in stopped["choices"][0]["message"]["content"], stopped
        kept = ok(await post(port, CHAT, continued(PREFIX, stop=["."], no_stop_trim=True)))
        assert kept["choices"][0]["message"]["content"] == said.split(".")[0] + ".", kept
        # Content parts (joined with newlines, as the docs say), an empty final
        # message, an assistant message alone, tools left to the model.
        parts = [{"type": "text", "text": "The capital of"}, {"type": "text", "text": "France is"}]
        for final, fields in (
            (parts, {}),
            ("", {}),
            ([], {}),
            (PREFIX, {"tools": [WEATHER], "tool_choice": "auto"}),
            (PREFIX, {"response_format": {"type": "text"}}),
            (PREFIX, {"tools": [WEATHER], "tool_choice": "none"}),
        ):
            doc = ok(await post(port, CHAT, continued(final, **fields)))
            message = doc["choices"][0]["message"]
            assert message["content"] or message.get("tool_calls"), (final, fields, doc)
            await control.check((final, fields))
        alone = {
            **continued(PREFIX, ignore_eos=True),
            "messages": [{"role": "assistant", "content": PREFIX}],
        }
        doc = ok(await post(port, CHAT, alone))
        assert doc["usage"]["completion_tokens"] == 6
        await control.check("alone")


async def test_continue_final_message_with_a_thinking_template_continues_the_answer(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine, chat_template=TEMPLATE, reasoning_budget=4) as (
        server,
        listening,
    ):
        port = listening.port
        control = Control(server, port)
        doc = ok(await post(port, CHAT, continued(PREFIX)))
        await control.check("thinking")
        expected = (
            f"<|im_start|>user\n{QUESTION[0]['content']}<|im_end|>\n<|im_start|>assistant\n{PREFIX}"
        )
        tokens = ok(await post(port, "/tokenize", {"model": "m", "prompt": expected}))["count"]
        assert doc["usage"]["prompt_tokens"] == tokens, (doc["usage"], tokens)


# --------------------------------------------------------------------------
# 3. Stop strings: straddling tokens, several, kept; special tokens' text


def first_stop(text: str, stops: list[str]) -> tuple[int, int] | None:
    """Where the first stop string to complete in ``text`` starts and ends
    (of two ending together, the longer)."""
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    if not found:
        return None
    end, start = min(found, key=lambda f: (f[0], f[1]))
    return start, end


async def test_stops_straddling_tokens_are_kept_or_trimmed_alike_streamed_or_not(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        base = {
            "model": "m",
            "prompt": PREFIX,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
        }
        whole = ok(await post(port, COMPLETIONS, {**base, "logprobs": 0}))["choices"][0]
        text, offsets = whole["text"], whole["logprobs"]["text_offset"]
        assert len(offsets) == 16 and len(text) > offsets[-1], whole
        # Stops that begin inside one token and end inside the next (each
        # token is a chunk of the stream), or span several tokens.
        straddle = [
            text[offsets[i] + 1 : offsets[i + 1] + 1]
            for i in range(1, 8)
            if offsets[i + 1] - offsets[i] > 1
        ]
        wide = text[offsets[2] + 1 : offsets[6] + 1]
        spans = list(zip(offsets, [*offsets[1:], len(text)], strict=True))
        long_token = next(text[a:b] for a, b in spans if b - a >= 3)
        assert straddle, text
        stop_sets: list[list[str]] = [
            [straddle[0]],
            [wide],
            ["never there", straddle[-1], wide],
            [straddle[-1], straddle[0]],
            [wide, wide[1:], wide[:-1]],
            [long_token, long_token[1:]],  # ending together: the longer one counts
            [text[-3:]],
            [straddle[0] + "\u00e9"],  # never matched: runs to max_tokens
            ["\ufffd"],
        ]
        for stops in stop_sets:
            where = first_stop(text, stops)
            for keep in (None, "no_stop_trim", "include_stop_str_in_output"):
                fields: dict[str, Any] = {**base, "stop": stops}
                if keep is not None:
                    fields[keep] = True
                got = ok(await post(port, COMPLETIONS, fields))["choices"][0]
                raw = await post(port, COMPLETIONS, {**fields, "stream": True})
                assert raw.status == 200, raw.body[:300]
                streamed, finish = streamed_completion(raw.body)
                if where is None:
                    expected, reason = text, "length"
                else:
                    start, end = where
                    expected, reason = (text[:start] if keep is None else text[:end]), "stop"
                assert got["text"] == expected, (stops, keep, got, expected)
                assert (streamed, finish) == (expected, reason), (stops, keep, streamed)
                assert got["finish_reason"] == reason
            await control.check(stops)
        # The chat door alike, with several stops, streamed.
        stops = ["s Par", "France i", "zz"]
        chat = {
            "model": "m",
            "messages": QUESTION,
            "max_tokens": 12,
            "temperature": 0,
            "stop": stops,
            "include_stop_str_in_output": True,
        }
        plain = ok(
            await post(port, CHAT, {**chat, "stop": None, "include_stop_str_in_output": None})
        )
        content = plain["choices"][0]["message"]["content"]
        where = first_stop(content, stops)
        assert where is not None, content
        kept = ok(await post(port, CHAT, chat))["choices"][0]["message"]["content"]
        assert kept == content[: where[1]], (kept, content)
        stream = streamed_chat((await post(port, CHAT, {**chat, "stream": True})).body)
        assert stream[0]["content"] == kept and stream[0]["finish"] == "stop", stream
        await control.check("chat stops")


async def test_no_stop_trim_logprobs_cover_the_text(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        base = {
            "model": "m",
            "prompt": PREFIX,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
        }
        first = ok(await post(port, COMPLETIONS, base))["choices"][0]
        offsets = first["logprobs"]["text_offset"]
        stop = first["text"][offsets[2] + 1 : offsets[4] + 1]
        doc = ok(await post(port, COMPLETIONS, {**base, "stop": [stop], "no_stop_trim": True}))
        await control.check("no_stop_trim logprobs")
        choice = doc["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["text"].endswith(stop), choice
        joined = "".join(choice["logprobs"]["tokens"])
        assert joined.startswith(choice["text"]), (joined, choice["text"])


async def test_a_stop_that_is_a_special_tokens_text_with_special_tokens_written(
    cpu_engine: CpuEngine,
) -> None:
    """With ``skip_special_tokens`` false the special tokens' text is the
    reply's, and a stop string of it (or one spanning it) ends it."""
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        base = {
            "model": "m",
            "messages": GREETING,
            "max_tokens": 40,
            "temperature": 0,
            "ignore_eos": True,
            "skip_special_tokens": False,
        }
        full = ok(await post(port, CHAT, base))["choices"][0]["message"]["content"]
        assert "<|im_end|>\n<|im_start|>user" in full, full
        turn = full.split("<|im_end|>")[0]
        for stop, keep, expected in (
            ("<|im_end|>", False, turn),
            ("<|im_end|>", True, turn + "<|im_end|>"),
            ("?<|im_end|>\n<|im_start|>us", True, full.split("er\n")[0]),
            ("<|im_start|>", True, turn + "<|im_end|>\n<|im_start|>"),
            ("im_end", False, turn + "<|"),
        ):
            fields = {**base, "stop": [stop], "no_stop_trim": keep}
            got = ok(await post(port, CHAT, fields))["choices"][0]
            assert (got["message"]["content"], got["finish_reason"]) == (expected, "stop"), (
                stop,
                got,
            )
            stream = streamed_chat((await post(port, CHAT, {**fields, "stream": True})).body)
            assert stream[0]["content"] == expected, (stop, stream)
            await control.check(stop)
        # The request's own stop token still ends an ignore_eos generation.
        doc = ok(await post(port, CHAT, {**base, "stop_token_ids": [2]}))
        assert doc["choices"][0]["finish_reason"] == "stop"
        assert doc["choices"][0]["message"]["content"] == turn
        await control.check("stop_token_ids")


async def test_a_stop_that_is_a_special_tokens_text_ends_the_generation_by_default(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        completion = ok(
            await post(
                port,
                COMPLETIONS,
                {
                    "model": "m",
                    "prompt": "<|im_start|>user\nSay hi<|im_end|>\n",
                    "max_tokens": 8,
                    "temperature": 0,
                    "stop": ["<|im_start|>"],
                },
            )
        )["choices"][0]
        await control.check("completion")
        chat = ok(
            await post(
                port,
                CHAT,
                {
                    "model": "m",
                    "messages": GREETING,
                    "max_tokens": 40,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stop": ["<|im_end|>"],
                },
            )
        )
        await control.check("chat")
        assert (completion["text"], completion["finish_reason"]) == ("", "stop"), completion
        assert chat["choices"][0]["finish_reason"] == "stop", chat
        assert chat["usage"]["completion_tokens"] < 40, chat


# --------------------------------------------------------------------------
# 4. ignore_eos and skip_special_tokens


async def test_ignore_eos_without_max_tokens_stays_within_the_servers_cap(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine, max_new_tokens=6) as (server, listening):
        port = listening.port
        control = Control(server, port)
        for path in DOORS:
            obj = body_for(path, ignore_eos=True)
            obj.pop("max_tokens", None)
            obj.pop("max_output_tokens", None)
            doc = ok(await post(port, path, obj))
            if path == RESPONSES:
                assert doc["usage"]["output_tokens"] == 6, doc
            else:
                assert doc["usage"]["completion_tokens"] == 6, doc
                assert doc["choices"][0]["finish_reason"] == "length"
            await control.check(path)
            if path != RESPONSES:
                many = ok(await post(port, path, {**obj, "n": 3}))
                assert many["usage"]["completion_tokens"] == 18, many
                assert {c["finish_reason"] for c in many["choices"]} == {"length"}
                # Asking for more than the cap is the cap's 400, ignore_eos or not.
                error = refused(await post(port, path, {**obj, "max_tokens": 7}))
                assert error["param"] == "max_tokens", error
                await control.check(path)


async def test_ignore_eos_with_n_and_logprobs_runs_each_choice_to_max_tokens(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        obj = {
            "model": "m",
            "messages": GREETING,
            "max_tokens": 30,
            "temperature": 0,
            "n": 3,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "logprobs": True,
            "top_logprobs": 2,
        }
        doc = ok(await post(port, CHAT, obj))
        assert doc["usage"]["completion_tokens"] == 90, doc["usage"]
        for choice in doc["choices"]:
            assert choice["finish_reason"] == "length"
            tokens = choice["logprobs"]["content"]
            assert len(tokens) == 30 and all(len(t["top_logprobs"]) == 2 for t in tokens)
            assert "".join(t["token"] for t in tokens) == choice["message"]["content"]
            assert "<|im_end|>" in choice["message"]["content"]
        await control.check("n logprobs")
        stream = streamed_chat((await post(port, CHAT, {**obj, "stream": True})).body)
        assert sorted(stream) == [0, 1, 2]
        for index, seen in stream.items():
            assert seen["content"] == doc["choices"][index]["message"]["content"]
            assert len(seen["tokens"]) == 30 and seen["finish"] == "length"
        await control.check("n logprobs stream")


async def test_skip_special_tokens_either_way_streamed_or_not(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        base = {
            "model": "m",
            "messages": GREETING,
            "max_tokens": 30,
            "temperature": 0,
            "ignore_eos": True,
        }
        texts = {}
        for skip in (False, True):
            obj = {**base, "skip_special_tokens": skip, "logprobs": True}
            whole = ok(await post(port, CHAT, obj))["choices"][0]
            stream = streamed_chat((await post(port, CHAT, {**obj, "stream": True})).body)[0]
            assert stream["content"] == whole["message"]["content"], (skip, stream, whole)
            assert stream["tokens"] == [t["token"] for t in whole["logprobs"]["content"]]
            texts[skip] = whole["message"]["content"]
            await control.check(skip)
        assert "<|im_end|>\n<|im_start|>" in texts[False]
        assert "<|im_" not in texts[True]
        assert texts[False].replace("<|im_end|>", "").replace("<|im_start|>", "") == texts[True]
        # The Responses door alike.
        answer = {"model": "m", "input": "Say hi", "max_output_tokens": 30, "temperature": 0}
        raw = ok(
            await post(
                port, RESPONSES, {**answer, "ignore_eos": True, "skip_special_tokens": False}
            )
        )
        assert text_of(RESPONSES, raw) == texts[False]
        clean = ok(await post(port, RESPONSES, {**answer, "ignore_eos": True}))
        assert text_of(RESPONSES, clean) == texts[True]
        await control.check("responses")


async def test_logprobs_agree_with_the_text_when_special_tokens_are_skipped(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        chat = ok(
            await post(
                port,
                CHAT,
                {
                    "model": "m",
                    "messages": GREETING,
                    "max_tokens": 40,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": True,
                },
            )
        )["choices"][0]
        await control.check("chat")
        completion = ok(
            await post(
                port,
                COMPLETIONS,
                {
                    "model": "m",
                    "prompt": "<|im_start|>user\nSay hi<|im_end|>\n",
                    "max_tokens": 8,
                    "temperature": 0,
                    "logprobs": 0,
                },
            )
        )["choices"][0]
        await control.check("completion")
        tokens = [t["token"] for t in chat["logprobs"]["content"]]
        assert "".join(tokens) == chat["message"]["content"], tokens
        text, lp = completion["text"], completion["logprobs"]
        for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
            assert text[offset:].startswith(token), (token, offset, text)


async def test_ignore_eos_with_tools_runs_to_max_tokens(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        obj = {
            "model": "m",
            "messages": QUESTION,
            "max_tokens": 30,
            "temperature": 0,
            "ignore_eos": True,
            "tools": [WEATHER],
            "tool_choice": "auto",
        }
        doc = ok(await post(port, CHAT, obj))
        await control.check("tools")
        assert doc["usage"]["completion_tokens"] == 30, doc
        assert doc["choices"][0]["finish_reason"] == "length", doc


async def test_ignore_eos_with_a_thinking_budget_runs_to_max_tokens(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine, chat_template=TEMPLATE, reasoning_budget=12) as (
        server,
        listening,
    ):
        port = listening.port
        control = Control(server, port)
        obj = {
            "model": "m",
            "messages": QUESTION,
            "max_tokens": 40,
            "temperature": 0,
            "ignore_eos": True,
        }
        doc = ok(await post(port, CHAT, obj))
        await control.check("budget")
        assert doc["usage"]["completion_tokens"] == 40, doc
        assert doc["choices"][0]["finish_reason"] == "length", doc


async def test_a_long_ignore_eos_stream_starves_nobody_and_frees_its_slot_when_left(
    cpu_engine: CpuEngine,
) -> None:
    """No max_tokens: the generation is bounded only by the context; another
    client is served meanwhile, and leaving the stream ends it."""
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)
        obj = {
            "model": "m",
            "messages": GREETING,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "n": 2,
        }
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        try:
            await stream.send_all(request("POST", CHAT, JSON, encode(obj)))
            seen = b""
            with trio.fail_after(60):
                while seen.count(b'"content"') < 20:
                    chunk = await stream.receive_some(65536)
                    assert chunk, seen[-300:]
                    seen += chunk
            assert server.generations.in_flight(CLIENT) == 2
            with trio.fail_after(QUICK_S):
                doc = ok(await post(port, COMPLETIONS, CONTROL))
            assert doc["choices"][0]["text"] == " Paris"
            assert server.generations.in_flight(CLIENT) == 2, "the long stream ended early"
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        finally:
            await stream.aclose()
        await control.check("left")


# --------------------------------------------------------------------------
# 5. Reasoning: stream_reasoning, separate_reasoning


async def test_stream_reasoning_false_sends_each_choices_thought_whole_first(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine, chat_template=TEMPLATE, reasoning_budget=12) as (
        server,
        listening,
    ):
        port = listening.port
        control = Control(server, port)
        obj = {"model": "m", "messages": QUESTION, "max_tokens": 40, "temperature": 0, "n": 2}
        whole = ok(await post(port, CHAT, obj))
        thoughts = [c["message"]["reasoning_content"] for c in whole["choices"]]
        assert all(thoughts), whole
        for flag in (False, None, True):
            raw = await post(port, CHAT, {**obj, "stream": True, "stream_reasoning": flag})
            assert raw.status == 200, raw.body[:300]
            choices = streamed_chat(raw.body)
            assert sorted(choices) == [0, 1]
            for index, seen in choices.items():
                assert "".join(seen["reasoning"]) == thoughts[index]
                assert seen["content"] == whole["choices"][index]["message"]["content"]
                assert seen["kinds"].startswith("r") and "r" not in seen["kinds"].lstrip("r")
                if flag is False:
                    assert seen["reasoning"] == [thoughts[index]], seen
                else:
                    assert len(seen["reasoning"]) > 1, seen
            await control.check(flag)
        # stream_reasoning is about a stream only: the reply as a whole is the same.
        same = ok(await post(port, CHAT, {**obj, "stream_reasoning": False}))
        assert same["choices"] == whole["choices"]


async def test_a_stream_that_sends_nothing_while_it_thinks_frees_its_slot_when_left(
    cpu_engine: CpuEngine,
) -> None:
    """stream_reasoning false: nothing is written while the model thinks;
    a client that leaves then is still noticed."""
    async with serving(cpu_engine, chat_template=TEMPLATE) as (server, listening):
        port = listening.port
        control = Control(server, port)
        obj = {
            "model": "m",
            "messages": QUESTION,
            "max_tokens": 3000,
            "min_tokens": 3000,
            "temperature": 0,
            "stream": True,
            "stream_reasoning": False,
        }
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(request("POST", CHAT, JSON, encode(obj)))
        seen = b""
        with trio.fail_after(30):
            while b'"role":"assistant"' not in seen:
                chunk = await stream.receive_some(65536)
                assert chunk, seen[-300:]
                seen += chunk
        assert seen.startswith(b"HTTP/1.1 200"), seen[:300]
        await trio.sleep(0.3)
        assert server.generations.in_flight(CLIENT) == 1
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()
        await wait_for(lambda: server.generations.in_flight(CLIENT) == 0, 10, "slot freed")
        await control.check("left mid-thinking")


async def test_separate_reasoning_false_keeps_the_servers_budget(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine, chat_template=TEMPLATE, reasoning_budget=0) as (
        server,
        listening,
    ):
        port = listening.port
        control = Control(server, port)
        obj = {"model": "m", "messages": QUESTION, "max_tokens": 40, "temperature": 0}
        split = ok(await post(port, CHAT, obj))
        together = ok(await post(port, CHAT, {**obj, "separate_reasoning": False}))
        await control.check("separate_reasoning")
        # The same tokens: only how they are presented differs.
        assert together["usage"] == split["usage"], (together, split)
        assert "</think>" in together["choices"][0]["message"]["content"], together


# --------------------------------------------------------------------------
# 6. /model_info, /server_info, and /metrics' vllm: series


async def test_model_info_whatever_the_method_body_key_or_path(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine, api_key="k") as (server, listening):
        port = listening.port
        key = {"Authorization": "Bearer k"}
        control = Control(server, port, key)
        docs = []
        for path in ("/model_info", "/server_info", "/model_info?model=../../etc/passwd"):
            doc = ok(await call(port, "GET", path, key))
            docs.append(doc)
            assert doc["served_model_name"] == SERVED_NAME, doc
            assert "model_path" not in doc and doc["is_generation"] is True
            assert isinstance(doc["context_length"], int) and doc["context_length"] > 0
            await control.check(path)
        assert docs[0] == docs[1] == docs[2]
        head = await call(port, "HEAD", "/model_info", key)
        assert head.status == 200 and head.body == b"", head
        assert ok(await call(port, "GET", "/model_info", {"X-Api-Key": "k"})) == docs[0]
        # A body on a GET is read and ignored; one over the limit is refused.
        with_body = await call(
            port, "GET", "/model_info", {**key, **JSON}, b'{"model": "other", "x": [1]}'
        )
        assert ok(with_body) == docs[0]
        big = await call(port, "GET", "/model_info", key, b"x" * 200_000)
        assert ok(big) == docs[0]
        await control.check("bodies")
        # No key, a wrong one, a key in the query where the header is wrong.
        for headers in ({}, {"Authorization": "Bearer K"}, {"Authorization": "k"}):
            for path in ("/model_info", "/server_info"):
                error = refused(await call(port, "GET", path, headers), status=401)
                assert error["code"] == "invalid_api_key", error
                assert SERVED_NAME not in json.dumps(error)
        await control.check("keys")
        # Other methods: 405 with Allow, whatever the body.
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            reply = await call(port, method, "/model_info", {**key, **JSON}, b'{"a": 1}')
            refused(reply, status=405)
            assert "GET" in reply.headers.get("allow", ""), reply.headers
            await control.check(method)
        # Paths near it are not it.
        for path in ("/model_info/", "/MODEL_INFO", "/model_info%00", "/model_info/../metrics"):
            reply = await call(port, "GET", path, key)
            assert reply.status == 404 and SERVED_NAME.encode() not in reply.body, (path, reply)
        await control.check("paths")


#: Model names a client may send (the server serves its own model).
HOSTILE_MODELS: Final = (
    'evil"} 1\nvllm:num_requests_running{model_name="x"} 99\n# EOF',
    "",
    "model_name",
    "\u6a21\u578b\u0000",
    "a" * 256,
    "SmolLM2-135M-Instruct ",
    "vllm:kv_cache_usage_perc",
)


def vllm_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("vllm:")
    ]


async def test_vllm_series_have_one_label_value_whatever_clients_send(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        control = Control(server, port)

        async def scrape() -> list[tuple[str, dict[str, str], float]]:
            reply = await call(port, "GET", "/metrics")
            assert reply.status == 200
            return vllm_samples(reply.body.decode())

        def total(samples: list[tuple[str, dict[str, str], float]], name: str) -> float:
            [value] = [v for n, _, v in samples if n == name]
            return value

        before = await scrape()
        names = sorted(n for n, _, _ in before)
        assert {
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
        } <= set(names)
        prompt_tokens = 0
        served: set[str] = set()
        for model in HOSTILE_MODELS:
            for path in DOORS:
                reply = await post(port, path, body_for(path, model=model))
                if reply.status == 200:
                    served.add(model)
                    usage = reply.json()["usage"]
                    prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0))
                else:  # a door that takes no such name refuses it by name
                    refused(reply, "model")
                prompt_tokens += (await control.check((path, model)))["prompt_tokens"]
        assert HOSTILE_MODELS[0] in served and "a" * 256 in served, served
        # Refused requests, with any model, count no prompt tokens.
        bad_models: tuple[Any, ...] = ("\ud800", "b" * 5000, ["m"], {"name": "m"})
        for bad in bad_models:
            refused(await post(port, CHAT, body_for(CHAT, model=bad)))
            prompt_tokens += (await control.check(bad))["prompt_tokens"]
        queries = total(before, "vllm:prefix_cache_queries_total") + prompt_tokens
        with trio.move_on_after(10):
            while total(await scrape(), "vllm:prefix_cache_queries_total") != queries:  # noqa: ASYNC110
                await trio.sleep(0.05)
        after = await scrape()
        assert sorted(n for n, _, _ in after) == names, "new vllm: series appeared"
        for name, labels, value in after:
            assert labels == {"model_name": SERVED_NAME}, (name, labels)
            assert value >= 0
        assert total(after, "vllm:prefix_cache_queries_total") == queries
        assert total(after, "vllm:prefix_cache_hits_total") <= queries
        assert 0.0 <= total(after, "vllm:kv_cache_usage_perc") <= 1.0
        assert total(after, "vllm:num_requests_running") == 0.0
        assert total(after, "vllm:num_requests_waiting") == 0.0


async def test_vllm_series_are_whole_in_openmetrics(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (server, listening):
        port = listening.port
        accept = {"Accept": "application/openmetrics-text; version=1.0.0"}
        reply = await call(port, "GET", "/metrics", accept)
        await Control(server, port).check("openmetrics")
        assert reply.status == 200
        assert reply.headers["content-type"].startswith("application/openmetrics-text")
        families = {f.name: f for f in openmetrics_families(reply.body.decode())}  # type: ignore[no-untyped-call]
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            assert name in families, sorted(families)
            samples = families[name].samples
            assert samples and {s.labels["model_name"] for s in samples} == {SERVED_NAME}, (
                name,
                samples,
            )
        untyped = [n for n, f in families.items() if n.startswith("vllm") and f.type == "unknown"]
        assert not untyped, untyped
