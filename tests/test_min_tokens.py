"""``min_tokens`` (vLLM's name; ExLlamaV2's ``min_new_tokens``): the first
``min_tokens`` generated tokens are never a stop token, and no stop string
is looked for in their text; more than the request's limit on new tokens is
an error naming it. The rules are checked on their own (the text stream, the
pipeline's check, the ExLlamaV2 job's conditions), then on the real model:
the CPU engine directly, and both doors over real sockets (the WebSocket
``infer`` and the ``openai`` SDK)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import openai
import pytest
import trio
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.helpers import raw_client, running_server
from tests.test_cpu_engine import GREEDY, make_spec, run_one
from tests.test_text import FFFD, _push_all, bl_decode, bl_encode, texts
from trioserve import openai as oa
from trioserve import protocol as p
from trioserve.engine.base import EngineInfo, GenerationSpec
from trioserve.engine.exllamav2.jobs import JobState, stop_conditions
from trioserve.engine.text import TextStream
from trioserve.generation import InvalidGeneration
from trioserve.generation.generation import check_request, fit_prompt
from trioserve.server.doors import from_infer, from_openai, openai_error, websocket_path
from trioserve.vocabulary.constraint import CONSTRAINT_KINDS
from trioserve.vocabulary.sampling import SamplingSettings

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

INFO = EngineInfo(
    engine="test",
    model_name="m",
    context_length=64,
    vocab_size=1000,
    bos_token_id=None,
    eos_token_ids=frozenset({2}),
    max_batch=4,
    constraints=CONSTRAINT_KINDS,
)

# -- the text stream: stop strings only in the text of later tokens -------------------


@pytest.mark.unit
@given(
    texts,
    st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), min_size=1, max_size=2),
    st.integers(0, 12),
)
@settings(deadline=None)
def test_stop_strings_count_only_in_the_text_after_the_held_tokens(
    text: str, cuts: list[tuple[int, int]], hold: int
) -> None:
    stops = [text[start : start + length] for start, length in cuts if start < len(text)]
    assume(stops and FFFD not in "".join(stops))
    ids = bl_encode(text)
    stream = TextStream(bl_decode, stops, hold_stops=hold)
    released = ""
    stopped = None
    for token in ids:
        piece = stream.push([token])
        released += piece.text
        if piece.stop_string is not None:
            stopped = piece.stop_string
            break
    # Reference: the text the held tokens made final is never searched; the
    # first later token whose text completes a stop string (the earliest,
    # then the longest) ends the stream before it.
    base = len(bl_decode(ids[:hold]).rstrip(FFFD)) if hold else 0
    expected = None
    for n in range(hold + 1, len(ids) + 1):
        so_far = bl_decode(ids[:n]).rstrip(FFFD)
        found = [(so_far.find(s, base), -len(s), s) for s in stops if s in so_far[base:]]
        if found:
            index, _, stop = min(found)
            expected = (so_far[:index], stop)
            break
    if expected is None:
        assert stopped is None
        assert released + stream.flush() == text
        assert stream.stop_string is None
    else:
        assert (released, stopped) == expected


@pytest.mark.unit
def test_a_stop_string_inside_the_held_tokens_is_released_as_text() -> None:
    ids = bl_encode("hello world said the quick brown fox")
    plain = TextStream(bl_decode, ["world"])
    pieces, _ = _push_all(plain, ids)
    assert pieces[-1].stop_string == "world"
    held = TextStream(bl_decode, ["world", "fox"], hold_stops=len(pieces))
    pieces, _ = _push_all(held, ids)
    assert pieces[-1].stop_string == "fox"
    assert "".join(p.text for p in pieces) == "hello world said the quick brown "


# -- the pipeline's check and the doors' names ----------------------------------------


def _websocket(frame: dict[str, Any]) -> tuple[p.InferRequest, Any]:
    request = p.decode_request(json.dumps({"action": "infer", "text": "x", **frame}))
    assert isinstance(request, p.InferRequest)
    return request, from_infer(request)


@pytest.mark.unit
def test_more_than_the_limit_on_new_tokens_is_refused_naming_min_tokens() -> None:
    request, generation = _websocket({"max_new_tokens": 4, "min_tokens": 5})
    with pytest.raises(InvalidGeneration) as caught:
        check_request(generation, INFO, max_new_tokens=63, renders_messages=True)
    assert websocket_path(caught.value, request) == "$.min_tokens"
    assert "(4), got 5" in caught.value.message
    parsed = oa.parse_completion_request(b'{"prompt": "x", "max_tokens": 4, "min_tokens": 5}')
    with pytest.raises(InvalidGeneration) as caught:
        check_request(from_openai(parsed), INFO, max_new_tokens=63, renders_messages=True)
    error = openai_error(caught.value)
    assert (error.status, error.param) == (400, "min_tokens")
    # Up to the limit is fine, and so is no limit at all.
    for frame in ({"max_new_tokens": 5, "min_tokens": 5}, {"max_new_tokens": 5}):
        _, generation = _websocket(frame)
        check_request(generation, INFO, max_new_tokens=63, renders_messages=True)


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["-1", "2.5", "true", '"3"', str(2**31)])
def test_a_bad_min_tokens_is_named_on_both_doors(bad: str) -> None:
    with pytest.raises(p.ProtocolError) as ws:
        p.decode_request(
            f'{{"action": "infer", "text": "x", "max_new_tokens": 8, "min_tokens": {bad}}}'
        )
    assert ws.value.field == "$.min_tokens"
    with pytest.raises(oa.OpenAIError) as http:
        oa.parse_chat_request(
            f'{{"messages": [{{"role": "user", "content": "x"}}], "min_tokens": {bad}}}'.encode()
        )
    assert (http.value.status, http.value.param) == (400, "min_tokens")


@pytest.mark.unit
def test_a_completion_without_max_tokens_generates_up_to_min_tokens() -> None:
    for fields, expected in (({}, 16), ({"min_tokens": 40}, 40), ({"min_tokens": 4}, 16)):
        body = json.dumps({"prompt": "x", **fields}).encode()
        generation = from_openai(oa.parse_completion_request(body))
        _, new = fit_prompt(generation, [5, 6, 7], INFO, max_new_tokens=63)
        assert new == expected, fields
    # The context (64 here) and the server's cap still bound it.
    generation = from_openai(oa.parse_completion_request(b'{"prompt": "x", "min_tokens": 100}'))
    assert fit_prompt(generation, [5, 6, 7], INFO, max_new_tokens=63)[1] == 64 - 3
    assert fit_prompt(generation, [5, 6, 7], INFO, max_new_tokens=30)[1] == 30


# -- the ExLlamaV2 job: ExLlamaV2 holds the stop ids, the engine's rules the strings --------


def _exl2_spec(**fields: Any) -> GenerationSpec:
    values: dict[str, Any] = {"job_id": 1, "prompt_ids": (5, 6, 7), "max_new_tokens": 10}
    return GenerationSpec(**{**values, **fields})


def _letters(ids: Sequence[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.mark.unit
def test_exllamav2_gets_no_stop_strings_when_min_tokens_holds_them() -> None:
    sampling = SamplingSettings(min_tokens=3)
    spec = _exl2_spec(stop_token_ids=frozenset({9}), stop_strings=("dc",), sampling=sampling)
    assert stop_conditions(spec, frozenset({2})) == [2, 9]
    assert stop_conditions(_exl2_spec(stop_strings=("dc",)), frozenset({2})) == [2, "dc"]
    # "cdcdcd...": "dc" is complete at every odd token from the third. Held
    # for 3 tokens, the first "dc" wholly after them ends at the fifth; token
    # healing's token (not one of min_tokens, as in ExLlamaV2) moves it to the seventh.
    for healing, first in ((False, 5), (True, 7)):
        state = JobState.for_spec(
            _exl2_spec(stop_strings=("dc",), sampling=sampling, token_healing=healing), _letters
        )
        pieces, _ = _push_all(state.stream, [2, 3] * 6)
        assert (len(pieces), pieces[-1].stop_string) == (first, "dc"), healing


# -- the real model -----------------------------------------------------------------------

QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_the_cpu_engine_holds_eos_and_stop_strings_back(cpu_engine: CpuEngine) -> None:
    plain = run_one(cpu_engine, make_spec(cpu_engine, PARIS, 48))
    assert plain.finished.reason == "stop_token"
    assert "Paris" in plain.text
    short = plain.finished.generated_tokens  # the answer and its EOS
    assert short < 16
    held_back = attrs.evolve(GREEDY, min_tokens=16)
    held = run_one(cpu_engine, make_spec(cpu_engine, PARIS, 48, sampling=held_back))
    assert held.finished.generated_tokens >= 16
    if held.finished.reason == "stop_token":
        # The stop token comes after the 16 held tokens.
        assert held.finished.generated_tokens >= 17
    # Greedy: the same text up to where the EOS was banned, then more.
    assert held.text.startswith(plain.text)
    assert len(held.text) > len(plain.text)
    # A stop string that the held tokens complete is text.
    stopped = run_one(cpu_engine, make_spec(cpu_engine, PARIS, 48, stop_strings=("Paris",)))
    assert stopped.finished.reason == "stop_string"
    assert stopped.text == plain.text[: plain.text.index("Paris")]
    spec = make_spec(
        cpu_engine,
        PARIS,
        48,
        stop_strings=("Paris",),
        sampling=attrs.evolve(GREEDY, min_tokens=short),
    )
    assert run_one(cpu_engine, spec).text.startswith(plain.text)


async def test_min_tokens_on_the_websocket_door(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        frame = {
            "action": "infer",
            "messages": QUESTION,
            "max_new_tokens": 48,
            "temperature": 0,
            "rep_pen": 1,
        }
        plain = await ws.request(frame)
        assert plain["eos_reason"] == "stop_token"
        assert "Paris" in plain["response"]
        short = plain["usage"]["generated_tokens"]
        held = await ws.request({**frame, "min_tokens": short + 8})
        assert held["usage"]["generated_tokens"] >= short + 8
        assert held["response"].startswith(plain["response"])
        assert len(held["response"]) > len(plain["response"])
        stopped = await ws.request({**frame, "stop_conditions": ["Paris"]})
        assert stopped["response"] == plain["response"][: plain["response"].index("Paris")]
        kept = await ws.request({**frame, "stop_conditions": ["Paris"], "min_tokens": short})
        assert kept["response"].startswith(plain["response"])
        for bad in (-1, 49):
            error = await ws.request({**frame, "min_tokens": bad})
            assert error["response_type"] == "error"
            assert error["error"]["field"] == "$.min_tokens"


async def test_min_tokens_on_the_openai_door(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening:
        base = f"http://127.0.0.1:{listening.port}/v1"

        def use_the_sdk() -> None:
            client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)

            def ask(**extra: Any) -> Any:
                return client.chat.completions.create(
                    model="m",
                    messages=QUESTION,
                    temperature=0,
                    max_tokens=48,
                    extra_body={"rep_pen": 1, **extra},
                )

            plain = ask()
            answer = plain.choices[0].message.content or ""
            assert plain.choices[0].finish_reason == "stop"
            assert "Paris" in answer
            assert plain.usage is not None
            short = plain.usage.completion_tokens
            held = ask(min_tokens=short + 8)
            assert held.usage is not None and held.usage.completion_tokens >= short + 8
            content = held.choices[0].message.content or ""
            assert content.startswith(answer)
            assert len(content) > len(answer)
            # Streamed: the same text.
            stream = client.chat.completions.create(
                model="m",
                messages=QUESTION,
                temperature=0,
                max_tokens=48,
                stream=True,
                extra_body={"rep_pen": 1, "min_tokens": short + 8},
            )
            streamed = "".join(
                chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices
            )
            assert streamed == content
            kept = ask(stop=["Paris"], min_tokens=short)
            assert (kept.choices[0].message.content or "").startswith(answer)
            for bad in (-1, 49):
                with pytest.raises(openai.BadRequestError) as caught:
                    ask(min_tokens=bad)
                body = caught.value.body
                assert isinstance(body, dict) and body["param"] == "min_tokens"

        await trio.to_thread.run_sync(use_the_sdk)
