"""vLLM's and SGLang's request fields (trioserve/openai/extensions.py): what
SGLang's Model Gateway writes into every body it routes is accepted, each
field reaches the generation, and every value that would not be honoured
is refused by name. Parsers only: the real model's answers are in
tests/test_gateway_fields_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trioserve.engine.base import EngineInfo
from trioserve.generation.request import build_spec
from trioserve.openai import OpenAIError
from trioserve.openai.extensions import EXTENSIONS, Extras, extension_table
from trioserve.openai.requests import parse_chat_request, parse_completion_request
from trioserve.responses.requests import parse_responses_body, parse_responses_request
from trioserve.server.doors import from_openai, from_responses

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
USER = [{"role": "user", "content": "What is the capital of France?"}]

#: The bodies sglang-router 0.3.2 forwarded to a worker, captured on a
#: listening socket: each client body came back with its engine's fields at
#: their defaults.
GATEWAY_CHAT = (
    '{"messages":[{"role":"user","content":"hi"}],"model":"m","logprobs":false,'
    '"max_completion_tokens":5,"stream":false,"no_stop_trim":false,"ignore_eos":false,'
    '"continue_final_message":false,"skip_special_tokens":true,"separate_reasoning":true,'
    '"stream_reasoning":true,"return_hidden_states":false}'
)
GATEWAY_COMPLETION = (
    '{"model":"m","prompt":"hi","max_tokens":5,"stream":false,"echo":false,'
    '"no_stop_trim":false,"ignore_eos":false,"skip_special_tokens":true,'
    '"return_hidden_states":false}'
)
GATEWAY_RESPONSES = (
    '{"input":"hi","model":"m","store":true,"stream":null,"temperature":1.0,"top_p":1.0,'
    '"priority":0,"top_k":-1,"min_p":0.0,"repetition_penalty":1.0}'
)


def chat(**fields: Any) -> bytes:
    return json.dumps({"messages": USER, **fields}).encode()


def completion(**fields: Any) -> bytes:
    return json.dumps({"prompt": "The capital of France is", **fields}).encode()


def responses(**fields: Any) -> Any:
    body = json.dumps({"model": "m", "input": "hi", **fields}).encode()
    return parse_responses_request(parse_responses_body(body))


def refused(parse: Any, body: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse(body)
    assert caught.value.status == 400
    return caught.value


def test_what_the_gateway_sends_is_the_same_request_as_what_the_client_sent() -> None:
    routed = parse_chat_request(GATEWAY_CHAT.encode())
    direct = parse_chat_request(b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":5}')
    assert routed.extras == Extras()
    assert from_openai(routed) == from_openai(direct)
    routed_c = parse_completion_request(GATEWAY_COMPLETION.encode())
    direct_c = parse_completion_request(b'{"prompt":"hi","max_tokens":5}')
    assert from_openai(routed_c) == from_openai(direct_c)
    routed_r = parse_responses_request(parse_responses_body(GATEWAY_RESPONSES.encode()))
    direct_r = responses(temperature=1.0, top_p=1.0, min_p=0.0)
    # top_k -1 is vLLM's and SGLang's "off", which is 0 here.
    assert routed_r.sampling_settings().top_k == 0
    assert from_responses(routed_r) == from_responses(direct_r)


def test_each_field_reaches_the_generation() -> None:
    request = from_openai(
        parse_chat_request(
            chat(ignore_eos=True, skip_special_tokens=False, no_stop_trim=True, stop=["x"])
        )
    )
    assert (request.ignore_eos, request.skip_special_tokens, request.include_stop_str) == (
        True,
        False,
        True,
    )
    # The API doors skip special tokens by default; the WebSocket writes them.
    assert from_openai(parse_chat_request(chat())).skip_special_tokens is True
    assert from_openai(parse_completion_request(completion())).skip_special_tokens is True
    vllm = from_openai(parse_completion_request(completion(include_stop_str_in_output=True)))
    assert vllm.include_stop_str is True
    thinking = from_openai(parse_chat_request(chat(separate_reasoning=False)))
    assert thinking.separate_reasoning is False
    r = from_responses(responses(ignore_eos=True, skip_special_tokens=False))
    assert (r.ignore_eos, r.skip_special_tokens) == (True, False)
    assert responses(repetition_penalty=1.3).sampling_settings().rep_pen == pytest.approx(1.3)


def test_continue_final_message_continues_the_assistant_turn() -> None:
    body = chat(
        messages=[*USER, {"role": "assistant", "content": "The capital of France is"}],
        continue_final_message=True,
        add_generation_prompt=False,
    )
    request = from_openai(parse_chat_request(body))
    assert request.assistant_prefix == "The capital of France is"
    assert [m["role"] for m in request.messages or ()] == ["user"]
    # Without it, a final assistant message is history and a new turn opens.
    plain = from_openai(
        parse_chat_request(chat(messages=[*USER, {"role": "assistant", "content": "Paris"}]))
    )
    assert plain.assistant_prefix == "" and len(plain.messages or ()) == 2


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (chat(continue_final_message=True), "messages[0]", "final message"),
        (
            chat(
                messages=[*USER, {"role": "assistant", "content": "{"}],
                continue_final_message=True,
                response_format={"type": "json_object"},
            ),
            "continue_final_message",
            "output format",
        ),
        (chat(add_generation_prompt=False), "add_generation_prompt", "continue_final_message"),
        (chat(return_hidden_states=True), "return_hidden_states", "hidden states"),
        (chat(priority=-3), "priority", "priority scheduling"),
        (chat(priority=True), "priority", "integer"),
        (chat(ignore_eos="yes"), "ignore_eos", "true or false"),
        (chat(skip_special_tokens=0), "skip_special_tokens", "true or false"),
        (chat(stream_reasoning=[]), "stream_reasoning", "true or false"),
        (
            chat(no_stop_trim=True, include_stop_str_in_output=False),
            "include_stop_str_in_output",
            "not both",
        ),
    ],
)
def test_chat_refuses_what_it_would_not_honour(body: bytes, param: str, says: str) -> None:
    error = refused(parse_chat_request, body)
    assert error.param == param and says in error.message


@pytest.mark.parametrize(
    "field", ["continue_final_message", "separate_reasoning", "stream_reasoning"]
)
def test_chat_fields_are_refused_by_name_elsewhere(field: str) -> None:
    error = refused(parse_completion_request, completion(**{field: True}))
    assert error.param == field and "/v1/chat/completions" in error.message
    with pytest.raises(OpenAIError) as caught:
        responses(**{field: True})
    assert caught.value.param == field


def test_null_is_the_default_and_no_op_values_are_taken() -> None:
    body = chat(ignore_eos=None, skip_special_tokens=None, priority=0, return_hidden_states=False)
    assert parse_chat_request(body).extras == Extras()
    assert responses(priority=None, return_hidden_states=None).extras == Extras()


def test_top_k_minus_one_is_off_and_other_negatives_are_refused() -> None:
    assert parse_chat_request(chat(top_k=-1)).sampling_settings().top_k == 0
    assert parse_completion_request(completion(top_k=-1)).sampling_settings().top_k == 0
    for parse, body in (
        (parse_chat_request, chat(top_k=-2)),
        (parse_chat_request, chat(top_k=-1.0)),
    ):
        assert refused(parse, body).param == "top_k"
    with pytest.raises(OpenAIError) as caught:
        responses(repetition_penalty=1.2, rep_pen=1.1)
    assert caught.value.param == "repetition_penalty"


def test_ignore_eos_takes_the_models_eos_out_of_the_stop_ids_but_not_the_clients() -> None:
    info = EngineInfo(
        engine="scripted",
        model_name="m",
        context_length=64,
        vocab_size=100,
        bos_token_id=None,
        eos_token_ids=frozenset({2}),
        max_batch=1,
    )
    ask = from_openai(parse_completion_request(completion(stop_token_ids=[7])))
    spec = build_spec(1, ask, [5, 6], info, max_new_tokens=4)
    assert spec.stop_token_ids == frozenset({2, 7}) and not spec.ignore_eos
    ask = from_openai(parse_completion_request(completion(stop_token_ids=[7], ignore_eos=True)))
    spec = build_spec(1, ask, [5, 6], info, max_new_tokens=4, kept_special=frozenset({"<t>"}))
    assert spec.stop_token_ids == frozenset({7}) and spec.ignore_eos
    assert spec.skip_special_tokens and spec.kept_special == frozenset({"<t>"})


def test_the_docs_table_is_the_declarations() -> None:
    doc = (ROOT / "docs" / "openai.md").read_text(encoding="utf-8")
    assert extension_table() in doc
    for extension in EXTENSIONS:
        assert f"`{extension.name}`" in doc
