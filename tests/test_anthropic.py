"""Anthropic's Messages API, sans-IO (trioserve/anthropic/): bodies read into
requests, every bad field a 400 naming it, and the reply made from a
generation's state with no socket, no trio and no model. The property that
carries the reply: however the text is cut into released pieces, the stream
says what the whole message says (the same blocks, stop reason and usage),
in Anthropic's event order."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve import anthropic as an
from trioserve.vocabulary.results import FailureCause, Finished, FinishReason
from trioserve.vocabulary.tools import HERMES, ToolCall, ToolFormat

pytestmark = pytest.mark.unit

USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "claude-x", "max_tokens": 16, "messages": USER, **fields}).encode()


def parse(**fields: Any) -> an.MessagesRequest:
    return an.parse_messages_request(body(**fields))


def refused(raw: bytes) -> an.AnthropicError:
    with pytest.raises(an.AnthropicError) as caught:
        an.parse_messages_request(raw)
    assert caught.value.status == 400
    error = json.loads(caught.value.body())
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    return caught.value


# --------------------------------------------------------------------------
# Requests


def test_a_conversation_is_read_as_the_template_reads_it() -> None:
    request = parse(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=f00d;"},
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": "rain",
                        "is_error": True,
                    },
                    {"type": "text", "text": "and now?"},
                ],
            },
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "assistant", "content": "The answer is"},
        ],
        tools=[WEATHER, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        stop_sequences=["\n\nHuman:"],
        temperature=0.5,
        top_k=40,
        metadata={"user_id": "u"},
        thinking={"type": "enabled", "budget_tokens": 2048},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "low"},
        stream=True,
    )
    # The billing line is gone; the blocks are joined.
    assert request.messages[0] == {"role": "system", "content": "You are terse."}
    assert request.messages[1] == {"role": "user", "content": "a\nb"}
    assistant = request.messages[2]
    assert assistant["content"] == "Let me look."
    assert assistant["tool_calls"] == (ToolCall("toolu_1", "get_weather", '{"city": "Oslo"}'),)
    assert request.messages[3] == {
        "role": "tool",
        "content": "Error: rain",
        "tool_call_id": "toolu_1",
        "name": "get_weather",
    }
    assert request.messages[4] == {"role": "user", "content": "and now?"}
    assert request.messages[5] == {"role": "system", "content": "Be brief."}
    assert len(request.messages) == 6
    assert request.prefix == "The answer is"
    assert request.tools is not None and [t.name for t in request.tools.tools] == ["get_weather"]
    assert (request.tools.choice, request.tools.parallel) == ("auto", False)
    assert request.skipped_tools == ("web_search",)
    assert request.stop_sequences == ("\n\nHuman:",)
    settings_ = request.sampling_settings()
    assert (settings_.temperature, settings_.top_k, settings_.top_p) == (0.5, 40, 1.0)
    assert request.stream and request.max_tokens == 16


def test_tool_choice_and_output_format() -> None:
    named = parse(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert named.tools is not None
    assert (named.tools.choice, named.tools.named) == ("required", "get_weather")
    assert parse(tools=[WEATHER], tool_choice={"type": "none"}).tools.choice == "none"  # type: ignore[union-attr]
    assert parse(tools=[WEATHER]).tools.choice == "auto"  # type: ignore[union-attr]
    assert parse(tool_choice={"type": "auto"}).tools is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for fields in (
        {"output_config": {"format": {"type": "json_schema", "schema": schema}}},
        {"output_format": {"type": "json_schema", "schema": schema}},
    ):
        constraint = parse(**fields).constraint
        assert constraint is not None and constraint.kind == "json_schema"


def test_count_tokens_takes_no_max_tokens() -> None:
    request = an.parse_count_request(json.dumps({"model": "m", "messages": USER}).encode())
    assert request.max_tokens is None
    with pytest.raises(an.AnthropicError, match="stream"):
        an.parse_count_request(
            json.dumps({"model": "m", "messages": USER, "stream": True}).encode()
        )


BAD: list[tuple[Any, str]] = [
    (b"\xff", "utf-8"),
    (b"[1]", "json object"),
    (b'{"model": ', "not valid json"),
    (b"[" * 10_000 + b"]" * 10_000, "not valid json"),
    ({"max_tokens": 4, "messages": USER}, "model"),
    ({"model": "m", "messages": USER}, "max_tokens: is required"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "system", "content": "x"}]}, "holds no user turn"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "holds no user turn"),
    (
        {"messages": [*USER, {"role": "system", "content": [{"type": "image"}]}]},
        "messages[1].content[0].type",
    ),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": "x", "name": "n"}]},
        "messages[0]: unknown field 'name'",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages[0].content[0].type: image blocks are not supported",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
        "document blocks",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content[0].text",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "wat"}]}]}, "unknown content block type"),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
        "answers no tool_use",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "a", "name": "f", "input": []}],
                },
                {"role": "user", "content": "x"},
            ]
        },
        "messages[0].content[0].input",
    ),
    ({"messages": [{"role": "user", "content": [{}] * 5000}]}, "at most 1024 blocks"),
    ({"system": 5}, "system"),
    ({"system": [{"type": "image"}]}, "system[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema: is required"),
    ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools[0].name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"tools": [{**WEATHER, "input_schema": "{}"}]}, "tools[0].input_schema"),
    ({"tools": [WEATHER] * 200}, "at most 128 tools"),
    ({"tools": [{**WEATHER, "wat": 1}]}, "tools[0]: unknown field 'wat'"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "required"}}, "tool_choice.type"),
    ({"temperature": 1.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 2}, "top_p"),
    ({"stop_sequences": ["x"] * 10_000}, "stop_sequences"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"stream": "yes"}, "stream"),
    ({"output_config": {"format": {"type": "regex", "schema": {}}}}, "output_config.format.type"),
    ({"output_config": {"effort": "maximal"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    (
        {
            "output_config": {"format": {"type": "json_schema", "schema": {}}},
            "output_format": {"type": "json_schema", "schema": {}},
        },
        "not both",
    ),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "on"}}, "thinking.type"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content: must not be empty"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content: must not be empty"),
    (
        {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}],
                },
            ]
        },
        "needs a user turn with their tool_result",
    ),
    ({"messages": [*USER, {"role": "assistant", "content": "The answer is "}]}, "whitespace"),
    (
        {
            "messages": [*USER, {"role": "assistant", "content": "{"}],
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
        },
        "cannot be continued under an output format",
    ),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens: must be at most max_tokens (4)"),
    ({"tools": [{"type": "function", "name": "f", "input_schema": {}}]}, "tools[0].type"),
    ({"tools": [{**WEATHER, "strict": "yes"}]}, "tools[0].strict"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages[0].content[0].type: image blocks",
    ),
    ({"container": "c"}, "container"),
    ({"mcp_servers": [{"url": "http://x"}]}, "mcp_servers"),
    ({"tools": [{**WEATHER, "description": "d" * 200_000}]}, "tools[0].description"),
    ({"wat": 1}, "'wat': unknown field"),
]


@pytest.mark.parametrize(("fields", "names"), BAD)
def test_bad_fields_are_400s_naming_them(fields: Any, names: str) -> None:
    if isinstance(fields, bytes):
        raw = fields
    else:
        base: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": USER}
        base.update(fields)
        for key in ("model", "max_tokens"):
            if key not in fields and key in base and names.startswith(key):
                del base[key]
        raw = json.dumps(base).encode()
    assert names in refused(raw).message


def test_consecutive_user_turns_are_one() -> None:
    request = parse(
        messages=[
            {"role": "user", "content": "first"},
            {"role": "user", "content": [{"type": "text", "text": "second"}]},
        ]
    )
    assert request.messages == ({"role": "user", "content": "first\n\nsecond"},)


def test_consecutive_assistant_turns_are_one() -> None:
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}
    request = parse(
        messages=[
            *USER,
            {"role": "assistant", "content": "Let me look. "},
            {"role": "assistant", "content": [call]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "rain"}],
            },
        ]
    )
    assert request.messages[1] == {
        "role": "assistant",
        "content": "Let me look. ",
        "tool_calls": (ToolCall("t1", "get_weather", '{"city": "Oslo"}'),),
    }
    assert request.messages[2]["role"] == "tool" and len(request.messages) == 3
    with pytest.raises(an.AnthropicError, match="repeats a tool_use id"):
        parse(
            messages=[
                *USER,
                {"role": "assistant", "content": [call]},
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": "x"},
            ]
        )


def test_media_of_earlier_turns_stand_as_a_placeholder() -> None:
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    request = parse(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "see"}, image]},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}],
            },
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": "and now?"},
        ]
    )
    assert request.messages[0]["content"] == "see\n[image omitted: this model reads text only]"
    assert request.messages[2]["content"] == "[image omitted: this model reads text only]"


def test_strict_tools_and_anthropics_own_tool_types() -> None:
    request = parse(
        tools=[{**WEATHER, "strict": True}, {"type": "bash_20250124", "name": "bash"}],
        tool_choice={"type": "auto"},
    )
    assert request.tools is not None
    assert [(t.name, t.strict) for t in request.tools.tools] == [("get_weather", True)]
    assert request.skipped_tools == ("bash",)


def test_null_fields_ask_for_nothing() -> None:
    request = parse(
        container=None, mcp_servers=None, stop_sequences=None, system=None, tools=None, stream=None
    )
    assert request.messages == tuple(USER) and not request.stream


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=30,
)
FIELDS = st.sampled_from(
    [
        "model",
        "max_tokens",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "stop_sequences",
        "temperature",
        "top_k",
        "thinking",
        "output_config",
        "stream",
        "metadata",
    ]
)


@settings(max_examples=300)
@given(st.dictionaries(FIELDS, JSON, max_size=6), st.data())
def test_any_body_is_a_request_or_a_400(fields: dict[str, Any], data: st.DataObject) -> None:
    base: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": USER}
    if data.draw(st.booleans()):
        base["messages"] = [
            {"role": data.draw(st.sampled_from(["user", "assistant"])), "content": data.draw(JSON)}
        ]
    base.update(fields)
    raw = json.dumps(base).encode()
    try:
        request = an.parse_messages_request(raw)
    except an.AnthropicError as exc:
        error = exc
    else:
        assert request.messages
        return
    assert error.status == 400 and error.message


# --------------------------------------------------------------------------
# Replies


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

    def finish(self, reason: FinishReason = "stop_token", stop: str | None = None) -> None:
        self.outcome = "finished"
        self.finished = Finished(
            job_id=1,
            text="",
            reason=reason,
            stop_string=stop,
            stop_token=0 if reason == "stop_token" else None,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
        )


def events(data: bytes) -> Iterator[tuple[str, dict[str, Any]]]:
    for chunk in data.decode().split("\n\n"):
        if not chunk:
            continue
        name, payload = chunk.split("\n")
        assert name.startswith("event: ") and payload.startswith("data: ")
        event = json.loads(payload[6:])
        assert event["type"] == name[7:]
        yield name[7:], event


def replay(data: bytes) -> dict[str, Any]:
    """The message a client builds from the events, checking their order."""
    seen = list(events(data))
    names = [name for name, _ in seen]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    message: dict[str, Any] = seen[0][1]["message"]
    assert message["content"] == [] and message["stop_reason"] is None
    open_index = None
    partial: dict[int, str] = {}
    for name, event in seen[1:-2]:
        if name == "content_block_start":
            assert open_index is None and event["index"] == len(message["content"])
            open_index = event["index"]
            message["content"].append(dict(event["content_block"]))
        elif name == "content_block_delta":
            assert event["index"] == open_index
            block, delta = message["content"][open_index], event["delta"]
            if delta["type"] == "text_delta":
                assert delta["text"]
                block["text"] += delta["text"]
            else:
                assert delta["type"] == "input_json_delta" and block["type"] == "tool_use"
                partial[open_index] = partial.get(open_index, "") + delta["partial_json"]
        elif name == "content_block_stop":
            assert event["index"] == open_index
            if open_index in partial:
                message["content"][open_index]["input"] = json.loads(partial[open_index])
            open_index = None
        else:
            assert name == "ping"
    assert open_index is None
    message.update(seen[-2][1]["delta"])
    message["usage"].update(seen[-2][1]["usage"])
    return message


def request(**fields: Any) -> an.MessagesRequest:
    return parse(**fields)


def streamed(reply: an.MessageReply, state: State, pieces: list[str], **finish: Any) -> bytes:
    out = reply.opening()
    for piece in pieces:
        state.release(piece)
        out += reply.advance() + reply.keepalive()
    state.finish(**finish)
    out += reply.advance()
    assert reply.complete and not reply.broken
    return out + reply.end()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


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
def test_the_stream_says_what_the_whole_message_says(
    case: tuple[str, ToolFormat | None], data: st.DataObject
) -> None:
    text, fmt = case
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    whole_state = State(tool_format=fmt)
    for piece in pieces:
        whole_state.release(piece)
    whole_state.finish()
    whole = json.loads(an.MessageReply(request(), "m", whole_state, id="msg_1").body())
    state = State(tool_format=fmt)
    message = replay(streamed(an.MessageReply(request(), "m", state, id="msg_1"), state, pieces))
    for block in whole["content"]:
        block.pop("id", None)
    for block in message["content"]:
        block.pop("id", None)
    assert message == whole
    kinds = [b["type"] for b in whole["content"]]
    if fmt is None or "<tool_call>" not in text:
        assert kinds == ["text"] and whole["content"][0]["text"] == text
        assert whole["stop_reason"] == "end_turn"
    else:
        assert "tool_use" in kinds and whole["stop_reason"] == "tool_use"
        assert {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}} in whole[
            "content"
        ]
    assert whole["usage"] == {
        "input_tokens": 18,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 12,
        "output_tokens": len(pieces),
    }


@pytest.mark.parametrize(
    ("reason", "stop", "expected", "sequence"),
    [
        ("stop_token", None, "end_turn", None),
        ("constraint", None, "end_turn", None),
        ("max_new_tokens", None, "max_tokens", None),
        ("stop_string", "\n\nHuman:", "stop_sequence", "\n\nHuman:"),
    ],
)
def test_stop_reasons(
    reason: FinishReason, stop: str | None, expected: str, sequence: str | None
) -> None:
    state = State()
    state.release("abc")
    state.finish(reason, stop)
    # One token generated, one asked for: max_new_tokens is max_tokens itself.
    whole = json.loads(an.MessageReply(request(max_tokens=1), "m", state).body())
    assert (whole["stop_reason"], whole["stop_sequence"]) == (expected, sequence)
    assert whole["id"].startswith("msg_") and whole["model"] == "m" and whole["role"] == "assistant"
    streamed_state = State()
    message = replay(
        streamed(
            an.MessageReply(request(max_tokens=1), "m", streamed_state),
            streamed_state,
            ["abc"],
            reason=reason,
            stop=stop,
        )
    )
    assert (message["stop_reason"], message["stop_sequence"]) == (expected, sequence)


def test_a_reply_cut_before_max_tokens_ran_out_of_context() -> None:
    """max_tokens is an upper bound: ended by the context's room (or the
    server's cap) before it, the reply says so, not max_tokens."""
    state = State()
    state.release("abc")
    state.finish("max_new_tokens")
    whole = json.loads(an.MessageReply(request(max_tokens=32_000), "m", state).body())
    assert whole["stop_reason"] == "model_context_window_exceeded"


def test_a_call_cut_short_keeps_its_pieces_and_an_empty_input() -> None:
    state = State(tool_format=HERMES)
    state.release('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    state.finish("max_new_tokens")
    whole = json.loads(an.MessageReply(request(max_tokens=1), "m", state).body())
    (block,) = whole["content"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_weather", {})
    assert block["id"].startswith("toolu_") and whole["stop_reason"] == "max_tokens"


def test_a_failed_or_interrupted_generation_ends_the_stream_with_an_error() -> None:
    state = State()
    reply = an.MessageReply(request(), "m", state)
    out = reply.opening()
    state.release("partial")
    out += reply.advance()
    state.outcome, state.failure = "failed", "the engine failed: out of memory"
    out += reply.advance()
    assert reply.broken and not reply.complete
    outcome, error = reply.failure(draining=False)
    assert (outcome, error.status) == ("internal", 500)
    out += reply.error(error)
    seen = list(events(out))
    assert [n for n, _ in seen][-2:] == ["content_block_stop", "error"]
    assert seen[-1][1]["error"] == {
        "type": "api_error",
        "message": "the engine failed: out of memory",
    }
    outcome, error = reply.failure(draining=True)
    assert (outcome, error.status, error.type) == ("interrupted", 503, "overloaded_error")
    # A failure the request caused (its constraint broke down) is its 400.
    state.failure_cause = "request"
    outcome, error = reply.failure(draining=False)
    assert (outcome, error.status, error.type) == ("invalid_request", 400, "invalid_request_error")


def test_error_bodies_follow_the_status() -> None:
    for status, kind in [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (529, "overloaded_error"),
    ]:
        assert json.loads(an.error_body(status, "m")) == {
            "type": "error",
            "error": {"type": kind, "message": "m"},
        }


# --------------------------------------------------------------------------
# The documentation's table


def test_the_docs_table_lists_every_field_as_the_parser_takes_it() -> None:
    from pathlib import Path

    from trioserve.anthropic import requests

    doc = (Path(__file__).resolve().parents[1] / "docs" / "anthropic.md").read_text("utf-8")
    table = doc[doc.index("## The request") : doc.index("Any other field is a 400")]
    rows: dict[str, str] = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            names, kind = (cell.strip() for cell in line.strip("|").split("|")[:2])
            for name in names.split(", "):
                rows[name.strip("`")] = kind
    for name in requests._MESSAGES_FIELDS:
        kinds = {kind for row, kind in rows.items() if row.split(".")[0] == name}
        assert kinds & {"required", ""}, name
    for name in requests._IGNORED - {"anthropic_version"}:
        assert rows.get(name) == "ignored", name
    for name in requests._REFUSED:
        assert rows.get(name) == "refused", name
    # And the parser agrees: ignored fields pass, refused ones are 400s.
    for name in requests._IGNORED - {"thinking", "context_management"}:
        parse(**{name: "anything"})
    for name in requests._REFUSED:
        assert name in refused(body(**{name: "x"})).message


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": [{"role": "user", "content": [{"type": []}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": {}}]}, *USER]},
        {"output_config": {"effort": []}},
        {"thinking": {"type": {}}},
    ],
)
def test_a_list_or_object_where_a_type_name_goes_is_a_400(fields: dict[str, Any]) -> None:
    """Found by the Responses door's hostile tests: a value that cannot be
    hashed, looked up among the known names, was the server's 500."""
    refused(body(**fields))
