"""Hypothesis strategies for the wire protocol, shared by the protocol, client
and server tests.

``valid_request_pairs`` yields a request frame as a client would write it
(integral floats for ints, a single stop condition instead of a list, ...)
together with the request object it must decode to, built here independently
of the decoder so that a test can compare the two.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from trioserve import protocol as p
from trioserve.vocabulary.sampling import Range, setting_ranges

__all__ = [
    "echoed_ids",
    "json_values",
    "replies",
    "requests_objects",
    "valid_request_pairs",
    "valid_requests",
]

#: Field names of every action, so that fuzzing reaches field validation
#: instead of stopping at "unknown field" most of the time.
KNOWN_KEYS: tuple[str, ...] = (
    "action",
    "request_id",
    "response_id",
    "tag",
    "text",
    "trimmed_length",
    "max_new_tokens",
    "stream",
    "stream_full",
    "top_k",
    "top_p",
    "top_a",
    "min_p",
    "typical",
    "temperature",
    "skew",
    "rep_pen",
    "freq_pen",
    "pres_pen",
    "customBos",
    "stop_conditions",
    "bann_bann",
    "token_healing",
    "seed",
    "compact_chunks",
    "messages",
    "target",
)

_finite = st.floats(allow_nan=False, allow_infinity=False)


def json_values(max_leaves: int = 10) -> st.SearchStrategy[Any]:
    """Any JSON value that survives ``json.dumps``/``json.loads`` unchanged
    (no NaN or infinities; strings without lone surrogates)."""
    scalars = st.none() | st.booleans() | st.integers() | _finite | st.text(max_size=20)
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=max_leaves,
    )


def echoed_ids(*, tag: bool = False) -> st.SearchStrategy[dict[str, Any]]:
    """Some of ``request_id``, ``response_id`` (and ``tag``), in that order."""
    optional = {"request_id": json_values(4), "response_id": json_values(4)}
    if tag:
        optional["tag"] = json_values(4)
    return st.fixed_dictionaries({}, optional=optional).map(
        lambda d: {k: d[k] for k in ("request_id", "response_id", "tag") if k in d}
    )


def _int_wire(min_value: int | None = None, max_value: int | None = None) -> Any:
    """(wire value, decoded value) of an int field: an int, or the same
    number as an integral float when a float can hold it exactly."""

    def as_pair(n: int) -> st.SearchStrategy[tuple[Any, int]]:
        pairs: list[tuple[Any, int]] = [(n, n)]
        if abs(n) <= 2**53:
            pairs.append((float(n), n))
        return st.sampled_from(pairs)

    return st.integers(min_value, max_value).flatmap(as_pair)


def _float_wire(
    min_value: float | None = None, max_value: float | None = None, *, exclude_min: bool = False
) -> Any:
    """(wire value, decoded value) of a float field; ints are accepted too."""
    floats = st.floats(
        min_value,
        max_value,
        allow_nan=False,
        allow_infinity=False,
        exclude_min=exclude_min,
    ).map(lambda x: (x, x))
    # Bounded so that every int converts to a float exactly.
    lo = -(2**53) if min_value is None else math.floor(min_value) + 1
    if min_value is not None and not exclude_min and float(math.ceil(min_value)) == min_value:
        lo = math.ceil(min_value)
    hi = 2**53 if max_value is None else math.floor(max_value)
    ints = st.integers(lo, hi).map(lambda n: (n, float(n)))
    return floats | ints


def _same(strategy: st.SearchStrategy[Any]) -> Any:
    return strategy.map(lambda x: (x, x))


_stop_item = st.text(min_size=1, max_size=8) | st.integers(0, 200_000)


def _stop_conditions() -> Any:
    single = _stop_item.map(lambda x: (x, (x,)))
    many = st.lists(_stop_item, max_size=4).map(lambda xs: (xs, tuple(xs)))
    return single | many


def _bann_bann() -> Any:
    ids = st.integers(0, 200_000)
    return ids.map(lambda x: (x, (x,))) | st.lists(ids, max_size=4).map(lambda xs: (xs, tuple(xs)))


def _in_range(allowed: Range) -> Any:
    """(wire value, decoded value) of a sampler field, within its range."""
    if allowed.integer:
        return _int_wire(int(allowed.lo), int(allowed.hi))
    return _float_wire(allowed.lo, allowed.hi)


def _breakers() -> Any:
    """(wire value, decoded value) of ``dry_sequence_breakers``."""
    return st.lists(st.text(min_size=1, max_size=4), max_size=4).map(lambda xs: (xs, tuple(xs)))


#: Decoded ``logit_bias`` values: ascending ids, each once.
_bias_pairs = st.dictionaries(st.integers(0, 200_000), st.floats(-100.0, 100.0), max_size=4).map(
    lambda d: tuple(sorted(d.items()))
)


def _logit_bias() -> Any:
    """(wire value, decoded value) of ``logit_bias``: an object keyed by
    the ids' decimal digits."""
    return _bias_pairs.map(lambda pairs: ({str(i): b for i, b in pairs}, pairs))


_messages = st.lists(
    st.builds(p.ChatMessage, role=st.text(min_size=1, max_size=10), content=st.text(max_size=20)),
    min_size=1,
    max_size=4,
).map(tuple)


def _messages_wire() -> Any:
    return _messages.map(lambda ms: ([{"role": m.role, "content": m.content} for m in ms], ms))


#: Wire name -> (attribute name, strategy of (wire value, decoded value)).
_INFER_FIELDS: dict[str, tuple[str, Any]] = {
    "stream": ("stream", _same(st.booleans())),
    "stream_full": ("stream_full", _same(st.booleans())),
    "customBos": ("custom_bos", _same(st.text(max_size=10))),
    "stop_conditions": ("stop_conditions", _stop_conditions()),
    "bann_bann": ("bann_bann", _bann_bann()),
    "token_healing": ("token_healing", _same(st.booleans())),
    "compact_chunks": ("compact_chunks", _same(st.booleans())),
    **{name: (name, _in_range(allowed)) for name, allowed in setting_ranges().items()},
    "mirostat": ("mirostat", _same(st.booleans())),
    "temperature_last": ("temperature_last", _same(st.booleans())),
    "dry_sequence_breakers": ("dry_sequence_breakers", _breakers()),
    "logit_bias": ("logit_bias", _logit_bias()),
}


@st.composite
def _infer_pair(draw: st.DrawFn) -> tuple[dict[str, Any], p.Request]:
    ids = draw(echoed_ids(tag=True))
    wire_max, max_new_tokens = draw(_int_wire(1, 100_000))
    frame: dict[str, Any] = {"action": "infer", **ids, "max_new_tokens": wire_max}
    kwargs: dict[str, Any] = {}
    # Mostly text: a server without a chat template answers messages with
    # invalid_request, and server tests want infers that run.
    if draw(st.integers(0, 4)) > 0:
        frame["text"] = kwargs["text"] = draw(st.text(max_size=30))
    else:
        frame["messages"], kwargs["messages"] = draw(_messages_wire())
    for wire in draw(st.lists(st.sampled_from(sorted(_INFER_FIELDS)), unique=True)):
        attr, pairs = _INFER_FIELDS[wire]
        wire_value, value = draw(pairs)
        frame[wire] = wire_value
        kwargs[attr] = value
    # Key order on the wire carries no meaning.
    items = draw(st.permutations(list(frame.items())))
    expected = p.InferRequest(max_new_tokens=max_new_tokens, echoed=ids, **kwargs)
    return dict(items), expected


@st.composite
def _simple_pair(draw: st.DrawFn) -> tuple[dict[str, Any], p.Request]:
    ids = draw(echoed_ids())
    action = draw(st.sampled_from(["echo", "estimate_token", "lefttrim_token", "stop", "info"]))
    frame: dict[str, Any] = {"action": action, **ids}
    expected: p.Request
    if action == "echo":
        expected = p.EchoRequest(echoed=ids)
    elif action == "info":
        expected = p.InfoRequest(echoed=ids)
    elif action == "estimate_token":
        frame["text"] = text = draw(st.text(max_size=30))
        expected = p.EstimateTokenRequest(text=text, echoed=ids)
    elif action == "lefttrim_token":
        frame["text"] = text = draw(st.text(max_size=30))
        frame["trimmed_length"], length = draw(_int_wire(0, 10_000))
        expected = p.LefttrimTokenRequest(text=text, trimmed_length=length, echoed=ids)
    elif draw(st.booleans()):
        frame["target"] = target = draw(json_values(4))
        expected = p.StopRequest(has_target=True, target=target, echoed=ids)
    else:
        expected = p.StopRequest(echoed=ids)
    return frame, expected


def valid_request_pairs() -> st.SearchStrategy[tuple[dict[str, Any], p.Request]]:
    """(frame as a JSON object, the request it must decode to), every action."""
    return _simple_pair() | _infer_pair()


def valid_requests() -> st.SearchStrategy[dict[str, Any]]:
    """Valid request frames (JSON objects) of every action, random ids."""
    return valid_request_pairs().map(lambda pair: pair[0])


def _ints(lo: int = 0) -> st.SearchStrategy[int]:
    return st.integers(lo, 2**40)


def requests_objects() -> st.SearchStrategy[p.Request]:
    """Request objects built directly, every action."""
    ids = echoed_ids()
    sampler: dict[str, st.SearchStrategy[Any]] = {
        name: (
            st.integers(int(allowed.lo), int(allowed.hi))
            if allowed.integer
            else st.floats(allowed.lo, allowed.hi)
        )
        for name, allowed in setting_ranges().items()
    }
    sampler["seed"] = st.none() | sampler["seed"]
    sampler["mirostat"] = sampler["temperature_last"] = st.booleans()
    sampler["dry_sequence_breakers"] = _breakers().map(lambda pair: pair[1])
    sampler["logit_bias"] = _bias_pairs
    prompt = st.fixed_dictionaries({"text": st.text(max_size=30)}) | st.fixed_dictionaries(
        {"messages": _messages}
    )
    infer = prompt.flatmap(
        lambda given: st.builds(
            p.InferRequest,
            **{name: st.just(value) for name, value in given.items()},
            max_new_tokens=_ints(1),
            stream=st.booleans(),
            stream_full=st.booleans(),
            custom_bos=st.text(max_size=10),
            stop_conditions=st.lists(_stop_item, max_size=4).map(tuple),
            bann_bann=st.lists(st.integers(0, 200_000), max_size=4).map(tuple),
            token_healing=st.booleans(),
            compact_chunks=st.booleans(),
            echoed=echoed_ids(tag=True),
            **sampler,
        )
    )
    stop = st.builds(p.StopRequest, echoed=ids) | st.builds(
        p.StopRequest, has_target=st.just(True), target=json_values(4), echoed=ids
    )
    return st.one_of(
        st.builds(p.EchoRequest, echoed=ids),
        st.builds(p.EstimateTokenRequest, text=st.text(max_size=30), echoed=ids),
        st.builds(
            p.LefttrimTokenRequest, text=st.text(max_size=30), trimmed_length=_ints(), echoed=ids
        ),
        infer,
        stop,
        st.builds(p.InfoRequest, echoed=ids),
    )


def replies() -> st.SearchStrategy[p.Reply]:
    """Reply objects of every kind, with the ids each kind may echo."""
    ids = echoed_ids()
    infer_ids = echoed_ids(tag=True)
    text = st.text(max_size=30)
    seconds = st.floats(0.0, 1e6)
    final = st.builds(
        p.InferFinal,
        response=text,
        util_text=text,
        stop_reason=st.sampled_from(["eos", "num_tokens", "interrupted"]),
        eos_reason=st.sampled_from([None, "stop_token", "stop_string"]),
        stop_string=st.none() | st.text(min_size=1, max_size=5),
        stop_token=st.none() | _ints(),
        usage=st.builds(p.Usage, _ints(), _ints(), _ints(), _ints()),
        timing=st.builds(p.Timing, seconds, st.none() | seconds, seconds),
        echoed=infer_ids,
    )
    info = st.builds(
        p.InfoReply,
        server=st.builds(p.ServerInfo, text, text),
        model=st.builds(
            p.ModelInfo,
            name=text,
            engine=st.sampled_from(["cpu", "exllamav2"]),
            context_length=_ints(1),
            vocab_size=_ints(1),
            bos_token_id=st.none() | _ints(),
            eos_token_ids=st.lists(_ints(), max_size=3).map(tuple),
            max_batch=_ints(1),
            batching=st.booleans(),
        ),
        limits=st.builds(p.Limits, _ints(1), _ints(1), _ints(1), _ints(1)),
        echoed=ids,
    )
    error = st.builds(
        p.ErrorReply,
        action=st.none() | st.sampled_from(p.ACTIONS) | text,
        error=st.builds(
            p.ErrorDetail,
            type=st.sampled_from(p.ERROR_TYPES),
            message=st.text(min_size=1, max_size=30),
            field=st.none() | st.sampled_from(["$.top_k", "$.stop_conditions[2]", "$.action"]),
        ),
        echoed=infer_ids,
    )
    return st.one_of(
        st.builds(p.EchoReply, echoed=ids),
        st.builds(p.EstimateTokenReply, num_tokens=_ints(), echoed=ids),
        st.builds(p.LefttrimTokenReply, trimmed_text=text, echoed=ids),
        st.builds(
            p.InferChunk,
            chunk=text,
            response=st.none() | text,
            util_text=st.none() | text,
            echoed=infer_ids,
        ),
        final,
        st.builds(p.StopReply, stopped=_ints(), echoed=ids),
        info,
        error,
    )
