"""Hostile clients at the reasoning surfaces, over real loopback sockets,
against the real embedded model served with a template that thinks
(tests/templates/chatml_thinking.jinja: the generation prompt opens
``<think>``, as in tests/test_reasoning_e2e.py).

What each test plays, and what it checks:

* the reasoning switches out of type and out of range on every door
  (``reasoning_effort``, ``chat_template_kwargs``, Anthropic's ``thinking``
  with budgets 0, negative, float, bool, huge; the Responses API's
  ``reasoning.effort``): a 4xx in the door's shape naming the field, never a
  5xx, nothing queued; and the odd values each door does take are served;
* regexes, choices and schemas crafted to break out of the Lark rule that
  holds the answer after the thinking (a slash already escaped, ``#``
  comments, line breaks, U+2028, quotes): the answer matches the constraint
  as the client wrote it, or the request is refused, never a grammar other
  than the client's;
* a grammar of the client's own beside a thinking section: a 400 naming the
  field, on HTTP and on the WebSocket; with thinking off it is served;
* a model that closes its own thinking under a constraint; a stop string
  and max_tokens inside the thinking; n choices streamed; a prefill; the
  WebSocket's ``infer`` with ``messages`` trimmed to the context;
* streams left mid-thinking on every door: the engine slot is freed.

Four tests here found bugs that are fixed (reasoning.py, tools.py): a regex
with ``\\/`` closed its Lark literal early (a 400 for a valid regex, or, with
``#``, another grammar than the client's), a U+2028 in a schema, choice or
regex split the grammar's lines, a model could not close its own thinking
under a constraint (its marker, text, was taken for more thinking), and a
free answer (or a regex) could open the section where the model may, outside
the budget. One is a limitation, marked xfail: with a budget and markers
that are text, not tokens, the thinking runs to the budget.
"""

from __future__ import annotations

import json
import re
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import jsonschema
import pytest
import trio

from .helpers import raw_client, serving
from .http_helpers import Reply, connect, request

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

TEMPLATE: Final = str(Path(__file__).parent / "templates" / "chatml_thinking.jinja")
CHAT: Final = "/v1/chat/completions"
MESSAGES: Final = "/v1/messages"
COUNT: Final = "/v1/messages/count_tokens"
RESPONSES: Final = "/v1/responses"
#: Every client here comes from loopback: one client, by address.
CLIENT: Final = ("address", "127.0.0.1")
JSON: Final = {"Content-Type": "application/json"}
QUESTION: Final = [{"role": "user", "content": "Name a city in Italy."}]
MAX_ERROR_BYTES: Final = 4096
CITY: Final = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER: Final[dict[str, Any]] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def body(path: str, **fields: Any) -> bytes:
    """A valid request of ``path`` for a short answer, with ``fields`` set."""
    obj: dict[str, Any] = {"model": "m"}
    if path == RESPONSES:
        obj.update(input="Name a city in Italy.", max_output_tokens=16)
    else:
        obj["messages"] = QUESTION
    if path in (CHAT, MESSAGES):
        obj["max_tokens"] = 2
    obj.update(fields)
    return json.dumps(obj).encode()


async def post(port: int, path: str, data: bytes, *, within: float = 60.0) -> Reply:
    async with connect(port) as client:
        await client.send(request("POST", path, JSON, data))
        reply = await client.response("POST", within=within)
    assert reply is not None, "the server closed the connection without an answer"
    return reply


def ok(reply: Reply) -> Any:
    assert reply.status == 200, f"{reply.status} {reply.body[:400]!r}"
    return reply.json()


def refused(reply: Reply, path: str) -> tuple[str, str | None]:
    """Check that ``reply`` is a 4xx in ``path``'s door's shape; its message
    and (OpenAI's doors) its ``param``."""
    shown = f"{reply.status} {reply.body[:300]!r}"
    assert 400 <= reply.status < 500, shown
    assert reply.headers.get("content-type", "").startswith("application/json"), shown
    assert len(reply.body) <= MAX_ERROR_BYTES, f"an error body of {len(reply.body)} bytes"
    doc = reply.json()
    if path in (MESSAGES, COUNT):
        assert doc.get("type") == "error", shown
        assert doc["error"]["type"] == "invalid_request_error", shown
        return doc["error"]["message"], None
    error = doc["error"]
    assert set(error) == {"message", "type", "param", "code"}, shown
    assert error["type"] == "invalid_request_error", shown
    return error["message"], error["param"]


def names(param: str | None, field: str) -> bool:
    """Whether ``param`` is ``field`` or a path inside it."""
    return param is not None and (
        param == field or param.startswith(f"{field}.") or param.startswith(f"{field}[")
    )


def message_of(reply: Reply, index: int = 0) -> dict[str, Any]:
    message: dict[str, Any] = ok(reply)["choices"][index]["message"]
    return message


async def wait_for(predicate: Callable[[], bool], within: float, what: str) -> None:
    with trio.move_on_after(within):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.02)
        return
    raise AssertionError(f"{what}: not within {within} s")


def sse_data(raw: bytes) -> list[dict[str, Any]]:
    """The JSON ``data:`` payloads of a Server-Sent Events body."""
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


# --------------------------------------------------------------------------
# 1. The switches out of type and out of range


def cases(
    path: str, wrap: Callable[[Any], dict[str, Any]], values: tuple[Any, ...], field: str
) -> list[tuple[str, dict[str, Any], str]]:
    return [(path, wrap(value), field) for value in values]


#: (path, fields, the field the refusal names: OpenAI's ``param``, or a
#: word of Anthropic's message).
BAD: Final[list[tuple[str, dict[str, Any], str]]] = [
    *cases(
        CHAT,
        lambda value: {"reasoning_effort": value},
        (5, "", "NONE", "none ", "maximum", ["none"], {"effort": "none"}, True, 0.0),
        "reasoning_effort",
    ),
    *cases(
        CHAT,
        lambda value: {"chat_template_kwargs": value},
        (
            "enable_thinking",
            ["enable_thinking"],
            1,
            True,
            "",
            {"add_generation_prompt": False},
            {"enable_thinking": False, "messages": []},
            {"__class__": 1},
            {"tools": [WEATHER]},
        ),
        "chat_template_kwargs",
    ),
    *cases(
        CHAT,
        lambda value: {"chat_template_kwargs": {"enable_thinking": value}},
        ("false", 0, 1, None, [], {"value": False}),
        "chat_template_kwargs.enable_thinking",
    ),
    (
        CHAT,
        {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
        "chat_template_kwargs",
    ),
    *[
        (path, {"thinking": value}, "thinking")
        for path in (MESSAGES, COUNT)
        for value in (
            "enabled",
            ["enabled"],
            1,
            True,
            {},
            {"type": "ENABLED"},
            {"type": None},
            {"type": ["enabled"]},
            {"type": "enabled"},
            *[
                {"type": "enabled", "budget_tokens": budget}
                for budget in (None, 0, -1, -(10**30), 1.5, True, False, "8", [8])
            ],
            {"type": "enabled", "budget_tokens": 8, "signature": "x"},
        )
    ],
    *cases(
        RESPONSES,
        lambda value: {"reasoning": value},
        (
            "none",
            ["none"],
            1,
            {"effort": "NONE"},
            {"effort": ""},
            {"effort": 0},
            {"effort": True},
            {"effort": ["none"]},
            {"effort": "none", "budget_tokens": 8},
        ),
        "reasoning",
    ),
]


async def test_each_reasoning_switch_out_of_type_or_range_gets_400_naming_it(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine, chat_template=TEMPLATE, reasoning_budget=4) as (
        server,
        listening,
    ):
        port = listening.port
        for path, fields, field in BAD:
            reply = await post(port, path, body(path, **fields), within=15)
            message, param = refused(reply, path)
            if path in (MESSAGES, COUNT):
                assert field in message, (fields, message)
            else:
                assert names(param, field), (fields, param, message)
            assert server.generations.in_flight(CLIENT) == 0
        # The control: each door serves the same request without the bad field.
        for path in (CHAT, MESSAGES, COUNT, RESPONSES):
            assert ok(await post(port, path, body(path)))


async def test_the_odd_values_each_door_takes_are_served(cpu_engine: CpuEngine) -> None:
    """No server budget here: Anthropic's own bounds the thinking."""
    async with serving(cpu_engine, chat_template=TEMPLATE) as (_, listening):
        port = listening.port
        # A budget written as a float with no fraction is a budget (of a few
        # tokens: the thinking's first, a newline, is dropped from it).
        doc = ok(
            await post(
                port,
                MESSAGES,
                body(
                    MESSAGES,
                    max_tokens=40,
                    temperature=0,
                    thinking={"type": "enabled", "budget_tokens": 3.0},
                    output_config={"format": {"type": "json_schema", "schema": CITY}},
                ),
            )
        )
        assert [block["type"] for block in doc["content"]] == ["thinking", "text"], doc
        assert 0 < len(doc["content"][0]["thinking"]) < 40, doc
        assert doc["content"][0]["signature"] == ""
        jsonschema.validate(json.loads(doc["content"][1]["text"]), CITY)
        # A budget past max_tokens: the reply is all thinking, cut by max_tokens.
        doc = ok(
            await post(
                port,
                MESSAGES,
                body(
                    MESSAGES,
                    max_tokens=3,
                    temperature=0,
                    thinking={"type": "enabled", "budget_tokens": 8191},
                ),
            )
        )
        assert [block["type"] for block in doc["content"]] == ["thinking"], doc
        assert doc["stop_reason"] == "max_tokens" and doc["usage"]["output_tokens"] == 3
        # adaptive is the template's default (the section is open). Greedy: a
        # sampled reply may end at once, with no block at all.
        doc = ok(
            await post(port, MESSAGES, body(MESSAGES, temperature=0, thinking={"type": "adaptive"}))
        )
        assert doc["content"][0]["type"] == "thinking", doc
        # An empty chat_template_kwargs changes nothing; both switches agreeing is no conflict.
        fields: dict[str, Any]
        for fields in (
            {"chat_template_kwargs": {}},
            {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": True}},
        ):
            message = message_of(
                await post(port, CHAT, body(CHAT, max_tokens=3, temperature=0, **fields))
            )
            assert message.get("reasoning_content"), (fields, message)
        for fields in (
            {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": False}},
            {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}},
        ):
            message = message_of(
                await post(port, CHAT, body(CHAT, max_tokens=3, temperature=0, **fields))
            )
            assert "reasoning_content" not in message and message["content"], (fields, message)
        # Responses: effort none is an answer alone, minimal thinks.
        doc = ok(
            await post(
                port, RESPONSES, body(RESPONSES, temperature=0, reasoning={"effort": "none"})
            )
        )
        assert [item["type"] for item in doc["output"]] == ["message"], doc
        doc = ok(
            await post(
                port, RESPONSES, body(RESPONSES, temperature=0, reasoning={"effort": "minimal"})
            )
        )
        assert doc["output"][0]["type"] == "reasoning", doc
        # Counting follows the switch: disabled writes an empty section into the prompt.
        counts = {}
        for kind in ("enabled", "disabled"):
            thinking: dict[str, Any] = {"type": kind}
            if kind == "enabled":
                thinking["budget_tokens"] = 8
            counts[kind] = ok(await post(port, COUNT, body(COUNT, thinking=thinking)))
        assert counts["disabled"]["input_tokens"] > counts["enabled"]["input_tokens"], counts


# --------------------------------------------------------------------------
# 2. Constraints crafted to break out of the answer's rule


#: Regexes that mean the same in Rust's syntax and Python's. The first is
#: an everyday pattern (JavaScript escapes its slashes); the others try to
#: close the Lark literal early and write grammar of their own.
REGEXES: Final = [
    r"https?:\/\/[a-z]{2,8}\.com",
    r'(yes|no)\/ | "pwned" #',
    r"(ok|no)\/\/ | x\\",
    'ok\nstart: "pwned"',
    "(ok|no)\u2028",
    "(ok|no)\r\n",
    r"[a-c]{1,3}\\",
]

#: Choices that try to leave their string literal.
CHOICES: Final = ['"] | /(.|\\n)*/ #', 'x\u2028start: "pwned"', "\\", "a\nb", '"', "\u0085"]

#: A schema whose text holds line breaks of every kind (JSON keeps U+2028 as it is).
SCHEMA: Final = {
    "type": "object",
    "description": "a\u2028start: /x/\u2029\u0085end",
    "properties": {"city": {"type": "string", "maxLength": 12, "description": "\u2028"}},
    "required": ["city"],
    "additionalProperties": False,
}


async def test_constraints_crafted_to_break_out_of_the_answers_rule_hold(
    cpu_engine: CpuEngine,
) -> None:
    async with serving(cpu_engine, chat_template=TEMPLATE, reasoning_budget=2) as (_, listening):
        port = listening.port
        asked = {"max_tokens": 24, "temperature": 0}
        for index, pattern in enumerate(REGEXES):
            field = ("guided_regex", "regex_pattern")[index % 2]
            reply = await post(port, CHAT, body(CHAT, **asked, **{field: pattern}))
            message = message_of(reply)
            assert message.get("reasoning_content"), message
            assert re.fullmatch(pattern, message["content"] or ""), (pattern, message)
        message = message_of(await post(port, CHAT, body(CHAT, **asked, guided_choice=CHOICES)))
        assert message.get("reasoning_content") and message["content"] in CHOICES, message
        message = message_of(
            await post(
                port,
                CHAT,
                body(
                    CHAT,
                    **asked,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "city", "schema": SCHEMA},
                    },
                ),
            )
        )
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        # A regex beside tools (the calls, or an answer in the regex) goes
        # through the tools' grammar.
        pattern = r"https?:\/\/[a-z]{2,8}\.com"
        message = message_of(
            await post(
                port,
                CHAT,
                body(
                    CHAT,
                    **{**asked, "max_tokens": 60},
                    tools=[WEATHER],
                    tool_choice="auto",
                    guided_regex=pattern,
                ),
            )
        )
        assert message.get("tool_calls") or re.fullmatch(pattern, message["content"]), message


async def test_a_client_grammar_after_the_thinking_is_a_400_naming_it(
    cpu_engine: CpuEngine,
) -> None:
    grammar = 'start: "yes" | "no"'
    async with serving(cpu_engine, chat_template=TEMPLATE) as (server, listening):
        port = listening.port
        for fields, field in (
            ({"grammar": grammar}, "grammar"),
            ({"guided_grammar": grammar}, "guided_grammar"),
            ({"structured_outputs": {"grammar": grammar}}, "structured_outputs.grammar"),
            ({"guided_grammar": "root ::= [a-z]+"}, "guided_grammar"),
        ):
            message, param = refused(await post(port, CHAT, body(CHAT, **fields)), CHAT)
            assert param == field and "thinking" in message, (fields, param, message)
            # n choices: refused before any is queued.
            refused(await post(port, CHAT, body(CHAT, n=3, **fields)), CHAT)
            assert server.generations.in_flight(CLIENT) == 0
        # Thinking off: the grammar is the answer's.
        for off in (
            {"reasoning_effort": "none"},
            {"chat_template_kwargs": {"enable_thinking": False}},
        ):
            message_ = message_of(await post(port, CHAT, body(CHAT, grammar=grammar, **off)))
            assert message_["content"] in ("yes", "no"), message_
        async with raw_client(listening.url) as ws:
            infer = {"action": "infer", "messages": QUESTION, "max_new_tokens": 4}
            await ws.send({**infer, "request_id": "g", "grammar": grammar})
            frame = (await ws.recv_until_final("g"))[-1]
            assert frame["response_type"] == "error", frame
            assert "grammar" in json.dumps(frame) and "thinking" in json.dumps(frame), frame
            # The connection goes on: a choice is held after the thinking.
            await ws.send(
                {**infer, "request_id": "c", "choice": ["yes", "no"], "max_new_tokens": 40}
            )
            frame = (await ws.recv_until_final("c"))[-1]
            assert frame["response_type"] == "full", frame


# --------------------------------------------------------------------------
# 3. The thinking's end, however it comes

#: A prompt and a bias after which the model writes a few words of thought,
#: then ``</think>`` itself (greedy decoding; its tokens are ``</``, ``think``,
#: ``>``): without a constraint it closes the section and answers.
SELF_CLOSE: Final = {
    "messages": [
        {
            "role": "system",
            "content": "Think briefly, then write </think> and the answer. Example: the user"
            " asks for a colour. Red is a colour.</think>Red",
        },
        {"role": "user", "content": "Name a city."},
    ],
    "logit_bias": {"9617": 2, "22577": 2},
    "temperature": 0,
    "max_tokens": 60,
    "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
}


async def test_the_model_closes_its_own_thinking_under_a_constraint(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine, chat_template=TEMPLATE) as (_, listening):
        doc = ok(
            await post(listening.port, CHAT, json.dumps({"model": "m", **SELF_CLOSE}).encode())
        )
        message = doc["choices"][0]["message"]
        assert doc["choices"][0]["finish_reason"] == "stop", doc
        assert message.get("reasoning_content") and "</think" not in message["reasoning_content"]
        jsonschema.validate(json.loads(message["content"]), CITY)


@pytest.mark.xfail(
    strict=True,
    reason="with a budget and markers that are text, not single tokens, the thinking is one"
    " greedy llguidance lexeme (the only kind max_tokens bounds): the end marker's first"
    " characters are taken for more thinking, so the model cannot close the section before"
    " the budget closes it (reasoning.py thinking_grammar)",
)
async def test_the_model_closes_its_own_thinking_before_the_budget(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine, chat_template=TEMPLATE, reasoning_budget=40) as (_, listening):
        doc = ok(
            await post(listening.port, CHAT, json.dumps({"model": "m", **SELF_CLOSE}).encode())
        )
        message = doc["choices"][0]["message"]
        jsonschema.validate(json.loads(message["content"]), CITY)
        assert "</think" not in message["reasoning_content"], message


#: A ChatML template whose generation prompt leaves the section to the
#: model (Qwen3's manner): it thinks when its first words are ``<think>``.
MODEL_OPENS: Final = """{#- The model may open <think> itself. -#}
{%- for message in messages %}
{%- set content = message.content or "" %}
{%- if "</think>" in content %}{%- set content = content.split("</think>")[-1] %}{%- endif %}
{{- "<|im_start|>" + message.role + "\\n" + content + "<|im_end|>\\n" }}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|im_start|>assistant\\n" }}{%- endif %}
"""


async def test_where_the_model_opens_the_section_its_answer_cannot_outrun_the_budget(
    cpu_engine: CpuEngine, tmp_path: Path
) -> None:
    """A model biased to write ``<think>`` (its tokens ``<``, ``think``,
    ``>``) as its first words, under a regex whose answer may itself start
    with the marker: what follows the marker is thinking, and the budget (2
    tokens) holds it; the answer matches the regex."""
    template = tmp_path / "opens.jinja"
    template.write_text(MODEL_OPENS, encoding="utf-8")
    bias = {"44": 20, "17400": 20, "46": 20}
    async with serving(cpu_engine, chat_template=str(template), reasoning_budget=2) as (
        _,
        listening,
    ):
        port = listening.port
        pattern = "(<think>[a-z<> ]{30,60}|ok)"
        data = body(CHAT, max_tokens=24, temperature=0, logit_bias=bias, guided_regex=pattern)
        message = message_of(await post(port, CHAT, data))
        # Two tokens of thought at most (each here a few characters).
        assert len(message.get("reasoning_content") or "") <= 12, message
        assert re.fullmatch(pattern, message["content"] or ""), message


async def test_a_stop_string_and_max_tokens_inside_the_thinking(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine, chat_template=TEMPLATE) as (_, listening):
        port = listening.port
        fields = {"max_tokens": 30, "temperature": 0, "stop": [" is", "\n"]}
        whole = ok(await post(port, CHAT, body(CHAT, **fields)))
        choice = whole["choices"][0]
        thought = choice["message"].get("reasoning_content", "")
        assert choice["finish_reason"] == "stop", whole
        assert not choice["message"]["content"], whole
        assert " is" not in thought and "<think>" not in thought, whole
        # Streamed: the same split.
        raw = await post(port, CHAT, body(CHAT, stream=True, **fields))
        deltas = [c["choices"][0]["delta"] for c in sse_data(raw.body) if c["choices"]]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == thought
        assert not "".join(d.get("content") or "" for d in deltas)
        # max_tokens inside the thinking: each door's reply is the thinking alone, cut.
        doc = ok(await post(port, MESSAGES, body(MESSAGES, max_tokens=3, temperature=0)))
        assert [b["type"] for b in doc["content"]] == ["thinking"], doc
        assert doc["stop_reason"] == "max_tokens"
        doc = ok(await post(port, RESPONSES, body(RESPONSES, max_output_tokens=6, temperature=0)))
        assert doc["status"] == "incomplete", doc
        assert [item["type"] for item in doc["output"]] == ["reasoning"], doc
        assert doc["output_text"] == ""
        # Streamed, the Responses API's events end the reasoning item and the response.
        raw = await post(
            port, RESPONSES, body(RESPONSES, max_output_tokens=6, temperature=0, stream=True)
        )
        kinds = [event["type"] for event in sse_data(raw.body)]
        assert (
            "response.reasoning_text.delta" in kinds and "response.output_text.delta" not in kinds
        )
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.incomplete")


async def test_n_choices_streamed_each_think_first(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine, chat_template=TEMPLATE, reasoning_budget=3) as (_, listening):
        raw = await post(
            listening.port,
            CHAT,
            body(
                CHAT,
                n=3,
                seed=7,
                temperature=1.0,
                max_tokens=16,
                stream=True,
                guided_choice=["Rome", "Milan"],
            ),
        )
        order: dict[int, str] = {}
        content: dict[int, str] = {}
        for chunk in sse_data(raw.body):
            for choice in chunk["choices"]:
                delta, index = choice["delta"], choice["index"]
                if delta.get("reasoning_content"):
                    order[index] = order.get(index, "") + "r"
                if delta.get("content"):
                    order[index] = order.get(index, "") + "c"
                    content[index] = content.get(index, "") + delta["content"]
        assert sorted(order) == [0, 1, 2], order
        for index, kinds in order.items():
            assert kinds.startswith("r") and "r" not in kinds.lstrip("r"), (index, kinds)
            assert content.get(index) in ("Rome", "Milan"), content


async def test_a_prefill_with_a_thinking_template_continues_the_answer(
    cpu_engine: CpuEngine,
) -> None:
    """A final assistant turn is continued as the answer: no thinking block,
    and no budget or grammar is set after a section it may be inside."""
    async with serving(cpu_engine, chat_template=TEMPLATE, reasoning_budget=2) as (_, listening):
        port = listening.port
        prefilled = [*QUESTION, {"role": "assistant", "content": "The city is"}]
        for thinking in (None, {"type": "enabled", "budget_tokens": 1}, {"type": "disabled"}):
            fields: dict[str, Any] = {"messages": prefilled, "max_tokens": 6, "temperature": 0}
            if thinking is not None:
                fields["thinking"] = thinking
            doc = ok(await post(port, MESSAGES, body(MESSAGES, **fields)))
            assert [b["type"] for b in doc["content"]] in (["text"], []), doc
            raw = await post(port, MESSAGES, body(MESSAGES, stream=True, **fields))
            events = sse_data(raw.body)
            starts = [
                e["content_block"]["type"] for e in events if e["type"] == "content_block_start"
            ]
            assert starts in (["text"], []) and events[-1]["type"] == "message_stop", events
            text = "".join(
                e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta"
            )
            assert text == "".join(b["text"] for b in doc["content"])


async def test_the_websockets_messages_trimmed_to_the_context_still_think(
    cpu_engine: CpuEngine,
) -> None:
    """A long chat with room asked for nearly the whole context: its head is
    trimmed, its generation prompt (which opens the section) is kept."""
    async with (
        serving(cpu_engine, chat_template=TEMPLATE, reasoning_budget=2) as (_, listening),
        raw_client(listening.url) as ws,
    ):
        await ws.send(
            {
                "action": "infer",
                "request_id": "t",
                "messages": [{"role": "user", "content": "The tide comes in. " * 400}],
                "max_new_tokens": 8100,
                "temperature": 0,
                "choice": ["yes", "no"],
                "stream": True,
            }
        )
        frames = await ws.recv_until_final("t", within=120)
        final = frames[-1]
        assert final["response_type"] == "full", final
        assert final["usage"]["trimmed_tokens"] > 0 and final["reasoning"], final
        assert final["response"] in ("yes", "no"), final
        assert "".join(f.get("chunk", "") for f in frames[:-1]) == final["response"]


async def test_a_stop_mid_thinking_keeps_the_text_held_for_a_marker(
    cpu_engine: CpuEngine,
) -> None:
    """A thought of ``<`` only (biased): each may begin ``</think>``, so the
    split holds the last one back. A ``stop`` interrupts it: the final
    frame's reasoning is every token released, the held ``<`` with them."""
    async with (
        serving(cpu_engine, chat_template=TEMPLATE) as (server, listening),
        raw_client(listening.url) as ws,
    ):
        await ws.send(
            {
                "action": "infer",
                "request_id": "s",
                "messages": QUESTION,
                "max_new_tokens": 1500,
                "min_tokens": 1500,
                "logit_bias": {"44": 100},
                "stream": True,
            }
        )
        await wait_for(lambda: server.generations.in_flight(CLIENT) == 1, 30, "no job")
        await trio.sleep(0.5)  # a few tokens of thought
        await ws.send({"action": "stop", "target": "s"})
        frames = await ws.recv_until_final("s")
        final = frames[-1]
        assert final["response_type"] == "full" and final["stop_reason"] == "interrupted", final
        assert final["reasoning"] == "<" * final["usage"]["generated_tokens"], final
        assert final["response"] == ""


# --------------------------------------------------------------------------
# 4. Streams left mid-thinking

#: Each door's stream, long (no stop before 1500 tokens), and the bytes of
#: its first reasoning event.
STREAMS: Final = {
    CHAT: ({"max_tokens": 1500, "min_tokens": 1500}, b"reasoning_content"),
    MESSAGES: ({"max_tokens": 1500, "min_tokens": 1500}, b"thinking_delta"),
    RESPONSES: ({"max_output_tokens": 1500, "min_tokens": 1500}, b"response.reasoning_text.delta"),
}


def reset(stream: trio.SocketStream) -> None:
    """Close with a TCP reset instead of a FIN (SO_LINGER 0)."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.parametrize("how", ["reset", "half_close"])
async def test_a_stream_left_mid_thinking_frees_its_slot(cpu_engine: CpuEngine, how: str) -> None:
    async with serving(cpu_engine, chat_template=TEMPLATE) as (server, listening):
        port = listening.port
        for path, (fields, marker) in STREAMS.items():
            data = body(path, stream=True, temperature=0, **fields)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(request("POST", path, JSON, data))
            seen = b""
            with trio.fail_after(60):
                while marker not in seen:
                    chunk = await stream.receive_some(65536)
                    assert chunk, f"{path}: the stream ended early: {seen[-300:]!r}"
                    seen += chunk
            assert seen.startswith(b"HTTP/1.1 200"), seen[:300]
            assert server.generations.in_flight(CLIENT) == 1, path
            if how == "reset":
                reset(stream)
            else:
                await stream.send_eof()
                with trio.fail_after(30):
                    while await stream.receive_some(65536):
                        pass
            await stream.aclose()
            await wait_for(lambda: server.generations.in_flight(CLIENT) == 0, 30, path)
        # The server goes on serving.
        reply = await post(port, CHAT, body(CHAT, temperature=0))
        assert ok(reply)["usage"]["completion_tokens"] == 2
