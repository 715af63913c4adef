"""What a request may constrain its output to: a JSON schema, a regular
expression, a choice of strings, or a grammar. Declarations only (no torch,
no llguidance): the protocol and the OpenAI door read the bounds here, and
:mod:`trioserve.engine.grammars` compiles and enforces a :class:`Constraint`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final, Literal, TypeAlias

import attrs

from trioserve.errors import TrioserveError

__all__ = [
    "CONSTRAINT_KINDS",
    "CONSTRAINT_LIMITS",
    "Constraint",
    "ConstraintError",
    "ConstraintKind",
    "ConstraintLimits",
    "grammar_syntax",
]

#: What a constraint may be: a JSON schema (``json_object`` is the schema
#: ``{"type": "object"}``), a regular expression the whole output matches,
#: one of a list of strings, or a context-free grammar (GBNF or Lark).
ConstraintKind: TypeAlias = Literal["json_schema", "regex", "choice", "grammar"]
CONSTRAINT_KINDS: Final[tuple[ConstraintKind, ...]] = ("json_schema", "regex", "choice", "grammar")


@attrs.frozen
class ConstraintLimits:
    """How large a constraint a request may send, checked before any work.

    A schema of 64 KiB holds hundreds of properties (OpenAI allows 5,000
    properties and 1,000 enum values in all: well under it); a grammar of 64 KiB
    is larger than any of llama.cpp's bundled ones; a regex of 4,096
    characters is far beyond real patterns (the cost of a regex grows with its
    automaton, which the parser limits bound as well).
    """

    max_schema_bytes: int = 64 * 1024
    max_regex_chars: int = 4096
    max_grammar_chars: int = 64 * 1024
    max_choices: int = 1024
    max_choice_chars: int = 256


CONSTRAINT_LIMITS: Final = ConstraintLimits()


class ConstraintError(TrioserveError):
    """A constraint cannot be compiled: a client's mistake (a bad schema,
    regex or grammar, or one beyond the limits). The message is llguidance's
    reason, in one line."""


def grammar_syntax(text: str) -> Literal["gbnf", "lark"]:
    """GBNF when the grammar holds ``::=`` (its rule operator), else Lark
    (llguidance's own syntax, which writes rules with ``:``)."""
    return "gbnf" if "::=" in text else "lark"


@attrs.frozen
class Constraint:
    """One request's constraint, as text: a schema as compact JSON (its keys
    in the client's order, which is the order of the generated properties),
    a pattern, a choice list, or a grammar. ``field`` is where the client
    wrote it (``$.json_schema``, ``response_format``...), for its errors; it
    is not part of the value."""

    kind: ConstraintKind
    #: json_schema: the schema as compact JSON; regex: the pattern; choice:
    #: the choices as a JSON list; grammar: the grammar text.
    text: str
    field: str = attrs.field(default="", eq=False)

    @classmethod
    def json_schema(cls, schema: Any, field: str = "") -> Constraint:
        return cls("json_schema", _compact(schema), field)

    @classmethod
    def choice(cls, choices: Sequence[str], field: str = "") -> Constraint:
        return cls("choice", _compact(list(choices)), field)

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8", "surrogatepass"))


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
