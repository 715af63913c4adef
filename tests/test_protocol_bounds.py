"""The protocol's bounds (issue 8, "bounds before work") and the field
declarations they come from (issue 9): nesting, sizes of free-form values,
list lengths, messages, and errors that name the field and suggest a fix."""

from __future__ import annotations

import json
import sys
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import json_values
from trioserve import protocol as p
from trioserve.engine.base import EngineInfo
from trioserve.generation import InvalidGeneration
from trioserve.generation.generation import check_request
from trioserve.server.doors import from_infer, infer_error
from trioserve.vocabulary.strict_json import _nesting_exceeds, json_depth_exceeds, json_size_exceeds

pytestmark = pytest.mark.unit


def decode_error(frame: str | dict[str, Any]) -> p.ProtocolError:
    if not isinstance(frame, str):
        frame = json.dumps(frame)
    with pytest.raises(p.ProtocolError) as info:
        p.decode_request(frame)
    return info.value


def infer(**fields: Any) -> dict[str, Any]:
    return {"action": "infer", "text": "hi", "max_new_tokens": 8, **fields}


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


# --------------------------------------------------------------------------
# Nesting


@pytest.mark.parametrize("depth", [65, 350, 979, 100_000])
def test_frames_nested_deeper_than_the_cap_are_invalid_json(depth: int) -> None:
    # Issue 8 defect 2: 979 levels made json.dumps of the echo reply raise
    # RecursionError, 350 crashed json_equal for a stop target.
    frame = '{"action":"echo","request_id":' + nested(depth) + "}"
    error = decode_error(frame)
    assert error.error_type == "invalid_json"
    assert "nested too deeply" in error.message
    assert error.echoed == {}
    p.encode_reply(error.reply())


def test_the_cap_counts_objects_and_arrays_together() -> None:
    # The frame itself is one level, so a value may nest 63 more.
    inner = '{"a":' * 31 + nested(32) + "}" * 31
    assert p.decode_request('{"action":"echo","request_id":' + inner + "}")
    deeper = '{"a":' * 32 + nested(32) + "}" * 32
    assert decode_error('{"action":"echo","request_id":' + deeper + "}").error_type == (
        "invalid_json"
    )


_tricky_text = st.text(alphabet='[]{}"\\ab\n', max_size=8)
_tricky_json = st.recursive(
    st.none() | st.integers() | _tricky_text,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(_tricky_text, children, max_size=3)
    ),
    max_leaves=30,
)


def depth_of(value: Any) -> int:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    return 0


@given(_tricky_json, st.integers(0, 8), st.booleans())
def test_the_bracket_scan_is_the_real_depth(value: Any, limit: int, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert _nesting_exceeds(text.encode(), limit) == (depth_of(value) > limit)
    assert json_depth_exceeds(value, limit) == (depth_of(value) > limit)


def test_brackets_inside_strings_do_not_nest() -> None:
    text = "[{" * 5000 + '\\"' + "]}" * 10
    request = p.decode_request(json.dumps({"action": "estimate_token", "text": text}))
    assert request == p.EstimateTokenRequest(text=text)


def test_many_shallow_brackets_are_fine() -> None:
    # More brackets than the cap, none deep: the full scan runs and passes.
    frame = json.dumps(infer(tag=[[i] for i in range(1000)]))
    assert isinstance(p.decode_request(frame), p.InferRequest)


def test_values_parsed_elsewhere_are_checked_without_recursion() -> None:
    deep: Any = 1
    for _ in range(200_000):
        deep = [deep]
    assert json_depth_exceeds(deep, 64)
    with pytest.raises(p.ProtocolError) as info:
        p.structure_request({"action": "echo", "request_id": deep})
    error = info.value
    assert error.error_type == "invalid_json"


def test_json_equal_takes_any_depth() -> None:
    a: Any = 1
    b: Any = 1.0
    for _ in range(sys.getrecursionlimit() * 10):
        a, b = [a], {"k": b}
    assert not p.json_equal(a, b)
    a2: Any = True
    a1: Any = 1
    for _ in range(sys.getrecursionlimit() * 10):
        a1, a2 = [a1], [a2]
    assert not p.json_equal(a1, a2)
    assert p.json_equal(a1, a1)


def test_a_stop_targets_the_deepest_request_id_allowed() -> None:
    deep = json.loads(nested(p.MAX_JSON_DEPTH - 1, '"x"'))
    request = p.decode_request(json.dumps(infer(request_id=deep)))
    stop = p.decode_request(json.dumps({"action": "stop", "target": deep}))
    assert isinstance(request, p.InferRequest) and isinstance(stop, p.StopRequest)
    assert request.matches_stop(stop)
    other = p.decode_request(json.dumps({"action": "stop", "target": json.loads(nested(62))}))
    assert isinstance(other, p.StopRequest)
    assert not request.matches_stop(other)


# --------------------------------------------------------------------------
# Sizes of free-form values


@given(json_values(12), st.integers(0, 200))
def test_json_size_is_the_compact_encoding(value: Any, limit: int) -> None:
    size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
    assert json_size_exceeds(value, limit) == (size > limit)


def test_json_size_of_huge_values_stops_early() -> None:
    assert json_size_exceeds("x" * 10_000_000, 1024)
    assert json_size_exceeds(10**100_000, 1024)
    assert json_size_exceeds([0] * 10_000_000, 1024)
    assert not json_size_exceeds(-(10**1000), 1024)
    assert json_size_exceeds({"k" * 5000: 1}, 1024)


@pytest.mark.parametrize(
    ("key", "limit"),
    [("request_id", "max_id_bytes"), ("response_id", "max_id_bytes"), ("tag", "max_tag_bytes")],
)
def test_echoed_values_have_a_size_limit(key: str, limit: str) -> None:
    size = p.FIELD_LIMITS[limit]
    fits = "x" * (size - 2)  # the quotes count
    request = p.decode_request(
        json.dumps(infer(**{key: fits, "response_id" if key != "response_id" else "request_id": 7}))
    )
    assert request.echoed[key] == fits
    error = decode_error(
        infer(**{key: fits + "x", "request_id" if key != "request_id" else "response_id": 7})
    )
    assert (error.error_type, error.field, error.action) == ("invalid_request", f"$.{key}", "infer")
    assert f"{key} must be any json value of at most {size} bytes" in error.message
    # The oversized value is not echoed; the other id is.
    assert key not in error.echoed
    assert len(error.echoed) == 1


def test_tag_size_is_checked_on_infer_only() -> None:
    error = decode_error({"action": "echo", "tag": 1})
    assert error.field == "$.tag"
    assert "unknown field" in error.message


def test_a_stop_target_has_the_id_limit() -> None:
    error = decode_error({"action": "stop", "request_id": 1, "target": "x" * 2000})
    assert (error.field, error.action, error.echoed) == ("$.target", "stop", {"request_id": 1})


# --------------------------------------------------------------------------
# Lists


def test_stop_conditions_are_bounded_in_count_and_length() -> None:
    most = p.FIELD_LIMITS["max_stop_conditions"]
    longest = p.FIELD_LIMITS["max_stop_string_chars"]
    ok = p.decode_request(json.dumps(infer(stop_conditions=["s" * longest] * most)))
    assert isinstance(ok, p.InferRequest) and len(ok.stop_conditions) == most
    error = decode_error(infer(stop_conditions=["s"] * (most + 1)))
    assert error.field == "$.stop_conditions"
    assert error.message == f"stop_conditions must hold at most {most} entries, got {most + 1}"
    error = decode_error(infer(stop_conditions=["a", "s" * (longest + 1)]))
    assert error.field == "$.stop_conditions[1]"
    assert error.message.endswith(f"got {longest + 1} characters")
    assert decode_error(infer(stop_conditions="s" * (longest + 1))).field == "$.stop_conditions"


@pytest.mark.parametrize("bad", [-1, 2**31, 2**63, 1e30])
def test_token_ids_are_bounded(bad: Any) -> None:
    assert decode_error(infer(stop_conditions=["x", bad])).field == "$.stop_conditions[1]"
    assert decode_error(infer(bann_bann=[0, bad])).field == "$.bann_bann[1]"
    assert decode_error(infer(bann_bann=bad)).field == "$.bann_bann"


def test_banned_ids_are_bounded_in_count() -> None:
    most = p.FIELD_LIMITS["max_banned_ids"]
    assert isinstance(p.decode_request(json.dumps(infer(bann_bann=[5] * most))), p.InferRequest)
    error = decode_error(infer(bann_bann=[5] * (most + 1)))
    assert (error.field, error.message) == (
        "$.bann_bann",
        f"bann_bann must hold at most {most} entries, got {most + 1}",
    )


# --------------------------------------------------------------------------
# Unknown fields


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("temprature", "temperature"),
        ("max_new_token", "max_new_tokens"),
        ("maxNewTokens", "max_new_tokens"),
        ("zzz", None),
        ("stop_condition", "stop_conditions"),
        ("custombos", "customBos"),
        ("request-id", "request_id"),
        ("tags", "tag"),
    ],
)
def test_unknown_fields_suggest_the_closest_known_one(key: str, hint: str | None) -> None:
    error = decode_error(infer(**{key: 1}))
    assert error.field == f"$.{key}" if key.isidentifier() else error.field == f'$["{key}"]'
    if hint is None:
        assert "did you mean" not in error.message
    else:
        assert f"(did you mean {hint!r}?)" in error.message
    allowed = error.message.split("allowed fields: ")[1].split(", ")
    assert allowed == sorted([*p.INFER_FIELDS, "request_id", "response_id", "tag"])


def test_other_actions_list_the_envelope_as_allowed() -> None:
    error = decode_error({"action": "echo", "request_idd": 1})
    assert "(did you mean 'request_id'?)" in error.message
    assert error.message.endswith("allowed fields: request_id, response_id")


def test_huge_unknown_keys_are_not_echoed_in_the_path() -> None:
    error = decode_error(infer(**{"k" * 100_000: 1}))
    assert error.field is None
    # The key cut short, then the allowed fields (about 600 characters).
    assert len(error.message) < 1000


# --------------------------------------------------------------------------
# messages


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_messages_replace_text() -> None:
    request = p.decode_request(
        json.dumps({"action": "infer", "max_new_tokens": 4, "messages": CHAT, "request_id": 1})
    )
    assert isinstance(request, p.InferRequest)
    assert request.text is None
    assert request.messages == (
        p.ChatMessage(role="system", content="Be brief."),
        p.ChatMessage(role="user", content="Hi!"),
    )
    assert p.unstructure_request(request) == {
        "action": "infer",
        "request_id": 1,
        "max_new_tokens": 4,
        "stream": False,
        "stream_full": False,
        **{
            k: list(v) if isinstance(v, tuple) else v
            for k, v in p.INFER_DEFAULTS.items()
            if k not in ("stream", "stream_full")
        },
        "logit_bias": {},  # an object on the wire, () in the request
        "messages": CHAT,
    }
    assert p.decode_request(p.encode_request(request)) == request


def test_exactly_one_of_text_and_messages() -> None:
    both = decode_error(infer(messages=CHAT, request_id=3))
    assert both.message == "give exactly one of text and messages, not both"
    assert (both.field, both.echoed) == ("$.messages", {"request_id": 3})
    neither = decode_error({"action": "infer", "max_new_tokens": 3})
    assert neither.field == "$.text"
    assert neither.message.startswith("text is required")
    assert "exactly one of text and messages" in neither.message
    with pytest.raises(ValueError, match="exactly one"):
        p.InferRequest(max_new_tokens=1)
    with pytest.raises(ValueError, match="exactly one"):
        p.InferRequest(text="", messages=(p.ChatMessage("user", "x"),), max_new_tokens=1)


@pytest.mark.parametrize(
    ("messages", "field", "message"),
    [
        ([], "$.messages", "messages must be a list of 1 to 2048 objects"),
        ("hi", "$.messages", "messages must be a list of 1 to 2048 objects"),
        ([CHAT[0], 5], "$.messages[1]", 'messages[1] must be an object {"role": ..., '),
        ([{"role": "user"}], "$.messages[0].content", "messages[0].content is required"),
        (
            [CHAT[0], {"role": "", "content": "x"}],
            "$.messages[1].role",
            "messages[1].role must be a string of 1 to 64 characters, got ''",
        ),
        (
            [{"role": "u" * 65, "content": "x"}],
            "$.messages[0].role",
            "messages[0].role must be a string of 1 to 64 characters, got 65 characters",
        ),
        (
            [{"role": "user", "content": None}],
            "$.messages[0].content",
            "messages[0].content must be a string, got None",
        ),
        (
            [{"rol": "user", "content": "x"}],
            "$.messages[0].rol",
            "messages[0].rol is not a field of a message (did you mean 'role'?)",
        ),
        (
            [{"role": "user", "content": "x", "name": "bob"}],
            "$.messages[0].name",
            "messages[0].name is not a field of a message; fields: content, role",
        ),
    ],
)
def test_bad_messages_are_named_by_path(messages: Any, field: str, message: str) -> None:
    error = decode_error({"action": "infer", "max_new_tokens": 2, "messages": messages})
    assert error.error_type == "invalid_request"
    assert error.field == field
    assert error.message.startswith(message)


def test_messages_are_bounded_in_count() -> None:
    most = p.FIELD_LIMITS["max_messages"]
    chat = [{"role": "user", "content": ""}] * (most + 1)
    error = decode_error({"action": "infer", "max_new_tokens": 2, "messages": chat})
    assert (error.field, error.message) == (
        "$.messages",
        f"messages must hold at most {most} messages, got {most + 1}",
    )


# --------------------------------------------------------------------------
# Replies: the seed's keys


def test_final_frames_carry_an_empty_chunk() -> None:
    final = p.InferFinal(
        response="Paris.",
        util_text="Q",
        stop_reason="eos",
        eos_reason="stop_token",
        stop_string=None,
        stop_token=2,
        usage=p.Usage(1, 0, 2),
        timing=p.Timing(0.0, 0.1, 0.2),
    )
    frame = json.loads(p.encode_reply(final))
    assert frame["chunk"] == ""
    assert list(frame)[:4] == ["action", "response_type", "chunk", "response"]
    with pytest.raises(ValueError, match="chunk"):
        attrs.evolve(final, chunk="x")
    # A final frame without "chunk" (older servers) still decodes.
    del frame["chunk"]
    assert p.structure_reply(frame) == final


def test_chunk_frames_carry_util_text_when_set() -> None:
    chunk = p.InferChunk("Par", util_text="Q", echoed={"request_id": 1})
    assert p.encode_reply(chunk) == (
        '{"action":"infer","request_id":1,"response_type":"chunk","chunk":"Par","util_text":"Q"}'
    )
    compact = p.InferChunk("Par", echoed={"request_id": 1})
    assert "util_text" not in p.encode_reply(compact)


# --------------------------------------------------------------------------
# Declarations, limits and the model-dependent checks


def test_info_limits_are_the_declared_ones() -> None:
    limits = p.Limits(1, 2, 3, 4)
    frame = p.unstructure_reply(
        p.InfoReply(
            server=p.ServerInfo("trioserve", "0"),
            model=p.ModelInfo("m", "cpu", 8, 10, None, (), 1, True),
            limits=limits,
        )
    )
    per_field = {k: v for k, v in frame["limits"].items() if k in p.FIELD_LIMITS}
    assert per_field == dict(p.FIELD_LIMITS)
    declared = {a.name for a in attrs.fields(p.Limits)} - {
        "max_message_bytes",
        "max_requests_per_connection",
        "max_waiting_jobs",
        "max_new_tokens",
    }
    assert declared == set(p.FIELD_LIMITS)
    assert p.FIELD_LIMITS["max_json_depth"] == p.MAX_JSON_DEPTH == 64


def test_sampler_fields_take_their_declarations_from_the_engine() -> None:
    from trioserve.vocabulary.sampling import SamplingSettings, setting_ranges

    fields = p.request_fields("infer")
    for name, allowed in setting_ranges().items():
        assert fields[name].rule.allowed == allowed.describe()
        default = attrs.fields_dict(SamplingSettings)[name].default
        assert p.INFER_DEFAULTS.get(name) == default


def validate_against_model(
    request: p.InferRequest,
    *,
    vocab_size: int,
    max_new_tokens: int,
    renders_messages: bool = False,
) -> None:
    """The server's model checks of an ``infer`` (the one pipeline's, through
    the WebSocket door's naming), as a ProtocolError."""
    info = EngineInfo(
        engine="test",
        model_name="m",
        context_length=max_new_tokens + 1,
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_ids=frozenset(),
        max_batch=1,
    )
    try:
        check_request(
            from_infer(request),
            info,
            max_new_tokens=max_new_tokens,
            renders_messages=renders_messages,
        )
    except InvalidGeneration as error:
        raise infer_error(error, request) from None


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"max_new_tokens": 300}, "$.max_new_tokens", "max_new_tokens must be at most 255"),
        ({"stop_conditions": ["x", 100]}, "$.stop_conditions[1]", "stop token ids must be in"),
        ({"bann_bann": [1, 2, 100]}, "$.bann_bann[2]", "banned token ids must be in 0..99"),
        (
            {"messages": CHAT, "text": None},
            "$.messages",
            "this model has no chat template",
        ),
    ],
)
def test_validate_against_model(fields: dict[str, Any], field: str, message: str) -> None:
    obj = {k: v for k, v in infer(request_id="r", **fields).items() if v is not None}
    request = p.decode_request(json.dumps(obj))
    assert isinstance(request, p.InferRequest)
    with pytest.raises(p.ProtocolError) as info:
        validate_against_model(request, vocab_size=100, max_new_tokens=255)
    assert (info.value.field, info.value.echoed) == (field, {"request_id": "r"})
    assert info.value.message.startswith(message)
    fine = attrs.evolve(request, max_new_tokens=1, stop_conditions=(), bann_bann=())
    if request.messages is None:
        validate_against_model(fine, vocab_size=100, max_new_tokens=255)
    else:
        validate_against_model(fine, vocab_size=100, max_new_tokens=255, renders_messages=True)


def test_bad_values_of_any_size_are_shown_short() -> None:
    # A valid int, far too large for the model: that is the server's check.
    huge = p.structure_request({"action": "infer", "text": "", "max_new_tokens": 10**5000})
    assert isinstance(huge, p.InferRequest)
    for bad in (10**5000, [list(range(100))] * 100, {"k": "v" * 10**6}):
        with pytest.raises(p.ProtocolError) as info:
            p.structure_request({"action": "infer", "text": "", "max_new_tokens": 1, "top_k": bad})
        failure = info.value
        assert failure.field == "$.top_k"
        assert len(failure.message) < 200


# --------------------------------------------------------------------------
# The samplers of ExLlamaV2's front ends


def structure_error(**fields: Any) -> p.ProtocolError:
    """The error of an infer built as Python objects (NaN cannot be JSON)."""
    with pytest.raises(p.ProtocolError) as info:
        p.structure_request(infer(**fields))
    return info.value


@pytest.mark.parametrize(
    "field",
    [
        "dry_multiplier",
        "dry_base",
        "xtc_probability",
        "xtc_threshold",
        "mirostat_tau",
        "mirostat_eta",
        "min_temp",
        "max_temp",
        "temp_exponent",
        "smoothing_factor",
    ],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1e-9, 1e300])
def test_new_numbers_refuse_nan_and_out_of_range(field: str, bad: float) -> None:
    error = structure_error(**{field: bad})
    assert (error.error_type, error.field) == ("invalid_request", f"$.{field}")
    assert error.message.startswith(f"{field} must be a number in [")
    assert error.message.endswith(f"got {bad!r}")


def test_a_hundred_thousand_breakers_are_refused_by_their_count() -> None:
    error = decode_error(infer(dry_sequence_breakers=["x"] * 100_000))
    assert error.field == "$.dry_sequence_breakers"
    assert error.message == "dry_sequence_breakers must hold at most 64 strings, got 100000"


@pytest.mark.parametrize(
    ("breakers", "path", "got"),
    [
        (["\n", ""], "$.dry_sequence_breakers[1]", "got ''"),
        ([5], "$.dry_sequence_breakers[0]", "got 5"),
        (["x" * 65], "$.dry_sequence_breakers[0]", "got 65 characters"),
        ([["x"]], "$.dry_sequence_breakers[0]", "got ['x']"),
    ],
)
def test_each_bad_breaker_is_named(breakers: list[Any], path: str, got: str) -> None:
    error = decode_error(infer(dry_sequence_breakers=breakers))
    assert error.field == path
    assert error.message.startswith(f"{path[2:]} must be a string of 1 to 64 characters")
    assert error.message.endswith(got)


def test_logit_bias_reads_an_object_of_digit_keys() -> None:
    request = p.decode_request(json.dumps(infer(logit_bias={"198": 2, "0": -100, "5": 1.5})))
    assert isinstance(request, p.InferRequest)
    assert request.logit_bias == ((0, -100.0), (5, 1.5), (198, 2.0))
    assert request.sampling_settings().logit_bias == request.logit_bias
    assert p.unstructure_request(request)["logit_bias"] == {"0": -100.0, "5": 1.5, "198": 2.0}
    assert p.decode_request(p.encode_request(request)) == request


@pytest.mark.parametrize(
    "key", ["abc", "-1", "01", "1.5", " 1", "", "1e3", "２", "2147483648", "99999999999"]
)
def test_logit_bias_keys_must_be_token_ids(key: str) -> None:
    error = decode_error(infer(logit_bias={"5": 1, key: 1}))
    assert error.field == "$.logit_bias"
    assert error.message == (
        "logit_bias keys must be token ids from 0 to 2^31-1 in decimal digits without "
        f"leading zeros, got {key!r}"
    )


@pytest.mark.parametrize("bias", [101, -100.5, True, "5", None, [1], 1e308])
def test_logit_bias_values_are_named_by_their_key(bias: Any) -> None:
    error = decode_error(infer(logit_bias={"7": 0, "42": bias}))
    assert error.field == '$.logit_bias["42"]'
    assert error.message == f'logit_bias["42"] must be a number in [-100, 100], got {bias!r}'


def test_logit_bias_nan_and_size() -> None:
    error = structure_error(logit_bias={"3": float("nan")})
    assert error.field == '$.logit_bias["3"]'
    error = decode_error(infer(logit_bias={str(i): 0 for i in range(100_000)}))
    assert error.field == "$.logit_bias"
    assert error.message == "logit_bias must hold at most 1024 entries, got 100000"
    assert p.FIELD_LIMITS["max_logit_bias"] == 1024


def test_logit_bias_ids_are_checked_against_the_vocabulary() -> None:
    request = p.decode_request(json.dumps(infer(logit_bias={"99": 1, "1000000000": -5})))
    assert isinstance(request, p.InferRequest)
    with pytest.raises(p.ProtocolError) as info:
        validate_against_model(request, vocab_size=100, max_new_tokens=255)
    assert (info.value.error_type, info.value.field) == (
        "invalid_request",
        '$.logit_bias["1000000000"]',
    )
    assert info.value.message == "logit_bias keys must be token ids in 0..99, got '1000000000'"
    fine = attrs.evolve(request, logit_bias=((99, 1.0),))
    validate_against_model(fine, vocab_size=100, max_new_tokens=255)


@pytest.mark.parametrize(("value", "ok"), [(0, True), (20, False), (21, True), (1, False)])
def test_dry_range_is_off_or_longer_than_exllamav2s_ngrams(value: int, ok: bool) -> None:
    frame = infer(dry_range=value)
    if ok:
        request = p.decode_request(json.dumps(frame))
        assert isinstance(request, p.InferRequest) and request.dry_range == value
    else:
        error = decode_error(frame)
        assert error.message == (
            f"dry_range must be 0 or an integer from 21 to 2^31-1, got {value!r}"
        )
