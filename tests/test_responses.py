"""OpenAI's Responses API, sans-IO (trioserve/responses/): bodies read into
requests, every bad field a 400 naming it, the conversation continued from
a stored one, the reply made from a generation's state with no socket, no
trio and no model, and the bounded store. The property that carries the
reply: however the text is cut into released pieces, the stream says what
the whole response says (the same items, status and usage), in OpenAI's
event order."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve import responses as rs
from trioserve.openai import OpenAIError
from trioserve.vocabulary.results import FailureCause, Finished, FinishReason
from trioserve.vocabulary.tools import HERMES, ToolCall, ToolFormat

pytestmark = pytest.mark.unit

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


def parse(history: rs.Turns = (), **fields: Any) -> rs.ResponsesRequest:
    obj = {"model": "gpt-x", "input": "hi", **fields}
    body = rs.parse_responses_body(json.dumps(obj).encode())
    return rs.parse_responses_request(body, history)


def refused(**fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse(**fields)
    assert caught.value.status == 400
    error = json.loads(caught.value.body())["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    return caught.value


# --------------------------------------------------------------------------
# Requests


def test_a_string_input_is_one_user_turn_under_the_instructions() -> None:
    request = parse(input="What is 2+2?", instructions="Be brief.")
    assert request.turns == ({"role": "user", "content": "What is 2+2?"},)
    assert request.template_messages() == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    )
    assert request.store is True and request.stream is False
    assert request.max_output_tokens is None and request.tools is None


def test_items_are_read_as_the_template_reads_them() -> None:
    """Codex CLI's shape: developer turns, two user turns in a row, then a
    call and its output; the assistant's text and its call are one turn."""
    request = parse(
        instructions="Be brief.",
        input=[
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "A"}],
            },
            {"type": "message", "id": "msg_1", "role": "developer", "content": "B"},
            {"role": "user", "content": [{"type": "input_text", "text": "ctx"}]},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        tools=[WEATHER],
    )
    assert request.template_messages() == (
        {"role": "system", "content": "Be brief.\n\nA\n\nB"},
        {"role": "user", "content": "ctx\n\nWeather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),),
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
    )


def test_a_previous_conversation_comes_first_and_its_calls_can_be_answered() -> None:
    history = (
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": (ToolCall("call_9", "get_weather", "{}"),),
        },
    )
    request = parse(
        history,
        instructions="New rules.",
        input=[{"type": "function_call_output", "call_id": "call_9", "output": "rain"}],
    )
    assert request.turns == (
        *history,
        {"role": "tool", "content": "rain", "tool_call_id": "call_9", "name": "get_weather"},
    )
    # The previous response's instructions are not carried over: only this one's.
    assert request.template_messages()[0] == {"role": "system", "content": "New rules."}


def test_media_is_a_placeholder_in_earlier_items_and_refused_in_the_last() -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    request = parse(
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "look"}, image]},
            {"role": "user", "content": "and now?"},
        ]
    )
    assert (
        request.turns[0]["content"]
        == "look\n[image omitted: this model reads text only]\n\nand now?"
    )
    error = refused(input=[{"role": "user", "content": [image]}])
    assert error.param == "input[0].content[0].type" and error.code == "unsupported_parameter"


def test_function_tools_are_strict_unless_they_say_otherwise_and_others_are_skipped() -> None:
    loose = {**WEATHER, "name": "loose", "strict": False}
    unsaid = {k: v for k, v in WEATHER.items() if k != "strict"} | {"name": "unsaid"}
    request = parse(
        tools=[
            WEATHER,
            loose,
            unsaid,
            {"type": "web_search"},
            {"type": "namespace", "name": "agents", "tools": []},
        ]
    )
    assert request.tools is not None
    assert [(t.name, t.strict) for t in request.tools.tools] == [
        ("get_weather", True),
        ("loose", False),
        ("unsaid", True),
    ]
    assert request.skipped_tools == ("web_search", "agents")
    assert request.tools.choice == "auto" and request.tools.parallel


@pytest.mark.parametrize(
    ("choice", "mode", "named", "names"),
    [
        ("none", "none", None, ["get_weather", "other"]),
        ("required", "required", None, ["get_weather", "other"]),
        ({"type": "function", "name": "other"}, "required", "other", ["get_weather", "other"]),
        (
            {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "other"}],
            },
            "required",
            None,
            ["other"],
        ),
    ],
)
def test_tool_choice(choice: Any, mode: str, named: str | None, names: list[str]) -> None:
    other = {**WEATHER, "name": "other"}
    request = parse(tools=[WEATHER, other], tool_choice=choice, parallel_tool_calls=False)
    assert request.tools is not None
    assert (request.tools.choice, request.tools.named, request.tools.parallel) == (
        mode,
        named,
        False,
    )
    assert [t.name for t in request.tools.tools] == names
    assert request.tool_choice == choice


def test_text_formats_are_constraints() -> None:
    assert parse(text={"format": {"type": "text"}}).constraint is None
    json_object = parse(text={"format": {"type": "json_object"}}).constraint
    assert json_object is not None and json.loads(json_object.text) == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    request = parse(
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}}
    )
    assert request.constraint is not None and json.loads(request.constraint.text) == schema
    assert request.text["format"]["name"] == "thing"


def test_sampler_settings_and_bounds() -> None:
    request = parse(temperature=0.2, top_p=0.5, top_k=40, max_output_tokens=7)
    settings_ = request.sampling_settings()
    assert (settings_.temperature, settings_.top_p, settings_.top_k) == (0.2, 0.5, 40)
    assert request.max_output_tokens == 7
    # OpenAI's defaults, not the WebSocket protocol's.
    plain = parse().sampling_settings()
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)


def test_what_codex_cli_sends_is_accepted() -> None:
    parse(
        stream=True,
        store=False,
        tool_choice="auto",
        parallel_tool_calls=True,
        reasoning={"summary": "auto"},
        include=["reasoning.encrypted_content"],
        prompt_cache_key="01a2",
        client_metadata={"thread_id": "x"},
        tools=[{"type": "web_search", "external_web_access": False}],
        max_output_tokens=1,
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": 3}, "model"),
        ({"model": ""}, "model"),
        ({"input": None}, "input"),
        ({"input": 7}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_video"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
            "input[0].call_id",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input[0].type"),
        ({"input": [{"type": "teleport"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input[0].extra"),
        ({"input": [{"role": "system", "content": "only a system turn"}]}, "input"),
        ({"instructions": 5}, "instructions"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": -3}, "max_output_tokens"),
        ({"max_output_tokens": 1.5}, "max_output_tokens"),
        ({"max_output_tokens": True}, "max_output_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"store": 1}, "store"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": "high"}, "top_p"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"tools": {}}, "tools"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
        ({"tools": [{"type": "teleporter"}]}, "tools[0].type"),
        ({"tools": [{**WEATHER, "strict": "yes"}]}, "tools[0].strict"),
        ({"tools": [{**WEATHER, "parameters": "x"}]}, "tools[0].parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}},
            "tool_choice.name",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
        ({"tools": [WEATHER], "tool_choice": 3}, "tool_choice"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"include": ["everything"]}, "include[0]"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"previous_response_id": 9}, "previous_response_id"),
        ({"frobnicate": True}, "frobnicate"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    assert refused(**fields).param == param


def test_a_body_that_is_not_a_json_object_is_a_400() -> None:
    for raw in (b"\xff", b"[1]", b"{", b'{"model": "\\ud800"}'):
        with pytest.raises(OpenAIError) as caught:
            rs.parse_responses_body(raw)
        assert caught.value.status == 400


# --------------------------------------------------------------------------
# The reply


@attrs.define
class State:
    """A generation as the server would show it, moved by hand."""

    response: str = ""
    reasoning: str = ""
    outcome: str | None = None
    finished: Finished | None = None
    failure: str | None = None
    failure_cause: FailureCause = "engine"
    tool_format: ToolFormat | None = None
    prompt_tokens: int = 30
    generated_tokens: int = 0
    cached_tokens: int = 12

    def release(self, text: str) -> None:
        self.response += text
        self.generated_tokens += 1

    def finish(self, reason: FinishReason = "stop_token") -> None:
        self.outcome = "finished"
        self.finished = Finished(
            job_id=1,
            text="",
            reason=reason,
            stop_string=None,
            stop_token=0 if reason == "stop_token" else None,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
        )


def events(data: bytes) -> Iterator[dict[str, Any]]:
    for number, chunk in enumerate(c for c in data.decode().split("\n\n") if c):
        name, payload = chunk.split("\n")
        assert name.startswith("event: ") and payload.startswith("data: ")
        event = json.loads(payload[6:])
        assert event["type"] == name[7:] and event["sequence_number"] == number
        yield event


def replay(data: bytes) -> dict[str, Any]:
    """The response a client builds from the events, checking their order."""
    seen = list(events(data))
    assert [e["type"] for e in seen[:2]] == ["response.created", "response.in_progress"]
    assert seen[0]["response"]["status"] == "in_progress" and seen[0]["response"]["output"] == []
    final = seen[-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    output: list[dict[str, Any]] = []
    item: dict[str, Any] | None = None
    for event in seen[2:-1]:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert item is None and event["output_index"] == len(output)
            item = dict(event["item"])
            assert item["status"] == "in_progress"
            if item["type"] == "function_call":
                assert item["arguments"] == ""
        elif kind == "response.content_part.added":
            assert item is not None and item["type"] == "message" and item["content"] == []
            item["content"] = [dict(event["part"])]
        elif kind == "response.output_text.delta":
            assert item is not None and event["item_id"] == item["id"] and event["delta"]
            item["content"][0]["text"] += event["delta"]
        elif kind == "response.output_text.done":
            assert item is not None and event["text"] == item["content"][0]["text"]
        elif kind == "response.content_part.done":
            assert item is not None and event["part"] == item["content"][0]
        elif kind == "response.function_call_arguments.delta":
            assert item is not None and item["type"] == "function_call"
            item["arguments"] += event["delta"]
        elif kind == "response.function_call_arguments.done":
            assert item is not None and json.loads(event["arguments"]) == json.loads(
                item["arguments"]
            )
            item["arguments"] = event["arguments"]
        else:
            assert kind == "response.output_item.done", kind
            assert item is not None and event["item"]["id"] == item["id"]
            assert event["item"] == {**item, "status": event["item"]["status"]}
            output.append(event["item"])
            item = None
    assert item is None
    response: dict[str, Any] = final["response"]
    assert response["output"] == output
    return response


def streamed(
    reply: rs.ResponseReply, state: State, pieces: list[str], reason: FinishReason = "stop_token"
) -> bytes:
    out = reply.opening()
    for piece in pieces:
        state.release(piece)
        out += reply.advance()
    state.finish(reason)
    out += reply.advance()
    assert reply.complete and not reply.broken
    return out + reply.end()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _without_ids(response: dict[str, Any]) -> dict[str, Any]:
    out = dict(response)
    out["output"] = [
        {k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]
    ]
    return out


@settings(max_examples=150)
@given(
    st.sampled_from(
        [
            ("Hello there, how are you?", None),
            ("Let me check. " + CALL, HERMES),
            (CALL + "\n" + CALL.replace("Paris", "Rome"), HERMES),
            ("Just text, no call: <tool", HERMES),
        ]
    ),
    st.data(),
)
def test_the_stream_says_what_the_whole_response_says(
    case: tuple[str, ToolFormat | None], data: st.DataObject
) -> None:
    text, fmt = case
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    request = parse(tools=[WEATHER])
    whole_state = State(tool_format=fmt)
    for piece in pieces:
        whole_state.release(piece)
    whole_state.finish()
    whole = json.loads(
        rs.ResponseReply(request, "m", whole_state, id="resp_1", created_at=5).body()
    )
    state = State(tool_format=fmt)
    response = replay(
        streamed(rs.ResponseReply(request, "m", state, id="resp_1", created_at=5), state, pieces)
    )
    assert _without_ids(response) == _without_ids(whole)
    kinds = [item["type"] for item in whole["output"]]
    if fmt is None or "<tool_call>" not in text:
        assert kinds == ["message"] and whole["output_text"] == text
    else:
        calls = [item for item in whole["output"] if item["type"] == "function_call"]
        assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {
            "city": "Paris"
        }
        assert calls[0]["call_id"].startswith("call_") and calls[0]["id"].startswith("fc_")
    assert whole["status"] == "completed" and whole["incomplete_details"] is None
    assert whole["usage"] == {
        "input_tokens": 30,
        "input_tokens_details": {"cached_tokens": 12},
        "output_tokens": len(pieces),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 30 + len(pieces),
    }
    assert whole["id"] == "resp_1" and whole["object"] == "response" and whole["model"] == "m"
    assert whole["tools"][0]["name"] == "get_weather"


def test_a_reply_cut_short_is_incomplete() -> None:
    state = State()
    state.release("abc")
    state.finish("max_new_tokens")
    request = parse(max_output_tokens=1)
    whole = json.loads(rs.ResponseReply(request, "m", state).body())
    assert whole["status"] == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][0]["status"] == "incomplete" and whole["max_output_tokens"] == 1
    stream_state = State()
    response = replay(
        streamed(
            rs.ResponseReply(request, "m", stream_state), stream_state, ["abc"], "max_new_tokens"
        )
    )
    assert response["status"] == "incomplete" and response["output_text"] == "abc"


@pytest.mark.parametrize(
    ("cause", "draining", "status", "outcome"),
    [
        ("request", False, 400, "invalid_request"),
        ("engine", False, 500, "internal"),
        ("engine", True, 503, "interrupted"),
    ],
)
def test_a_failed_generation_ends_the_stream_with_response_failed(
    cause: FailureCause, draining: bool, status: int, outcome: str
) -> None:
    state = State(failure_cause=cause)
    reply = rs.ResponseReply(parse(), "m", state)
    out = reply.opening()
    state.release("par")
    out += reply.advance()
    state.outcome, state.failure = "failed", "it broke"
    out += reply.advance()
    assert reply.broken and not reply.complete
    counted, error = reply.failure(draining=draining)
    assert (counted, error.status) == (outcome, status)
    out += reply.error(error)
    last = list(events(out))[-1]
    assert last["type"] == "response.failed"
    assert last["response"]["status"] == "failed" and last["response"]["error"]["message"]


def test_the_history_a_response_leaves_is_its_turns_and_its_turn() -> None:
    state = State(tool_format=HERMES)
    state.release("Checking. " + CALL)
    state.finish()
    request = parse(input="Weather in Paris?", tools=[WEATHER])
    reply = rs.ResponseReply(request, "m", state)
    body = json.loads(reply.body())
    (call,) = [item for item in body["output"] if item["type"] == "function_call"]
    history = reply.history()
    assert history[:-1] == request.turns
    assert history[-1] == {
        "role": "assistant",
        "content": "Checking. ",
        "tool_calls": (ToolCall(call["call_id"], "get_weather", call["arguments"]),),
    }
    # The next request answers the call by its id.
    follow = parse(
        history,
        input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}],
    )
    assert follow.turns[-1]["tool_call_id"] == call["call_id"]


# --------------------------------------------------------------------------
# The store


@attrs.define
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


TURNS: rs.Turns = ({"role": "user", "content": "x" * 1000},)


def test_the_store_is_seen_only_by_its_owner_and_deletes() -> None:
    store = rs.ResponseStore(max_bytes=1 << 20)
    assert store.put("resp_a", "alice", b"{}", TURNS)
    assert store.get("resp_a", "bob") is None
    assert not store.delete("resp_a", "bob")
    found = store.get("resp_a", "alice")
    assert found is not None and found.turns == TURNS
    assert store.delete("resp_a", "alice") and store.get("resp_a", "alice") is None
    assert len(store) == 0 and store.nbytes == 0


def test_the_store_forgets_what_is_not_used_within_its_ttl() -> None:
    clock = Clock()
    store = rs.ResponseStore(max_bytes=1 << 20, ttl_s=10, clock=clock)
    store.put("old", "a", b"{}", TURNS)
    store.put("used", "a", b"{}", TURNS)
    clock.now = 8
    assert store.get("used", "a") is not None  # a use: kept 10 s more
    clock.now = 12
    assert store.get("old", "a") is None
    assert store.get("used", "a") is not None
    store.put("new", "a", b"{}", TURNS)  # a put sweeps what expired
    clock.now = 30
    store.put("newer", "a", b"{}", TURNS)
    assert len(store) == 1


def test_a_flood_evicts_the_flooders_own_responses_first() -> None:
    store = rs.ResponseStore(max_bytes=40_000)
    store.put("quiet", "quiet", b"{}", TURNS)
    for i in range(200):
        store.put(f"flood{i}", "flood", b"{}", TURNS)
        assert store.nbytes <= 40_000
    assert store.get("quiet", "quiet") is not None
    assert store.get("flood199", "flood") is not None and store.get("flood0", "flood") is None
    assert store.evicted > 150


def test_a_response_larger_than_the_store_is_not_stored() -> None:
    store = rs.ResponseStore(max_bytes=2000)
    assert not store.put("big", "a", b"{}", TURNS * 3)
    assert len(store) == 0
    off = rs.ResponseStore(max_bytes=0)
    assert not off.put("any", "a", b"{}", ())


def test_the_store_keeps_at_most_its_entries() -> None:
    store = rs.ResponseStore(max_bytes=1 << 30, max_entries=5)
    for i in range(20):
        store.put(f"r{i}", "a", b"{}", ())
    assert len(store) == 5 and store.get("r19", "a") is not None and store.get("r14", "a") is None


# --------------------------------------------------------------------------
# The documentation's table


def test_the_docs_table_lists_every_field_as_the_parser_takes_it() -> None:
    from pathlib import Path

    from trioserve.responses import requests

    doc = (Path(__file__).resolve().parents[1] / "docs" / "responses.md").read_text("utf-8")
    table = doc[doc.index("## The request") : doc.index("Any other field is a 400")]
    rows: dict[str, str] = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            names, kind = (cell.strip() for cell in line.strip("|").split("|")[:2])
            for name in names.split(", "):
                rows[name.strip("`")] = kind
    for name in requests._FIELDS:
        kinds = {kind for row, kind in rows.items() if row.split(".")[0] == name}
        assert kinds & {"required", ""}, name
    for name in requests._IGNORED:
        assert rows.get(name) == "ignored", name
    for name in requests._REFUSED:
        assert rows.get(name) == "refused", name
    # And the parser agrees: ignored fields pass, refused ones are 400s.
    for name in requests._IGNORED:
        parse((), **{name: "anything"})
    for name in requests._REFUSED:
        assert refused(**{name: "x"}).param == name
