"""docs/protocol.md's field table and the codec agree.

The table is generated from the field declarations (the first test checks
that the doc holds exactly what they produce). The property test reads the
table as a client would -- the type column's words, the default column -- and
checks the codec against that reading, with a checker written here from the
words alone: values the doc allows decode, values it does not are an
``invalid_request`` naming the field, and a field left out takes the
documented default.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import json_values
from trioserve import protocol as p

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


def doc_rows() -> dict[str, tuple[str, str]]:
    """field -> (type, default) from the doc's infer table."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index("| field | type | default | meaning |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("| `"):
            break
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def test_the_doc_table_is_the_declared_one() -> None:
    assert p.infer_field_table() in DOC.read_text(encoding="utf-8")
    assert set(doc_rows()) == {*p.INFER_FIELDS, "tag"}


# --------------------------------------------------------------------------
# A reading of the type column, independent of the codec


def number(text: str) -> int | float:
    """'2^31-1', '-2^63', '0.01', '100'."""
    found = re.fullmatch(r"(-?)2\^(\d+)(-1)?", text)
    if found:
        sign, exponent, minus_one = found.groups()
        value: int = 2 ** int(exponent) - (1 if minus_one else 0)
        return -value if sign else value
    return float(text) if "." in text else int(text)


def is_int(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )


def is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def json_bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


Checker = Callable[[Any], bool]


def checker(kind: str) -> tuple[Checker, list[Any]]:
    """What the words allow, and values at its edges."""
    edges: list[Any]
    if kind == "string":
        return (lambda v: isinstance(v, str)), ["", "x", 5, None]
    if kind == "true or false":
        return (lambda v: isinstance(v, bool)), [True, False, 0, 1, "true"]
    if found := re.fullmatch(r"integer >= (\S+)", kind):
        lo = number(found[1])
        return (lambda v: is_int(v) and v >= lo), [lo, lo - 1, lo + 0.5, float(lo), 10**30]
    if found := re.fullmatch(r"integer from (\S+) to (\S+)", kind):
        lo, hi = number(found[1]), number(found[2])
        return (lambda v: is_int(v) and lo <= v <= hi), [lo, hi, lo - 1, hi + 1, 1e30, 1.5]
    if found := re.fullmatch(r"(\S+) or an integer from (\S+) to (\S+)", kind):
        off, lo, hi = number(found[1]), number(found[2]), number(found[3])
        edges = [off, lo, hi, lo - 1, off - 1, hi + 1, float(off), 1.5]
        return (lambda v: is_int(v) and (v == off or lo <= v <= hi)), edges
    if found := re.fullmatch(r"list of at most (\d+) strings of 1 to (\d+) characters", kind):
        most, chars = int(found[1]), int(found[2])
        edges = [[], ["x"], [""], ["x" * chars], ["x" * (chars + 1)], ["a"] * most]
        edges += [["a"] * (most + 1), "x", [1], [None]]
        return (
            lambda v: (
                isinstance(v, list)
                and len(v) <= most
                and all(isinstance(s, str) and 1 <= len(s) <= chars for s in v)
            )
        ), edges
    if found := re.fullmatch(
        r"object of at most (\d+) entries from a token id from 0 to (\S+) \(a key of decimal "
        r"digits without leading zeros\) to a number in \[(\S+), (\S+)\]",
        kind,
    ):
        most, top = int(found[1]), number(found[2])
        low, high = number(found[3]), number(found[4])

        def key_ok(k: str) -> bool:
            digits = k.isascii() and k.isdigit() and (k == "0" or not k.startswith("0"))
            return digits and int(k) <= top

        edges = [
            {},
            {"0": low, str(top): high},
            {str(top + 1): 0},
            {"-1": 0},
            {"01": 0},
            {" 1": 0},
            {"1": high + 1},
            {"1": True},
            {"1": "1"},
            {str(i): 0 for i in range(most)},
            {str(i): 0 for i in range(most + 1)},
            [],
        ]
        return (
            lambda v: (
                isinstance(v, dict)
                and len(v) <= most
                and all(key_ok(k) and is_number(b) and low <= b <= high for k, b in v.items())
            )
        ), edges
    if found := re.fullmatch(r"number in \[(\S+), (\S+)\]", kind):
        lo, hi = number(found[1]), number(found[2])
        edges = [
            lo,
            hi,
            lo - 1e-9,
            hi + 1e-9,
            (lo + hi) / 2,
            1e308,
            -1e308,
            1e-300,
            2**63,
        ]
        return (lambda v: is_number(v) and lo <= v <= hi), edges
    if found := re.fullmatch(r"any json value of at most (\d+) bytes", kind):
        most = int(found[1])
        edges = [
            "x" * (most - 2),
            "x" * (most - 1),
            [0] * (most // 2 - 1),
            [0] * (most // 2),
        ]
        return (lambda v: json_bytes(v) <= most), edges
    if found := re.fullmatch(
        r"stop string of 1 to (\d+) characters or a token id from (\S+) to (\S+), "
        r"or a list of at most (\d+) of them",
        kind,
    ):
        chars, lo, hi, most = int(found[1]), number(found[2]), number(found[3]), int(found[4])

        def stop_item(v: Any) -> bool:
            if isinstance(v, str):
                return 1 <= len(v) <= chars
            return is_int(v) and lo <= v <= hi

        edges = [
            "x" * chars,
            "x" * (chars + 1),
            "",
            -1,
            hi,
            hi + 1,
            ["a", 2] * (most // 2),
        ]
        edges.append(["a"] * (most + 1))
        return (
            lambda v: (
                all(map(stop_item, v)) and len(v) <= most if isinstance(v, list) else stop_item(v)
            )
        ), edges
    if found := re.fullmatch(
        r"token id from (\S+) to (\S+), or a list of at most (\d+) of them", kind
    ):
        lo, hi, most = number(found[1]), number(found[2]), int(found[3])

        def token(v: Any) -> bool:
            return is_int(v) and lo <= v <= hi

        edges = [lo, hi, hi + 1, -1, [lo] * most, [lo] * (most + 1), [1, "2"], [True]]
        return (
            lambda v: all(map(token, v)) and len(v) <= most if isinstance(v, list) else token(v)
        ), edges
    if found := re.fullmatch(
        r'list of 1 to (\d+) objects \{"role": string of 1 to (\d+) characters, '
        r'"content": string\}',
        kind,
    ):
        most, role = int(found[1]), int(found[2])

        def message(v: Any) -> bool:
            return (
                isinstance(v, dict)
                and set(v) == {"role", "content"}
                and isinstance(v["role"], str)
                and 1 <= len(v["role"]) <= role
                and isinstance(v["content"], str)
            )

        ok = {"role": "user", "content": "hi"}
        edges = [
            [ok],
            [],
            [ok] * most,
            [ok] * (most + 1),
            [{"role": "r" * role, "content": ""}],
            [{"role": "r" * (role + 1), "content": ""}],
            [{"role": "user"}],
            [{"role": "user", "content": "x", "name": "n"}],
        ]
        return (
            lambda v: isinstance(v, list) and 1 <= len(v) <= most and all(map(message, v))
        ), edges
    if found := re.fullmatch(r"string of (\d+) to (\d+) characters", kind):
        least, most = int(found[1]), int(found[2])
        edges = ["x" * least, "x" * most, "x" * (most + 1), "", 5, None, ["x"]]
        if least:
            edges.append("x" * (least - 1))
        return (lambda v: isinstance(v, str) and least <= len(v) <= most), edges
    if found := re.fullmatch(r"list of (\d+) to (\d+) strings of 1 to (\d+) characters", kind):
        least, most, chars = int(found[1]), int(found[2]), int(found[3])
        edges = [[], ["x"], [""], ["x" * chars], ["x" * (chars + 1)], ["a"] * most]
        edges += [["a"] * (most + 1), "x", [1], [None]]
        return (
            lambda v: (
                isinstance(v, list)
                and least <= len(v) <= most
                and all(isinstance(s, str) and 1 <= len(s) <= chars for s in v)
            )
        ), edges
    if found := re.fullmatch(r"object of at most (\d+) bytes as compact json", kind):
        most = int(found[1])
        edges = [
            {},
            {"type": "object"},
            {"x": "y" * (most - 10)},
            {"x": "y" * (most - 7)},
            {"x": "y" * (most - 6)},
            [],
            "{}",
            None,
        ]
        return (lambda v: isinstance(v, dict) and json_bytes(v) <= most), edges
    raise AssertionError(f"the doc's type {kind!r} has no reading here")


ROWS = doc_rows()
FIELDS = sorted(name for name in ROWS if name != "text")


def frame_with(name: str, value: Any) -> dict[str, Any]:
    frame: dict[str, Any] = {"action": "infer", "max_new_tokens": 8, "text": "hi"}
    if name == "messages":
        del frame["text"]  # exactly one of them
    frame[name] = value
    return frame


@st.composite
def field_and_value(draw: st.DrawFn) -> tuple[str, Any]:
    name = draw(st.sampled_from(FIELDS))
    _, edges = checker(ROWS[name][0])
    value = draw(st.sampled_from(edges) | json_values(6))
    return name, value


@pytest.mark.slow
@settings(max_examples=500)
@given(field_and_value())
def test_the_codec_accepts_what_the_doc_allows(case: tuple[str, Any]) -> None:
    name, value = case
    allowed, _ = checker(ROWS[name][0])
    frame = frame_with(name, value)
    failure: p.ProtocolError | None = None
    try:
        request = p.structure_request(frame)
    except p.ProtocolError as error:
        failure = error
    if failure is not None:
        assert not allowed(value), f"{name}={value!r} is allowed by the doc: {failure.message}"
        assert failure.error_type == "invalid_request"
        assert failure.field is not None
        assert failure.field == f"$.{name}" or failure.field.startswith(f"$.{name}[")
        return
    assert allowed(value), f"{name}={value!r} is not allowed by the doc, yet decoded"
    if name == "tag":
        assert request.echoed["tag"] == value
    else:
        wire = p.unstructure_request(request)[name]
        single = not isinstance(value, list) and isinstance(wire, list)
        assert p.json_equal(wire, [value] if single else value)


@pytest.mark.parametrize("name", FIELDS)
def test_a_field_left_out_takes_the_documented_default(name: str) -> None:
    _, default = ROWS[name]
    frame: dict[str, Any] = {"action": "infer", "text": "hi", "max_new_tokens": 8}
    frame.pop(name, None)
    if name == "max_new_tokens":
        assert default == "required"
        with pytest.raises(p.ProtocolError):
            p.structure_request(frame)
        return
    request = p.structure_request(frame)
    wire = p.unstructure_request(request)
    if default == "absent":
        assert name not in wire and name not in request.echoed
    else:
        assert default.startswith("`") and default.endswith("`")
        assert p.json_equal(wire[name], json.loads(default.strip("`")))


def test_text_is_required_unless_messages_are_given() -> None:
    assert ROWS["text"] == ("string", "required, unless `messages` is given")
    with pytest.raises(p.ProtocolError) as info:
        p.structure_request({"action": "infer", "max_new_tokens": 1})
    assert info.value.field == "$.text"
