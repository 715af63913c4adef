"""The wire codec: round trips, strict validation, and error frames that
match protocol.md section 5 for any input."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import (
    KNOWN_KEYS,
    json_values,
    replies,
    requests_objects,
    valid_request_pairs,
)
from trioserve import protocol as p
from trioserve.errors import TrioserveError
from trioserve.vocabulary.sampling import SamplingSettings

pytestmark = pytest.mark.unit


def decode_error(frame: str | bytes) -> p.ProtocolError:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_request(frame)
    return info.value


def infer_frame(**fields: Any) -> str:
    return json.dumps({"action": "infer", "text": "hi", "max_new_tokens": 8, **fields})


def check_error_frame(error: p.ProtocolError, obj: Any) -> None:
    """An error frame as protocol.md section 5 describes it, echoing what
    could be read of ``obj`` (the decoded request, when it was JSON)."""
    frame = json.loads(p.encode_reply(error.reply()))
    assert frame["response_type"] == "error"
    assert set(frame["error"]) <= {"type", "message", "field"}
    assert frame["error"]["type"] in p.ERROR_TYPES
    assert isinstance(frame["error"]["message"], str)
    assert frame["error"]["message"]
    assert not frame["error"]["message"][0].isupper()
    if error.field is None:
        assert "field" not in frame["error"]
    else:
        assert frame["error"]["field"] == error.field
        assert error.field.startswith("$")
    action = frame["action"]
    assert action is None or isinstance(action, str)
    if isinstance(obj, dict):
        if isinstance(obj.get("action"), str):
            assert action == obj["action"]
        else:
            assert action is None
        expected_keys = ["request_id", "response_id"]
        if obj.get("action") == "infer":
            expected_keys.append("tag")
        for key in expected_keys:
            if key in obj:
                assert json.dumps(frame[key]) == json.dumps(obj[key])
            else:
                assert key not in frame
        if obj.get("action") != "infer":
            assert "tag" not in frame
    else:
        assert action is None
        assert set(frame) == {"action", "response_type", "error"}
        assert frame["error"]["type"] == "invalid_json"
    # The frame decodes back to the same error reply.
    assert p.decode_reply(p.encode_reply(error.reply())) == error.reply()


# --------------------------------------------------------------------------
# Round trips


@given(valid_request_pairs())
def test_valid_frames_decode_to_the_request_built_directly(
    pair: tuple[dict[str, Any], Any],
) -> None:
    frame, expected = pair
    assert p.decode_request(json.dumps(frame)) == expected


@given(requests_objects())
def test_requests_round_trip(request: p.Request) -> None:
    assert p.decode_request(p.encode_request(request)) == request


@given(replies())
def test_replies_round_trip(reply: p.Reply) -> None:
    text = p.encode_reply(reply)
    assert p.decode_reply(text) == reply
    assert json.loads(text) == p.unstructure_reply(reply)


@given(replies())
def test_reply_frames_have_the_documented_envelope(reply: p.Reply) -> None:
    frame = p.unstructure_reply(reply)
    assert next(iter(frame)) == "action"
    for key, value in reply.echoed.items():
        assert frame[key] == value
    if isinstance(reply, p.InferChunk):
        assert frame["response_type"] == "chunk"
        assert ("response" in frame) == (reply.response is not None)
    elif isinstance(reply, p.InferFinal):
        assert frame["response_type"] == "full"
        for key in ("eos_reason", "stop_string", "stop_token"):
            assert key in frame
        assert set(frame["usage"]) == {
            "prompt_tokens",
            "trimmed_tokens",
            "generated_tokens",
            "cached_tokens",
        }
        assert set(frame["timing"]) == {"queued_s", "first_token_s", "total_s"}
    elif isinstance(reply, p.ErrorReply):
        assert frame["response_type"] == "error"
    else:
        assert "response_type" not in frame


def test_encoded_frames_are_compact_and_keep_unicode() -> None:
    text = p.encode_reply(p.InferChunk(chunk="héllo 世界", echoed={"request_id": 1}))
    assert text == '{"action":"infer","request_id":1,"response_type":"chunk","chunk":"héllo 世界"}'


# --------------------------------------------------------------------------
# Anything in, only ProtocolError out


@given(json_values(20))
def test_any_json_value_gets_a_request_or_an_error_frame(obj: Any) -> None:
    try:
        p.decode_request(json.dumps(obj))
    except p.ProtocolError as error:
        check_error_frame(error, obj)


@given(
    st.dictionaries(
        st.sampled_from(KNOWN_KEYS) | st.text(max_size=6),
        json_values(6),
        max_size=8,
    ),
    st.sampled_from((*p.ACTIONS, "nope")),
)
def test_any_object_with_an_action_gets_a_request_or_an_error_frame(
    obj: dict[str, Any], action: str
) -> None:
    obj = {"action": action, **obj} if "action" not in obj else obj
    try:
        request = p.structure_request(obj)
    except p.ProtocolError as error:
        check_error_frame(error, obj)
    else:
        assert p.structure_request(p.unstructure_request(request)) == request


@given(st.text())
def test_any_text_gets_a_request_or_an_error_frame(frame: str) -> None:
    try:
        p.decode_request(frame)
    except p.ProtocolError as error:
        failure = error
    else:
        return
    assert failure.error_type in p.ERROR_TYPES
    p.encode_reply(failure.reply()).encode("utf-8")


@given(st.binary())
def test_binary_frames_are_invalid_json(frame: bytes) -> None:
    error = decode_error(frame)
    assert error.error_type == "invalid_json"
    check_error_frame(error, None)


@pytest.mark.parametrize(
    "frame",
    [
        "",
        "{",
        "nope",
        "NaN",
        '{"action": "echo", "request_id": NaN}',
        '{"action": "echo", "request_id": Infinity}',
        '{"action": "echo", "request_id": -Infinity}',
        "[1, 2]",
        '"echo"',
        "null",
        "[" * 100_000,
        '{"action": "echo", "request_id": "\\ud800"}',
        '{"action": "echo", "request_id": "\ud800"}',
        "1" * 5000,
        '{"action": "infer", "text": "", "max_new_tokens": 1e999}',
        '{"action": "echo", "request_id": -1e400}',
    ],
)
def test_frames_that_are_not_json_objects_are_invalid_json(frame: str) -> None:
    error = decode_error(frame)
    assert error.error_type == "invalid_json"
    assert error.action is None
    assert error.echoed == {}
    check_error_frame(error, None)


def test_escaped_surrogate_pairs_are_fine() -> None:
    request = p.decode_request('{"action": "estimate_token", "text": "\\ud83d\\ude00"}')
    assert request == p.EstimateTokenRequest(text="😀")


# --------------------------------------------------------------------------
# The envelope


def test_action_is_required_and_ids_are_still_echoed() -> None:
    error = decode_error('{"request_id": 7, "response_id": "r", "tag": 1}')
    assert (error.error_type, error.field, error.action) == ("invalid_request", "$.action", None)
    assert error.echoed == {"request_id": 7, "response_id": "r"}


@pytest.mark.parametrize("action", [5, None, True, ["infer"], {"a": 1}])
def test_action_must_be_a_string(action: Any) -> None:
    error = decode_error(json.dumps({"action": action, "request_id": 1}))
    assert (error.error_type, error.field, error.action) == ("invalid_request", "$.action", None)
    assert repr(action) in error.message
    assert error.echoed == {"request_id": 1}


def test_unknown_action_lists_the_known_ones() -> None:
    error = decode_error('{"action": "generate", "response_id": [1]}')
    assert error.error_type == "unknown_action"
    assert error.action == "generate"
    assert error.echoed == {"response_id": [1]}
    assert "'generate'" in error.message
    for action in p.ACTIONS:
        assert action in error.message


@pytest.mark.parametrize(("key", "field"), [("top_kk", "$.top_kk"), ("a b", '$["a b"]')])
def test_unknown_keys_are_named(key: str, field: str) -> None:
    error = decode_error(infer_frame(**{key: 1}, request_id=3, tag="t"))
    assert (error.error_type, error.field, error.action) == ("invalid_request", field, "infer")
    assert repr(key) in error.message
    assert error.echoed == {"request_id": 3, "tag": "t"}


def test_tag_belongs_to_infer_only() -> None:
    error = decode_error('{"action": "echo", "tag": 1}')
    assert (error.error_type, error.field) == ("invalid_request", "$.tag")
    assert error.echoed == {}


def test_echoed_is_not_a_wire_field() -> None:
    error = decode_error('{"action": "echo", "echoed": {"request_id": 1}}')
    assert (error.error_type, error.field) == ("invalid_request", "$.echoed")


def test_ids_are_echoed_unchanged_in_order() -> None:
    request = p.decode_request(
        '{"tag": {"x": [1]}, "response_id": null, "action": "infer", "text": "",'
        ' "max_new_tokens": 1, "request_id": 1.5}'
    )
    assert list(request.echoed.items()) == [
        ("request_id", 1.5),
        ("response_id", None),
        ("tag", {"x": [1]}),
    ]


# --------------------------------------------------------------------------
# Infer fields

#: (wire field, bad JSON text) for every infer field: wrong type, bool for a
#: number, out of range, a fraction for an int, and an overflowing number.
BAD_INFER_FIELDS: list[tuple[str, str]] = [
    ("text", "5"),
    ("text", "null"),
    ("model", "5"),
    ("model", '""'),
    ("model", '["m"]'),
    ("max_new_tokens", "0"),
    ("max_new_tokens", "-3"),
    ("max_new_tokens", "2.5"),
    ("max_new_tokens", "true"),
    ("max_new_tokens", '"8"'),
    ("stream", "1"),
    ("stream", '"true"'),
    ("stream_full", "0"),
    ("top_k", "-1"),
    ("top_k", "1.5"),
    ("top_k", "false"),
    ("top_p", "1.01"),
    ("top_p", "-0.1"),
    ("top_p", "true"),
    ("top_a", "-1"),
    ("min_p", "2"),
    ("typical", "-1e-9"),
    ("temperature", "-0.5"),
    ("temperature", '"hot"'),
    ("skew", "true"),
    ("skew", "[1]"),
    ("rep_pen", "0"),
    ("rep_pen", "-1"),
    ("freq_pen", "null"),
    ("pres_pen", "{}"),
    ("customBos", "1"),
    ("stop_conditions", '""'),
    ("stop_conditions", "1.5"),
    ("stop_conditions", "true"),
    ("stop_conditions", "{}"),
    ("bann_bann", '"5"'),
    ("bann_bann", "true"),
    ("bann_bann", "null"),
    ("token_healing", "1"),
    ("seed", "null"),
    ("seed", "0.5"),
    ("seed", "true"),
    ("seed", str(2**64)),
    ("compact_chunks", "0"),
    ("messages", "5"),
    ("messages", "[]"),
    ("messages", '"hi"'),
    ("dry_multiplier", "-0.5"),
    ("dry_multiplier", "101"),
    ("dry_base", "0.5"),
    ("dry_base", "1e308"),
    ("dry_allowed_length", "0"),
    ("dry_allowed_length", "21"),
    ("dry_allowed_length", "2.5"),
    ("dry_range", "20"),
    ("dry_range", "-1"),
    ("dry_range", str(2**31)),
    ("dry_sequence_breakers", '"\\n"'),
    ("dry_sequence_breakers", "null"),
    ("xtc_probability", "1.5"),
    ("xtc_probability", "true"),
    ("xtc_threshold", "-0.1"),
    ("mirostat", "1"),
    ("mirostat", '"true"'),
    ("mirostat_tau", "-1"),
    ("mirostat_tau", "1e30"),
    ("mirostat_eta", "11"),
    ("min_temp", "-1"),
    ("max_temp", "1e30"),
    ("temp_exponent", "101"),
    ("smoothing_factor", "-0.1"),
    ("smoothing_factor", "1e308"),
    ("temperature_last", "0"),
    ("logit_bias", "[]"),
    ("logit_bias", "null"),
    ("logit_bias", '"5"'),
    ("min_tokens", "-1"),
    ("min_tokens", "2.5"),
    ("min_tokens", str(2**31)),
    # Beyond what the engines can represent (issue 8): each must be named, not
    # reach a sampling step.
    ("top_k", str(2**31)),
    ("top_k", str(2**63)),
    ("top_k", "1e30"),
    ("top_k", "1e308"),
    ("temperature", "1e30"),
    ("temperature", "1001"),
    ("rep_pen", "1e-300"),
    ("rep_pen", "0.001"),
    ("rep_pen", "101"),
    ("pres_pen", "-1e308"),
    ("freq_pen", "1e30"),
    ("skew", "1e308"),
    ("top_a", "1e308"),
    # Constraints (issue 18): the right type and within their bounds.
    ("json_schema", "[]"),
    ("json_schema", '"{}"'),
    ("json_schema", "null"),
    ("regex", '""'),
    ("regex", "5"),
    ("choice", "[]"),
    ("choice", '"yes"'),
    ("grammar", '""'),
    ("grammar", "null"),
    ("grammar", "{}"),
    ("logprobs", "21"),
    ("logprobs", "-1"),
    ("logprobs", "true"),
    ("logprobs", "1.5"),
]


@pytest.mark.parametrize(("field", "bad"), BAD_INFER_FIELDS)
def test_each_bad_infer_field_is_named(field: str, bad: str) -> None:
    # messages replaces text (exactly one of them is given).
    prompt = "" if field == "messages" else '"text": "hi", '
    frame = (
        f'{{"action": "infer", "request_id": "r1", "tag": [2], {prompt}'
        f'"max_new_tokens": 8, "{field}": {bad}}}'
    )
    error = decode_error(frame)
    assert error.error_type == "invalid_request"
    assert error.field == f"$.{field}"
    assert error.message.startswith(f"{field} must be ")
    assert error.message.endswith(f"got {json.loads(bad)!r}")
    assert error.action == "infer"
    assert error.echoed == {"request_id": "r1", "tag": [2]}
    check_error_frame(error, json.loads(frame))


@pytest.mark.parametrize(
    ("field", "bad", "said"),
    [
        (
            "json_schema",
            '{"enum": [' + ",".join(["12345678"] * 8000) + "]}",
            "more than 65536 bytes",
        ),
        ("regex", '"' + "a" * 4097 + '"', "4097 characters"),
        ("grammar", '"' + "g" * 65537 + '"', "65537 characters"),
        ("choice", "[" + ",".join(['"x"'] * 1025) + "]", "1025"),
        ("choice", '["' + "y" * 257 + '"]', "257 characters"),
    ],
)
def test_constraints_beyond_their_bounds_are_named(field: str, bad: str, said: str) -> None:
    frame = f'{{"action": "infer", "text": "hi", "max_new_tokens": 8, "{field}": {bad}}}'
    error = decode_error(frame)
    assert error.error_type == "invalid_request"
    assert error.field in (f"$.{field}", f"$.{field}[0]")
    assert "must " in error.message and error.message.endswith(f"got {said}")


def test_two_constraints_are_refused_naming_both() -> None:
    frame = '{"action": "infer", "text": "hi", "max_new_tokens": 8, "regex": "a+", "choice": ["b"]}'
    error = decode_error(frame)
    assert (error.error_type, error.field) == ("invalid_request", "$.choice")
    assert "regex and choice" in error.message


def test_every_infer_field_has_a_bad_value_case() -> None:
    assert {field for field, _ in BAD_INFER_FIELDS} == set(p.INFER_FIELDS)
    assert set(p.INFER_FIELDS) == {
        "text",
        "max_new_tokens",
        *p.INFER_DEFAULTS,
        "seed",
        "messages",
        "json_schema",
        "regex",
        "choice",
        "grammar",
        "logprobs",
        "model",
    }


@pytest.mark.parametrize(
    ("field", "bad", "path"),
    [
        ("stop_conditions", ["a", 1, ""], "$.stop_conditions[2]"),
        ("stop_conditions", [None], "$.stop_conditions[0]"),
        ("stop_conditions", ["x", True], "$.stop_conditions[1]"),
        ("bann_bann", [1, 2.5], "$.bann_bann[1]"),
        ("bann_bann", [False], "$.bann_bann[0]"),
        ("choice", ["a", ""], "$.choice[1]"),
        ("choice", ["a", 5], "$.choice[1]"),
    ],
)
def test_bad_list_elements_are_named_by_index(field: str, bad: list[Any], path: str) -> None:
    error = decode_error(infer_frame(**{field: bad}))
    assert error.field == path
    assert error.message.startswith(path[2:] + " must be ")


@pytest.mark.parametrize(
    "field", ["top_p", "top_a", "min_p", "typical", "temperature", "skew", "rep_pen", "freq_pen"]
)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_rejected(field: str, bad: float) -> None:
    # JSON text cannot hold them (the parser rejects NaN and overflowing
    # literals such as 1e999), but a caller may hand over a parsed object.
    with pytest.raises(p.ProtocolError) as info:
        p.structure_request({"action": "infer", "text": "", "max_new_tokens": 1, field: bad})
    assert info.value.field == f"$.{field}"


@pytest.mark.parametrize("field", ["text", "max_new_tokens"])
def test_required_infer_fields(field: str) -> None:
    obj = {"action": "infer", "text": "hi", "max_new_tokens": 3, "tag": None}
    del obj[field]
    error = decode_error(json.dumps(obj))
    assert (error.error_type, error.field) == ("invalid_request", f"$.{field}")
    assert error.message.startswith(f"{field} is required")
    assert error.echoed == {"tag": None}


def test_defaults_are_the_seed_servers() -> None:
    request = p.decode_request('{"action": "infer", "text": "hi", "max_new_tokens": 5}')
    assert isinstance(request, p.InferRequest)
    assert (request.top_k, request.top_p, request.temperature, request.rep_pen) == (
        100,
        0.8,
        0.9,
        1.05,
    )
    assert (request.top_a, request.min_p, request.typical, request.skew) == (0, 0, 0, 0)
    assert (request.freq_pen, request.pres_pen) == (0, 0)
    assert (request.stream, request.stream_full, request.token_healing) == (False, False, False)
    assert (request.custom_bos, request.stop_conditions, request.bann_bann) == ("", (), ())
    assert request.seed is None
    assert request.messages is None
    assert request.compact_chunks is False
    assert request.echoed == {}
    # The engine's own defaults agree with the protocol's.
    assert request.sampling_settings() == SamplingSettings()


def test_integral_floats_are_accepted_for_ints() -> None:
    request = p.decode_request(
        infer_frame(max_new_tokens=200.0, top_k=5.0, seed=-3.0, stop_conditions=[2.0, "s"])
    )
    assert isinstance(request, p.InferRequest)
    assert request.max_new_tokens == 200
    assert type(request.max_new_tokens) is int
    assert type(request.top_k) is int
    assert request.seed == -3
    assert request.stop_conditions == (2, "s")
    assert type(request.stop_conditions[0]) is int
    lefttrim = p.decode_request('{"action": "lefttrim_token", "text": "x", "trimmed_length": 3.0}')
    assert lefttrim == p.LefttrimTokenRequest(text="x", trimmed_length=3)


def test_ints_are_accepted_for_floats() -> None:
    request = p.decode_request(infer_frame(top_p=1, temperature=0, rep_pen=2))
    assert isinstance(request, p.InferRequest)
    assert (request.top_p, request.temperature, request.rep_pen) == (1.0, 0.0, 2.0)
    assert all(type(x) is float for x in (request.top_p, request.temperature, request.rep_pen))


def test_single_stop_condition_and_banned_id() -> None:
    request = p.decode_request(infer_frame(stop_conditions="\n\n", bann_bann=7))
    assert isinstance(request, p.InferRequest)
    assert request.stop_conditions == ("\n\n",)
    assert request.bann_bann == (7,)
    mixed = p.decode_request(infer_frame(stop_conditions=["a", 2, "b", 3]))
    assert isinstance(mixed, p.InferRequest)
    assert mixed.stop_strings == ("a", "b")
    assert mixed.stop_token_ids == frozenset({2, 3})


def test_custom_bos_has_its_wire_name() -> None:
    request = p.decode_request(infer_frame(customBos="<s>"))
    assert isinstance(request, p.InferRequest)
    assert request.custom_bos == "<s>"
    assert p.unstructure_request(request)["customBos"] == "<s>"
    assert decode_error(infer_frame(custom_bos="<s>")).field == "$.custom_bos"


def test_bad_values_are_shown_short() -> None:
    error = decode_error(infer_frame(top_k="x" * 100_000))
    assert len(error.message) < 200
    assert error.message.endswith("...")


# --------------------------------------------------------------------------
# Other actions


@pytest.mark.parametrize(
    ("frame", "field"),
    [
        ('{"action": "estimate_token"}', "$.text"),
        ('{"action": "estimate_token", "text": 1}', "$.text"),
        ('{"action": "lefttrim_token", "text": "x"}', "$.trimmed_length"),
        ('{"action": "lefttrim_token", "text": "x", "trimmed_length": -1}', "$.trimmed_length"),
        ('{"action": "lefttrim_token", "text": "x", "trimmed_length": 0.5}', "$.trimmed_length"),
        ('{"action": "lefttrim_token", "text": "x", "trimmed_length": "3"}', "$.trimmed_length"),
        ('{"action": "info", "verbose": true}', "$.verbose"),
        ('{"action": "stop", "targets": 1}', "$.targets"),
    ],
)
def test_other_actions_name_their_bad_fields(frame: str, field: str) -> None:
    error = decode_error(frame)
    assert (error.error_type, error.field) == ("invalid_request", field)
    assert error.action == json.loads(frame)["action"]


def test_trimmed_length_zero_is_valid() -> None:
    request = p.decode_request('{"action": "lefttrim_token", "text": "x", "trimmed_length": 0}')
    assert request == p.LefttrimTokenRequest(text="x", trimmed_length=0)


def test_stop_tells_absent_target_from_null() -> None:
    assert p.decode_request('{"action": "stop"}') == p.StopRequest(has_target=False)
    null = p.decode_request('{"action": "stop", "target": null}')
    assert null == p.StopRequest(has_target=True, target=None)


def test_stop_targets_match_as_json_values() -> None:
    infer = p.decode_request(infer_frame(request_id=1))
    anonymous = p.decode_request(infer_frame())
    assert isinstance(infer, p.InferRequest)
    assert isinstance(anonymous, p.InferRequest)
    assert infer.request_id == (True, 1)
    assert anonymous.request_id == (False, None)
    everything = p.StopRequest()
    assert infer.matches_stop(everything)
    assert anonymous.matches_stop(everything)
    assert infer.matches_stop(p.StopRequest(has_target=True, target=1.0))
    assert not infer.matches_stop(p.StopRequest(has_target=True, target=True))
    assert not infer.matches_stop(p.StopRequest(has_target=True, target="1"))
    assert not anonymous.matches_stop(p.StopRequest(has_target=True, target=None))


@given(json_values(6), json_values(6))
def test_json_equal_agrees_with_the_json_text(a: Any, b: Any) -> None:
    if p.json_equal(a, b):
        # Equal values re-encode to texts that decode equal again.
        assert p.json_equal(json.loads(json.dumps(a)), json.loads(json.dumps(b)))
    assert p.json_equal(a, json.loads(json.dumps(a)))
    if json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True):
        assert p.json_equal(a, b)


# --------------------------------------------------------------------------
# Errors raised by the server


def test_protocol_error_is_convenient_for_the_server() -> None:
    error = p.ProtocolError(
        "overloaded",
        "too many jobs waiting (256); retry later",
        action="infer",
        echoed={"request_id": 4, "tag": "x"},
    )
    assert isinstance(error, TrioserveError)
    assert str(error) == "too many jobs waiting (256); retry later"
    assert json.loads(p.encode_reply(error.reply())) == {
        "action": "infer",
        "request_id": 4,
        "tag": "x",
        "response_type": "error",
        "error": {"type": "overloaded", "message": "too many jobs waiting (256); retry later"},
    }


# --------------------------------------------------------------------------
# Replies from the server, seen by a client


@pytest.mark.parametrize(
    "frame",
    [
        '{"action": "echo", "extra": 1}',
        '{"action": "infer", "response_type": "partial", "chunk": "x"}',
        '{"action": "infer", "response_type": "chunk"}',
        '{"action": "stop", "stopped": true}',
        '{"action": "estimate_token", "num_tokens": 1.5}',
        '{"action": "echo", "tag": 1}',
        '{"response_type": "error", "error": {"type": "bad", "message": "m"}}',
        '{"action": 5, "response_type": "error", "error": {"type": "internal", "message": "m"}}',
        "[]",
        "x",
    ],
)
def test_garbage_replies_raise_protocol_error(frame: str) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode_reply(frame)


def test_reply_types_are_frozen_values() -> None:
    reply = p.EchoReply(echoed={"request_id": [1, 2]})
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        reply.echoed = {}  # type: ignore[misc]
    assert reply == p.EchoReply(echoed={"request_id": [1, 2]})
    assert hash(reply) == hash(p.EchoReply(echoed={"request_id": [3]}))


# --------------------------------------------------------------------------
# docs/protocol.md shows real frames

DOCS = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


def test_every_frame_in_the_protocol_doc_is_what_the_codec_writes() -> None:
    frames = [
        (line[0], line[2:])
        for line in DOCS.read_text(encoding="utf-8").splitlines()
        if line.startswith(("→ ", "← "))
    ]
    actions: set[str] = set()
    error_types: set[str] = set()
    pending: p.ProtocolError | None = None
    for direction, text in frames:
        if direction == "→":
            try:
                actions.add(type(p.decode_request(text)).__name__)
                pending = None
            except p.ProtocolError as error:
                pending = error
            continue
        reply = p.decode_reply(text)
        assert p.encode_reply(reply) == text
        if isinstance(reply, p.ErrorReply):
            error_types.add(reply.error.type)
        if pending is not None:
            # An invalid request: the doc shows exactly the codec's answer.
            assert p.encode_reply(pending.reply()) == text
            pending = None
    assert actions == {
        "EchoRequest",
        "EstimateTokenRequest",
        "LefttrimTokenRequest",
        "InferRequest",
        "StopRequest",
        "InfoRequest",
    }
    assert error_types == set(p.ERROR_TYPES)
