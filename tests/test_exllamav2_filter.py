"""Constraints on the ExLlamaV2 engine (issue 18, item 3).

Two parts:

* :class:`~trioserve.engine.exllamav2.filter.GrammarMask` and the engine's
  rules for constrained jobs (:func:`constrained_update`, :func:`refusal`),
  with real llguidance matchers over the embedded model's tokenizer; these
  run everywhere.
* The filter inside ExLlamaV2 0.3.2's own code, on the CPU (``nox -s
  exl2-cpu``; they skip elsewhere and fail there when exllamav2 cannot be
  imported): the real ``ExLlamaV2Filter`` base class and its background
  scheduling, the real ``ExLlamaV2DynamicJob.receive_logits`` and
  ``receive_sample`` and the real ``ExLlamaV2Sampler.sample`` (its mask path
  and its C++ CPU sampler), driven by :class:`SamplingGenerator`. That is a
  stand-in for ``ExLlamaV2DynamicGenerator.iterate_gen``, which needs a model
  on a GPU: it does what iterate_gen does after its forward pass (schedule the
  queued filters' masks in a thread pool, sample each job, in the sampling
  pool from three jobs on, then ``receive_sample``), with seeded random logits
  in place of the model's.

The end-to-end runs on a GPU are in tests/test_exllamav2.py (marked ``gpu``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import jsonschema
import pytest
import torch

from tests.test_exllamav2 import (
    EOS,
    PROMPT,
    RealJobs,
    ScriptedGenerator,
    exllamav2_unavailable,
)
from trioserve.engine.base import EngineInfo, GenerationSpec
from trioserve.engine.exllamav2.filter import GrammarMask
from trioserve.engine.exllamav2.jobs import JobState, constrained_update, refusal
from trioserve.engine.exllamav2.plan import PAGE_SIZE, plan_load
from trioserve.engine.grammars import CompiledGrammar, Grammars, JobMatcher, MaskBudget
from trioserve.engine.models import default_model_dir
from trioserve.engine.tokenizer import Tokenizer
from trioserve.vocabulary.constraint import CONSTRAINT_KINDS, Constraint
from trioserve.vocabulary.results import Failed, Finished, TextUpdate, Update
from trioserve.vocabulary.sampling import SamplingSettings

VOCAB = 49152  # the embedded model's (a multiple of 32: no padding)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}
CHOICES = ["red", "green", "blue"]
GREEDY = SamplingSettings(temperature=0.0, rep_pen=1.0)
REGEX = "(ab|cd)[0-9]{1,3}"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir(offline=True))


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer) -> Grammars:
    return Grammars.for_model(
        default_model_dir(offline=True), vocab_size=VOCAB, eos_ids=tokenizer.eos_token_ids
    )


@pytest.fixture(scope="module")
def compiled(grammars: Grammars) -> dict[str, CompiledGrammar]:
    return {
        "json_schema": grammars.compile(Constraint.json_schema(SCHEMA)),
        "choice": grammars.compile(Constraint.choice(CHOICES)),
        "regex": grammars.compile(Constraint("regex", REGEX)),
    }


def _allowed(mask: GrammarMask, width: int = VOCAB) -> set[int]:
    """The ids ``mask`` leaves finite in a row of zeros ``width`` wide."""
    assert mask.prepare_logit_mask() is True
    logits = torch.zeros(width)
    out = mask.mask_logits(logits)
    assert out.data_ptr() == logits.data_ptr()  # in place, as the sampler reads it
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


def _feed(mask: GrammarMask, ids: list[int]) -> None:
    for token in ids:
        assert token in _allowed(mask), token
        # receive_sample feeds a [1, 1] tensor.
        mask.feed(torch.tensor([[token]], dtype=torch.long))


def _complete(mask: GrammarMask) -> bool:
    # A call, not the property, so that mypy does not keep its first value.
    return mask.complete


def _problem(mask: GrammarMask) -> str | None:
    return mask.problem


# -- the mask, with real matchers -------------------------------------------------------


def test_mask_allows_what_the_grammar_allows(
    tokenizer: Tokenizer, compiled: dict[str, CompiledGrammar]
) -> None:
    mask = GrammarMask(JobMatcher.start(compiled["choice"]), VOCAB)
    allowed = _allowed(mask)
    texts = {tokenizer.decode([i]) for i in allowed}
    assert allowed and all(any(c.startswith(t) for c in CHOICES) for t in texts), texts
    (red,) = tokenizer.encode("red")
    assert red in allowed
    assert EOS not in allowed
    # Ids past the vocabulary (ExLlamaV2 pads the logits to a multiple of 32)
    # are never allowed.
    wide = torch.zeros(VOCAB + 32)
    mask.mask_logits(wide)
    assert torch.isinf(wide[VOCAB:]).all()


def test_a_complete_value_allows_only_the_end(
    tokenizer: Tokenizer, compiled: dict[str, CompiledGrammar]
) -> None:
    mask = GrammarMask(JobMatcher.start(compiled["json_schema"]), VOCAB)
    _feed(mask, tokenizer.encode('{"name": "ab", "ok": true, "n": 7'))
    assert not _complete(mask)
    _feed(mask, tokenizer.encode("}"))
    assert _complete(mask) and mask.problem is None
    assert _allowed(mask) == {EOS}


def test_an_accepting_regex_is_not_complete(
    tokenizer: Tokenizer, compiled: dict[str, CompiledGrammar]
) -> None:
    mask = GrammarMask(JobMatcher.start(compiled["regex"]), VOCAB)
    _feed(mask, tokenizer.encode("ab1"))
    # One to three digits: the end or another digit.
    assert not mask.complete
    allowed = _allowed(mask)
    assert EOS in allowed and tokenizer.encode("2")[0] in allowed
    _feed(mask, tokenizer.encode("23"))
    assert _complete(mask)


def test_a_refused_token_is_the_jobs_problem_and_opens_the_mask(
    tokenizer: Tokenizer, compiled: dict[str, CompiledGrammar]
) -> None:
    mask = GrammarMask(JobMatcher.start(compiled["choice"]), VOCAB)
    (bad,) = tokenizer.encode("x")
    assert bad not in _allowed(mask)
    mask.feed(torch.tensor([[bad]]))
    problem = mask.problem
    assert problem is not None and problem.startswith("the constraint failed: "), problem
    assert not mask.complete
    # The sampler must still draw something: every token is left as it was,
    # and the engine fails the job before that token's text is released.
    assert _allowed(mask) == set(range(VOCAB))
    # A later feed changes nothing.
    mask.feed(torch.tensor([[bad]]))
    assert mask.problem == problem


def test_masks_over_the_budget_are_the_jobs_problem(tokenizer: Tokenizer) -> None:
    """The CPU engine's mask budget applies: a job whose masks took more CPU
    time than its budget fails (here a budget no mask can meet)."""
    tight = Grammars.for_model(
        default_model_dir(offline=True),
        vocab_size=VOCAB,
        eos_ids=tokenizer.eos_token_ids,
        budget=MaskBudget(window=2, seconds_per_token=1e-9),
    )
    mask = GrammarMask(JobMatcher.start(tight.compile(Constraint.choice(CHOICES))), VOCAB)
    assert mask.problem is None
    assert _allowed(mask) == set(range(VOCAB))  # over the budget at once: opened
    problem = _problem(mask)
    assert problem is not None and "too costly" in problem, problem
    # The token drawn under the opened mask is not fed: the reason stays.
    mask.feed(torch.tensor([[tokenizer.encode("x")[0]]]))
    assert mask.problem == problem


def test_a_closed_mask_computes_and_masks_nothing(compiled: dict[str, CompiledGrammar]) -> None:
    mask = GrammarMask(JobMatcher.start(compiled["choice"]), VOCAB)
    mask.close()
    assert mask.job is None and mask.closed
    assert mask.prepare_logit_mask() is True
    logits = torch.randn(VOCAB)
    assert torch.equal(mask.mask_logits(logits.clone()), logits)
    mask.feed(torch.tensor([[5]]))
    assert mask.problem is None and not mask.complete


def test_next_lists_the_masks_tokens(compiled: dict[str, CompiledGrammar]) -> None:
    mask = GrammarMask(JobMatcher.start(compiled["choice"]), VOCAB)
    expected = _allowed(GrammarMask(JobMatcher.start(compiled["choice"]), VOCAB))
    assert mask.next() == (expected, set())


def test_each_job_has_its_own_matcher(
    tokenizer: Tokenizer, compiled: dict[str, CompiledGrammar]
) -> None:
    first = GrammarMask(JobMatcher.start(compiled["choice"]), VOCAB)
    second = GrammarMask(JobMatcher.start(compiled["choice"]), VOCAB)
    _feed(first, tokenizer.encode("red"))
    assert first.complete and not second.complete
    assert tokenizer.encode("green")[0] in _allowed(second)


# -- the engine's rules for constrained jobs --------------------------------------------


def _state(tokenizer: Tokenizer, spec: GenerationSpec) -> JobState:
    return JobState.for_spec(spec, tokenizer.decode)


def _result(eos_reason: str | None = None, **fields: Any) -> dict[str, Any]:
    result: dict[str, Any] = {"stage": "streaming", "identifier": 1, "eos": eos_reason is not None}
    if eos_reason is not None:
        result["eos_reason"] = eos_reason
    result.update(fields)
    return result


def test_constrained_update_follows_the_cpu_rule(
    tokenizer: Tokenizer, compiled: dict[str, CompiledGrammar]
) -> None:
    spec = GenerationSpec(job_id=1, prompt_ids=PROMPT, max_new_tokens=8, stop_strings=("zz",))
    mask = GrammarMask(JobMatcher.start(compiled["choice"]), VOCAB)
    state = _state(tokenizer, spec)
    # Mid-value: the update is unchanged.
    text = TextUpdate(job_id=1, text="gr", held="", generated_tokens=1)
    assert constrained_update(text, _result(), state, mask) is text
    # A complete value ends the job at once, releasing what was held.
    _feed(mask, tokenizer.encode("red"))
    state.stream.push(tokenizer.encode("red"))
    held = TextUpdate(job_id=1, text="", held=state.stream.held, generated_tokens=1)
    end = constrained_update(held, _result(), state, mask)
    assert isinstance(end, Finished)
    assert (end.reason, end.stop_string) == ("constraint", None)
    # At max_new_tokens too.
    at_limit = Finished(1, "red", "max_new_tokens", None, None, 3, 1)
    assert constrained_update(at_limit, _result("max_new_tokens"), state, mask) == attrs.evolve(
        at_limit, reason="constraint"
    )
    # A stop token keeps its reason.
    stopped = Finished(1, "red", "stop_token", None, EOS, 3, 2)
    assert constrained_update(stopped, _result("stop_token"), state, mask) is stopped


def test_constrained_update_fails_the_job_of_a_failed_constraint(
    tokenizer: Tokenizer, compiled: dict[str, CompiledGrammar]
) -> None:
    spec = GenerationSpec(job_id=1, prompt_ids=PROMPT, max_new_tokens=8)
    mask = GrammarMask(JobMatcher.start(compiled["choice"]), VOCAB)
    mask.feed(torch.tensor([[tokenizer.encode("x")[0]]]))
    text = TextUpdate(job_id=1, text="x", held="", generated_tokens=1)
    failed = constrained_update(text, _result(), _state(tokenizer, spec), mask)
    assert isinstance(failed, Failed)
    assert failed.message.startswith("the constraint failed: ")


def test_token_healing_with_a_constraint_is_refused(compiled: dict[str, CompiledGrammar]) -> None:
    spec = GenerationSpec(
        job_id=1,
        prompt_ids=PROMPT,
        max_new_tokens=8,
        token_healing=True,
        constraint=compiled["choice"],
    )
    limits = {"context_length": 256, "vocab_size": VOCAB, "page_size": 256, "max_pages": 1}
    reason = refusal(spec, **limits)
    assert reason is not None and "token_healing" in reason
    assert refusal(attrs.evolve(spec, token_healing=False), **limits) is None


# -- inside ExLlamaV2 0.3.2's own code, on the CPU (nox -s exl2-cpu) ---------------------


@pytest.fixture(scope="module")
def real_jobs() -> RealJobs:
    reason = exllamav2_unavailable()
    if reason is not None:
        if os.environ.get("TRIOSERVE_EXL2_CPU") == "1":
            pytest.fail(f"nox -s exl2-cpu must run the real filter tests: {reason}")
        pytest.skip(reason)
    return RealJobs.load()


def _logits(job: Any) -> torch.Tensor:
    """The stand-in forward pass: seeded random logits for ``job``'s next
    token, large enough that unconstrained sampling would rarely pick a token
    the grammar allows. float32 ``[1, 1, padded vocab]``, as iterate_gen hands
    each job a slice of its pinned float logits."""
    seed = 1000 * int(job.identifier) + int(job.new_tokens)
    generator = torch.Generator().manual_seed(seed)
    width = int(job.generator.padded_vocab_size)
    return (torch.randn((1, 1, width), generator=generator) * 4).float()


@attrs.define(eq=False, repr=False)
class SamplingGenerator(ScriptedGenerator):
    """``ExLlamaV2DynamicGenerator`` with the model's forward pass replaced by
    :func:`_logits` and its decode step written as ``iterate_gen`` does it
    (dynamic.py at v0.3.2): after the forward is launched, every filter queued
    by the previous step's ``receive_sample`` is scheduled, through its own
    (real) ``background_prepare_logit_mask``, in ``filter_pool``; each job
    then samples with the real ``receive_logits`` (in ``sampling_pool`` when at
    least ``min_sampling_threads`` jobs run, as ``max_sampling_threads > 1``
    makes it) and takes the token with the real ``receive_sample``."""

    filter_queue: list[tuple[Any, bool]] = attrs.Factory(list)
    filter_pool: ThreadPoolExecutor = attrs.Factory(lambda: ThreadPoolExecutor(4))
    sampling_pool: ThreadPoolExecutor = attrs.Factory(lambda: ThreadPoolExecutor(4))
    min_sampling_threads: int = 3
    max_batch_size: int = 16
    #: Every filter whose mask a step scheduled.
    scheduled: list[Any] = attrs.Factory(list)
    #: Each job's logits and sampled tokens, by identifier.
    seen: dict[int, list[torch.Tensor]] = attrs.Factory(dict)
    sampled: dict[int, list[int]] = attrs.Factory(dict)
    #: As the generator's pinned logits buffer: allocated once, outside
    #: inference mode (dynamic.py, ExLlamaV2DynamicGenerator.__init__); each
    #: job samples from a view of it, which is not an inference tensor even
    #: though the step runs in inference mode.
    logits_pinned: torch.Tensor = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.logits_pinned = torch.empty((self.max_batch_size, 1, self.padded_vocab_size))

    def iterate(self) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = []
        jobs = list(self.active)
        batch_logits = self.logits_pinned[: len(jobs), :1, :]
        batch_logits.copy_(torch.cat([_logits(job) for job in jobs]))
        logits = [batch_logits[n : n + 1, :1, :] for n in range(len(jobs))]
        for job, row in zip(jobs, logits, strict=True):
            self.seen.setdefault(job.identifier, []).append(row.clone())
        for f, mask in self.filter_queue:
            self.scheduled.append(f)
            if mask:
                f.background_prepare_logit_mask(self.filter_pool)
            else:
                f.background_next(self.filter_pool)
        self.filter_queue.clear()
        futures: list[Future[Any]] = []
        if len(jobs) >= self.min_sampling_threads:
            futures = [
                self.sampling_pool.submit(j.receive_logits, r)
                for j, r in zip(jobs, logits, strict=True)
            ]
        for n, (job, row) in enumerate(zip(jobs, logits, strict=True)):
            sample = futures[n].result() if futures else job.receive_logits(row)
            eos, _ = job.receive_sample(row, *sample, results, True)
            self.sampled.setdefault(job.identifier, []).append(int(sample[0]))
            if eos:
                self.active.remove(job)
        return results

    def close(self) -> None:
        self.filter_pool.shutdown(wait=True)
        self.sampling_pool.shutdown(wait=True)


@pytest.fixture
def engine(real_jobs: RealJobs, grammars: Grammars) -> Iterator[Any]:
    from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    from trioserve.engine.exllamav2.engine import ExLlamaV2Engine

    generator = SamplingGenerator(
        tokenizer=real_jobs.host.tokenizer, padded_vocab_size=real_jobs.host.padded_vocab_size
    )
    info = EngineInfo(
        engine="exllamav2",
        model_name="sampled",
        context_length=PAGE_SIZE,
        vocab_size=real_jobs.vocab_size,
        bos_token_id=1,
        eos_token_ids=real_jobs.eos_token_ids,
        max_batch=8,
        constraints=CONSTRAINT_KINDS,
    )
    yield ExLlamaV2Engine(
        info=info,
        plan=plan_load(PAGE_SIZE, paged=True, max_batch=8),
        tokenizer=real_jobs.tokenizer,
        model=None,
        cache=None,
        xtokenizer=real_jobs.host.tokenizer,
        generator=generator,
        job_class=ExLlamaV2DynamicJob,
        settings_class=ExLlamaV2Sampler.Settings,
        grammars=grammars,
    )
    generator.close()


def _spec(real: RealJobs, job_id: int, constraint: CompiledGrammar | None, **fields: Any) -> Any:
    values: dict[str, Any] = {
        "job_id": job_id,
        "prompt_ids": PROMPT,
        "max_new_tokens": 64,
        "sampling": SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, rep_pen=1.0, seed=job_id),
        "stop_token_ids": real.eos_token_ids,
        "constraint": constraint,
    }
    values.update(fields)
    return GenerationSpec(**values)


def _run(engine: Any, submit: list[Any], *, cancel_after: dict[int, int] | None = None) -> Any:
    got: dict[int, list[Update]] = {spec.job_id: [] for spec in submit}
    cancel: list[int] = []
    for step in range(200):
        for update in engine.step(submit, cancel):
            got.setdefault(update.job_id, []).append(update)
        submit = []
        cancel = [j for j, n in (cancel_after or {}).items() if n == step]
        if not engine._generator.num_remaining_jobs() and not cancel:
            return got
    raise AssertionError("the jobs did not end")


def _text(updates: list[Update]) -> str:
    return "".join(u.text for u in updates if isinstance(u, TextUpdate | Finished))


def test_real_filter_is_an_exllamav2_filter(real_jobs: RealJobs, compiled: Any) -> None:
    from exllamav2.generator.filters import ExLlamaV2Filter

    from trioserve.engine.exllamav2.filter import filter_class

    cls: Any = filter_class()
    assert issubclass(cls, ExLlamaV2Filter) and issubclass(cls, GrammarMask)
    f = cls(None, real_jobs.host.tokenizer, JobMatcher.start(compiled["choice"]), VOCAB)
    assert f.background_result is None and f.can_mask_logits() and f.use_background_worker()
    with pytest.raises(NotImplementedError):
        f.clone()


def test_real_sampler_draws_only_allowed_tokens(real_jobs: RealJobs, compiled: Any) -> None:
    """ExLlamaV2Sampler.sample's mask path with the filter, over many draws
    of its C++ sampler at points of a JSON value where one token or
    thousands are allowed: every token is one the grammar allows."""
    from exllamav2.generator import ExLlamaV2Sampler

    from trioserve.engine.exllamav2.filter import filter_class
    from trioserve.engine.exllamav2.jobs import sampler_fields

    settings = ExLlamaV2Sampler.Settings()
    sampling = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, rep_pen=1.0)
    for name, value in sampler_fields(sampling, real_jobs.tokenizer, VOCAB).items():
        setattr(settings, name, value)
    generator = torch.Generator().manual_seed(7)
    prefixes = ["", '{"name": "', '{"name": "ab", "ok": ', '{"name": "a", "ok": true, "n": 1']
    for n in range(40):
        prefix = real_jobs.tokenizer.encode(prefixes[n % len(prefixes)])
        f = filter_class()(
            None, real_jobs.host.tokenizer, JobMatcher.start(compiled["json_schema"]), VOCAB
        )
        _feed(f, prefix)
        logits = torch.randn((1, 1, VOCAB), generator=generator) * 4
        token, *_, end_filter = ExLlamaV2Sampler.sample(
            logits,
            settings,
            torch.tensor([list(PROMPT)], dtype=torch.long),
            # Not 0.0: at exactly 0 the C++ sampler returns id 0 whatever its
            # probability (job.rng.random() gives 0.0 once in 2**53 draws).
            (n + 0.5) / 40,
            real_jobs.host.tokenizer,
            filters=[f],
            filter_prefer_eos=True,
        )
        # llguidance itself, on a matcher of its own, takes the token.
        oracle = compiled["json_schema"].matcher()
        assert oracle.consume_tokens(prefix)
        assert oracle.consume_token(int(token)), (prefixes[n % len(prefixes)], int(token))
        # The mask path reports no filter end (end_tokens is None there).
        assert end_filter is False


def test_real_constrained_jobs_in_one_batch(
    real_jobs: RealJobs, engine: Any, compiled: Any
) -> None:
    """A batch of constrained jobs at temperature 1 over random logits and a
    greedy unconstrained one, through ExLlamaV2Engine.step and the real job and
    sampler code: every constrained output is valid, a complete value ends
    its job with reason constraint, the unconstrained job takes the argmax
    of its own logits (no mask of another job reaches it), and nothing is
    left queued."""
    specs = [
        *(_spec(real_jobs, 10 + n, compiled["json_schema"]) for n in range(3)),
        *(_spec(real_jobs, 20 + n, compiled["choice"]) for n in range(2)),
        *(_spec(real_jobs, 30 + n, compiled["regex"]) for n in range(3)),
        _spec(
            real_jobs,
            40,
            None,
            max_new_tokens=6,
            sampling=GREEDY,
        ),
    ]
    got = _run(engine, specs)
    generator = engine._generator
    for spec in specs:
        end = got[spec.job_id][-1]
        assert isinstance(end, Finished), got[spec.job_id]
        text = _text(got[spec.job_id])
        kind = None if spec.constraint is None else spec.constraint.constraint.kind
        if kind == "json_schema":
            assert end.reason == "constraint", end
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "choice":
            assert end.reason == "constraint", end
            assert text in CHOICES
        elif kind == "regex":
            assert end.reason in ("constraint", "stop_token"), end
            assert re.fullmatch(REGEX, text), text
            if end.reason == "constraint":
                assert re.fullmatch("(ab|cd)[0-9]{3}", text), text
    # The unconstrained job sampled greedily from its own logits.
    plain = got[40]
    assert isinstance(plain[-1], Finished) and plain[-1].reason == "max_new_tokens"
    argmax = [int(row[0, 0, :VOCAB].argmax()) for row in generator.seen[40]]
    assert generator.sampled[40] == argmax
    # Jobs that ended by the constraint were cancelled in ExLlamaV2; none is
    # left, and no mask is queued for a job that is gone.
    assert generator.active == [] and generator.filter_queue == []
    assert {10, 11, 12, 20, 21} <= set(generator.cancelled)
    # The masks were computed in the background pool, as iterate_gen does.
    assert generator.scheduled


def test_real_failed_constraint_fails_its_job_alone(
    real_jobs: RealJobs, engine: Any, compiled: Any
) -> None:
    specs = [_spec(real_jobs, 50 + n, compiled["json_schema"]) for n in range(3)]
    got: dict[int, list[Update]] = {spec.job_id: [] for spec in specs}
    for update in engine.step(specs, []):
        got[update.job_id].append(update)
    # Break one job's matcher from outside, as a hostile grammar running out
    # of llguidance's parser limits would: a token its grammar refuses.
    running = engine._jobs[51]
    running.mask.job.matcher.consume_token(real_jobs.tokenizer.encode("x")[0])
    assert running.mask.job.matcher.is_error()
    for _ in range(200):
        for update in engine.step([], []):
            got[update.job_id].append(update)
        if not engine._generator.num_remaining_jobs():
            break
    failed = got[51][-1]
    assert isinstance(failed, Failed) and failed.message.startswith("the constraint failed: ")
    # Its token drawn under the opened mask was not released.
    assert len(got[51]) == 2
    for job_id in (50, 52):
        end = got[job_id][-1]
        assert isinstance(end, Finished) and end.reason == "constraint", got[job_id]
        jsonschema.validate(json.loads(_text(got[job_id])), SCHEMA)
    generator = engine._generator
    assert 51 in generator.cancelled and generator.filter_queue == []
    assert running.mask.closed


def test_real_cancelled_job_leaves_nothing_behind(
    real_jobs: RealJobs, engine: Any, compiled: Any
) -> None:
    """0.3.2's receive_sample queues a job's filter for the next step's mask
    before it decides whether the job ends; a job cancelled (or ended) has
    its entry taken off the queue, so no mask is computed for it."""
    generator = engine._generator
    specs = [_spec(real_jobs, 60, compiled["json_schema"]), _spec(real_jobs, 61, None)]
    engine.step(specs, [])
    cancelled = engine._jobs[60].mask
    # ExLlamaV2 queued it.
    assert [f for f, _ in generator.filter_queue] == [cancelled]
    engine.step([], [60])
    assert cancelled.closed and cancelled.job is None
    assert cancelled.background_result is None
    assert cancelled not in generator.scheduled
    assert 60 not in engine._jobs and 60 in generator.cancelled
    # The other job goes on; a new constrained job runs to its end.
    got = _run(engine, [_spec(real_jobs, 62, compiled["choice"])])
    assert isinstance(got[62][-1], Finished) and got[62][-1].reason == "constraint"
    assert generator.filter_queue == []


def test_real_job_that_exllamav2_ends_leaves_its_filter_queued(
    real_jobs: RealJobs, compiled: Any
) -> None:
    """Why the engine clears the queue: at a stop token 0.3.2's
    receive_sample has already queued the job's filter (dynamic.py, "Feed
    filters" comes before "End on stop tokens")."""
    from trioserve.engine.exllamav2.filter import filter_class

    host = SamplingGenerator(
        tokenizer=real_jobs.host.tokenizer, padded_vocab_size=real_jobs.host.padded_vocab_size
    )
    try:
        f = filter_class()(
            None, real_jobs.host.tokenizer, JobMatcher.start(compiled["choice"]), VOCAB
        )
        spec = _spec(real_jobs, 70, None)
        job = real_jobs.job_class(
            input_ids=torch.tensor([spec.prompt_ids], dtype=torch.long),
            max_new_tokens=8,
            stop_conditions=[EOS],
            filters=[f],
            filter_prefer_eos=True,
            identifier=70,
        )
        host.enqueue(job)
        for token in [*real_jobs.tokenizer.encode("red"), EOS]:
            eos, _ = job.receive_sample(None, torch.tensor([[token]]), None, None, None, False, [])
        assert eos
        assert host.filter_queue and all(entry == (f, True) for entry in host.filter_queue)
        assert f.complete
    finally:
        host.close()


def test_real_engine_refuses_healing_with_a_constraint(
    real_jobs: RealJobs, engine: Any, compiled: Any
) -> None:
    spec = _spec(real_jobs, 80, compiled["choice"], token_healing=True)
    (update,) = engine.step([spec], [])
    assert isinstance(update, Failed) and "token_healing" in update.message
    assert engine._generator.active == []
