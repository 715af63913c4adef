"""JSON as the protocol reads it: strict, bounded, and never recursive.

Every frame is checked for nesting depth *before* ``json.loads`` sees it (a
linear scan of its brackets outside strings), so no decoded value is deeper
than :data:`MAX_JSON_DEPTH`. Everything that walks a client's value later --
equality of a ``stop`` target, the size of an echoed id, a check of a value
handed over already parsed -- is a loop with an explicit stack, and encoding a
reply (``json.dumps``, recursive in C) meets values of bounded depth only.
"""

from __future__ import annotations

import json
import math
import reprlib
from typing import Any, Final

__all__ = [
    "MAX_JSON_DEPTH",
    "JsonError",
    "json_depth_exceeds",
    "json_equal",
    "json_kind",
    "json_size_exceeds",
    "parse_json",
    "show",
]

#: Arrays and objects nest at most this deep in a frame. Real clients send a
#: few levels (an id, a tag holding a small object); the cap keeps recursive
#: C code (json.dumps of an echoed id) far from any recursion limit.
MAX_JSON_DEPTH: Final = 64


class JsonError(ValueError):
    """A frame is not JSON this protocol reads; the message is for the client."""


#: Bytes that are neither a quote nor a bracket: dropped before the scan.
_NOT_SYNTAX: Final = bytes(b for b in range(256) if b not in b'"[]{}')


def _nesting_exceeds(data: bytes, limit: int) -> bool:
    """Whether the brackets of a UTF-8 JSON text, outside strings, nest
    deeper than ``limit``.

    Linear in the text and with no Python loop per byte: a few C passes
    (``count``, ``replace``, ``translate``) reduce the text to its quotes and
    brackets, and numpy finds the deepest point of what is left. The answer
    is exact for valid JSON; for text that is not JSON it may be either, and
    ``json.loads`` rejects that text anyway.
    """
    # Most frames have few brackets: no nesting can reach the limit then.
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    # Escapes first: each "\\" pair is one escaped backslash, and a backslash
    # left before a quote escapes it; neither delimits a string.
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    reduced = data.translate(None, _NOT_SYNTAX)
    # Two adjacent quotes bound either an empty string or a stretch between
    # two strings that holds no bracket: dropping both keeps every other
    # bracket on its side of every string.
    reduced = reduced.replace(b'""', b"")
    if 0 < reduced.count(b'"') <= 4096:
        # Few strings hold brackets: cut them out (every other piece between
        # quotes is inside a string).
        reduced = b"".join(reduced.split(b'"')[0::2])
    if reduced.count(b"[") + reduced.count(b"{") <= limit:
        return False
    import numpy as np  # only here: clients of the codec need not load it

    chars = np.frombuffer(reduced, dtype=np.uint8)
    steps = ((chars == ord("[")) | (chars == ord("{"))).astype(np.int8)
    steps -= ((chars == ord("]")) | (chars == ord("}"))).astype(np.int8)
    if b'"' in reduced:
        # After an odd number of quotes a bracket is inside a string.
        inside = (np.cumsum(chars == ord('"'), dtype=np.int32) & 1).astype(bool)
        steps[inside] = 0
    return bool(int(np.cumsum(steps, dtype=np.int32).max()) > limit)


def _reject_constant(name: str) -> Any:
    raise JsonError(f"{name} is not a json value")


def _finite_float(text: str) -> float:
    # "1e999" is valid JSON syntax but reads as infinity, which no frame
    # may carry back (an echoed id would come out as the non-JSON "Infinity").
    number = float(text)
    if not math.isfinite(number):
        raise JsonError(f"number {show(text)} is too large")
    return number


#: A decoder that refuses ``NaN``/``Infinity`` and numbers that read as
#: infinite (:class:`JsonError`, a ``ValueError``); the OpenAI routes parse
#: request bodies with it too.
STRICT_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def _has_lone_surrogate(obj: Any) -> bool:
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def parse_json(frame: str) -> Any:
    """Parse one text frame as strict JSON: valid Unicode (no lone
    surrogates, raw or escaped), no NaN or infinities, nesting at most
    :data:`MAX_JSON_DEPTH`. Raises :class:`JsonError`."""
    # Lone UTF-16 surrogates are valid JSON syntax but not Unicode: no
    # tokenizer takes them and no frame carrying them can be sent back.
    try:
        data = frame.encode("utf-8")
    except UnicodeEncodeError:
        raise JsonError("frame is not valid unicode (it holds a lone surrogate)") from None
    if _nesting_exceeds(data, MAX_JSON_DEPTH):
        raise JsonError(
            f"frame is nested too deeply: arrays and objects may nest {MAX_JSON_DEPTH} deep"
        )
    try:
        obj = STRICT_DECODER.decode(frame)
    except json.JSONDecodeError as exc:
        raise JsonError(
            f"frame is not valid json: {exc.msg[:1].lower()}{exc.msg[1:]}"
            f" at line {exc.lineno} column {exc.colno}"
        ) from None
    except JsonError as exc:
        raise JsonError(f"frame is not valid json: {exc}") from None
    except ValueError as exc:  # an integer too long to read
        raise JsonError(f"frame is not valid json: {exc}") from None
    except RecursionError:  # pragma: no cover - the depth check comes first
        raise JsonError("frame is nested too deeply") from None
    if (b"\\ud" in data or b"\\uD" in data) and _has_lone_surrogate(obj):
        raise JsonError("frame is not valid unicode (it holds a lone surrogate escape)")
    return obj


def json_depth_exceeds(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether arrays and objects in ``value`` nest deeper than ``limit``
    (a scalar has depth 0, ``[]`` depth 1). For values parsed elsewhere;
    a loop, not a recursion."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        depth += 1
        if depth > limit:
            return True
        stack.extend((child, depth) for child in item if isinstance(child, dict | list))
    return False


def _scalar_size(value: Any) -> int:
    if isinstance(value, str):
        return len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
    if value is None or value is True:
        return 4
    if value is False:
        return 5
    if isinstance(value, int):
        bits = value.bit_length()
        if bits > 9000:
            # Too long to print (Python prints at most 4300 digits); the
            # count of digits from the bits is off by at most one.
            return bits * 30103 // 100000 + 1 + (value < 0)
        return len(str(value))
    return len(repr(value))


def json_size_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` takes more than ``limit`` bytes as compact UTF-8 JSON
    (``json.dumps(value, ensure_ascii=False, separators=(",", ":"))``). Stops
    as soon as the limit is passed, so a huge value costs no more than
    ``limit`` to reject."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            # Braces, a colon per member, commas between members.
            total += 2 + len(item) + max(len(item) - 1, 0)
            for key, child in item.items():
                # Every character is a byte at least: a long key is over at once.
                total += len(key) if len(key) > limit else _scalar_size(key)
                stack.append(child)
        elif isinstance(item, list):
            total += 2 + max(len(item) - 1, 0)
            stack.extend(item)
        elif isinstance(item, str) and len(item) > limit:
            return True
        else:
            total += _scalar_size(item)
        if total > limit:
            return True
    return False


def json_equal(a: Any, b: Any) -> bool:
    """Equality of two decoded JSON values as JSON sees them.

    Python's ``==`` says ``True == 1``; JSON does not, and a ``stop`` target
    ``true`` must not hit the request ``1``. Numbers compare by value (``1``
    equals ``1.0``). A loop over an explicit stack: any depth is safe.
    """
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if isinstance(x, bool) or isinstance(y, bool):
            if type(x) is not type(y) or x != y:
                return False
        elif isinstance(x, int | float) and isinstance(y, int | float):
            if x != y:
                return False
        elif isinstance(x, dict) and isinstance(y, dict):
            if x.keys() != y.keys():
                return False
            stack.extend((x[key], y[key]) for key in x)
        elif isinstance(x, list) and isinstance(y, list):
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        elif type(x) is not type(y) or x != y:
            return False
    return True


def _make_repr() -> reprlib.Repr:
    short = reprlib.Repr()
    short.maxlevel = 3
    short.maxtuple = short.maxlist = 6
    short.maxdict = 4
    short.maxstring = short.maxlong = short.maxother = 40
    return short


_REPR: Final = _make_repr()


def show(value: Any) -> str:
    """``repr`` of a bad value, cut short after 80 characters: a client's
    8 MiB string must not come back in an error message, nor cost a full
    ``repr`` to print."""
    if isinstance(value, str):
        text = repr(value[:81])
    else:
        try:
            text = _REPR.repr(value)
        except ValueError:  # an int too long to print
            text = f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= 80 else text[:77] + "..."


def json_kind(value: Any) -> str:
    """The JSON type of a decoded value, with its article."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
