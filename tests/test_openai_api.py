"""The OpenAI-compatible API's pure core: parsing, bounds, the mapping onto the
engine's spec, and responses that the official ``openai`` SDK's own types
parse."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion import Completion as CompletionChunk

from trioserve.engine.base import EngineInfo, GenerationSpec
from trioserve.generation import InvalidGeneration
from trioserve.generation.generation import build_spec as pipeline_build_spec
from trioserve.generation.generation import check_request, fit_prompt
from trioserve.openai import (
    SSE_DONE,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionStream,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionStream,
    OpenAIError,
    OpenAILimits,
    TokenUsage,
    chat_completion_response,
    completion_response,
    finish_reason,
    models_response,
    new_id,
    parse_chat_request,
    parse_completion_request,
)
from trioserve.server.doors import from_openai, openai_error
from trioserve.vocabulary.results import Finished
from trioserve.vocabulary.sampling import SamplingSettings

pytestmark = pytest.mark.unit

MODEL = EngineInfo(
    engine="scripted",
    model_name="SmolLM2-135M-Instruct",
    context_length=64,
    vocab_size=1000,
    bos_token_id=None,
    eos_token_ids=frozenset({2}),
    max_batch=1,
)


def build_spec(
    request: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    model: EngineInfo = MODEL,
    *,
    job_id: int,
    cap: int = 63,
) -> GenerationSpec:
    """The engine's job of an OpenAI request, through the one pipeline's pure
    steps (as the routes run them), its errors in OpenAI's terms."""
    generation = from_openai(request)
    try:
        check_request(generation, model, max_new_tokens=cap, renders_messages=True)
        fitted, new = fit_prompt(generation, ids, model, max_new_tokens=cap)
    except InvalidGeneration as exc:
        raise openai_error(exc) from None
    return pipeline_build_spec(job_id, generation, fitted, model, max_new_tokens=new)


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def chat(**fields: Any) -> ChatCompletionRequest:
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_chat_request(body(**fields))


def completion(**fields: Any) -> CompletionRequest:
    fields.setdefault("prompt", "Once upon a time")
    return parse_completion_request(body(**fields))


def refused(parse: Any, raw: bytes) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(raw)
    assert info.value.status == 400
    return info.value


def outcome(parse: Any, raw: bytes) -> OpenAIError | None:
    """None when ``raw`` parses, its error otherwise; anything else escapes."""
    try:
        parse(raw)
    except OpenAIError as error:
        return error
    return None


# -- parsing ----------------------------------------------------------------------


def test_defaults_are_openais() -> None:
    request = chat()
    assert request.max_tokens is None
    assert request.stream is False
    assert request.sampling_settings() == SamplingSettings(
        temperature=1.0, top_k=0, top_p=1.0, rep_pen=1.0, freq_pen=0.0, pres_pen=0.0
    )
    assert completion().max_tokens is None  # up to oa.COMPLETIONS_MAX_TOKENS


def test_every_openai_field_maps_onto_the_engine() -> None:
    request = chat(
        model="anything",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        stop=["\n\n", "User:"],
        seed=-3,
        presence_penalty=0.5,
        frequency_penalty=-1.5,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert request.model == "anything"
    assert request.stop == ("\n\n", "User:")
    assert request.include_usage
    settings = request.sampling_settings()
    assert (settings.temperature, settings.top_p, settings.seed) == (0.5, 0.9, -3)
    assert (settings.pres_pen, settings.freq_pen) == (0.5, -1.5)


def test_exllamav2_extensions_are_accepted() -> None:
    request = completion(
        top_k=40,
        min_p=0.05,
        typical=0.9,
        top_a=0.2,
        skew=0.5,
        rep_pen=1.1,
        token_healing=True,
        bann_bann=[5, 6],
        stop_token_ids=[7],
    )
    settings = request.sampling_settings()
    assert (settings.top_k, settings.min_p, settings.typical) == (40, 0.05, 0.9)
    assert (settings.top_a, settings.skew, settings.rep_pen) == (0.2, 0.5, 1.1)
    assert request.token_healing
    assert request.bann_bann == (5, 6)
    assert completion(repetition_penalty=1.2).sampling_settings().rep_pen == 1.2
    assert completion(repetition_penalty=1.2, rep_pen=1.2).sampling_settings().rep_pen == 1.2
    error = refused(parse_completion_request, body(prompt="x", repetition_penalty=1.2, rep_pen=1.3))
    assert "not both" in error.message


def test_top_p_zero_means_the_most_likely_token() -> None:
    settings = chat(top_p=0).sampling_settings()
    assert (settings.top_p, settings.top_k) == (1.0, 1)


def test_max_completion_tokens_is_max_tokens() -> None:
    assert chat(max_completion_tokens=9).max_tokens == 9
    assert chat(max_completion_tokens=9, max_tokens=9).max_tokens == 9
    refused(
        parse_chat_request,
        body(messages=[{"role": "user", "content": "x"}], max_tokens=3, max_completion_tokens=4),
    )


def test_stop_as_one_string() -> None:
    assert completion(stop="END").stop == ("END",)
    assert completion(stop=None).stop == ()


def test_null_means_default() -> None:
    request = chat(temperature=None, top_p=None, seed=None, stream=None, stop=None, max_tokens=None)
    assert request.sampling_settings().temperature == 1.0
    assert completion(max_tokens=None).max_tokens is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 1.01}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1e30}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": 1e30}, "top_k"),
        ({"rep_pen": 1e-300}, "rep_pen"),
        ({"rep_pen": 0}, "rep_pen"),
        ({"skew": 1e308}, "skew"),
        ({"min_p": 2}, "min_p"),
        ({"stream": "yes"}, "stream"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 5]}, "stop[1]"),
        ({"stop": [""]}, "stop[0]"),
        ({"stop": ["x"] * 65}, "stop"),
        ({"stop": ["x" * 1025]}, "stop[0]"),
        ({"bann_bann": [-1]}, "bann_bann[0]"),
        ({"bann_bann": list(range(OpenAILimits().max_banned_ids + 1))}, "bann_bann"),
        ({"model": 5}, "model"),
        ({"n": 0}, "n"),
        ({"n": 9}, "n"),
        ({"n": True}, "n"),
        ({"n": "2"}, "n"),
        ({"n": 2.5}, "n"),
        ({"n": 2**70}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"n": 2, "best_of": 9}, "best_of"),
        ({"best_of": 0}, "best_of"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": "5"}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_tokens": 0, "logprobs": 1}, "max_tokens"),
        ({"max_tokens": 0, "logprobs": 1, "echo": True, "stream": True}, "stream"),
        ({"logprobs": 1, "echo": True, "stream": True}, "stream"),
        ({"logit_bias": {"x": -100}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, 'logit_bias["5"]'),
        ({"suffix": "end"}, "suffix"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"nope": True}}, "stream_options.nope"),
        ({"stream": True, "stream_options": []}, "stream_options"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": "\ud800"}, "prompt"),
    ],
)
def test_bad_completion_fields_name_their_param(fields: dict[str, Any], param: str) -> None:
    fields.setdefault("prompt", "x")
    error = refused(parse_completion_request, body(**fields))
    assert error.param == param
    payload = json.loads(error.body())
    assert payload["error"]["param"] == param
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["message"] == error.message


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "user", "content": "x"}] * 4097, "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        # A tool result needs the call it answers, and says which.
        ([{"role": "tool", "content": "x", "tool_call_id": "1"}], "messages[0].tool_call_id"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        ([{"role": "function", "content": "x", "name": "f"}], "messages[0].name"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0].type",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            "messages[0].content[0].text",
        ),
        ([{"role": "user", "content": "x", "name": 7}], "messages[0].name"),
        ([{"role": "user", "content": "x", "colour": "red"}], "messages[0].colour"),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
            "messages[0].tool_calls[0].function",
        ),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"id": 5}]}],
            "messages[0].tool_calls[0].id",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "a",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "content": "1", "tool_call_id": "a"},
                {"role": "tool", "content": "2", "tool_call_id": "a"},
            ],
            "messages[2].tool_call_id",
        ),
    ],
)
def test_bad_messages_name_their_param(messages: Any, param: str) -> None:
    error = refused(parse_chat_request, body(messages=messages))
    assert error.param == param


def test_message_forms() -> None:
    request = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
            },
            {"role": "assistant", "content": None, "refusal": None},
            {"role": "user", "content": "three", "name": "bob"},
        ]
    )
    assert request.messages == (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "one\ntwo"),
        ChatMessage("assistant", ""),
        ChatMessage("user", "three", name="bob"),
    )
    assert request.template_messages()[3] == {"role": "user", "content": "three", "name": "bob"}


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 1, "best_of": None, "logprobs": None, "logit_bias": {}, "suffix": None, "user": "u1"},
        {"tools": [], "tool_choice": "none", "parallel_tool_calls": False, "logprobs": False},
        {"response_format": {"type": "text"}, "top_logprobs": None, "modalities": ["text"]},
        {"metadata": {"a": "b"}, "store": False, "service_tier": "auto", "reasoning_effort": "low"},
        {"stream": True, "stream_options": {"include_usage": False, "include_obfuscation": True}},
    ],
)
def test_fields_that_ask_for_nothing_are_accepted(fields: dict[str, Any]) -> None:
    # Accepted, and the generation is the one asked for without them.
    assert from_openai(chat(**fields)) == from_openai(chat())


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy"}}, "audio"),
    ],
)
def test_fields_that_would_change_the_output_are_refused(
    fields: dict[str, Any], param: str
) -> None:
    fields["messages"] = [{"role": "user", "content": "x"}]
    error = refused(parse_chat_request, body(**fields))
    assert error.param == param
    assert error.code == "unsupported_parameter"


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"[]",
        b'"x"',
        b"\xff\xfe",
        b'{"prompt": NaN}',
        b'{"prompt": 1e999}',
        b"[" * 100_000,
    ],
)
def test_malformed_bodies_are_400(raw: bytes) -> None:
    error = refused(parse_completion_request, raw)
    assert error.param is None


@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_no_body_crashes_the_parser(raw: bytes) -> None:
    for parse in (parse_completion_request, parse_chat_request):
        error = outcome(parse, raw)
        if error is not None:
            assert error.status == 400
            json.loads(error.body())


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
field_names = st.sampled_from(
    [
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "stop",
        "n",
        "tools",
        "stream",
        "stream_options",
        "seed",
        "top_k",
    ]
) | st.text(max_size=10)


@given(st.dictionaries(field_names, json_values, max_size=6))
def test_arbitrary_objects_parse_or_get_a_400(obj: dict[str, Any]) -> None:
    raw = json.dumps(obj).encode()
    for parse in (parse_completion_request, parse_chat_request):
        error = outcome(parse, raw)
        if error is not None:
            assert error.status == 400
            assert isinstance(error.message, str) and error.message


def test_limits_are_configurable() -> None:
    limits = OpenAILimits(max_stop_strings=2, max_messages=1)
    error = refused(
        lambda raw: parse_completion_request(raw, limits), body(prompt="x", stop=["a", "b", "c"])
    )
    assert "at most 2" in error.message
    messages = [{"role": "user", "content": "x"}] * 2
    refused(lambda raw: parse_chat_request(raw, limits), body(messages=messages))


# -- the engine's job -----------------------------------------------------------


def test_build_spec() -> None:
    request = completion(max_tokens=5, stop=["\n"], stop_token_ids=[9], bann_bann=[4], seed=1)
    spec = build_spec(request, [1, 2, 3], job_id=77)
    assert spec.job_id == 77
    assert spec.prompt_ids == (1, 2, 3)
    assert spec.max_new_tokens == 5
    assert spec.stop_strings == ("\n",)
    assert spec.stop_token_ids == {2, 9}
    assert spec.banned_ids == {4}
    assert spec.sampling.seed == 1


def test_chat_without_max_tokens_gets_the_rest_of_the_context() -> None:
    spec = build_spec(chat(), list(range(40)), job_id=1)
    assert spec.max_new_tokens == 24
    assert build_spec(chat(), [1], job_id=1, cap=10).max_new_tokens == 10


@pytest.mark.parametrize(
    ("request_", "ids", "param", "code"),
    [
        (completion(max_tokens=63), [1, 2], "max_tokens", "context_length_exceeded"),
        (completion(max_tokens=64), [1], "max_tokens", None),
        (chat(), list(range(64)), "messages", "context_length_exceeded"),
        (completion(), [], "prompt", None),
        (completion(prompt=[1, 5000]), [1, 5000], "prompt", None),
        (completion(bann_bann=[1000]), [1], "bann_bann[0]", None),
        (completion(stop_token_ids=[99999]), [1], "stop_token_ids[0]", None),
    ],
)
def test_build_spec_refuses(
    request_: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    param: str,
    code: str | None,
) -> None:
    with pytest.raises(OpenAIError) as info:
        build_spec(request_, ids, job_id=1)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.code == code


# -- responses, read back by the openai SDK's own types ----------------------------


USAGE = TokenUsage(prompt_tokens=10, completion_tokens=4, cached_tokens=3)


def test_completion_response_parses_as_the_sdks_completion() -> None:
    raw = completion_response(
        id=new_id("cmpl"),
        created=1700000000,
        model=MODEL.model_name,
        choices=[CompletionChoice(text=" there", finish_reason="stop")],
        usage=USAGE,
    )
    parsed = Completion.model_validate(json.loads(raw))
    assert parsed.object == "text_completion"
    assert parsed.id.startswith("cmpl-")
    assert parsed.choices[0].text == " there"
    assert parsed.choices[0].finish_reason == "stop"
    assert parsed.usage is not None
    assert (
        parsed.usage.prompt_tokens,
        parsed.usage.completion_tokens,
        parsed.usage.total_tokens,
    ) == (10, 4, 14)
    assert parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 3


def test_chat_completion_response_parses_as_the_sdks_chat_completion() -> None:
    raw = chat_completion_response(
        id=new_id("chatcmpl"),
        created=1700000000,
        model=MODEL.model_name,
        choices=[ChatChoice(content="Paris.", finish_reason="length")],
        usage=USAGE,
    )
    parsed = ChatCompletion.model_validate(json.loads(raw))
    assert parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].message.content == "Paris."
    assert parsed.choices[0].finish_reason == "length"
    assert parsed.usage is not None and parsed.usage.total_tokens == 14


def events(raw: bytes) -> list[Any]:
    """Split a stream into its events' data, as an SSE client does."""
    assert raw.endswith(b"\n\n")
    out: list[Any] = []
    for event in raw.decode().split("\n\n")[:-1]:
        assert event.startswith("data: ") and "\n" not in event
        data = event.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_events_parse_as_the_sdks_chunks(include_usage: bool) -> None:
    stream = ChatCompletionStream(
        id="chatcmpl-1", created=1, model=MODEL.model_name, include_usage=include_usage
    )
    raw = stream.start() + stream.text("Hel") + stream.text("lo\n") + stream.finish("stop", USAGE)
    data = events(raw)
    assert data[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(d) for d in data[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello\n"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons == [None, None, None, "stop"]
    if include_usage:
        assert chunks[-1].choices == []
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        assert all(c.usage is None for c in chunks[:-1])
    else:
        assert all(c.usage is None for c in chunks)
        assert all("usage" not in d for d in data[:-1])


def test_completion_stream_events_parse_as_the_sdks_completions() -> None:
    stream = CompletionStream(id="cmpl-1", created=1, model=MODEL.model_name, include_usage=True)
    raw = stream.text("a") + stream.finish("length", USAGE, text="b")
    first, last, usage, done = events(raw)
    assert done == "[DONE]"
    # The SDK's Completion type wants a finish reason, which chunks before
    # the last one do not have yet (OpenAI sends null there too).
    assert first["choices"] == [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]
    assert first["object"] == "text_completion" and first["usage"] is None
    parsed = CompletionChunk.model_validate(last)
    assert parsed.choices[0].text == "b"
    assert parsed.choices[0].finish_reason == "length"
    parsed = CompletionChunk.model_validate(usage)
    assert parsed.choices == []
    assert parsed.usage is not None and parsed.usage.prompt_tokens == 10


def test_stream_error_event_is_openais_error_shape() -> None:
    stream = ChatCompletionStream(id="chatcmpl-1", created=1, model="m", include_usage=False)
    data = events(stream.error(OpenAIError(503, "the server is shutting down")))
    assert data[0]["error"]["message"] == "the server is shutting down"
    assert data[0]["error"]["type"] == "server_error"
    assert data[1] == "[DONE]"
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_text_with_newlines_and_unicode_stays_one_event() -> None:
    stream = CompletionStream(id="cmpl-1", created=1, model="m", include_usage=False)
    [data] = events(stream.text("a\n\nb\r\n日本 🙂"))
    assert data["choices"][0]["text"] == "a\n\nb\r\n日本 🙂"


def test_models_response_parses_as_the_sdks_models() -> None:
    data = json.loads(models_response([(MODEL.model_name, {})], 1700000000))
    assert data["object"] == "list"
    [model] = [Model.model_validate(m) for m in data["data"]]
    assert model.id == MODEL.model_name
    assert model.owned_by == "trioserve"


def test_finish_reasons() -> None:
    def finished(reason: Any) -> Finished:
        return Finished(
            job_id=1,
            text="",
            reason=reason,
            stop_string=None,
            stop_token=None,
            prompt_tokens=1,
            generated_tokens=1,
        )

    assert finish_reason(finished("max_new_tokens")) == "length"
    assert finish_reason(finished("stop_token")) == "stop"
    assert finish_reason(finished("stop_string")) == "stop"


def test_retry_after_header() -> None:
    error = OpenAIError(503, "busy", retry_after=1)
    assert error.headers() == [("Retry-After", "1")]
    assert OpenAIError(400, "bad").headers() == []


def test_the_doc_table_is_the_declared_one() -> None:
    from pathlib import Path

    from trioserve.openai.fields import field_table

    doc = Path(__file__).resolve().parents[1] / "docs" / "openai.md"
    assert field_table() in doc.read_text(encoding="utf-8")


# -- every parameter the official SDK sends is known and documented ---------------------

#: The SDK's own transport arguments, not body fields.
_SDK_TRANSPORT = frozenset({"self", "extra_headers", "extra_query", "extra_body", "timeout"})


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_every_sdk_parameter_is_known_and_documented(route: str) -> None:
    import inspect
    from pathlib import Path

    from openai.resources.chat.completions import Completions as ChatResource
    from openai.resources.completions import Completions as CompletionResource

    resource = ChatResource if route == "chat" else CompletionResource
    params = [p for p in inspect.signature(resource.create).parameters if p not in _SDK_TRANSPORT]
    assert len(params) > 15  # the SDK's signature was read, not an empty list
    doc = (Path(__file__).parents[1] / "docs" / "openai.md").read_text(encoding="utf-8")
    parse = parse_chat_request if route == "chat" else parse_completion_request
    base: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "x"}]} if route == "chat" else {"prompt": "x"}
    )
    for param in params:
        assert f"`{param}`" in doc, f"docs/openai.md does not say what becomes of {param}"
        # Accepted, ignored, or refused naming it: never an unknown field.
        code = None
        try:
            parse(body(**{**base, param: base.get(param)}))
        except OpenAIError as exc:
            code = exc.code
        assert code != "unknown_parameter", param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": []}}, "response_format.type"),
        (
            {"messages": [{"role": "user", "content": [{"type": {}}]}]},
            "messages[0].content[0].type",
        ),
    ],
)
def test_a_list_or_object_where_a_type_name_goes_is_a_400(
    fields: dict[str, Any], param: str
) -> None:
    """Found by the Responses door's hostile tests: a value that cannot be
    hashed, looked up among the known names, was the server's 500."""
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    assert refused(parse_chat_request, body(**fields)).param == param


def test_thinking_is_switched_by_reasoning_effort_or_enable_thinking() -> None:
    assert chat().thinking is None
    assert chat(reasoning_effort="none").thinking is False
    assert chat(reasoning_effort="high").thinking is None
    assert chat(chat_template_kwargs={"enable_thinking": False}).thinking is False
    assert chat(chat_template_kwargs={"enable_thinking": True}).thinking is True


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"reasoning_effort": ["none"]}, "reasoning_effort"),
        ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tools_in_user_message": True}}, "chat_template_kwargs"),
        (
            {"chat_template_kwargs": {"enable_thinking": "no"}},
            "chat_template_kwargs.enable_thinking",
        ),
        (
            {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
            "chat_template_kwargs.enable_thinking",
        ),
    ],
)
def test_a_bad_thinking_switch_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    assert refused(parse_chat_request, body(**fields)).param == param
