"""Structured output, the pure parts: every door's way of asking for a
constraint reads into one :class:`Constraint` (or a 400 / ``invalid_request``
naming the field), and :class:`Grammars` compiles, refuses, caches and masks
with the embedded model's real tokenizer."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from trioserve import protocol as p
from trioserve.engine.base import grammars_of
from trioserve.engine.grammars import Grammars, MaskRows
from trioserve.openai import OpenAIError, parse_chat_request, parse_completion_request
from trioserve.vocabulary.constraint import CONSTRAINT_LIMITS, Constraint, ConstraintError

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def chat(**fields: Any) -> Any:
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_chat_request(json.dumps(fields).encode())


def refused(**fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        chat(**fields)
    assert info.value.status == 400
    return info.value


# --------------------------------------------------------------------------
# The OpenAI door: every server's spelling


@pytest.mark.parametrize(
    ("fields", "kind", "value", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": SCHEMA},
                }
            },
            "json_schema",
            SCHEMA,
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "p",
                        "strict": True,
                        "schema": SCHEMA,
                        "description": "d",
                    },
                }
            },
            "json_schema",
            SCHEMA,
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_object"}},
            "json_schema",
            {"type": "object"},
            "response_format",
        ),
        (
            {"response_format": {"type": "json_object", "schema": SCHEMA}},
            "json_schema",
            SCHEMA,
            "response_format.schema",
        ),
        ({"json_schema": SCHEMA}, "json_schema", SCHEMA, "json_schema"),
        ({"grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"', "grammar"),
        (
            {"structured_outputs": {"json": SCHEMA}},
            "json_schema",
            SCHEMA,
            "structured_outputs.json",
        ),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA), "backend": "xgrammar"}},
            "json_schema",
            SCHEMA,
            "structured_outputs.json",
        ),
        (
            {"structured_outputs": {"regex": "[0-9]+"}},
            "regex",
            "[0-9]+",
            "structured_outputs.regex",
        ),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            "choice",
            ["yes", "no"],
            "structured_outputs.choice",
        ),
        (
            {"structured_outputs": {"grammar": "start: /x+/"}},
            "grammar",
            "start: /x+/",
            "structured_outputs.grammar",
        ),
        (
            {"structured_outputs": {"json_object": True}},
            "json_schema",
            {"type": "object"},
            "structured_outputs.json_object",
        ),
        ({"guided_json": SCHEMA}, "json_schema", SCHEMA, "guided_json"),
        (
            {"guided_regex": "a|b", "guided_decoding_backend": "outlines"},
            "regex",
            "a|b",
            "guided_regex",
        ),
        ({"guided_choice": ["x"]}, "choice", ["x"], "guided_choice"),
        ({"guided_grammar": 'root ::= "z"'}, "grammar", 'root ::= "z"', "guided_grammar"),
        ({"regex_pattern": "[a-z]{3}"}, "regex", "[a-z]{3}", "regex_pattern"),
        ({"grammar_string": 'start: "q"'}, "grammar", 'start: "q"', "grammar_string"),
    ],
)
def test_each_servers_spelling_is_one_constraint(
    fields: dict[str, Any], kind: str, value: Any, param: str
) -> None:
    constraint = chat(**fields).constraint
    assert constraint is not None
    assert (constraint.kind, constraint.field) == (kind, param)
    if kind in ("json_schema", "choice"):
        assert json.loads(constraint.text) == value
    else:
        assert constraint.text == value
    # The completions route reads the same fields.
    request = parse_completion_request(json.dumps({"prompt": "x", **fields}).encode())
    assert request.constraint == constraint


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"response_format": {"type": "text"}},
        {"response_format": None, "guided_json": None},
        {"json_schema": {}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}}},
        {"structured_outputs": {"json": {}, "backend": "auto"}},
        {"guided_decoding_backend": "xgrammar"},
    ],
)
def test_what_asks_for_nothing_is_no_constraint(fields: dict[str, Any]) -> None:
    assert chat(**fields).constraint is None


def test_the_schema_keeps_the_clients_property_order() -> None:
    schema = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}
    constraint = chat(json_schema=schema).constraint
    assert constraint is not None
    assert list(json.loads(constraint.text)["properties"]) == ["z", "a"]


def test_two_constraints_are_a_400_naming_both() -> None:
    error = refused(response_format={"type": "json_object"}, guided_regex="a+")
    assert error.param == "guided_regex"
    assert "response_format and guided_regex" in error.message
    error = refused(structured_outputs={"regex": "a", "choice": ["b"]})
    assert error.param == "structured_outputs.choice"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type", "must be one of"),
        ({"response_format": "json"}, "response_format", "must be an object"),
        (
            {"response_format": {"type": "text", "schema": {}}},
            "response_format.schema",
            "unrecognized",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
            "must be an object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"strict": "yes"}}},
            "response_format.json_schema.strict",
            "true or false",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"nam": "x"}}},
            "response_format.json_schema.nam",
            "unrecognized",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "object"),
        ({"guided_json": "{not json"}, "guided_json", "not JSON"),
        ({"guided_json": "x" * 70000}, "guided_json", "at most 65536 bytes"),
        ({"json_schema": {"enum": ["x" * 100] * 700}}, "json_schema", "at most 65536 bytes"),
        ({"guided_regex": ""}, "guided_regex", "must be a string of 1 to 4096"),
        ({"regex_pattern": "a" * 4097}, "regex_pattern", "got 4097 characters"),
        ({"guided_choice": []}, "guided_choice", "must be"),
        ({"guided_choice": ["a", 3]}, "guided_choice[1]", "must be a string"),
        ({"guided_choice": ["c"] * 1025}, "guided_choice", "at most 1024"),
        ({"grammar": 7}, "grammar", "must be a string"),
        ({"grammar_string": "g" * 65537}, "grammar_string", "65537 characters"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "unrecognized"),
        (
            {"structured_outputs": {"json_object": 1}},
            "structured_outputs.json_object",
            "true or false",
        ),
        (
            {"structured_outputs": {"structural_tag": "x"}},
            "structured_outputs.structural_tag",
            "not supported",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    error = refused(**fields)
    assert error.param == param
    assert words in error.message


def test_the_websocket_door_reads_the_same_bounds() -> None:
    for name, bad in (
        ("json_schema", {"enum": ["x" * 100] * 700}),
        ("regex", "a" * (CONSTRAINT_LIMITS.max_regex_chars + 1)),
        ("choice", ["c"] * (CONSTRAINT_LIMITS.max_choices + 1)),
        ("grammar", "g" * (CONSTRAINT_LIMITS.max_grammar_chars + 1)),
    ):
        frame = {"action": "infer", "text": "x", "max_new_tokens": 1, name: bad}
        with pytest.raises(p.ProtocolError) as info:
            p.structure_request(frame)
        assert info.value.field == f"$.{name}"
    request = p.structure_request(
        {"action": "infer", "text": "x", "max_new_tokens": 1, "json_schema": SCHEMA}
    )
    assert isinstance(request, p.InferRequest)
    assert request.constraint() == chat(json_schema=SCHEMA).constraint
    empty = p.structure_request(
        {"action": "infer", "text": "x", "max_new_tokens": 1, "json_schema": {}}
    )
    assert isinstance(empty, p.InferRequest) and empty.constraint() is None


# --------------------------------------------------------------------------
# Compiling with the real tokenizer


@pytest.fixture(scope="module")
def grammars(model_dir: Path) -> Grammars:
    return Grammars.for_model(model_dir, vocab_size=49152, eos_ids=[2], cache_bytes=64 * 1024)


@pytest.mark.parametrize(
    ("constraint", "reason"),
    [
        (Constraint("regex", "(a"), "unclosed group"),
        (Constraint("grammar", "root ::= missing"), "missing"),
        (Constraint("grammar", "start: undefined_rule"), "undefined_rule"),
        (
            Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
            "nope",
        ),
        (Constraint.json_schema({"type": "strnig"}), "strnig"),
        (Constraint.json_schema({"type": "object", "patternProperties": 5}), ""),
        # A language with no sentence at all: nothing is ever allowed.
        (Constraint("regex", "[^\\s\\S]"), "no text satisfies it"),
    ],
)
def test_bad_constraints_are_refused_with_llguidances_reason(
    grammars: Grammars, constraint: Constraint, reason: str
) -> None:
    with pytest.raises(ConstraintError) as info:
        grammars.compile(constraint)
    message = str(info.value)
    assert reason in message and "\n" not in message and len(message) <= 500


def test_a_lone_surrogate_is_refused_not_a_crash(grammars: Grammars) -> None:
    with pytest.raises(ConstraintError):
        grammars.compile(Constraint("regex", "a\ud800b"))


@pytest.mark.parametrize(
    "constraint",
    [
        # A 10,000-entry enum (about the most a 64 KiB schema holds): tens of
        # milliseconds; 100,000 entries were refused by the lexer's fuel.
        Constraint.json_schema({"enum": list(range(10**4, 10**4 + 10_000))}),
        Constraint.json_schema({"enum": list(range(100_000))}),
        # Exponential as a backtracking regex; an automaton here.
        Constraint("regex", "(a|aa)*" * 50 + "b{1000}"),
        # Deep nesting, as deep as a frame allows.
        Constraint.json_schema(
            _nested := {"type": "array", "items": {"type": "array", "items": {}}}
        ),
        # Left recursion is fine for an Earley parser.
        Constraint("grammar", 'root ::= root "a" | "a"'),
    ],
)
def test_pathological_constraints_compile_or_fail_in_bounded_time(
    grammars: Grammars, constraint: Constraint
) -> None:
    started = time.perf_counter()
    try:
        compiled = grammars.compile(constraint)
    except ConstraintError:
        compiled = None
    # Bounded by llguidance's fuel (about 1 s of lexer work at most); the
    # figure is not a speed test, it only shows the bound holds at all.
    assert time.perf_counter() - started < 20
    if compiled is not None:
        mask = MaskRows(49152, 1).fill([compiled.matcher()])
        assert mask.any()


def test_compiled_grammars_are_cached_by_content_within_the_byte_bound(
    model_dir: Path,
) -> None:
    grammars = Grammars.for_model(model_dir, vocab_size=49152, eos_ids=[2], cache_bytes=4000)
    first = grammars.compile(Constraint("regex", "[0-9]{4}", "$.regex"))
    # The same text from another field is the same grammar.
    assert grammars.compile(Constraint("regex", "[0-9]{4}", "guided_regex")) is first
    for n in range(40):
        grammars.compile(Constraint("regex", f"x{n}[a-z]+"))
    count, size = grammars.cache_statistics
    assert 0 < size <= 4000 and count < 41
    assert grammars.cached(Constraint("regex", "[0-9]{4}")) is None  # evicted, oldest first


def test_the_mask_is_llguidances_own_and_each_job_has_its_matcher(grammars: Grammars) -> None:
    compiled = grammars.compile(Constraint.choice(["yes", "no"]))
    a, b = compiled.matcher(), compiled.matcher()
    rows = MaskRows(49152, 2)
    mask = rows.fill([a, b])
    expected = torch.frombuffer(bytearray(a.compute_bitmask()), dtype=torch.uint8)
    bits = torch.tensor([(int(byte) >> i) & 1 for byte in expected.tolist() for i in range(8)])
    assert torch.equal(mask[0], bits[:49152].bool())
    tokenizer = grammars.tokenizer
    allowed = mask[0].nonzero().flatten().tolist()
    texts = {tokenizer.decode_str([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    # Advancing one matcher leaves the other at the start.
    yes = tokenizer.tokenize_str("yes")
    assert a.consume_tokens(yes) and a.is_stopped()
    assert torch.equal(rows.fill([b])[0], mask[1])


def test_regex_outputs_match_in_full(grammars: Grammars) -> None:
    compiled = grammars.compile(Constraint("regex", r"[0-9]{3}-[a-z]{2}"))
    matcher = compiled.matcher()
    tokenizer = grammars.tokenizer
    assert matcher.consume_tokens(tokenizer.tokenize_str("123-ab"))
    assert matcher.is_accepting()
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", "123-ab")
    other = compiled.matcher()
    assert not other.consume_tokens(tokenizer.tokenize_str("12a"))
    assert other.is_error()


# --------------------------------------------------------------------------
# The CPU engine: one matcher per job, failures alone


def _spec(engine: Any, job_id: int, prompt: str, **fields: Any) -> Any:
    from trioserve.engine.base import GenerationSpec
    from trioserve.vocabulary.sampling import SamplingSettings

    return GenerationSpec(
        job_id=job_id,
        prompt_ids=tuple(engine.encode(prompt)),
        max_new_tokens=fields.pop("max_new_tokens", 100),
        sampling=fields.pop("sampling", SamplingSettings(temperature=0)),
        stop_token_ids=frozenset(engine.info.eos_token_ids),
        **fields,
    )


def _run(engine: Any, specs: list[Any]) -> dict[int, tuple[str, Any]]:
    from trioserve.vocabulary.results import Failed, Finished, TextUpdate

    texts: dict[int, str] = {spec.job_id: "" for spec in specs}
    ends: dict[int, Any] = {}
    pending = specs
    while len(ends) < len(specs):
        for update in engine.step(pending, []):
            if isinstance(update, TextUpdate | Finished):
                texts[update.job_id] += update.text
            if isinstance(update, Finished | Failed):
                ends[update.job_id] = update
        pending = []
    return {job: (texts[job], ends[job]) for job in ends}


PROMPT = (
    "<|im_start|>system\nYou are a careful assistant. You answer every question with one JSON"
    " object and nothing else, and you never add comments, explanations or markdown around it."
    " Keep names short, and keep every answer on one line, with the fields in the order the"
    " schema gives them, because the program that reads your answers is strict."
    "<|im_end|>\n"
    "<|im_start|>user\nDescribe a cat as JSON.<|im_end|>\n<|im_start|>assistant\n"
)


CAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
    },
    "required": ["name", "age"],
}


def test_the_embedded_models_engine_has_grammars(cpu_engine: Any) -> None:
    assert isinstance(grammars_of(cpu_engine), Grammars)


def test_a_job_whose_masks_cost_too_much_fails_alone(cpu_engine: Any) -> None:
    from trioserve.engine.grammars import MaskBudget
    from trioserve.vocabulary.results import Failed, Finished

    costly = Grammars.for_model(
        Path(cpu_engine.info.model_dir),
        vocab_size=cpu_engine.info.vocab_size,
        eos_ids=cpu_engine.info.eos_token_ids,
        budget=MaskBudget(window=2, seconds_per_token=0.0),
    ).compile(Constraint("regex", "[a-z ]{1,100}"))
    fine = cpu_engine.grammars.compile(Constraint("regex", "[a-z ]{1,100}"))
    plain_alone = _run(cpu_engine, [_spec(cpu_engine, 1, PROMPT, constraint=fine)])[1]
    out = _run(
        cpu_engine,
        [
            _spec(cpu_engine, 2, PROMPT, constraint=costly),
            _spec(cpu_engine, 3, PROMPT, constraint=fine),
        ],
    )
    failed = out[2][1]
    assert isinstance(failed, Failed)
    assert failed.message.startswith("the constraint is too costly to enforce")
    # The other job of the same batch is the same as alone (greedy).
    assert isinstance(out[3][1], Finished) and out[3][0] == plain_alone[0]


def test_constrained_greedy_text_is_the_same_alone_beside_others_and_from_the_prefix_cache(
    cpu_engine: Any,
) -> None:
    from trioserve.vocabulary.results import Finished
    from trioserve.vocabulary.sampling import SamplingSettings

    schema = cpu_engine.grammars.compile(Constraint.json_schema(CAT))
    alone = _run(cpu_engine, [_spec(cpu_engine, 10, PROMPT, constraint=schema)])[10]
    beside = _run(
        cpu_engine,
        [
            _spec(cpu_engine, 11, PROMPT, sampling=SamplingSettings(temperature=1.0, seed=3)),
            _spec(cpu_engine, 12, PROMPT, constraint=schema),
            _spec(
                cpu_engine,
                13,
                PROMPT,
                constraint=cpu_engine.grammars.compile(Constraint.choice(["a", "b"])),
            ),
        ],
    )
    again = _run(cpu_engine, [_spec(cpu_engine, 14, PROMPT, constraint=schema)])[14]
    assert alone[0] == beside[12][0] == again[0]
    assert isinstance(again[1], Finished) and again[1].cached_tokens > 0
    assert isinstance(alone[1], Finished) and alone[1].reason == "constraint"
    value = json.loads(alone[0])
    jsonschema.validate(value, CAT)
    assert list(value)[:2] == ["name", "age"]
    assert beside[13][0] in ("a", "b")


def test_a_cancelled_constrained_job_leaves_nothing_behind(cpu_engine: Any) -> None:
    schema = cpu_engine.grammars.compile(Constraint.json_schema(CAT))
    spec = _spec(cpu_engine, 20, PROMPT, constraint=schema, max_new_tokens=100)
    cpu_engine.step([spec], [])
    cpu_engine.step([], [])
    assert cpu_engine.step([], [20]) == []
    assert cpu_engine.statistics().running_jobs == 0
    # The same grammar serves a new job from its start.
    out = _run(cpu_engine, [_spec(cpu_engine, 21, PROMPT, constraint=schema)])
    assert json.loads(out[21][0])["name"]


def test_token_healing_with_a_constraint_fails_the_job_at_the_engine(cpu_engine: Any) -> None:
    from trioserve.vocabulary.results import Failed

    compiled = cpu_engine.grammars.compile(Constraint("regex", "[a-z]+"))
    out = _run(cpu_engine, [_spec(cpu_engine, 30, PROMPT, constraint=compiled, token_healing=True)])
    assert isinstance(out[30][1], Failed) and "token_healing" in out[30][1].message
