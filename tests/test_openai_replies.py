"""The OpenAI reply, sans-IO (trioserve/openai/replies.py): whole bodies and
streamed events made from choice states with no socket, no trio and no
model. The property that carries the rest: however a generation's text is cut
into released pieces, the stream says what the whole body says (the same
content, tool calls, finish reason and logprob offsets)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trioserve import openai as oa
from trioserve.vocabulary.results import FailureCause, Finished, FinishReason, TokenLogprob
from trioserve.vocabulary.tools import HERMES, ToolFormat

pytestmark = pytest.mark.unit


@attrs.define
class State:
    """A choice as a generation would show it, moved by hand."""

    response: str = ""
    reasoning: str = ""
    logprobs: list[TokenLogprob] = attrs.Factory(list)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    outcome: str | None = None
    finished: Finished | None = None
    failure: str | None = None
    failure_cause: FailureCause = "engine"
    tool_format: ToolFormat | None = None
    util_text: str = "the prompt"
    prompt_tokens: int = 7
    generated_tokens: int = 0
    cached_tokens: int = 0

    def release(self, text: str, entries: Sequence[TokenLogprob] = ()) -> None:
        self.response += text
        self.logprobs.extend(entries)
        self.generated_tokens += max(1, len(entries))

    def finish(self, reason: FinishReason = "stop_token", stop: TokenLogprob | None = None) -> None:
        self.outcome = "finished"
        self.finished = Finished(
            job_id=1,
            text="",
            reason=reason,
            stop_string=None,
            stop_token=0 if reason == "stop_token" else None,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
            stop_logprob=stop,
        )


def entry(text: str, logprob: float = -0.5) -> TokenLogprob:
    return TokenLogprob(
        0, text, text.encode(), logprob, top=(TokenLogprob(1, "x", b"x", -1.0),) * 2
    )


def chat(**fields: Any) -> oa.ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return oa.parse_chat_request(json.dumps(body).encode())


def completion(**fields: Any) -> oa.CompletionRequest:
    return oa.parse_completion_request(json.dumps({"prompt": "the prompt", **fields}).encode())


def events(data: bytes) -> list[Any]:
    """The JSON of each Server-Sent Event, ``[DONE]`` as the string."""
    out: list[Any] = []
    for block in data.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: "), block
        payload = block[len(b"data: ") :]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def stream(reply: oa.Reply, state: State, pieces: Sequence[str], **finish: Any) -> list[Any]:
    """Release ``pieces`` one advance each, finish, and read every event."""
    data = reply.opening()
    for piece in pieces:
        state.release(piece, [entry(piece)] if piece else [])
        data += reply.advance()
    state.finish(**finish)
    data += reply.advance()
    assert reply.complete and not reply.broken
    return events(data + reply.end())


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def cuts(text: str) -> st.SearchStrategy[list[str]]:
    """``text`` cut into pieces at arbitrary places (empty ones included)."""

    def pieces(at: list[int]) -> list[str]:
        ends = [0, *sorted(at), len(text)]
        return [text[a:b] for a, b in itertools.pairwise(ends)]

    return st.lists(st.integers(0, len(text)), max_size=12).map(pieces)


@given(st.data())
def test_a_streamed_chat_says_what_the_whole_one_says(data: st.DataObject) -> None:
    text = data.draw(st.sampled_from(["It is sunny.", "Let me look. " + CALL, CALL + " done"]))
    pieces = data.draw(cuts(text))
    whole_state = State(tool_format=HERMES)
    whole_state.release(text)
    whole_state.finish()
    body = json.loads(oa.Reply(chat(tools=TOOLS), "m", [whole_state]).body())
    message = body["choices"][0]["message"]

    state = State(tool_format=HERMES)
    got = stream(oa.Reply(chat(tools=TOOLS, stream=True), "m", [state]), state, pieces)
    assert got[-1] == "[DONE]"
    deltas = [c["choices"][0]["delta"] for c in got[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == (message["content"] or "")
    assert "<tool_call>" not in content
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            into = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            into["name"] += call["function"].get("name", "")
            into["arguments"] += call["function"]["arguments"]
    whole_calls = message.get("tool_calls") or []
    assert [c["function"]["name"] for c in whole_calls] == [c["name"] for c in calls.values()]
    assert [json.loads(c["function"]["arguments"]) for c in whole_calls] == [
        json.loads(c["arguments"]) for c in calls.values()
    ]
    reasons = [c["choices"][0]["finish_reason"] for c in got[:-1]]
    assert reasons[:-1] == [None] * (len(reasons) - 1)
    assert reasons[-1] == body["choices"][0]["finish_reason"]
    assert reasons[-1] == ("tool_calls" if CALL in text else "stop")


@given(cuts("The capital of France is Paris."))
def test_streamed_legacy_logprobs_count_offsets_as_the_whole_reply_does(
    pieces: list[str],
) -> None:
    stop = entry("<|endoftext|>", -0.1)
    whole_state = State()
    for piece in pieces:
        whole_state.release(piece, [entry(piece)] if piece else [])
    whole_state.finish(stop=stop)
    whole = json.loads(oa.Reply(completion(logprobs=2), "m", [whole_state]).body())
    expected = whole["choices"][0]["logprobs"]

    state = State()
    reply = oa.Reply(completion(logprobs=2, stream=True), "m", [state])
    got = stream(reply, state, pieces, stop=stop)
    chunks = [c["choices"][0] for c in got[:-1]]
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert offsets == expected["text_offset"]
    assert tokens == expected["tokens"]
    # The stop token is listed last, its text in no chunk's text.
    assert tokens[-1] == "<|endoftext|>"
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]


def test_choices_stream_side_by_side_each_under_its_index() -> None:
    states = [State(), State()]
    reply = oa.Reply(chat(n=2, stream=True), "m", states)
    data = reply.opening()
    states[1].release("B1 ")
    states[0].release("A1 ")
    data += reply.advance()
    states[0].release("A2")
    states[0].finish()
    data += reply.advance()
    assert (reply.complete, reply.broken) == (False, False)
    states[1].release("B2")
    states[1].finish(reason="max_new_tokens")
    data += reply.advance()
    assert reply.complete
    got = events(data + reply.end())
    text: dict[int, str] = {0: "", 1: ""}
    reasons: dict[int, str] = {}
    for chunk in got[:-1]:
        (choice,) = chunk["choices"]
        text[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            reasons[choice["index"]] = choice["finish_reason"]
    assert text == {0: "A1 A2", 1: "B1 B2"}
    assert reasons == {0: "stop", 1: "length"}


def test_nothing_new_is_no_event_and_text_between_calls_is_one_event() -> None:
    state = State()
    reply = oa.Reply(completion(stream=True), "m", [state])
    assert reply.advance() == b""
    state.release("one ")
    state.release("two")
    (event,) = events(reply.advance())
    assert event["choices"][0]["text"] == "one two"
    assert reply.advance() == b""


def test_the_usage_chunk_counts_the_prompt_once() -> None:
    states = [State(), State()]
    reply = oa.Reply(
        completion(n=2, stream=True, stream_options={"include_usage": True}), "m", states
    )
    for state, text in zip(states, ["ab", "cde"], strict=True):
        state.release(text, [entry(c) for c in text])
        state.finish()
    reply.advance()
    *_, usage, done = events(reply.end())
    assert done == "[DONE]"
    assert usage["usage"]["prompt_tokens"] == 7
    assert usage["usage"]["completion_tokens"] == 5
    assert usage["choices"] == []


def test_echo_opens_a_completion_with_its_prompt() -> None:
    state = State()
    reply = oa.Reply(completion(echo=True, stream=True), "m", [state])
    (opening,) = events(reply.opening())
    assert opening["choices"][0]["text"] == "the prompt"
    state.release(" and more")
    state.finish()
    assert json.loads(reply.body())["choices"][0]["text"] == "the prompt and more"
    # Token ids are echoed as the text the model read.
    ids = oa.Reply(completion(prompt=[1, 2, 3], echo=True), "m", [State(util_text="abc")])
    assert ids.echo == "abc"


def test_a_failed_choice_ends_the_stream_in_an_error() -> None:
    states = [State(), State()]
    reply = oa.Reply(chat(n=2, stream=True), "m", states)
    states[0].release("partial")
    states[1].outcome, states[1].failure = "failed", "the engine ran out of memory"
    data = reply.advance()
    assert reply.broken
    outcome, error = reply.failure(draining=False)
    assert (outcome, error.status, error.message) == ("internal", 500, states[1].failure)
    got = events(data + reply.error(error))
    assert got[-2] == {
        "error": {
            "message": states[1].failure,
            "type": "server_error",
            "param": None,
            "code": "internal",
        }
    }
    assert got[-1] == "[DONE]"
    # The same failure during a shutdown is the shutdown's: retry elsewhere.
    outcome, error = reply.failure(draining=True)
    assert (outcome, error.status, error.retry_after) == ("interrupted", 503, 1)
    # One the request caused (its constraint broke down mid-generation) is its 400.
    states[1].failure_cause = "request"
    outcome, error = reply.failure(draining=False)
    assert (outcome, error.status, error.code) == ("invalid_request", 400, "constraint_failed")


def test_an_interrupted_choice_is_a_retryable_503() -> None:
    state = State()
    reply = oa.Reply(chat(), "m", [state])
    state.outcome = "interrupted"
    assert not reply.finished
    outcome, error = reply.failure(draining=False)
    assert (outcome, error.status, error.code) == ("interrupted", 503, "overloaded")
    with pytest.raises(ValueError, match="every choice finished"):
        reply.body()


def test_a_whole_chat_reply_with_a_call_and_logprobs() -> None:
    state = State(tool_format=HERMES)
    state.release("Checking. ", [entry("Checking. ")])
    state.release(CALL, [entry(CALL)])
    state.finish()
    reply = oa.Reply(chat(tools=TOOLS, logprobs=True, top_logprobs=2), "m", [state])
    (choice,) = json.loads(reply.body())["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking. "
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["Checking. ", CALL]
    assert all(len(e["top_logprobs"]) == 2 for e in choice["logprobs"]["content"])
    assert reply.outcome() == "eos"


def test_a_reply_needs_a_choice() -> None:
    with pytest.raises(ValueError, match="at least one choice"):
        oa.Reply(chat(), "m", [])
