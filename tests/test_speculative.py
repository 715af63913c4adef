"""Speculative decoding by prompt lookup (trioserve.engine.cpu.speculative).

The draft finder against a scan of the context (Hypothesis); the accept rule
on scripted logits, counted against the distribution it must preserve; and
on the real model, every job's output with drafts equal to its output
without: greedy, seeded sampling with penalties, stop strings, log
probabilities, a constraint and max_new_tokens boundaries, in one batch and
alone, and again from the prefix cache.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.test_cpu_engine import GREEDY, Outcome, chat, make_spec, run_all
from trioserve.engine import EngineOptions
from trioserve.engine.base import GenerationSpec
from trioserve.engine.cpu.engine import CpuEngine
from trioserve.engine.cpu.jobs import CpuJob, start_job
from trioserve.engine.cpu.logprobs import TokenTexts
from trioserve.engine.cpu.prefix import PrefixCache
from trioserve.engine.cpu.speculative import ROW_BLOCK, NgramIndex, draft_budget, merged
from trioserve.engine.cpu.step import StepSampler, XtcProtected
from trioserve.errors import ConfigError
from trioserve.vocabulary.constraint import Constraint
from trioserve.vocabulary.results import Failed, Finished, TextUpdate, TokenLogprob, Update
from trioserve.vocabulary.sampling import SamplingSettings

# --- the draft finder ------------------------------------------------------------


def scanned_draft(tokens: Sequence[int], most: int, shortest: int, longest: int) -> tuple[int, ...]:
    """What NgramIndex.draft must answer, by scanning the whole context."""
    last = len(tokens) - 1
    for n in range(min(longest, last), shortest - 1, -1):
        suffix = list(tokens[last + 1 - n :])
        for end in range(last - 1, n - 2, -1):
            if list(tokens[end + 1 - n : end + 1]) == suffix:
                return tuple(tokens[end + 1 : end + 1 + max(most, 0)])
    return ()


@given(
    tokens=st.lists(st.integers(0, 3), max_size=50),
    most=st.integers(0, 6),
    sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    steps=st.lists(st.integers(1, 5), min_size=1, max_size=50),
)
def test_the_index_drafts_what_a_scan_of_the_context_finds(
    tokens: list[int], most: int, sizes: tuple[int, int], steps: list[int]
) -> None:
    shortest, longest = sizes[0], sizes[0] + sizes[1]
    index = NgramIndex(shortest, longest)
    # The context grows by a few tokens at a time, as a job's does.
    ends = itertools.accumulate(itertools.cycle(steps))
    for end in itertools.takewhile(lambda n: n <= len(tokens), ends):
        context = tokens[:end]
        assert index.draft(context, most) == scanned_draft(context, most, shortest, longest)


def test_the_index_prefers_the_longest_and_the_latest_occurrence() -> None:
    index = NgramIndex(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 7, 2, 3, 8, 9, 2, 3]
    # "2 3" last occurred at 4-5 (then 8), "9 2 3" never did.
    assert index.draft(tokens, 3) == (8, 9, 2)
    tokens += [8]
    # "2 3 8" occurred at 4-6: what followed it, up to the end.
    assert index.draft(tokens, 5) == (9, 2, 3, 8)
    assert index.draft([*tokens, 5], 2) == ()  # 5 never occurred before
    with pytest.raises(ValueError, match="shortest"):
        NgramIndex(3, 2)


def test_drafts_fill_the_last_block_of_rows() -> None:
    assert ROW_BLOCK == 4
    assert [draft_budget(rows, 3) for rows in range(1, 10)] == [3, 2, 1, 0, 3, 2, 1, 0, 3]
    # More drafts than a block holds make the block that long.
    assert [draft_budget(rows, 8) for rows in (1, 2, 9, 10)] == [8, 7, 0, 8]
    assert draft_budget(1, 0) == 0


# --- merging one step's updates ------------------------------------------------------


def entry(token: int) -> TokenLogprob:
    return TokenLogprob(token=token, text=str(token), bytes=b"", logprob=-1.0)


def test_merged_updates_are_what_plain_decodings_steps_add_up_to() -> None:
    one = TextUpdate(7, "a", "", 1, (entry(1),))
    two = TextUpdate(7, "", "b", 2, ())
    three = TextUpdate(7, "bc", "", 3, (entry(2), entry(3)))
    assert merged([one, two, three]) == [
        TextUpdate(7, "abc", "", 3, (entry(1), entry(2), entry(3)))
    ]
    end = Finished(7, "d", "stop_string", "x", None, 5, 4, logprobs=(entry(4),))
    assert merged([one, end]) == [attrs.evolve(end, text="ad", logprobs=(entry(1), entry(4)))]
    failed = Failed(7, "sampling failed: no")
    assert merged([one, two, failed]) == [TextUpdate(7, "a", "b", 2, (entry(1),)), failed]
    assert merged([failed]) == [failed]
    assert merged([]) == []


# --- the accept rule, on scripted logits --------------------------------------------


#: Scripted logits, the drafts, the job's sampling -> the tokens it took.
Settle = Callable[[torch.Tensor, tuple[int, ...], SamplingSettings], list[int]]


@pytest.fixture(scope="module")
def settle_one(cpu_engine: CpuEngine) -> Settle:
    """Settle one decoding job's position and its drafts' positions from
    scripted logits (``[1 + len(drafts), V]``) through the engine's own
    StepSampler; the tokens the job took."""
    tokenizer = cpu_engine.tokenizer
    vocab = cpu_engine.info.vocab_size
    cpu = torch.device("cpu")
    texts = TokenTexts(tokenizer)
    sampler = StepSampler(vocab, cpu, texts, XtcProtected(tokenizer, vocab, cpu), None)
    prompt = tuple(cpu_engine.encode("Once upon a time"))

    def settle(
        logits: torch.Tensor, drafts: tuple[int, ...], sampling: SamplingSettings
    ) -> list[int]:
        spec = GenerationSpec(job_id=1, prompt_ids=prompt, max_new_tokens=8, sampling=sampling)
        job = start_job(
            spec, 0, tokenizer=tokenizer, vocab=vocab, device=cpu,
            prefix_cache=PrefixCache(0), texts=texts,
        )  # fmt: skip
        # As after a step that fed the prompt's last token (at len - 1) and the drafts.
        job.pending, job.cached = prompt[-1], len(prompt)

        def exact(index: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return logits[index].gather(1, ids)

        def fail(job: CpuJob, message: str) -> Failed:
            raise AssertionError(message)

        updates = sampler.settle([job], [drafts], logits, exact, lambda job: None, fail)
        assert len(updates) == 1
        taken = job.tokens[len(prompt) :]
        # Each draft taken keeps its position; the last token taken is pending.
        assert job.cached == len(prompt) + len(taken) - 1
        return taken

    return settle


#: Four candidate ids (any four) and their probabilities at each position.
IDS = (100, 200, 300, 400)
P = (
    (0.5, 0.3, 0.15, 0.05),  # the draft is IDS[0]
    (0.2, 0.6, 0.1, 0.1),  # after it, the draft is IDS[1]
    (0.25, 0.25, 0.25, 0.25),
)


def scripted_logits(vocab: int) -> torch.Tensor:
    logits = torch.full((len(P), vocab), -1e4)
    for row, probabilities in enumerate(P):
        logits[row, list(IDS)] = torch.tensor(probabilities).log()
    return logits


def test_drafts_are_taken_as_often_as_the_model_would_sample_them(
    cpu_engine: CpuEngine, settle_one: Settle
) -> None:
    """Drafts (IDS[0], IDS[1]) against the model's distributions P: every
    outcome (the first token other than a draft, or both drafts and the
    next token) must come as often as sampling token after token gives it,
    the residual included (a token sampled instead of a draft). Pearson's
    chi-square over the 10 outcomes, fixed seeds."""
    settle = settle_one
    logits = scripted_logits(cpu_engine.info.vocab_size)
    drafts = (IDS[0], IDS[1])
    expected: dict[tuple[int, ...], float] = {}
    for a, pa in zip(IDS, P[0], strict=True):
        if a != drafts[0]:
            expected[(a,)] = pa
            continue
        for b, pb in zip(IDS, P[1], strict=True):
            if b != drafts[1]:
                expected[(a, b)] = pa * pb
                continue
            for c, pc in zip(IDS, P[2], strict=True):
                expected[(a, b, c)] = pa * pb * pc
    draws = 3000
    counts = collections.Counter(
        tuple(
            settle(
                logits,
                drafts,
                SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, rep_pen=1.0, seed=seed),
            )
        )
        for seed in range(draws)
    )
    assert set(counts) <= set(expected), counts
    chi2 = sum((counts[k] - draws * p) ** 2 / (draws * p) for k, p in expected.items())
    # The 0.1 % critical value of chi-square with 9 degrees of freedom.
    assert chi2 < 27.88, (chi2, counts)


def test_greedy_takes_drafts_while_they_are_the_best(
    cpu_engine: CpuEngine, settle_one: Settle
) -> None:
    settle = settle_one
    logits = scripted_logits(cpu_engine.info.vocab_size)
    assert settle(logits, (IDS[0], IDS[1]), GREEDY) == [IDS[0], IDS[1], IDS[0]]
    assert settle(logits, (IDS[0], IDS[2]), GREEDY) == [IDS[0], IDS[1]]
    assert settle(logits, (IDS[3], IDS[1]), GREEDY) == [IDS[0]]
    assert settle(logits[:1], (), GREEDY) == [IDS[0]]


# --- the real model ---------------------------------------------------------------

PARAGRAPH = (
    "The river town began with a ford, a mill and a market that met every Thursday. Farmers"
    " brought grain and wool; merchants brought salt, iron and news. Over three centuries the"
    " bridge was rebuilt four times, and the market moved indoors."
)
SUMMARY = chat("Summarize this paragraph in two sentences:\n\n" + PARAGRAPH)
COUNTING = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"


def specs_for(engine: CpuEngine) -> list[GenerationSpec]:
    """Jobs whose drafts are often taken (copying, repeating), and others."""
    seeded = SamplingSettings(temperature=0.8, top_p=0.95, rep_pen=1.1, seed=11)
    dry = attrs.evolve(GREEDY, dry_multiplier=0.8, dry_allowed_length=3, freq_pen=0.1)
    grammars = engine.grammars
    assert grammars is not None, "the embedded model's engine has grammars"
    return [
        make_spec(engine, SUMMARY, 40),
        make_spec(engine, COUNTING, 24),
        make_spec(engine, chat("Tell me a story about a lighthouse."), 24),
        make_spec(engine, SUMMARY, 40, stop_strings=("a market",)),
        make_spec(engine, SUMMARY, 24, logprobs=3),
        make_spec(engine, SUMMARY, 32, sampling=seeded),
        make_spec(engine, COUNTING, 24, sampling=dry),
        make_spec(
            engine,
            chat("List the market days."),
            24,
            constraint=grammars.compile(Constraint("regex", "(Thursday, ){2,5}and Friday\\.")),
        ),
        *(make_spec(engine, COUNTING, n) for n in (1, 2, 3)),
    ]


def fresh(specs: Sequence[GenerationSpec], base: int) -> list[GenerationSpec]:
    return [attrs.evolve(spec, job_id=base + i) for i, spec in enumerate(specs)]


@attrs.frozen
class Seen:
    """What a client sees of a job: at each update, the text so far, the
    held text, the tokens generated and the log-probability entries so far;
    and the end, with all its text and entries."""

    states: tuple[tuple[str, str, int, tuple[TokenLogprob, ...]], ...]
    end: Update


def seen(outcome: Outcome) -> Seen:
    text, states = "", []
    entries: tuple[TokenLogprob, ...] = ()
    for update in outcome.updates:
        if isinstance(update, TextUpdate):
            text += update.text
            entries += update.logprobs
            states.append((text, update.held, update.generated_tokens, entries))
    end = attrs.evolve(outcome.end, job_id=0)
    if isinstance(end, Finished):
        # cached_tokens: what the prefix cache held is no part of the output.
        end = attrs.evolve(
            end, text=text + end.text, logprobs=entries + end.logprobs, cached_tokens=0
        )
    return Seen(tuple(states), end)


def assert_same_output(plain: Outcome, drafted: Outcome) -> None:
    """The same end, and each update with drafts is what plain decoding had
    sent at the same token count (it may send several tokens at once)."""
    a, b = seen(plain), seen(drafted)
    assert b.end == a.end
    at_count = {state[2]: state for state in a.states}
    for state in b.states:
        assert at_count[state[2]] == state


@pytest.fixture
def speculating(cpu_engine: CpuEngine) -> Iterator[CpuEngine]:
    """The shared engine with drafts on (as ``--speculative ngram``), then off again."""
    before = cpu_engine.draft_tokens
    cpu_engine.draft_tokens = 4
    try:
        yield cpu_engine
    finally:
        cpu_engine.draft_tokens = before


def run(engine: CpuEngine, drafts: int, specs: Sequence[GenerationSpec]) -> dict[int, Outcome]:
    engine.draft_tokens = drafts
    try:
        return run_all(engine, specs)
    finally:
        engine.draft_tokens = 4


def test_speculative_output_is_plain_output_in_a_batch(speculating: CpuEngine) -> None:
    engine = speculating
    specs = specs_for(engine)
    plain = run(engine, 0, specs)
    before = engine.statistics()
    # Eight drafts: blocks of nine rows leave drafts for several of the jobs.
    drafted = run(engine, 8, fresh(specs, 1_000_000))
    after = engine.statistics()
    for spec, twin in zip(specs, fresh(specs, 1_000_000), strict=True):
        assert_same_output(plain[spec.job_id], drafted[twin.job_id])
    # The lookup paid: drafts were fed and many taken.
    accepted = after.accepted_tokens - before.accepted_tokens
    assert accepted >= 20, (after, before)
    assert isinstance(plain[specs[3].job_id].end, Finished)
    assert plain[specs[3].job_id].finished.reason == "stop_string"
    assert plain[specs[7].job_id].finished.reason == "constraint"
    assert [plain[s.job_id].finished.generated_tokens for s in specs[-3:]] == [1, 2, 3]


@pytest.mark.slow
def test_speculative_output_alone_and_from_the_prefix_cache(speculating: CpuEngine) -> None:
    """Alone (its rows the whole forward), and again once the prefix cache
    holds its prompt and answer, a copying job gives the plain output."""
    engine = speculating
    spec = make_spec(engine, SUMMARY, 48)
    plain = run(engine, 0, [spec])[spec.job_id]
    for round_ in range(2):
        again = attrs.evolve(spec, job_id=2_000_000 + round_)
        assert_same_output(plain, run(engine, 4, [again])[again.job_id])
    assert engine.statistics().prefix_cache.hits > 0


def test_speculation_is_an_engine_option() -> None:
    with pytest.raises(ConfigError, match="speculative"):
        CpuEngine.load(None, speculative="eagle")
    with pytest.raises(ConfigError, match="draft_tokens"):
        CpuEngine.load(None, speculative="ngram", draft_tokens=0)
    with pytest.raises(ConfigError, match="speculative"):
        EngineOptions(speculative="eagle")  # type: ignore[arg-type]
    assert EngineOptions(speculative="ngram", draft_tokens=6).draft_tokens == 6


async def test_speculative_output_through_the_server(speculating: CpuEngine) -> None:
    """Over a real socket with the openai SDK (the server's path, whole and
    streamed): a copying prompt's greedy text with drafts is the text without."""
    import openai
    import trio

    from tests.helpers import serving

    engine = speculating
    async with serving(engine) as (_, listening):
        sdk = openai.OpenAI(
            base_url=f"http://127.0.0.1:{listening.port}/v1", api_key="x", max_retries=0
        )

        def texts() -> tuple[str, str]:
            fields: dict[str, Any] = {
                "model": "m",
                "prompt": SUMMARY,
                "max_tokens": 40,
                "temperature": 0,
            }
            whole = sdk.completions.create(**fields).choices[0].text
            stream = sdk.completions.create(**fields, stream=True)
            return whole, "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

        engine.draft_tokens = 0
        plain = await trio.to_thread.run_sync(texts)
        engine.draft_tokens = 4
        before = engine.statistics().accepted_tokens
        drafted = await trio.to_thread.run_sync(texts)
        assert engine.statistics().accepted_tokens - before >= 10
    assert drafted == plain and plain[0] == plain[1]
