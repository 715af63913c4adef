"""Each door as a table (trioserve/server/doors.py): what it reads into the
pipeline's GenerationRequest has the types the request declares (the table is
beyond mypy's reach, so this test checks what mypy checked of the mapping
functions it replaced), and the names it reads by are the names its errors
give."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping
from typing import Any

import attrs
import pytest

from trioserve import openai as oa
from trioserve import protocol as p
from trioserve.generation import GenerationRequest, InvalidGeneration
from trioserve.server.doors import (
    CHAT,
    COMPLETION,
    INFER,
    Door,
    from_infer,
    from_openai,
    openai_error,
    openai_param,
    websocket_path,
)

pytestmark = pytest.mark.unit

HINTS = typing.get_type_hints(GenerationRequest)


def conforms(value: object, hint: Any) -> bool:
    """``value`` is of the annotation ``hint`` (the forms GenerationRequest uses)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(map(conforms, value, args))
    if origin in (Mapping, dict):
        return isinstance(value, Mapping) and all(
            conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items()
        )
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin or hint)


def test_conforms_tells_the_types_apart() -> None:
    assert conforms((1, 2), tuple[int, ...]) and not conforms([1, 2], tuple[int, ...])
    assert not conforms((True,), tuple[int, ...])
    assert conforms(None, int | None) and not conforms("1", int | None)
    assert conforms("trim", typing.Literal["trim", "refuse"]) and not conforms("cut", HINTS["fit"])
    assert conforms(({"role": "user"},), HINTS["messages"]) and not conforms(
        [{}], HINTS["messages"]
    )


def infer(**fields: Any) -> p.InferRequest:
    request = p.decode_request(json.dumps({"action": "infer", **fields}))
    assert isinstance(request, p.InferRequest)
    return request


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]

EXAMPLES: list[tuple[Door, object]] = [
    (INFER, infer(text="hi", max_new_tokens=5)),
    (
        INFER,
        infer(
            text="hi",
            customBos="<s>",
            max_new_tokens=5,
            stop_conditions=["x", 7, "y", 9],
            bann_bann=[3, 4],
            token_healing=True,
            logprobs=2,
            json_schema=SCHEMA,
            temperature=0.5,
            min_tokens=2,
        ),
    ),
    (INFER, infer(messages=[{"role": "user", "content": "hi"}], max_new_tokens=5, regex="a+")),
    (CHAT, oa.parse_chat_request(b'{"messages": [{"role": "user", "content": "hi"}]}')),
    (
        CHAT,
        oa.parse_chat_request(
            json.dumps(
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8,
                    "stop": ["a", "b"],
                    "stop_token_ids": [5],
                    "bann_bann": [6],
                    "logprobs": True,
                    "top_logprobs": 3,
                    "tools": TOOLS,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "s", "schema": SCHEMA},
                    },
                    "frequency_penalty": 0.5,
                }
            ).encode()
        ),
    ),
    (COMPLETION, oa.parse_completion_request(b'{"prompt": "hi"}')),
    (
        COMPLETION,
        oa.parse_completion_request(
            b'{"prompt": [1, 2, 3], "echo": true, "logprobs": 2, "max_tokens": 0,'
            b' "stop": "z", "token_healing": true}'
        ),
    ),
]


@pytest.mark.parametrize(("door", "wire"), EXAMPLES)
def test_each_door_reads_the_declared_types(door: Door, wire: object) -> None:
    generation = door.request(wire)
    for field in attrs.fields(GenerationRequest):
        value = getattr(generation, field.name)
        assert conforms(value, HINTS[field.name]), (field.name, value, HINTS[field.name])


def test_the_tables_read_what_the_requests_say() -> None:
    _, full = EXAMPLES[1]
    assert isinstance(full, p.InferRequest)
    got = from_infer(full)
    assert (got.text, got.custom_bos, got.messages, got.fit) == ("hi", "<s>", None, "trim")
    assert (got.stop_strings, got.stop_token_ids, got.banned_ids) == (("x", "y"), (7, 9), (3, 4))
    assert (got.token_healing, got.logprobs, got.sampling.min_tokens) == (True, 2, 2)
    assert got.constraint is not None and got.constraint.kind == "json_schema"
    _, chat = EXAMPLES[4]
    assert isinstance(chat, oa.ChatCompletionRequest)
    got = from_openai(chat)
    assert got.messages == ({"role": "user", "content": "hi"},) and got.fit == "refuse"
    assert (got.max_new_tokens, got.stop_strings, got.stop_token_ids) == (8, ("a", "b"), (5,))
    assert (got.banned_ids, got.logprobs, got.sampling.freq_pen) == ((6,), 3, 0.5)
    assert got.tools is not None and got.constraint is not None
    _, completion = EXAMPLES[6]
    assert isinstance(completion, oa.CompletionRequest)
    got = from_openai(completion)
    assert (got.text, got.prompt_ids, got.prompt_logprobs, got.max_new_tokens) == (
        "",
        (1, 2, 3),
        2,
        0,
    )
    assert got.default_max_new_tokens == oa.COMPLETIONS_MAX_TOKENS
    assert from_openai(oa.parse_completion_request(b'{"prompt": "hi"}')).prompt_logprobs is None


def test_the_names_a_door_reads_by_are_the_names_its_errors_give() -> None:
    request = infer(text="hi", max_new_tokens=5, stop_conditions=["x", 7, 9], bann_bann=[1, 2])
    cases = [
        (InvalidGeneration("m", "banned_ids", index=1), "$.bann_bann[1]", "bann_bann[1]"),
        (InvalidGeneration("m", "max_new_tokens"), "$.max_new_tokens", "max_tokens"),
        (InvalidGeneration("m", "stop_strings", index=0), "$.stop_strings[0]", "stop[0]"),
        (
            InvalidGeneration("m", "stop_token_ids", index=1),
            "$.stop_conditions[2]",
            "stop_token_ids[1]",
        ),
        (InvalidGeneration("m", "prompt", index=3), "$.text[3]", "prompt"),
        (InvalidGeneration("m", "min_tokens"), "$.min_tokens", "min_tokens"),
    ]
    for error, websocket, openai in cases:
        assert (websocket_path(error, request), openai_param(error)) == (websocket, openai)
    said = openai_error(InvalidGeneration("max_new_tokens must be at most 63", "max_new_tokens"))
    assert (said.message, said.param) == ("max_tokens must be at most 63", "max_tokens")


def test_a_table_that_names_no_field_or_misses_one_is_refused_at_import() -> None:
    with pytest.raises(TypeError, match=r"not GenerationRequest fields \['max_tokens'\]"):
        Door(reads={"max_new_tokens": "x", "max_tokens": "max_tokens"})
    with pytest.raises(TypeError, match=r"required fields not read \['max_new_tokens'\]"):
        Door(reads={"text": "text"})
