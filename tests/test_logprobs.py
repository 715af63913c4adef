"""Log probabilities on the CPU engine: the entries of generated and prompt
tokens against a direct computation with the engine's own model, and the
rule that entries go out with the text they belong to."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from tests.test_cpu_engine import GREEDY, chat, make_spec, run_one
from trioserve.engine.cpu import llama
from trioserve.engine.cpu.engine import CpuEngine
from trioserve.engine.grammars import Grammars
from trioserve.vocabulary.results import Finished, TextUpdate, TokenLogprob
from trioserve.vocabulary.sampling import SamplingSettings

pytestmark = pytest.mark.usefixtures("cpu_engine")


def direct_logprobs(
    engine: CpuEngine, prompt: Sequence[int], ids: Sequence[int] = (), *, chunk: int = 512
) -> torch.Tensor:
    """``[len(prompt) + len(ids), V]``: row i is the model's log-softmax after
    the first i + 1 ids of ``prompt + ids``, over logits computed exactly in
    float32 from the engine's weights on a cache of its own: the prompt in
    forwards of ``chunk`` tokens, then ``ids`` one decode step each (the
    engine's own model path, without its batching, sampler or queues)."""
    weights = engine._weights
    assert weights is not None
    config = engine._config
    cpu = torch.device("cpu")
    cache = llama.KVCache(config.n_layers, config.n_kv_heads, config.head_dim, weights.dtype, cpu)
    cache.fit(1, len(prompt) + len(ids))
    slot = torch.tensor([0])
    rows = []
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            end = min(len(prompt), start + chunk)
            hidden = llama.forward(
                weights,
                config,
                cache,
                engine._rope,
                torch.tensor([list(prompt[start:end])]),
                torch.arange(start, end)[None],
                slot,
                every_position=True,
            )
            rows.append(llama.exact_logits(weights, hidden[0]))
        for i, token in enumerate(ids):
            position = torch.tensor([[len(prompt) + i]])
            out = llama.forward(
                weights, config, cache, engine._rope, torch.tensor([[token]]), position, slot
            )
            rows.append(llama.exact_logits(weights, out))
        return torch.log_softmax(torch.cat(rows), dim=-1)


def value(entry: TokenLogprob) -> float:
    assert entry.logprob is not None
    return entry.logprob


def entries(outcome_updates: Sequence[object]) -> list[TokenLogprob]:
    out: list[TokenLogprob] = []
    for update in outcome_updates:
        if isinstance(update, TextUpdate | Finished):
            out.extend(update.logprobs)
    return out


def test_greedy_entries_match_the_model_and_the_text(cpu_engine: CpuEngine) -> None:
    spec = make_spec(cpu_engine, chat("Name three colours."), 24, logprobs=5)
    outcome = run_one(cpu_engine, spec)
    got = entries(outcome.updates)
    ids = [e.token for e in got]
    finished = outcome.finished
    # Every generated token has its entry, the stop token aside.
    assert len(got) == finished.generated_tokens - (finished.reason == "stop_token")
    assert b"".join(e.bytes for e in got).decode() == outcome.text
    direct = direct_logprobs(cpu_engine, spec.prompt_ids, ids)
    for i, entry in enumerate(got):
        row = direct[len(spec.prompt_ids) - 1 + i]
        # The token's own logit is exact; the normaliser sums bfloat16-rounded
        # logits of the rest of the vocabulary (docs/sampling.md): up to
        # 7.5e-3 from the exact one seen on torch's operators on an AVX2-only
        # AMD EPYC, under 5e-3 on the native kernels.
        assert entry.logprob == pytest.approx(float(row[entry.token]), abs=1e-2)
        assert len(entry.top) == 5
        # Greedy takes the most likely token: the first alternative.
        assert entry.top[0].token == entry.token
        assert entry.top[0].logprob == entry.logprob
        values = [value(t) for t in entry.top]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(value(t)) for t in entry.top) <= 1 + 1e-6
        assert entry.top[0].text == entry.text and entry.top[0].bytes == entry.bytes


def test_entries_are_released_with_their_text_and_cut_by_a_stop_string(
    cpu_engine: CpuEngine,
) -> None:
    prompt = chat("What is the capital of France?")
    free = run_one(cpu_engine, make_spec(cpu_engine, prompt, 20, logprobs=0))
    text = free.text
    assert "Paris" in text
    stopped = run_one(
        cpu_engine, make_spec(cpu_engine, prompt, 20, logprobs=0, stop_strings=("Paris",))
    )
    assert stopped.finished.reason == "stop_string"
    released = ""
    for update in stopped.updates:
        assert isinstance(update, TextUpdate | Finished)
        released += update.text
        so_far = b"".join(
            e.bytes for e in entries(stopped.updates[: stopped.updates.index(update) + 1])
        )
        # Never an entry ahead of the released text.
        assert len(so_far.decode("utf-8", "replace")) <= len(released) or isinstance(
            update, Finished
        )
    got = entries(stopped.updates)
    joined = b"".join(e.bytes for e in got).decode("utf-8", "replace")
    assert joined.startswith(released)
    # Tokens wholly inside the stop string carry no entry: the last entry's
    # token starts before the stop string.
    before_last = b"".join(e.bytes for e in got[:-1]).decode("utf-8", "replace")
    assert len(before_last) < len(released)
    assert [e.token for e in got] == [e.token for e in entries(free.updates)][: len(got)]
    assert all(e.top == () for e in got)


def test_prompt_logprobs_with_no_new_token_match_the_model(cpu_engine: CpuEngine) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 30
    spec = make_spec(cpu_engine, text, 0, prompt_logprobs=3)
    assert len(spec.prompt_ids) > 128  # more than one block of scored rows
    cpu_engine.prefill_chunk, chunk = 200, cpu_engine.prefill_chunk  # several chunks too
    try:
        outcome = run_one(cpu_engine, spec)
    finally:
        cpu_engine.prefill_chunk = chunk
    finished = outcome.finished
    assert finished.text == "" and finished.generated_tokens == 0
    scored = finished.prompt_logprobs
    assert len(scored) == len(spec.prompt_ids) and scored[0].logprob is None
    assert scored[0].token == spec.prompt_ids[0] and scored[0].top == ()
    direct = direct_logprobs(cpu_engine, spec.prompt_ids, chunk=200)
    for i, entry in enumerate(scored[1:], start=1):
        assert entry.token == spec.prompt_ids[i] and entry.logprob is not None
        assert entry.logprob == pytest.approx(float(direct[i - 1][entry.token]), abs=1e-3)
        best = direct[i - 1].topk(3).values.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(best, abs=1e-3)
        for t in entry.top:  # ties may list either of equal tokens
            assert t.logprob == pytest.approx(float(direct[i - 1][t.token]), abs=1e-3)


def test_logprobs_respect_the_constraint_mask(cpu_engine: CpuEngine) -> None:
    grammars = cpu_engine.grammars
    assert isinstance(grammars, Grammars)
    from trioserve.vocabulary.constraint import Constraint

    compiled = grammars.compile(Constraint.choice(("yes", "no", "maybe"), "$.choice"))
    spec = make_spec(
        cpu_engine,
        chat("Is the sky blue? Answer yes or no."),
        8,
        logprobs=20,
        constraint=compiled,
        sampling=SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, rep_pen=1.0, seed=5),
    )
    outcome = run_one(cpu_engine, spec)
    got = entries(outcome.updates)
    assert outcome.text in ("yes", "no", "maybe")
    so_far = ""
    for entry in got:
        assert 1 <= len(entry.top) < 20  # the mask leaves a few tokens
        for alternative in entry.top:
            continued = so_far + alternative.text
            assert any(c.startswith(continued) for c in ("yes", "no", "maybe")), continued
        assert sum(math.exp(value(t)) for t in entry.top) == pytest.approx(1.0, abs=1e-3)
        so_far += entry.text


def test_rows_that_do_not_ask_get_no_entries(cpu_engine: CpuEngine) -> None:
    outcome = run_one(cpu_engine, make_spec(cpu_engine, chat("Hi"), 6))
    assert entries(outcome.updates) == [] and outcome.finished.prompt_logprobs == ()


def test_bad_logprob_specs_fail_alone(cpu_engine: CpuEngine) -> None:
    for kwargs, words in (
        ({"logprobs": 21}, "logprobs must be"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be"),
        ({"prompt_logprobs": 1, "token_healing": True}, "token_healing"),
    ):
        outcome = run_one(cpu_engine, make_spec(cpu_engine, "Hello", 2, **kwargs))
        assert words in getattr(outcome.end, "message", ""), outcome.end
    outcome = run_one(cpu_engine, make_spec(cpu_engine, "Hello", 0))
    assert "max_new_tokens must be >= 1" in getattr(outcome.end, "message", "")


_ = GREEDY


def _entry(token: int) -> TokenLogprob:
    return TokenLogprob(token, str(token), b"", -1.0)


def test_entry_queue_releases_entries_with_their_text() -> None:
    from trioserve.engine.cpu.logprobs import EntryQueue

    queue = EntryQueue()
    a, b, c, d = (_entry(i) for i in range(4))
    queue.add(a, 3)  # "abc"
    queue.add(b, 3)  # half a character: no text yet
    queue.add(c, 7)  # completes it, and more
    assert queue.release(2) == ()  # part of a's text is held
    assert queue.release(3) == (a, b)
    assert queue.release(6) == ()
    assert queue.release(7) == (c,)
    queue.add(d, 9)
    assert queue.flush() == (d,)


def test_entry_queue_cut_keeps_tokens_that_start_before_the_stop_string() -> None:
    from trioserve.engine.cpu.logprobs import EntryQueue

    queue = EntryQueue()
    a, b, c = (_entry(i) for i in range(3))
    queue.add(a, 2)  # [0, 2)
    queue.add(b, 5)  # [2, 5): the stop string starts at 4, inside b
    queue.add(c, 8)  # [5, 8): wholly after
    assert queue.release(0) == ()
    assert queue.cut(4) == (a, b)
    queue.add(a, 9)
    assert queue.cut(8) == ()  # starts at 8: wholly in the stop string
