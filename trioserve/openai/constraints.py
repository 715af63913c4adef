"""Structured output on the OpenAI door: every field that clients of the
usual servers send to constrain an answer, read into one
:class:`~trioserve.vocabulary.constraint.Constraint`.

* OpenAI: ``response_format`` ``{"type": "text" | "json_object" |
  "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``
  (and llama.cpp's ``{"type": "json_object", "schema": ...}``);
* llama.cpp: ``json_schema`` (an object) and ``grammar`` (GBNF);
* vLLM: ``structured_outputs: {json | regex | choice | grammar | json_object}``
  and the older ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar``;
* TabbyAPI: ``json_schema``, ``regex_pattern``, ``grammar_string``.

A grammar is GBNF when it holds ``::=``, else Lark. An empty schema ``{}`` and
``{"type": "text"}`` ask for nothing (front ends send them by default). Each
value is read by the rule the WebSocket ``infer`` declares for it (the same
bounds on both doors). At most one constraint per request: two are a 400
naming both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from cattrs.errors import IterableValidationError, IterableValidationNote

from trioserve.vocabulary.constraint import Constraint
from trioserve.vocabulary.rules import BadValue, Rule
from trioserve.vocabulary.strict_json import STRICT_DECODER, show

from .errors import OpenAIError
from .errors import invalid as _invalid
from .fields import _rule

__all__ = ["CONSTRAINT_PARAMS", "read_constraint"]

_UNSUPPORTED: Final = "unsupported_parameter"


def _read(param: str, rule: Rule, value: Any) -> Any:
    """``value`` read by ``rule``; its error names ``param`` (and the element)."""
    try:
        return rule.read(value)
    except BadValue as exc:
        raise _invalid(f"{param} {exc}", param) from None
    except IterableValidationError as exc:
        for error in exc.exceptions:
            for note in getattr(error, "__notes__", ()):
                if isinstance(note, IterableValidationNote):
                    where = f"{param}[{note.index}]"
                    raise _invalid(f"{where} {error}", where) from None
        raise _invalid(f"{param} {exc}", param) from None


def _schema(param: str, value: Any, *, text: bool = False) -> Constraint | None:
    """A JSON schema given as an object, or (with ``text``: vLLM's fields
    take both) as its JSON text; ``{}`` is no constraint."""
    rule = _rule("json_schema")
    if text and isinstance(value, str):
        limit = rule.max_bytes  # type: ignore[attr-defined]
        if len(value) > limit:
            raise _invalid(
                f"{param} must be a schema of at most {limit} bytes, got {len(value)} characters",
                param,
            )
        try:
            value = STRICT_DECODER.decode(value)
        except ValueError as exc:
            raise _invalid(f"{param} is a string that is not JSON: {exc}", param) from None
    schema = _read(param, rule, value)
    return None if schema == {} else Constraint.json_schema(schema, param)


def _schema_or_text(param: str, value: Any) -> Constraint | None:
    return _schema(param, value, text=True)


def _regex(param: str, value: Any) -> Constraint:
    return Constraint("regex", _read(param, _rule("regex"), value), param)


def _choice(param: str, value: Any) -> Constraint:
    return Constraint.choice(_read(param, _rule("choice"), value), param)


def _grammar(param: str, value: Any) -> Constraint:
    return Constraint("grammar", _read(param, _rule("grammar"), value), param)


def _object(param: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _invalid(f"{param} must be an object, got {show(value)}", param)
    return value


def _unknown(param: str, key: Any, known: list[str]) -> OpenAIError:
    return _invalid(
        f"unrecognized field {show(key)} of {param}; its fields: {', '.join(known)}",
        f"{param}.{key}" if isinstance(key, str) and len(key) <= 64 else param,
        "unknown_parameter",
    )


_OBJECT: Final = Constraint.json_schema({"type": "object"})


def _response_format(param: str, value: Any) -> list[Constraint]:
    if value is None:
        return []
    body = _object(param, value)
    kind = body.get("type")
    allowed = {
        "text": ["type"],
        "json_object": ["type", "schema"],
        "json_schema": ["type", "json_schema"],
    }
    if not isinstance(kind, str) or kind not in allowed:
        raise _invalid(
            f"{param}.type must be one of 'text', 'json_object', 'json_schema'; got {show(kind)}",
            f"{param}.type",
        )
    for key in body:
        if key not in allowed[kind]:
            raise _unknown(param, key, allowed[kind])
    if kind == "text":
        return []
    if kind == "json_object":
        # llama.cpp's form: a json_object with a schema is that schema.
        if body.get("schema") is not None:
            found = _schema(f"{param}.schema", body["schema"])
            return [found] if found is not None else [_field(_OBJECT, param)]
        return [_field(_OBJECT, param)]
    where = f"{param}.json_schema"
    spec = _object(where, body.get("json_schema"))
    known = ["name", "schema", "strict", "description"]
    for key in spec:
        if key not in known:
            raise _unknown(where, key, known)
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or len(name) > 256):
        raise _invalid(
            f"{where}.name must be a string of at most 256 characters, got {show(name)}",
            f"{where}.name",
        )
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise _invalid(
            f"{where}.description must be a string, got {show(description)}",
            f"{where}.description",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _invalid(
            f"{where}.strict must be true or false, got {show(strict)}", f"{where}.strict"
        )
    if spec.get("schema") is None:
        # OpenAI's schema is optional: without one, any JSON object.
        return [_field(_OBJECT, where)]
    found = _schema(f"{where}.schema", spec["schema"])
    return [] if found is None else [found]


def _field(constraint: Constraint, param: str) -> Constraint:
    return Constraint(constraint.kind, constraint.text, param)


#: vLLM's ``structured_outputs`` keys: what each constrains to, or why it is
#: refused; options that cannot change the guarantee are accepted.
_VLLM_IGNORED: Final = frozenset({"backend", "disable_fallback", "disable_any_whitespace"})


def _structured_outputs(param: str, value: Any) -> list[Constraint]:
    if value is None:
        return []
    body = _object(param, value)
    readers: dict[str, Callable[[str, Any], Constraint | None]] = {
        "json": _schema_or_text,
        "regex": _regex,
        "choice": _choice,
        "grammar": _grammar,
    }
    found: list[Constraint] = []
    for key, given in body.items():
        where = f"{param}.{key}"
        if key in _VLLM_IGNORED or given is None:
            continue
        if key in readers:
            constraint = readers[key](where, given)
            if constraint is not None:
                found.append(constraint)
        elif key == "json_object":
            if given is not True and given is not False:
                raise _invalid(f"{where} must be true or false, got {show(given)}", where)
            if given:
                found.append(_field(_OBJECT, where))
        elif key in ("whitespace_pattern", "structural_tag", "disable_additional_properties"):
            raise _invalid(f"{where} is not supported", where, _UNSUPPORTED)
        else:
            raise _unknown(param, key, [*readers, "json_object", *sorted(_VLLM_IGNORED)])
    return found


def _one(reader: Callable[[str, Any], Constraint | None]) -> Callable[[str, Any], list[Constraint]]:
    def read(param: str, value: Any) -> list[Constraint]:
        if value is None:
            return []
        found = reader(param, value)
        return [] if found is None else [found]

    return read


def _refused_unless_null(param: str, value: Any) -> list[Constraint]:
    if value is not None:
        raise _invalid(f"{param} is not supported", param, _UNSUPPORTED)
    return []


def _ignored(param: str, value: Any) -> list[Constraint]:
    return []


#: Field -> how it is read. ``guided_decoding_backend`` names vLLM's engine:
#: there is one here, and it cannot change what the output must match.
_READERS: Final[Mapping[str, Callable[[str, Any], list[Constraint]]]] = {
    "response_format": _response_format,
    "json_schema": _one(_schema),
    "grammar": _one(_grammar),
    "structured_outputs": _structured_outputs,
    "guided_json": _one(_schema_or_text),
    "guided_regex": _one(_regex),
    "guided_choice": _one(_choice),
    "guided_grammar": _one(_grammar),
    "regex_pattern": _one(_regex),
    "grammar_string": _one(_grammar),
    "guided_decoding_backend": _ignored,
    "guided_whitespace_pattern": _refused_unless_null,
}

#: Every body field that may carry a constraint.
CONSTRAINT_PARAMS: Final = frozenset(_READERS)


def read_constraint(fields: Mapping[str, Any]) -> Constraint | None:
    """The one constraint among ``fields`` (a body's constraint fields, in
    its order), or None; raises :class:`OpenAIError` (400, naming the field)."""
    found: list[Constraint] = []
    for key, value in fields.items():
        found.extend(_READERS[key](key, value))
    if len(found) > 1:
        first, second = found[0].field, found[1].field
        raise _invalid(f"give at most one constraint per request; got {first} and {second}", second)
    return found[0] if found else None
