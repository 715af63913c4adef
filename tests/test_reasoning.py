"""Reasoning apart from the answer, with no model: a template's thinking
markers read from it, where a generation starts in the section, the
streaming split (however the text is cut, the same reasoning and answer),
the grammar that holds a constraint after the thinking (compiled by
llguidance), and each API's reply of a generation that thought."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve import anthropic as an
from trioserve import openai as oa
from trioserve import responses as rs
from trioserve.vocabulary.reasoning import (
    KNOWN_MARKERS,
    ReasoningFormat,
    ReasoningSplitter,
    Section,
    reasoning_format,
    thinking_grammar,
)
from trioserve.vocabulary.results import FailureCause, Finished
from trioserve.vocabulary.tools import HERMES, ToolFormat

pytestmark = pytest.mark.unit

THINK = ReasoningFormat("<think>", "</think>")
TEMPLATE = (Path(__file__).parent / "templates" / "chatml_thinking.jinja").read_text("utf-8")
#: Qwen3's handling of past reasoning, as its template writes it.
QWEN3_LIKE = (
    "{%- if '</think>' in content %}{%- set reasoning_content = "
    "content.split('</think>')[0].rstrip('\\n').split('<think>')[-1] %}{%- endif %}"
)
COMMAND_A_LIKE = "{{ '<|START_THINKING|>' + thinking + '<|END_THINKING|>' }}"
SMOLLM2_LIKE = "{% for message in messages %}<|im_start|>{{ message['role'] }}{% endfor %}"


# --------------------------------------------------------------------------
# Markers


def test_markers_are_read_from_the_template() -> None:
    assert reasoning_format(TEMPLATE) == THINK
    assert reasoning_format(QWEN3_LIKE) == THINK
    assert reasoning_format(COMMAND_A_LIKE) == ReasoningFormat(
        "<|START_THINKING|>", "<|END_THINKING|>"
    )
    assert reasoning_format(SMOLLM2_LIKE) is None
    assert reasoning_format(None) is None
    # A pair the tokenizer has as tokens wins over one merely mentioned.
    both = COMMAND_A_LIKE + QWEN3_LIKE
    assert reasoning_format(both) == THINK
    preferred = reasoning_format(both, ["<|START_THINKING|>", "<|END_THINKING|>"])
    assert preferred is not None and preferred.start == "<|START_THINKING|>"
    for start, end in KNOWN_MARKERS:
        assert reasoning_format(f"{start} ... {end}") == ReasoningFormat(start, end)


@pytest.mark.parametrize(
    ("prompt", "section"),
    [
        ("<|im_start|>assistant\n<think>\n", "inside"),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "after"),
        ("<|im_start|>assistant\n", "before"),
    ],
)
def test_where_a_generation_starts_is_read_from_its_prompt(prompt: str, section: Section) -> None:
    assert THINK.section(prompt) == section


# --------------------------------------------------------------------------
# The split


def split(pieces: list[str], start: Section) -> tuple[str, str]:
    splitter = ReasoningSplitter(THINK, start)
    thought, answer = "", ""
    for index, piece in enumerate(pieces):
        t, a = splitter.split(piece, final=index == len(pieces) - 1)
        thought, answer = thought + t, answer + a
    return thought, answer


CASES: list[tuple[str, Section, str, str]] = [
    ("Let me see: 2+2.</think>\n\nIt is 4.", "inside", "Let me see: 2+2.", "It is 4."),
    ("\nFirst, < and > </thin k></think>4", "inside", "First, < and > </thin k>", "4"),
    ("  <think>\nHmm.</think>\n\nParis.", "before", "Hmm.", "Paris."),
    ("Paris is the capital.", "before", "", "Paris."[:0] + "Paris is the capital."),
    ("<thin is not a marker", "before", "", "<thin is not a marker"),
    ("Still thinking when cut </thi", "inside", "Still thinking when cut </thi", ""),
    ("", "inside", "", ""),
]


@settings(max_examples=200)
@given(st.sampled_from(CASES), st.data())
def test_the_split_does_not_depend_on_how_the_text_is_cut(
    case: tuple[str, Section, str, str], data: st.DataObject
) -> None:
    text, start, thought, answer = case
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=10)))
    cuts = [c for c in cuts if c < len(text)]
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)] or [""]
    assert split(pieces, start) == (thought, answer)


# --------------------------------------------------------------------------
# The grammar after the thinking


def _compiles(grammar: str) -> None:
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_lark(grammar)
    )
    assert not failed and not messages, messages


@pytest.mark.parametrize("start", ["inside", "before"])
@pytest.mark.parametrize("budget", [None, 16])
@pytest.mark.parametrize("special", [False, True])
def test_the_thinking_grammar_compiles_around_each_answer(
    start: Section, budget: int | None, special: bool
) -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    answers = [
        f"%llguidance {{}}\nstart: %json {schema}",
        '%llguidance {}\nstart: "yes" | "no"',
        "start: /(.|\\n)*/",
    ]
    for answer in answers:
        grammar = thinking_grammar(answer, THINK, start, budget=budget, special=special)
        assert "answer_start:" in grammar and grammar.count("\nstart:") == 1
        if budget is not None:
            assert f"thought[max_tokens={budget}]" in grammar
        if not special:
            _compiles(grammar)


def test_a_grammar_without_a_start_rule_is_a_mistake() -> None:
    with pytest.raises(ValueError, match="start"):
        thinking_grammar("answer: /x/", THINK, "inside")


# --------------------------------------------------------------------------
# The replies


@attrs.define
class State:
    """A generation that thought, as the server would show it."""

    response: str = ""
    reasoning: str = ""
    outcome: str | None = None
    finished: Finished | None = None
    failure: str | None = None
    failure_cause: FailureCause = "engine"
    tool_format: ToolFormat | None = None
    prompt_tokens: int = 30
    generated_tokens: int = 0
    cached_tokens: int = 0
    logprobs: tuple[Any, ...] = ()
    prompt_logprobs: tuple[Any, ...] = ()
    util_text: str = ""

    def think(self, text: str) -> None:
        self.reasoning += text
        self.generated_tokens += 1

    def say(self, text: str) -> None:
        self.response += text
        self.generated_tokens += 1

    def finish(self) -> None:
        self.outcome = "finished"
        self.finished = Finished(
            job_id=1,
            text="",
            reason="stop_token",
            stop_string=None,
            stop_token=0,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
        )


def run(reply: Any, state: State, steps: list[tuple[str, str]]) -> bytes:
    out = reply.opening()
    for kind, text in steps:
        (state.think if kind == "think" else state.say)(text)
        out += reply.advance()
    state.finish()
    out += reply.advance()
    end: bytes = reply.end()
    return bytes(out) + end


STEPS = [("think", "Two and "), ("think", "two make four."), ("say", "It is "), ("say", "4.")]


def test_chat_completions_give_reasoning_content() -> None:
    request = oa.parse_chat_request(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "2+2?"}]}).encode()
    )
    whole_state = State()
    for kind, text in STEPS:
        (whole_state.think if kind == "think" else whole_state.say)(text)
    whole_state.finish()
    message = json.loads(oa.Reply(request, "m", [whole_state]).body())["choices"][0]["message"]
    assert message["reasoning_content"] == "Two and two make four."
    assert message["content"] == "It is 4."
    state = State()
    events = run(oa.Reply(request, "m", [state]), state, STEPS).decode().split("\n\n")
    deltas = [json.loads(e[6:])["choices"] for e in events if e.startswith("data: {")]
    fields = [list(c[0]["delta"]) for c in deltas if c]
    thought = "".join(c[0]["delta"].get("reasoning_content", "") for c in deltas if c)
    said = "".join(c[0]["delta"].get("content") or "" for c in deltas if c)
    assert (thought, said) == ("Two and two make four.", "It is 4.")
    # Every reasoning delta comes before the first content.
    first_content = next(i for i, f in enumerate(fields) if "content" in f and i > 0)
    assert all("content" not in f or i == 0 for i, f in enumerate(fields[:first_content]))
    # A generation that did not think has no reasoning_content at all.
    plain = State()
    plain.say("4")
    plain.finish()
    body = json.loads(oa.Reply(request, "m", [plain]).body())
    assert "reasoning_content" not in body["choices"][0]["message"]


def test_messages_give_a_thinking_block_first() -> None:
    request = an.parse_messages_request(
        json.dumps(
            {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "2+2?"}]}
        ).encode()
    )
    state = State()
    events = run(an.MessageReply(request, "m", state), state, STEPS).decode()
    blocks = [
        json.loads(line[6:])
        for line in events.splitlines()
        if line.startswith("data: ") and "content_block_start" in line
    ]
    assert [b["content_block"]["type"] for b in blocks] == ["thinking", "text"]
    assert '"thinking_delta"' in events
    body = json.loads(an.MessageReply(request, "m", state).body())
    assert body["content"][0] == {
        "type": "thinking",
        "thinking": "Two and two make four.",
        "signature": "",
    }
    assert body["content"][1] == {"type": "text", "text": "It is 4."}


@pytest.mark.parametrize("fmt", [None, HERMES])
def test_responses_give_a_reasoning_item_first(fmt: ToolFormat | None) -> None:
    body = rs.parse_responses_body(json.dumps({"model": "m", "input": "2+2?"}).encode())
    request = rs.parse_responses_request(body)
    state = State(tool_format=fmt)
    stream = run(rs.ResponseReply(request, "m", state), state, STEPS).decode()
    names = [line[7:] for line in stream.splitlines() if line.startswith("event: ")]
    assert names.index("response.reasoning_text.delta") < names.index("response.output_text.delta")
    assert names.count("response.output_item.done") == 2
    final = json.loads(stream.strip().split("\n\n")[-1].split("\n")[1][6:])["response"]
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Two and two make four."}]
    assert message["type"] == "message" and final["output_text"] == "It is 4."
    whole = json.loads(rs.ResponseReply(request, "m", state).body())
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == reasoning["content"]
    # The conversation a stored response leaves keeps the answer, not the thinking.
    assert rs.ResponseReply(request, "m", state).history()[-1]["content"] == "It is 4."


async def test_tools_in_auto_are_guarded_where_the_model_may_open_the_section() -> None:
    """The tools grammar's free text must not open the section either: the
    splitter would take the reply for thinking, the calls unparsed."""
    from trioserve.generation.constraining import tools_constraint
    from trioserve.generation.thinking import after_thinking
    from trioserve.vocabulary.tools import Tool, ToolUse

    async def encode(text: str) -> list[int]:
        return list(range(len(text)))  # text markers: several tokens each

    use = ToolUse(tools=(Tool(name="f", description=None, parameters=None),), choice="auto")
    tools = tools_constraint(use, HERMES, special_trigger=False)
    assert tools is not None
    wrapped = await after_thinking(tools, ReasoningSplitter(THINK, "before"), None, encode)
    assert wrapped is not None and "& ~/\\s*<think>" in wrapped.text
    _compiles(wrapped.text)
    inside = await after_thinking(tools, ReasoningSplitter(THINK, "inside"), None, encode)
    assert inside is not None and "~/\\s*<think>" not in inside.text
    _compiles(inside.text)
