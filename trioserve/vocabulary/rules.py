"""Request fields declared once: wire name, type, range, default, doc line.

Every field of every request class is an attrs field made by
:func:`wire_field` (or :func:`sampler_field`, which takes the default and the
range from :class:`~trioserve.vocabulary.sampling.SamplingSettings`). Its metadata is a
:class:`Wire`: the wire name, the :class:`Rule` that reads and checks a value,
and the words for the docs table. The codec's structure hooks, the error
paths, the per-field ``info`` limits and the docs' field table are all built
from these declarations, so adding a field is one line.

A rule raises :class:`BadValue` (the message lacks only the field's path) or,
for a bad element of a list, cattrs' own ``IterableValidationError`` /
``ClassValidationError`` with the element's index or attribute in the
exception notes; the codec reads the path from those notes.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

import attrs
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    IterableValidationError,
    IterableValidationNote,
)

from trioserve.vocabulary.sampling import RANGE, Flag, Range, SamplingSettings, Strings, TokenBias
from trioserve.vocabulary.strict_json import json_size_exceeds, show

__all__ = [
    "WIRE",
    "AnyJson",
    "BadValue",
    "Bool",
    "Float",
    "Int",
    "JsonObject",
    "LogitBias",
    "Messages",
    "Rule",
    "StopConditions",
    "Str",
    "StrList",
    "TokenIds",
    "Wire",
    "as_float",
    "as_int",
    "closest",
    "sampler_field",
    "wire_field",
]

#: Metadata key of an attrs field's :class:`Wire`.
WIRE: Final = "trioserve.wire"

_T = TypeVar("_T")


class BadValue(ValueError):
    """A field value broke its rule; the message lacks only the field's path
    (``"must be an integer >= 1, got 0"``)."""


def as_int(value: Any) -> int | None:
    """An int from a JSON number: ints, and floats with no fraction
    (``200.0``); never a bool."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def as_float(value: Any) -> float | None:
    """A finite float from a JSON number (ints accepted); never a bool."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            return None
    return None


def closest(key: str, known: list[str]) -> str | None:
    """The known name a misspelt key most likely meant, if any is close."""
    if len(key) > 64:  # difflib is quadratic: a hostile key gets no advice
        return None
    found = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return found[0] if found else None


# --------------------------------------------------------------------------
# Rules


class Rule:
    """How one field's value is read from JSON and checked.

    ``allowed`` says what is accepted, with its article ("an integer from 1 to
    10"): error messages append it to "must be", the docs table shows it
    without the article. ``limits`` are the per-field limits the ``info``
    action reports.
    """

    allowed: str = ""
    limits: Mapping[str, int] = {}

    def read(self, value: Any) -> Any:
        raise NotImplementedError

    def hook(self, value: Any, _: Any) -> Any:
        """The cattrs structure hook of the field."""
        return self.read(value)

    def write(self, value: Any, default: Callable[[Any], Any]) -> Any:
        """The wire form of a value ``read`` returned; ``default`` is the
        converter's own (a tuple becomes a list)."""
        return default(value)

    def bad(self, value: Any) -> BadValue:
        return BadValue(f"must be {self.allowed}, got {show(value)}")

    @property
    def doc(self) -> str:
        """The docs table's type column: ``allowed`` without its article."""
        for article in ("a ", "an "):
            if self.allowed.startswith(article):
                return self.allowed[len(article) :]
        return self.allowed


class Str(Rule):
    def __init__(self, max_chars: int | None = None, *, min_chars: int = 0) -> None:
        self.max_chars = max_chars
        self.min_chars = min_chars
        if max_chars is not None:
            self.allowed = f"a string of {min_chars} to {max_chars} characters"
        elif min_chars:
            self.allowed = f"a string of at least {min_chars} characters"
        else:
            self.allowed = "a string"

    def read(self, value: Any) -> str:
        if not isinstance(value, str) or len(value) < self.min_chars:
            raise self.bad(value)
        if self.max_chars is not None and len(value) > self.max_chars:
            raise BadValue(f"must be {self.allowed}, got {len(value)} characters")
        return value


class Bool(Rule):
    allowed = "true or false"

    def read(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.bad(value)
        return value


class Int(Rule):
    def __init__(
        self, lo: int | None = None, hi: int | None = None, *, off: int | None = None
    ) -> None:
        self.lo = lo
        self.hi = hi
        #: A value outside [lo, hi] that is also allowed (``dry_range`` 0).
        self.off = off
        if lo is not None and hi is not None:
            self.allowed = Range(lo, hi, integer=True, off=off).describe()
        elif lo is not None:
            self.allowed = f"an integer >= {lo}"
        else:
            self.allowed = "an integer"

    def read(self, value: Any) -> int:
        number = as_int(value)
        if number is not None and number == self.off:
            return number
        if (
            number is None
            or (self.lo is not None and number < self.lo)
            or (self.hi is not None and number > self.hi)
        ):
            raise self.bad(value)
        return number


class Float(Rule):
    def __init__(self, allowed_range: Range) -> None:
        self.range = allowed_range
        self.allowed = allowed_range.describe()

    def read(self, value: Any) -> float:
        number = as_float(value)
        if number is None or not self.range.lo <= number <= self.range.hi:
            raise self.bad(value)
        return number


def _rule_of(bound: Range | Flag | Strings | TokenBias) -> Rule:
    if isinstance(bound, Flag):
        return Bool()
    if isinstance(bound, Strings):
        return StrList(bound)
    if isinstance(bound, TokenBias):
        return LogitBias(bound)
    if bound.integer:
        return Int(int(bound.lo), int(bound.hi), off=bound.off)
    return Float(bound)


def _element_error(index: int, error: Exception) -> IterableValidationError:
    """A bad list element, as cattrs reports one: the index in a note."""
    error.__notes__ = [IterableValidationNote(f"@ index {index}", index, object)]
    return IterableValidationError(f"invalid element {index}", [error], tuple)


def _elements(value: Any, rule: Rule, item: Callable[[Any], _T], max_count: int) -> tuple[_T, ...]:
    """A list of items, or one item standing for a list of one (the seed
    accepted both for ``stop_conditions`` and ``bann_bann``)."""
    if not isinstance(value, list):
        try:
            return (item(value),)
        except BadValue:
            raise rule.bad(value) from None
    if len(value) > max_count:
        raise BadValue(f"must hold at most {max_count} entries, got {len(value)}")
    out: list[_T] = []
    for index, element in enumerate(value):
        try:
            out.append(item(element))
        except BadValue as error:
            raise _element_error(index, error) from None
    return tuple(out)


#: Token ids fit a signed 32-bit int in every engine (ExLlamaV2 passes them
#: to C++ as int); the model's vocabulary bounds them further, at the server.
MAX_TOKEN_ID: Final = 2**31 - 1


class StopConditions(Rule):
    """Stop strings and stop token ids, a list or a single one."""

    def __init__(self, max_count: int, max_chars: int) -> None:
        self.max_count = max_count
        self.max_chars = max_chars
        self.item_allowed = (
            f"a stop string of 1 to {max_chars} characters or a token id from 0 to 2^31-1"
        )
        self.allowed = f"{self.item_allowed}, or a list of at most {max_count} of them"
        self.limits = {"max_stop_conditions": max_count, "max_stop_string_chars": max_chars}

    def item(self, value: Any) -> str | int:
        if isinstance(value, str):
            if not value:
                raise BadValue(f"must be {self.item_allowed}, got ''")
            if len(value) > self.max_chars:
                raise BadValue(f"must be {self.item_allowed}, got {len(value)} characters")
            return value
        number = as_int(value)
        if number is None or not 0 <= number <= MAX_TOKEN_ID:
            raise BadValue(f"must be {self.item_allowed}, got {show(value)}")
        return number

    def read(self, value: Any) -> tuple[str | int, ...]:
        return _elements(value, self, self.item, self.max_count)


class StopStrings(Rule):
    """Stop strings only (OpenAI's ``stop``, Anthropic's ``stop_sequences``),
    a list or a single one."""

    def __init__(self, max_count: int, max_chars: int) -> None:
        self.max_count = max_count
        self.max_chars = max_chars
        self.item_allowed = f"a stop string of 1 to {max_chars} characters"
        self.allowed = f"{self.item_allowed}, or a list of at most {max_count} of them"
        self.limits = {"max_stop_strings": max_count, "max_stop_string_chars": max_chars}

    def item(self, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise BadValue(f"must be {self.item_allowed}, got {show(value)}")
        if len(value) > self.max_chars:
            raise BadValue(f"must be {self.item_allowed}, got {len(value)} characters")
        return value

    def read(self, value: Any) -> tuple[str, ...]:
        return _elements(value, self, self.item, self.max_count)


class TokenIds(Rule):
    """Token ids, a list or a single one."""

    def __init__(self, max_count: int, limit_name: str) -> None:
        self.max_count = max_count
        self.item_allowed = "a token id from 0 to 2^31-1"
        self.allowed = f"{self.item_allowed}, or a list of at most {max_count} of them"
        self.limits = {limit_name: max_count}

    def item(self, value: Any) -> int:
        number = as_int(value)
        if number is None or not 0 <= number <= MAX_TOKEN_ID:
            raise BadValue(f"must be {self.item_allowed}, got {show(value)}")
        return number

    def read(self, value: Any) -> tuple[int, ...]:
        # The usual list, checked in C-speed passes; the loop below finds the
        # first bad element (and handles integral floats) otherwise.
        if (
            isinstance(value, list)
            and 0 < len(value) <= self.max_count
            and set(map(type, value)) == {int}
            and min(value) >= 0
            and max(value) <= MAX_TOKEN_ID
        ):
            return tuple(value)
        return _elements(value, self, self.item, self.max_count)


class StrList(Rule):
    """A list of strings, bounded in count and in characters
    (``dry_sequence_breakers``, ``choice``); ``limit_names`` name the two
    bounds in ``info``'s limits."""

    def __init__(
        self,
        bound: Strings,
        limit_names: tuple[str, str] = (
            "max_dry_sequence_breakers",
            "max_dry_sequence_breaker_chars",
        ),
        *,
        min_count: int = 0,
    ) -> None:
        self.bound = bound
        self.min_count = min_count
        self.item_allowed = f"a string of 1 to {bound.max_chars} characters"
        self.allowed = bound.describe()
        if min_count:
            self.allowed = self.allowed.replace("at most", f"{min_count} to", 1)
        self.limits = {limit_names[0]: bound.max_count, limit_names[1]: bound.max_chars}

    def item(self, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise BadValue(f"must be {self.item_allowed}, got {show(value)}")
        if len(value) > self.bound.max_chars:
            raise BadValue(f"must be {self.item_allowed}, got {len(value)} characters")
        return value

    def read(self, value: Any) -> tuple[str, ...]:
        if not isinstance(value, list):
            raise self.bad(value)
        # The count first: a list of 100,000 strings is refused before any
        # of them is looked at.
        if len(value) > self.bound.max_count:
            raise BadValue(f"must hold at most {self.bound.max_count} strings, got {len(value)}")
        if len(value) < self.min_count:
            raise self.bad(value)
        out = []
        for index, element in enumerate(value):
            try:
                out.append(self.item(element))
            except BadValue as error:
                raise _element_error(index, error) from None
        return tuple(out)


#: The digits of a token id as OpenAI writes ``logit_bias`` keys: no sign, no
#: leading zero (so each id has one spelling), at most 10 digits (2^31-1 has 10).
_MAX_ID_DIGITS: Final = 10


class LogitBias(Rule):
    """OpenAI's ``logit_bias``: an object from token ids, written as JSON
    object keys of decimal digits, to additive biases. Read into ``(id,
    bias)`` pairs in ascending order of id, as
    :class:`~trioserve.vocabulary.sampling.SamplingSettings` holds them."""

    def __init__(self, bound: TokenBias) -> None:
        self.bound = bound
        self.bias = Range(bound.lo, bound.hi)
        self.allowed = bound.describe()
        self.limits = {"max_logit_bias": bound.max_count}

    def _token(self, key: Any) -> int:
        if (
            not isinstance(key, str)
            or not 0 < len(key) <= _MAX_ID_DIGITS
            or not key.isascii()
            or not key.isdigit()
            or (key[0] == "0" and key != "0")
        ):
            raise self._bad_key(key)
        token = int(key)
        if token > self.bound.max_id:
            raise self._bad_key(key)
        return token

    def _bad_key(self, key: Any) -> BadValue:
        return BadValue(
            f"keys must be token ids from 0 to 2^31-1 in decimal digits without leading "
            f"zeros, got {show(key)}"
        )

    def read(self, value: Any) -> tuple[tuple[int, float], ...]:
        if not isinstance(value, dict):
            raise self.bad(value)
        # The count before any key is parsed.
        if len(value) > self.bound.max_count:
            raise BadValue(f"must hold at most {self.bound.max_count} entries, got {len(value)}")
        pairs = []
        for key, bias in value.items():
            token = self._token(key)
            number = as_float(bias)
            if number is None or not self.bias.contains(number):
                raise _attribute_error(
                    key, BadValue(f"must be {self.bias.describe()}, got {show(bias)}")
                )
            pairs.append((token, number))
        return tuple(sorted(pairs))

    def write(self, value: Any, default: Callable[[Any], Any]) -> Any:
        return {str(token): bias for token, bias in value}


class AnyJson(Rule):
    """Any JSON value of at most ``max_bytes`` as compact JSON (echoed ids,
    ``tag``, a ``stop`` target)."""

    def __init__(self, max_bytes: int, limit_name: str) -> None:
        self.max_bytes = max_bytes
        self.allowed = f"any json value of at most {max_bytes} bytes"
        self.limits = {limit_name: max_bytes}

    def read(self, value: Any) -> Any:
        if json_size_exceeds(value, self.max_bytes):
            raise BadValue(f"must be {self.allowed} (as compact json)")
        return value


class JsonObject(Rule):
    """A JSON object of at most ``max_bytes`` as compact JSON (a JSON
    schema)."""

    def __init__(self, max_bytes: int, limit_name: str) -> None:
        self.max_bytes = max_bytes
        self.allowed = f"an object of at most {max_bytes} bytes as compact json"
        self.limits = {limit_name: max_bytes}

    def read(self, value: Any) -> Any:
        if not isinstance(value, dict):
            raise self.bad(value)
        if json_size_exceeds(value, self.max_bytes):
            raise BadValue(f"must be {self.allowed}, got more than {self.max_bytes} bytes")
        return value


class Messages(Rule):
    """A chat: a list of ``{"role": str, "content": str}`` objects, read into
    instances of ``message_class`` (whose fields are ``role`` and
    ``content``)."""

    def __init__(self, message_class: type[Any], max_count: int, max_role_chars: int) -> None:
        self.message_class = message_class
        self.max_count = max_count
        self.role = Str(max_role_chars, min_chars=1)
        self.content = Str()
        self.allowed = (
            f'a list of 1 to {max_count} objects {{"role": string of 1 to '
            f'{max_role_chars} characters, "content": string}}'
        )
        self.limits = {"max_messages": max_count, "max_role_chars": max_role_chars}

    def read(self, value: Any) -> tuple[Any, ...]:
        if not isinstance(value, list) or not value:
            raise self.bad(value)
        if len(value) > self.max_count:
            raise BadValue(f"must hold at most {self.max_count} messages, got {len(value)}")
        out = []
        for index, element in enumerate(value):
            try:
                out.append(self._message(element))
            except (BadValue, ClassValidationError) as error:
                raise _element_error(index, error) from None
        return tuple(out)

    def _message(self, element: Any) -> Any:
        if not isinstance(element, dict):
            raise BadValue(
                f'must be an object {{"role": ..., "content": ...}}, got {show(element)}'
            )
        for key in element:
            if key not in ("role", "content"):
                hint = closest(key, ["content", "role"]) if isinstance(key, str) else None
                advice = f" (did you mean {hint!r}?)" if hint else ""
                raise _attribute_error(
                    key, BadValue(f"is not a field of a message{advice}; fields: content, role")
                )
        values = {}
        for name, rule in (("role", self.role), ("content", self.content)):
            if name not in element:
                raise _attribute_error(name, BadValue(f"is required: {rule.allowed}"))
            try:
                values[name] = rule.read(element[name])
            except BadValue as error:
                raise _attribute_error(name, error) from None
        return self.message_class(**values)


def _attribute_error(name: Any, error: Exception) -> ClassValidationError:
    """A bad attribute of a nested object, as cattrs reports one."""
    error.__notes__ = [AttributeValidationNote(f"@ attribute {name}", name, object)]
    return ClassValidationError(f"invalid attribute {name!r}", [error], object)


# --------------------------------------------------------------------------
# Declarations


@attrs.frozen
class Wire:
    """A request field as the wire sees it (the metadata of its attrs field)."""

    #: The key in the JSON object.
    name: str
    rule: Rule
    #: The docs table's "meaning" column.
    meaning: str
    #: Not in the ExLlamaV2 server's protocol.
    extension: bool = False
    #: Fields of one group are alternatives: exactly one must be given.
    group: str | None = None
    #: The docs table's default column for a field without a default value.
    default_doc: str | None = None
    #: Fields of one exclusive set: at most one may be given (constraints).
    exclusive: str | None = None


def wire_field(
    rule: Rule,
    meaning: str,
    *,
    default: Any = attrs.NOTHING,
    name: str | None = None,
    extension: bool = False,
    group: str | None = None,
    default_doc: str | None = None,
    exclusive: str | None = None,
) -> Any:
    """An attrs field that is also a wire field. ``name`` is the wire name
    when it differs from the attribute's (``customBos``); ``""`` stands for
    the attribute's name."""
    wire = Wire(
        name=name or "",
        rule=rule,
        meaning=meaning,
        extension=extension,
        group=group,
        default_doc=default_doc,
        exclusive=exclusive,
    )
    hashable = not isinstance(rule, (AnyJson, JsonObject))
    return attrs.field(default=default, metadata={WIRE: wire}, hash=hashable)


_SAMPLER: Final = {a.name: a for a in attrs.fields(SamplingSettings)}


def sampler_field(
    name: str, meaning: str, *, extension: bool = False, default_doc: str | None = None
) -> Any:
    """A wire field that is a sampler setting: its default and its bound are
    :class:`SamplingSettings`' (declared there once, for the engines too)."""
    setting = _SAMPLER[name]
    return wire_field(
        _rule_of(setting.metadata[RANGE]),
        meaning,
        default=setting.default,
        name=name,
        extension=extension,
        default_doc=default_doc,
    )
