"""What the fuzzer sends: JSON-level frames and malformed WebSocket frames.

Everything here is a pure function of a ``random.Random``, so that a run is
repeatable from its seed (the report prints it, and ``--seed`` replays it).

JSON level (:func:`json_frame`), in these families:

* ``valid``: a well-formed request of each action, with random valid fields;
* ``mutated``: a valid request with a field deleted, added, retyped, or set to
  an extreme (huge integers, 1e308, 5e-324, empty or huge strings, deep
  nesting, lone surrogates), or its action changed;
* ``text``: a valid request's JSON text cut, spliced, or with characters
  inserted, removed or replaced (usually no longer JSON);
* ``random``: any JSON value, mostly objects, from a small random grammar;
* ``deep``: arrays and objects nested 65 to 1,000,000 deep, alone or inside an
  id, a tag, a target or a text field;
* ``numbers``: integers of up to 5,000 digits, 1e999, -0.0, in every numeric field;
* ``long``: long strings and long lists (prompts, stop strings, ids, tags);
* ``binary``: binary frames, of random bytes or of a valid request.

WebSocket level (:func:`ws_frame`): a frame that breaks RFC 6455 in one chosen
way (``expected`` holds the close codes the RFC asks for), or random bytes,
lying lengths and truncated frames (``expected`` is None: anything but a
crash is acceptable).
"""

from __future__ import annotations

import copy
import json
import random
import re
import string
from typing import Any

import attrs

from tests import wire

__all__ = [
    "JSON_FAMILIES",
    "WS_KINDS",
    "FuzzFrame",
    "WsCase",
    "json_frame",
    "ws_frame",
]

JSON_FAMILIES = ("valid", "mutated", "text", "random", "deep", "numbers", "long", "binary")
#: How often each family is drawn (relative).
_FAMILY_WEIGHTS = (12, 40, 18, 10, 6, 6, 3, 5)

ACTIONS = ("echo", "estimate_token", "lefttrim_token", "infer", "stop", "info")
INFER_FIELDS = (
    "text",
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
    "tag",
    "seed",
    "request_id",
    "response_id",
    "logit_bias",
    "dry_multiplier",
    "dry_range",
    "dry_sequence_breakers",
    "xtc_probability",
    "mirostat",
    "mirostat_tau",
    "max_temp",
    "smoothing_factor",
    "temperature_last",
    "json_schema",
    "regex",
    "choice",
    "grammar",
)

#: Constraints, good and bad, for the four constraint fields.
_CONSTRAINTS: tuple[tuple[str, Any], ...] = (
    ("json_schema", {"type": "object"}),
    ("json_schema", {"type": "strnig"}),
    ("json_schema", {"$ref": "#/$defs/missing"}),
    ("json_schema", {"enum": list(range(3000))}),
    ("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}}),
    ("regex", "(a"),
    ("regex", "[a-z]{1,4}"),
    ("regex", "(a|aa)*" * 20 + "b"),
    ("regex", "[^\\s\\S]"),
    ("choice", ["yes", "no"]),
    ("choice", ["\ud800"]),
    ("grammar", 'root ::= "a" | "b"'),
    ("grammar", "root ::= undefined"),
    ("grammar", "start: /[0-9]+/"),
)

_WORDS = (
    *[
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "hello",
        "world",
        "paris",
        "capital",
        "france",
    ],
    *(
        "日本語",
        "テキスト",
        "中文",
        "🙂",
        "🚀",
        "ünïcödé",
        "<|im_start|>",
        "<|im_end|>",
        "\n",
        "\t",
    ),
)

#: Extremes for numeric fields: where validation, conversion to a float32 or
#: an int64 tensor, and JSON parsing each have an edge.
_EXTREME_NUMBERS: tuple[Any, ...] = (
    0,
    -0.0,
    1,
    -1,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    10**100,
    1e30,
    1e308,
    -1e308,
    1.7976931348623157e308,
    5e-324,
    -5e-324,
    1e-300,
    0.5,
    1.0000000000000002,
    3.4e38,
    3.5e38,
    True,
    False,
    None,
    "1",
    "",
    [],
    {},
)


@attrs.frozen
class FuzzFrame:
    """One frame to send and what the fuzzer knows of it."""

    family: str
    data: str | bytes
    #: The request_id when the frame is a valid infer the fuzzer lets run to
    #: its end (it then waits for that id's terminal frame).
    complete_id: str | None = None


def _extreme(rng: random.Random) -> Any:
    # A copy: the table's lists and dicts must not end up shared (or inside
    # themselves) in the values built from it.
    return copy.deepcopy(rng.choice(_EXTREME_NUMBERS))


def _text(rng: random.Random, low: int = 1, high: int = 12) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high))) or "x"


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    """Any JSON value from a small grammar, mostly shallow."""
    kinds = ["null", "bool", "int", "float", "str"]
    if depth < 4:
        kinds += ["list", "dict", "dict"]
    kind = rng.choice(kinds)
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([rng.randint(-1000, 1000), _extreme(rng)])
    if kind == "float":
        return rng.choice([rng.uniform(-10, 10), rng.random(), 1e308, 5e-324, -0.0])
    if kind == "str":
        return rng.choice([_text(rng), "", rng.choice(ACTIONS), _unicode(rng, 8)])
    if kind == "list":
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = [*ACTIONS, *INFER_FIELDS, "action", "target", "trimmed_length", "x", ""]
    return {rng.choice(keys): _json_value(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def _unicode(rng: random.Random, length: int) -> str:
    """Random code points, lone surrogates included (sent escaped)."""
    chars = []
    for _ in range(length):
        roll = rng.random()
        if roll < 0.5:
            chars.append(rng.choice(string.printable))
        elif roll < 0.7:
            chars.append(chr(rng.randint(0x80, 0x7FF)))
        elif roll < 0.85:
            chars.append(chr(rng.randint(0x10000, 0x10FFFF)))
        elif roll < 0.95:
            chars.append(chr(rng.randint(0x800, 0xD7FF)))
        else:
            chars.append(chr(rng.randint(0xD800, 0xDFFF)))
    return "".join(chars)


def _without_surrogates(value: Any) -> Any:
    """``value`` with every lone surrogate replaced: protocol.md refuses a
    frame that holds one (``invalid_json``), so no valid request can."""
    if isinstance(value, str):
        return _SURROGATE.sub("?", value)
    if isinstance(value, list):
        return [_without_surrogates(item) for item in value]
    if isinstance(value, dict):
        return {_without_surrogates(k): _without_surrogates(v) for k, v in value.items()}
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_request(rng: random.Random, vocab_size: int, serial: str) -> dict[str, Any]:
    """A request every server must accept (up to its limits)."""
    return dict(_without_surrogates(_valid_request(rng, vocab_size, serial)))


def _valid_request(rng: random.Random, vocab_size: int, serial: str) -> dict[str, Any]:
    action = rng.choice(ACTIONS)
    request: dict[str, Any] = {"action": action}
    if rng.random() < 0.8:
        request["request_id"] = rng.choice([serial, rng.randint(0, 10**6), [serial], {"k": serial}])
    if rng.random() < 0.2:
        request["response_id"] = _json_value(rng, 2)
    if action == "estimate_token":
        request["text"] = _text(rng)
    elif action == "lefttrim_token":
        request["text"] = _text(rng)
        request["trimmed_length"] = rng.randint(0, 20)
    elif action == "stop":
        if rng.random() < 0.5:
            request["target"] = _json_value(rng, 3)
    elif action == "infer":
        request.update(text=_text(rng), max_new_tokens=rng.randint(1, 4))
        optional: dict[str, Any] = {
            "stream": rng.random() < 0.5,
            "stream_full": rng.random() < 0.5,
            "top_k": rng.randint(0, 200),
            "top_p": rng.random(),
            "top_a": rng.uniform(0, 2),
            "min_p": rng.random() * 0.5,
            "typical": rng.random(),
            "temperature": rng.choice([0, 0.5, 1.0, 2.0]),
            "skew": rng.uniform(-1, 1),
            "rep_pen": rng.uniform(0.5, 2),
            "freq_pen": rng.uniform(-1, 1),
            "pres_pen": rng.uniform(-1, 1),
            "customBos": rng.choice(["", "<|im_start|>", "Q: "]),
            "stop_conditions": rng.choice(
                [[], "\n", [".", rng.randint(0, vocab_size - 1)], rng.randint(0, vocab_size - 1)]
            ),
            "bann_bann": rng.choice([[], rng.randint(0, vocab_size - 1), [1, 2, 3]]),
            "token_healing": rng.random() < 0.3,
            "tag": _json_value(rng, 2),
            "seed": rng.randint(-(2**63), 2**64 - 1),
        }
        for name in rng.sample(sorted(optional), rng.randint(0, len(optional))):
            request[name] = optional[name]
    return request


def _dumps(value: Any, rng: random.Random) -> str:
    """JSON text; with or without escaping non-ASCII (a lone surrogate can
    only travel escaped: a WebSocket text frame must be valid UTF-8)."""
    if rng.random() < 0.5:
        return json.dumps(value)
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


def _nested(rng: random.Random, depth: int) -> str:
    if rng.random() < 0.5:
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "0" + "}" * depth


def _mutate(rng: random.Random, request: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    out = dict(request)
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        keys = list(out)
        if roll < 0.15 and keys:
            del out[rng.choice(keys)]
        elif roll < 0.3:
            out[rng.choice([*INFER_FIELDS, "target", "trimmed_length", "bogus", "Action"])] = (
                _json_value(rng, 1)
            )
        elif roll < 0.6 and keys:
            out[rng.choice(keys)] = _extreme(rng)
        elif roll < 0.75 and keys:
            out[rng.choice(keys)] = _json_value(rng, 0)
        elif roll < 0.85:
            out["action"] = rng.choice([*ACTIONS, "ECHO", "", None, 1, ["echo"], _unicode(rng, 5)])
        elif roll < 0.92:
            out[rng.choice(["text", "tag", "request_id", "customBos"])] = _unicode(rng, 50)
        elif roll < 0.96:
            field = rng.choice(["stop_conditions", "bann_bann"])
            out[field] = [_extreme(rng) for _ in range(rng.randint(1, 5))]
        else:
            field, value = rng.choice(_CONSTRAINTS)
            out[field] = value
    return out


def _text_mutation(rng: random.Random, text: str) -> str:
    chars = list(text)
    for _ in range(rng.randint(1, 4)):
        roll = rng.random()
        where = rng.randint(0, len(chars))
        if roll < 0.25:
            chars = chars[:where]
        elif roll < 0.5:
            chars.insert(where, rng.choice('{}[]",:\\ 0-eE.tfn\x00\ufeff🙂'))
        elif roll < 0.7 and chars:
            del chars[min(where, len(chars) - 1)]
        elif roll < 0.85 and chars:
            chars[min(where, len(chars) - 1)] = rng.choice(string.printable)
        else:
            chars[where:where] = list(
                rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "\\ud800"])
            )
    return "".join(chars)


def json_frame(rng: random.Random, vocab_size: int, serial: str) -> FuzzFrame:
    """One JSON-level frame (see the module docstring for the families)."""
    family = rng.choices(JSON_FAMILIES, weights=_FAMILY_WEIGHTS)[0]
    base = valid_request(rng, vocab_size, serial)
    if family == "valid":
        complete = None
        if base["action"] == "infer" and rng.random() < 0.3:
            base["request_id"] = serial
            complete = serial
        return FuzzFrame(family, _dumps(base, rng), complete)
    if family == "mutated":
        return FuzzFrame(family, _dumps(_mutate(rng, base, vocab_size), rng))
    if family == "text":
        return FuzzFrame(family, _text_mutation(rng, _dumps(base, rng)))
    if family == "random":
        value = _json_value(rng) if rng.random() < 0.3 else {"action": rng.choice(ACTIONS)}
        if isinstance(value, dict) and rng.random() < 0.7:
            extra = _json_value(rng, 3)
            if isinstance(extra, dict):
                value.update(extra)
            for _ in range(rng.randint(0, 4)):
                value[rng.choice([*INFER_FIELDS, "target"])] = _json_value(rng, 1)
        return FuzzFrame(family, _dumps(value, rng))
    if family == "deep":
        # Half of them near Python's recursion limit, where the depth at which
        # encoding a reply fails depends on how deep the server's stack is.
        depth = rng.choice([65, 100, 300, 5000, 100_000, 1_000_000])
        if rng.random() < 0.5:
            depth = rng.randint(850, 1010)
        nested = _nested(rng, depth)
        place = rng.choice(["request_id", "response_id", "tag", "target", "text", "whole"])
        if place == "whole":
            return FuzzFrame(family, nested)
        body = _dumps({k: v for k, v in base.items() if k != place}, rng)
        return FuzzFrame(
            family, body[:-1] + ("," if len(body) > 2 else "") + f'"{place}":{nested}}}'
        )
    if family == "numbers":
        field = rng.choice(
            [
                "max_new_tokens",
                "top_k",
                "top_p",
                "temperature",
                "rep_pen",
                "pres_pen",
                "seed",
                "trimmed_length",
                "skew",
                "freq_pen",
                "request_id",
                "bann_bann",
            ]
        )
        literal = rng.choice(
            [
                "1" * rng.choice([20, 310, 4300, 4301, 5000]),
                "-" + "9" * rng.choice([19, 400]),
                "1e999",
                "-1e999",
                "1e-999",
                "-0",
                "0.0e0",
                "1E308",
                "2.5e-324",
                "18446744073709551616",
                "9223372036854775808.0",
            ]
        )
        body = _dumps({k: v for k, v in base.items() if k != field}, rng)
        return FuzzFrame(
            family, body[:-1] + ("," if len(body) > 2 else "") + f'"{field}":{literal}}}'
        )
    if family == "long":
        size = rng.choice([1_000, 10_000, 100_000, 300_000])
        choice = rng.random()
        if choice < 0.4:
            request = {
                "action": rng.choice(["estimate_token", "lefttrim_token", "infer"]),
                "text": ("lorem ipsum " * (size // 12 + 1))[:size],
                "trimmed_length": 3,
                "max_new_tokens": 1,
            }
            if request["action"] == "estimate_token":
                del request["trimmed_length"], request["max_new_tokens"]
            elif request["action"] == "lefttrim_token":
                del request["max_new_tokens"]
            else:
                del request["trimmed_length"]
        elif choice < 0.7:
            count = rng.choice([100, 1_000, 10_000, 64_000])
            request = {
                "action": "infer",
                "text": "hi",
                "max_new_tokens": 1,
                "stop_conditions": [f"s{i}" for i in range(count)],
            }
        else:
            request = {**base, rng.choice(["request_id", "tag", "response_id"]): "x" * size}
        return FuzzFrame(family, _dumps(request, rng))
    # binary
    if rng.random() < 0.5:
        return FuzzFrame(family, _dumps(base, rng).encode())
    return FuzzFrame(family, rng.randbytes(rng.randint(0, 200)))


# --- the WebSocket level ------------------------------------------------------------


WS_KINDS = (
    "invalid_utf8",
    "invalid_utf8_fragmented",
    "reserved_opcode",
    "rsv_bit",
    "unmasked",
    "stray_continuation",
    "interleaved_data_frame",
    "fragmented_control",
    "oversized_control",
    "bad_close_code",
    "short_close",
    "close_reason_utf8",
    "random_bytes",
    "lying_length",
    "truncated",
    "random_header",
)
_WS_WEIGHTS = (2, 1, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 3, 2, 2, 3)


@attrs.frozen
class WsCase:
    kind: str
    data: bytes
    #: Close codes RFC 6455 asks for, or None when any answer but a crash is fine.
    expected: frozenset[int] | None


def _invalid_utf8(rng: random.Random) -> bytes:
    good = json.dumps({"action": "echo", "request_id": rng.randint(0, 99)}).encode()
    bad = rng.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf5\x80\x80\x80", b"\xe2\x28\xa1"])
    cut = rng.randint(0, len(good))
    return good[:cut] + bad + good[cut:]


def ws_frame(rng: random.Random) -> WsCase:
    """One malformed WebSocket input (see the module docstring)."""
    kind = rng.choices(WS_KINDS, weights=_WS_WEIGHTS)[0]
    b = wire.build_frame
    payload = json.dumps({"action": "echo"}).encode()
    c1002 = frozenset({1002})
    if kind == "invalid_utf8":
        return WsCase(kind, b(wire.TEXT, _invalid_utf8(rng)), frozenset({1007}))
    if kind == "invalid_utf8_fragmented":
        data = _invalid_utf8(rng)
        cut = rng.randint(1, len(data) - 1)
        return WsCase(
            kind,
            b(wire.TEXT, data[:cut], fin=False) + b(wire.CONTINUATION, data[cut:]),
            frozenset({1007}),
        )
    if kind == "reserved_opcode":
        opcode = rng.choice([3, 4, 5, 6, 7, 0xB, 0xC, 0xD, 0xE, 0xF])
        return WsCase(kind, b(opcode, rng.randbytes(rng.randint(0, 20))), c1002)
    if kind == "rsv_bit":
        opcode = rng.choice([wire.TEXT, wire.BINARY, wire.PING])
        return WsCase(kind, b(opcode, payload, rsv=rng.randint(1, 7)), c1002)
    if kind == "unmasked":
        opcode = rng.choice([wire.TEXT, wire.BINARY, wire.PING, wire.CLOSE])
        body = wire.close_payload(1000) if opcode == wire.CLOSE else payload
        return WsCase(kind, b(opcode, body, mask=False), c1002)
    if kind == "stray_continuation":
        return WsCase(kind, b(wire.CONTINUATION, payload, fin=rng.random() < 0.5), c1002)
    if kind == "interleaved_data_frame":
        return WsCase(
            kind,
            b(wire.TEXT, payload[:5], fin=False)
            + b(rng.choice([wire.TEXT, wire.BINARY]), payload[5:]),
            c1002,
        )
    if kind == "fragmented_control":
        return WsCase(
            kind, b(rng.choice([wire.PING, wire.PONG, wire.CLOSE]), b"", fin=False), c1002
        )
    if kind == "oversized_control":
        size = rng.randint(126, 1000)
        return WsCase(kind, b(rng.choice([wire.PING, wire.PONG]), b"x" * size), c1002)
    if kind == "bad_close_code":
        code = rng.choice([0, 999, 1004, 1005, 1006, 1015, 1016, 2999, 5000, 65535])
        return WsCase(kind, b(wire.CLOSE, wire.close_payload(code)), c1002)
    if kind == "short_close":
        return WsCase(kind, b(wire.CLOSE, rng.randbytes(1)), c1002)
    if kind == "close_reason_utf8":
        return WsCase(kind, b(wire.CLOSE, wire.close_payload(1000, b"bye\xff")), frozenset({1007}))
    if kind == "random_bytes":
        return WsCase(kind, rng.randbytes(rng.randint(1, 64)), None)
    if kind == "lying_length":
        declared = rng.choice([len(payload) + 10, 2**16, 2**31, 2**63 - 1, 2**63 + 5])
        return WsCase(kind, b(wire.TEXT, payload, declared_length=declared), None)
    if kind == "truncated":
        whole = b(wire.TEXT, payload)
        return WsCase(kind, whole[: rng.randint(1, len(whole) - 1)], None)
    head = bytes([rng.randint(0, 255), rng.randint(0, 255)])
    return WsCase(kind, head + rng.randbytes(rng.randint(0, 40)), None)
