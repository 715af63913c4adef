"""The CPU engine on the real embedded model (SmolLM2-135M-Instruct, bfloat16).

One engine is shared by the session (``cpu_engine`` in conftest.py); every
test leaves it with no job running. Generations are short to keep the file
quick on two cores.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
import torch

from tests.direct import CPU, greedy_ids, perplexity_ratio, token_nlls
from trioserve.engine.base import Engine, GenerationSpec
from trioserve.engine.cpu import llama, native
from trioserve.engine.cpu.engine import CpuEngine
from trioserve.engine.cpu.options import CpuOptions
from trioserve.errors import ConfigError, ModelError
from trioserve.vocabulary.results import Failed, Finished, TextUpdate, Update
from trioserve.vocabulary.sampling import SamplingSettings

GREEDY = SamplingSettings(temperature=0.0, rep_pen=1.0)
_ids = itertools.count(1)


def chat(question: str) -> str:
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging"
        f" Face<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )


def make_spec(
    engine: CpuEngine, prompt: str, max_new_tokens: int = 16, **kwargs: object
) -> GenerationSpec:
    fields: dict[str, object] = {
        "sampling": GREEDY,
        "stop_token_ids": engine.info.eos_token_ids,
        **kwargs,
    }
    return GenerationSpec(
        job_id=next(_ids),
        prompt_ids=tuple(engine.encode(prompt)),
        max_new_tokens=max_new_tokens,
        **fields,  # type: ignore[arg-type]
    )


@attrs.define
class Outcome:
    updates: list[Update] = attrs.field(factory=list)

    @property
    def end(self) -> Update:
        return self.updates[-1]

    @property
    def finished(self) -> Finished:
        assert isinstance(self.end, Finished), self.end
        return self.end

    @property
    def chunks(self) -> list[str]:
        return [u.text for u in self.updates if isinstance(u, TextUpdate | Finished)]

    @property
    def text(self) -> str:
        return "".join(self.chunks)


def run_all(
    engine: CpuEngine, specs: Sequence[GenerationSpec], *, max_steps: int = 10_000
) -> dict[int, Outcome]:
    """Submit ``specs`` together and step until each has its final update."""
    outcomes = {spec.job_id: Outcome() for spec in specs}
    submit: Sequence[GenerationSpec] = specs
    open_jobs = set(outcomes)
    for _ in range(max_steps):
        for update in engine.step(submit, []):
            outcome = outcomes[update.job_id]
            assert not (outcome.updates and isinstance(outcome.updates[-1], Finished | Failed))
            outcome.updates.append(update)
            if isinstance(update, Finished | Failed):
                open_jobs.discard(update.job_id)
        submit = []
        if not open_jobs:
            return outcomes
    raise AssertionError(f"jobs {open_jobs} did not finish in {max_steps} steps")


def run_one(engine: CpuEngine, spec: GenerationSpec) -> Outcome:
    return run_all(engine, [spec])[spec.job_id]


def greedy_ids_direct(model_dir: Path, prompt: Sequence[int], n: int) -> list[int]:
    """Greedy ids from the model functions alone (no engine, no sampler), to
    check what the engine streams against the ids it must have generated."""
    config = llama.LlamaConfig.from_dir(model_dir)
    weights = llama.LlamaWeights.load(model_dir, config, CpuOptions())
    return greedy_ids(model_dir, weights, prompt, n)


def test_is_an_engine_with_the_models_facts(cpu_engine: CpuEngine) -> None:
    assert isinstance(cpu_engine, Engine)
    info = cpu_engine.info
    assert (info.engine, info.model_name) == ("cpu", "SmolLM2-135M-Instruct")
    assert info.context_length == 8192
    assert info.vocab_size == 49152
    assert info.bos_token_id == 1
    assert info.eos_token_ids == frozenset({2})
    assert info.max_batch == 8
    assert info.batching


def test_step_with_nothing_to_do_returns_no_update(cpu_engine: CpuEngine) -> None:
    assert cpu_engine.step([], []) == []
    assert cpu_engine.step([], [12345]) == []  # unknown ids are ignored
    assert cpu_engine.cache_bytes == 0


def test_chat_answer_names_paris_and_ends_on_eos(cpu_engine: CpuEngine) -> None:
    question = "What is the capital of France?"
    outcome = run_one(cpu_engine, make_spec(cpu_engine, chat(question), 32))
    assert "Paris" in outcome.text
    end = outcome.finished
    assert end.reason == "stop_token"
    assert end.stop_token in cpu_engine.info.eos_token_ids
    assert end.stop_string is None
    # The EOS token counts as generated but its text is never emitted.
    assert end.generated_tokens < 32
    assert "<|im_end|>" not in outcome.text
    assert end.prompt_tokens == len(cpu_engine.encode(chat(question)))


@pytest.mark.slow
def test_greedy_is_deterministic(cpu_engine: CpuEngine) -> None:
    prompt = chat("Give me three tips for staying healthy.")
    first = run_one(cpu_engine, make_spec(cpu_engine, prompt, 20))
    second = run_one(cpu_engine, make_spec(cpu_engine, prompt, 20))
    assert first.chunks == second.chunks
    assert first.finished.generated_tokens == second.finished.generated_tokens == 20
    assert first.finished.reason == "max_new_tokens"


def _generated_ids(outcome: Outcome) -> list[int]:
    return [
        entry.token
        for update in outcome.updates
        if isinstance(update, TextUpdate | Finished)
        for entry in update.logprobs
    ]


def test_penalties_reach_the_sampler_row_by_row(cpu_engine: CpuEngine) -> None:
    """A greedy job with the largest presence penalty never picks an id its
    context already holds (prompt or output), in the same steps as a job
    without penalties, which gives exactly what it gives alone: the
    counts reach the penalised row and no other."""
    prompt = chat("Repeat after me: the cat sat on the mat, the cat sat on the mat.")
    plain = make_spec(cpu_engine, prompt, 24, stop_token_ids=(), logprobs=0)
    alone = _generated_ids(run_one(cpu_engine, plain))
    assert len(alone) == 24
    assert len(set(alone)) < len(alone)  # unpenalised, this answer repeats itself
    penalised = make_spec(
        cpu_engine,
        prompt,
        24,
        stop_token_ids=(),
        logprobs=0,
        sampling=attrs.evolve(GREEDY, pres_pen=100.0),
    )
    beside = make_spec(cpu_engine, prompt, 24, stop_token_ids=(), logprobs=0)
    outcomes = run_all(cpu_engine, [penalised, beside])
    assert _generated_ids(outcomes[beside.job_id]) == alone
    ids = _generated_ids(outcomes[penalised.job_id])
    assert len(ids) == 24
    for i, token in enumerate(ids):
        assert token not in penalised.prompt_ids, (i, token)
        assert token not in ids[:i], (i, token)


def test_seeded_sampling_is_reproducible(cpu_engine: CpuEngine) -> None:
    sampling = SamplingSettings(temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    prompt = chat("Write a short poem about the sea.")
    first = run_one(cpu_engine, make_spec(cpu_engine, prompt, 16, sampling=sampling))
    second = run_one(cpu_engine, make_spec(cpu_engine, prompt, 16, sampling=sampling))
    assert first.text == second.text
    assert first.text


def test_stop_string_spanning_tokens_and_ending_inside_one(
    cpu_engine: CpuEngine,
) -> None:
    prompt = chat("Give me three tips for staying healthy.")
    spec = make_spec(cpu_engine, prompt, 24)
    reference = run_one(cpu_engine, spec).text
    ids = cpu_engine.encode(reference)
    # Token boundaries of the reference text (re-encoding plain ASCII prose
    # gives the generated split closely enough to pick a stop string that
    # starts inside one token and ends inside a later one).
    bounds = list(itertools.accumulate(len(cpu_engine.decode([i])) for i in ids))
    long_tokens = [k for k in range(1, len(ids) - 2) if bounds[k] - bounds[k - 1] >= 3]
    k = long_tokens[1]
    start = bounds[k - 1] + 1  # inside token k
    end = bounds[k + 1] + 1  # inside token k + 2
    stop = reference[start:end]
    assert reference.index(stop) == start

    outcome = run_one(cpu_engine, attrs.evolve(spec, job_id=next(_ids), stop_strings=(stop,)))
    end_update = outcome.finished
    assert end_update.reason == "stop_string"
    assert end_update.stop_string == stop
    assert outcome.text == reference[:start]
    assert stop not in outcome.text


def test_held_text_is_flushed_at_max_new_tokens(cpu_engine: CpuEngine) -> None:
    prompt = chat("What is the capital of France?")
    spec = make_spec(cpu_engine, prompt, 6)
    reference = run_one(cpu_engine, spec)
    assert reference.finished.reason == "max_new_tokens"
    # A stop string that starts with the last generated character never
    # completes: that character is held at the end and must be flushed.
    stop = reference.text[-1] + "\x00never"
    outcome = run_one(cpu_engine, attrs.evolve(spec, job_id=next(_ids), stop_strings=(stop,)))
    assert outcome.text == reference.text
    assert outcome.finished.reason == "max_new_tokens"
    assert outcome.finished.text.endswith(reference.text[-1])


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["🎉🎉🎉🎉🎉", "中国的首都是", "日本語: こんにちは、"])
def test_multibyte_output_never_streams_replacement_characters(
    cpu_engine: CpuEngine, model_dir: Path, prompt: str
) -> None:
    spec = make_spec(cpu_engine, prompt, 12)
    outcome = run_one(cpu_engine, spec)
    expected_ids = greedy_ids_direct(model_dir, spec.prompt_ids, 12)
    assert outcome.finished.reason == "max_new_tokens"
    text_updates = [u for u in outcome.updates if isinstance(u, TextUpdate)]
    assert all("\ufffd" not in u.text for u in text_updates)
    # Some characters spanned tokens, so some text was held meanwhile.
    assert any(u.held for u in text_updates)
    assert outcome.text == cpu_engine.decode(expected_ids)
    assert any(ord(ch) > 0x2E80 for ch in outcome.text)


#: Eight chat questions: the batch of the batch-invariance tests.
BATCH_QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "What is 2+2?",
    "Name a color.",
    "Who wrote Hamlet? Answer in one long sentence with the year.",
    "Translate 'hello' to Spanish.",
    "What is Python?",
)


@pytest.mark.slow
def test_text_alone_equals_text_beside_seven_others(cpu_engine: CpuEngine) -> None:
    """Holds in bfloat16 (the default): each job's greedy tokens do not depend
    on the other rows of its batch."""
    specs = [make_spec(cpu_engine, chat(q), 16) for q in BATCH_QUESTIONS]
    together = run_all(cpu_engine, specs)
    for spec in specs:
        alone = run_one(cpu_engine, attrs.evolve(spec, job_id=next(_ids)))
        assert alone.chunks == together[spec.job_id].chunks
        assert alone.finished == attrs.evolve(
            together[spec.job_id].finished, job_id=alone.end.job_id
        )


def test_token_healing_continues_a_cut_word(cpu_engine: CpuEngine) -> None:
    prompt = "I love eating straw"
    plain = make_spec(cpu_engine, prompt, 4)
    healed = run_one(cpu_engine, attrs.evolve(plain, job_id=next(_ids), token_healing=True))
    # The prompt's last token was re-generated, not run.
    assert healed.finished.prompt_tokens == len(plain.prompt_ids) - 1
    # What comes out continues the word "straw..." (no space first) and does
    # not repeat the healed prefix.
    first_word = healed.text.split()[0]
    assert healed.text[0].isalpha()
    assert not first_word.startswith("straw")
    assert (prompt + healed.text).split()[3].startswith("straw")


def test_cancelling_frees_slots_for_waiting_jobs(cpu_engine: CpuEngine) -> None:
    specs = [make_spec(cpu_engine, chat(f"Count to {n}."), 8) for n in range(12)]
    first = cpu_engine.step(specs, [])
    # Only max_batch jobs ran; the rest waited.
    assert {u.job_id for u in first} <= {s.job_id for s in specs[:8]}
    cancelled = {specs[0].job_id, specs[3].job_id, specs[9].job_id}  # two running, one waiting
    outcomes: dict[int, list[Update]] = {s.job_id: [] for s in specs}
    for u in first:
        outcomes[u.job_id].append(u)
    updates = cpu_engine.step([], list(cancelled))
    for _ in range(200):
        assert not {u.job_id for u in updates} & cancelled
        for u in updates:
            outcomes[u.job_id].append(u)
        if all(
            outcomes[j] and isinstance(outcomes[j][-1], Finished)
            for j in outcomes.keys() - cancelled
        ):
            break
        updates = cpu_engine.step([], [])
    for job_id in outcomes.keys() - cancelled:
        assert isinstance(outcomes[job_id][-1], Finished)
    assert cpu_engine.step([], []) == []
    assert cpu_engine.cache_bytes == 0


def test_a_job_cancelled_as_it_is_submitted_never_runs(cpu_engine: CpuEngine) -> None:
    spec = make_spec(cpu_engine, chat("Name a color."), 4)
    assert cpu_engine.step([spec], [spec.job_id]) == []
    assert cpu_engine.step([], []) == []


def test_over_long_spec_fails_alone(cpu_engine: CpuEngine) -> None:
    context = cpu_engine.info.context_length
    ok = make_spec(cpu_engine, chat("Name a color."), 4)
    too_long = GenerationSpec(job_id=next(_ids), prompt_ids=(1, 2, 3), max_new_tokens=context)
    bad_id = GenerationSpec(job_id=next(_ids), prompt_ids=(1, 10**6), max_new_tokens=2)
    outcomes = run_all(cpu_engine, [too_long, ok, bad_id])
    failed = outcomes[too_long.job_id].end
    assert isinstance(failed, Failed)
    assert "context length" in failed.message
    assert isinstance(outcomes[bad_id.job_id].end, Failed)
    assert outcomes[ok.job_id].finished.generated_tokens >= 1


def test_a_job_that_cannot_be_sampled_fails_alone(cpu_engine: CpuEngine) -> None:
    everything = frozenset(range(cpu_engine.info.vocab_size))
    doomed = make_spec(cpu_engine, chat("Name a color."), 4, banned_ids=everything)
    fine = make_spec(cpu_engine, chat("Name a color."), 4)
    outcomes = run_all(cpu_engine, [doomed, fine])
    failed = outcomes[doomed.job_id].end
    assert isinstance(failed, Failed)
    assert "banned" in failed.message
    assert outcomes[fine.job_id].finished.generated_tokens >= 1
    assert cpu_engine.cache_bytes == 0


def test_context_length_option_lowers_the_limit(model_dir: Path) -> None:
    engine = CpuEngine.load(model_dir, context_length=64, max_batch=2)
    try:
        assert engine.info.context_length == 64
        spec = make_spec(engine, "Hello there", 60)
        ok = run_one(engine, spec)
        assert ok.finished.prompt_tokens + ok.finished.generated_tokens <= 64
        over = run_one(engine, attrs.evolve(spec, job_id=next(_ids), max_new_tokens=63))
        assert isinstance(over.end, Failed)
    finally:
        engine.close()


def test_bad_options_are_clear_errors(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dtype"):
        CpuEngine.load(model_dir, dtype="int3")
    with pytest.raises(ConfigError, match="context_length"):
        CpuEngine.load(model_dir, context_length=10**6)
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelError, match="GPT2LMHeadModel"):
        CpuEngine.load(tmp_path)


# --- token healing with a SentencePiece-style tokenizer --------------------------

SP_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]


def write_metaspace_model(path: Path, favourite: str) -> list[str]:
    """A tiny Llama directory with a Metaspace (SentencePiece-style) word
    tokenizer, whose greedy choice is always ``"▁" + favourite``.

    Every layer's weights are zero, so the hidden state is the embedding (all
    ones, the same for every token) and the logits are the untied lm_head's row
    sums: one row of ones, every other row zero. Returns the vocabulary.
    """
    from safetensors.torch import save_file
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = ["<unk>", "<s>", "</s>", *(f"\u2581{w}" for w in SP_WORDS)]
    tok = HfTokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    d, f, layers, heads, head_dim = 32, 64, 1, 2, 16
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": len(vocab),
        "hidden_size": d,
        "intermediate_size": f,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    zeros = torch.zeros
    tensors = {
        "model.embed_tokens.weight": torch.ones(len(vocab), d),
        "model.norm.weight": torch.ones(d),
        "lm_head.weight": zeros(len(vocab), d),
    }
    tensors["lm_head.weight"][vocab.index(f"\u2581{favourite}")] = 1.0
    p = "model.layers.0."
    tensors |= {
        p + "input_layernorm.weight": torch.ones(d),
        p + "post_attention_layernorm.weight": torch.ones(d),
        p + "self_attn.q_proj.weight": zeros(heads * head_dim, d),
        p + "self_attn.k_proj.weight": zeros(heads * head_dim, d),
        p + "self_attn.v_proj.weight": zeros(heads * head_dim, d),
        p + "self_attn.o_proj.weight": zeros(d, heads * head_dim),
        p + "mlp.gate_proj.weight": zeros(f, d),
        p + "mlp.up_proj.weight": zeros(f, d),
        p + "mlp.down_proj.weight": zeros(d, f),
    }
    save_file(tensors, str(path / "model.safetensors"))
    return vocab


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_healing_on_a_sentencepiece_tokenizer_drops_the_space_too(
    tmp_path: Path, dtype: str
) -> None:
    # Issue 8, defect 12: decoded alone, "▁lazy" is "lazy" (a Metaspace
    # decoder drops the first token's space), while the healed token decodes
    # as " lazy" after the prompt; the old code then emitted " lazy dog ...",
    # repeating the word.
    write_metaspace_model(tmp_path / "sp", favourite="dog")
    engine = CpuEngine.load(tmp_path / "sp", dtype=dtype, max_batch=2)
    try:
        prompt = "the quick brown fox jumps over the lazy"
        ids = tuple(engine.encode(prompt))
        assert engine.decode(ids[-1:]) == "lazy"  # the trap: no space alone
        spec = GenerationSpec(
            job_id=next(_ids),
            prompt_ids=ids,
            max_new_tokens=4,
            sampling=GREEDY,
            token_healing=True,
        )
        healed = run_one(engine, spec)
        # The healed token can only be "▁lazy" (the one token that extends
        # " lazy"); then "▁dog" three times. Only the new text comes out.
        assert healed.text == " dog dog dog"
        assert healed.finished.generated_tokens == 4
        assert healed.finished.prompt_tokens == len(ids) - 1
        assert engine.decode(ids) + healed.text == prompt + " dog dog dog"
        plain = run_one(engine, attrs.evolve(spec, job_id=next(_ids), token_healing=False))
        assert plain.text == " dog dog dog dog"
    finally:
        engine.close()


# --- the prefix cache ------------------------------------------------------------

STORY = (
    "Chapter {n}. The lighthouse keeper of the northern cape kept a logbook of every ship"
    " that passed, every storm that broke against the rocks, and every letter the supply"
    " boat brought. In the spring of that year the boat brought a stranger instead, a"
    " surveyor with a brass theodolite and a habit of humming while he worked."
)


def story_chat(n: int, question: str) -> str:
    """A chat whose first turn is long enough for several prefix-cache blocks,
    with a number that keeps other tests' prompts from sharing its blocks."""
    return chat(STORY.format(n=n) + " " + question)


#: How a 200-token prompt may reach the KV cache: in one chunk; resumed after
#: a cached prefix (of whole 64-token blocks or not); in chunks that end
#: inside a bucket; its last positions fed by decode steps.
SCHEDULES = [
    [(0, 200)],
    [(0, 10), (10, 200)],
    [(0, 37), (37, 200)],
    [(0, 64), (64, 128), (128, 200)],
    [(0, 100), (100, 200)],
    [(0, 5), (5, 77), (77, 130), (130, 200)],
    [(0, 128), (128, 150), (150, 200)],
    [(0, 150), (150, 190), *((p, p + 1) for p in range(190, 200))],
    [(0, 160), *((p, p + 1) for p in range(160, 200))],
]


@pytest.mark.parametrize("quantized", [False, True], ids=["bfloat16", "int8"])
def test_a_positions_keys_do_not_depend_on_how_its_prompt_was_cut(
    cpu_engine: CpuEngine, quantized: bool
) -> None:
    """What the prefix cache and batch invariance rest on, on the real model
    (head size 64: toy models' 16 hid a difference on AVX2): every position's
    keys and values, and the last hidden state, come out bit for bit the same
    however the prompt was cut into chunks and decode steps."""
    weights, config = cpu_engine._weights, cpu_engine._config
    assert weights is not None
    ids = torch.randint(0, config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(3))
    rope = llama.rope_tables(config, 256, CPU)
    results = []
    for schedule in SCHEDULES:
        cache = llama.KVCache(
            config.n_layers,
            config.n_kv_heads,
            config.head_dim,
            torch.bfloat16,
            CPU,
            quantized=quantized,
        )
        cache.fit(1, 256)
        with torch.inference_mode():
            for start, end in schedule:
                hidden = llama.forward(
                    weights,
                    config,
                    cache,
                    rope,
                    ids[:, start:end],
                    torch.arange(start, end)[None],
                    torch.tensor([0]),
                )
        results.append((cache.kv[:, 0, :, :200].clone(), hidden))
    for schedule, (kv, hidden) in zip(SCHEDULES[1:], results[1:], strict=True):
        if quantized and not weights.native_norm and not torch.equal(kv, results[0][0]):
            # Seen on an AVX2-only AMD EPYC (Zen 2) with torch's operators
            # (TRIOSERVE_NATIVE=0): one position's attention output in one
            # layer differs in its last bit between two cuts of the prompt,
            # and the 8-bit cache's rounding carries that into later layers.
            # The native kernels and the bfloat16 cache are exact there.
            pytest.xfail(f"torch's operators with the 8-bit cache on this CPU: {schedule[:3]}")
        assert torch.equal(kv, results[0][0]), schedule[:3]
        assert torch.equal(hidden, results[0][1]), schedule[:3]


def test_a_reused_prefix_gives_the_same_greedy_text(cpu_engine: CpuEngine) -> None:
    spec = make_spec(cpu_engine, story_chat(101, "Who came on the boat?"), 12)
    before = cpu_engine.statistics().prefix_cache
    cold = run_one(cpu_engine, spec)
    assert cold.finished.cached_tokens == 0
    warm = run_one(cpu_engine, attrs.evolve(spec, job_id=next(_ids)))
    after = cpu_engine.statistics().prefix_cache
    # Every whole block before the last prompt token came from the cache.
    block = after.block_tokens
    assert warm.finished.cached_tokens == (len(spec.prompt_ids) - 1) // block * block > 0
    assert warm.finished.prompt_tokens == cold.finished.prompt_tokens
    assert warm.chunks == cold.chunks
    assert after.hits == before.hits + 1
    assert after.hit_tokens == before.hit_tokens + warm.finished.cached_tokens
    assert 0 < after.bytes <= after.capacity_bytes


@pytest.mark.slow
def test_a_chats_next_turn_reuses_the_answer_and_matches_a_cold_run(
    cpu_engine: CpuEngine, model_dir: Path
) -> None:
    """The next turn's prompt holds the first turn's prompt and answer; the
    answer's keys and values were computed one decode step at a time, the cold
    run computes them in a prefill chunk, and the greedy text is the same."""
    first = make_spec(cpu_engine, story_chat(102, "Describe the surveyor."), 40)
    answer = run_one(cpu_engine, first)
    assert answer.finished.generated_tokens > 8
    history = story_chat(102, "Describe the surveyor.") + answer.text
    second_prompt = history + "<|im_end|>\n<|im_start|>user\nAnd the keeper?<|im_end|>\n"
    second = make_spec(cpu_engine, second_prompt + "<|im_start|>assistant\n", 12)
    warm = run_one(cpu_engine, second)
    assert warm.finished.cached_tokens > len(first.prompt_ids)
    cold_engine = CpuEngine.load(model_dir, max_batch=2, prefix_cache_mib=0)
    try:
        cold = run_one(cold_engine, attrs.evolve(second, job_id=next(_ids)))
        assert cold.finished.cached_tokens == 0
        assert cold_engine.statistics().prefix_cache.blocks == 0
    finally:
        cold_engine.close()
    assert warm.chunks == cold.chunks


@pytest.mark.slow
def test_reuse_keeps_batch_invariance(cpu_engine: CpuEngine) -> None:
    """Eight jobs sharing a long first part run together (nothing cached yet
    for them), then each alone (served from the cache): same greedy text."""
    questions = ["Who is the keeper?", "What did the boat bring?", "Name the season.", "Why?"]
    specs = [make_spec(cpu_engine, story_chat(103, q), 10) for q in questions * 2]
    together = run_all(cpu_engine, specs)
    assert all(together[s.job_id].finished.cached_tokens == 0 for s in specs[:1])
    for spec in specs:
        alone = run_one(cpu_engine, attrs.evolve(spec, job_id=next(_ids)))
        assert alone.finished.cached_tokens > 0
        assert alone.chunks == together[spec.job_id].chunks


def test_statistics_report_jobs_and_memory(cpu_engine: CpuEngine) -> None:
    stats = cpu_engine.statistics()
    assert (stats.running_jobs, stats.waiting_jobs, stats.kv_cache_bytes) == (0, 0, 0)
    assert stats.weight_bytes > 0
    assert stats.prefix_cache.capacity_bytes == CpuOptions().prefix_cache_bytes
    spec = make_spec(cpu_engine, chat("Name a color."), 4)
    cpu_engine.step([spec], [])
    running = cpu_engine.statistics()
    assert running.running_jobs == 1
    assert running.kv_cache_bytes > 0
    cpu_engine.step([], [spec.job_id])
    assert cpu_engine.statistics().running_jobs == 0


def test_the_default_model_runs_on_its_4bit_weights(cpu_engine: CpuEngine) -> None:
    weights = cpu_engine._weights
    assert weights is not None
    # trioserve's own 4-bit kernel where it builds here, else torch's.
    kind = "q4" if native.kernel() is None else "q4 native"
    assert weights.kinds() == {kind: 4 * 30}
    assert weights.native_norm == (native.kernel() is not None)


# --- quality of the 4-bit path ------------------------------------------------------

#: A fixed English text for the perplexity guard (88 tokens).
PERPLEXITY_TEXT = (
    "The river town grew around a ford, a mill and a Thursday market. Farmers brought grain"
    " and wool; merchants brought salt, iron and news from the coast. Over three centuries the"
    " bridge was rebuilt four times, the mill became a paper works, and the market moved"
    " indoors, but the Thursday crowd never stopped coming. Today the paper works is a museum,"
    " and on Thursdays children still follow their grandparents across the old stone bridge."
)


def _q4_and_bfloat16_nlls(model_dir: Path, ids: Sequence[int]) -> list[torch.Tensor]:
    """The NLL of each of ``ids[1:]`` on the 4-bit path and on the bfloat16
    one, logits in float32."""
    config = llama.LlamaConfig.from_dir(model_dir)
    nlls = []
    for mode in ("auto", "float"):
        weights = llama.LlamaWeights.load(model_dir, config, CpuOptions(weights=mode))
        nlls.append(token_nlls(model_dir, weights, ids, logits=_float32_logits))
        del weights
    return nlls


def _float32_logits(weights: llama.LlamaWeights, hidden: torch.Tensor) -> torch.Tensor:
    return hidden.float() @ weights.lm_head.float().T


#: About 960 tokens of English prose written for the perplexity guards.
PERPLEXITY_FILE = Path(__file__).parent / "data" / "perplexity.txt"


def test_4bit_perplexity_is_within_one_percent_of_bfloat16(
    cpu_engine: CpuEngine, model_dir: Path
) -> None:
    """The quality guard of issue 13. The bfloat16 path runs the GGUF's 4-bit
    weights dequantized (through float16, rounded to bfloat16); the 4-bit path
    runs the groups themselves (bfloat16 scales on torch's kernel, float16 on
    trioserve's). Over about 960 tokens, so that 1 % means something on every
    instruction set (:func:`tests.direct.perplexity_ratio`). Measured: see
    docs/performance.md."""
    ids = [cpu_engine.info.bos_token_id or 1]
    ids += cpu_engine.encode(PERPLEXITY_FILE.read_text(encoding="utf-8"))
    q4, bf16 = _q4_and_bfloat16_nlls(model_dir, ids)
    assert 1.0 < math.exp(float(bf16.mean())) < 100.0  # a real model on English prose
    ratio = perplexity_ratio(q4, bf16, 0.01)
    assert abs(ratio - 1) <= 0.01, ratio


def _long_prompt(engine: CpuEngine, salt: int) -> str:
    """A chat prompt of more than two prefill chunks (about 1,400 tokens)."""
    text = chat(" ".join(STORY.format(n=salt * 100 + i) for i in range(20)) + " Who came?")
    assert len(engine.encode(text)) > 2 * engine.prefill_chunk
    return text


def _tokens_streamed_during_prefill(engine: CpuEngine, salt: int) -> tuple[int, int, Outcome]:
    """A stream runs; a long prompt arrives. Returns how many tokens the stream
    got before the long prompt's first token, the prompt's chunks, and its outcome."""
    stream = make_spec(engine, chat(f"Count slowly from 1 to {salt}."), 2000, stop_token_ids=())
    engine.step([stream], [])
    long = make_spec(engine, _long_prompt(engine, salt), 4)
    chunks = -(-len(long.prompt_ids) // engine.prefill_chunk)
    streamed = 0
    outcome = Outcome()
    submit = [long]
    while not outcome.updates:
        for update in engine.step(submit, []):
            if update.job_id == long.job_id:
                outcome.updates.append(update)
            else:
                assert isinstance(update, TextUpdate), update  # 2,000 tokens outlast the prefill
                streamed += 1
        submit = []
    cancel = [stream.job_id]
    while not isinstance(outcome.end, Finished):
        outcome.updates.extend(u for u in engine.step([], cancel) if u.job_id == long.job_id)
        cancel = []
    return streamed, chunks, outcome


@pytest.mark.slow
def test_prefill_takes_its_share_and_the_streams_keep_decoding(cpu_engine: CpuEngine) -> None:
    """With the default share (0.5), a long prompt's chunks alternate with
    steps that decode the running stream alone; with a share of 1, every step
    runs a chunk. Which step runs a chunk changes none of the prompt's numbers."""
    assert cpu_engine.prefill_share == 0.5
    deferrals = cpu_engine.statistics().prefill_deferrals
    streamed, chunks, shared = _tokens_streamed_during_prefill(cpu_engine, 1)
    # A 512-token chunk takes far longer than a one-row decode step, so after
    # each chunk the stream gets steps of its own.
    assert streamed > chunks
    assert cpu_engine.statistics().prefill_deferrals - deferrals >= streamed - chunks
    cpu_engine.prefill_share = 1.0
    try:
        every, chunks_1, _ = _tokens_streamed_during_prefill(cpu_engine, 2)
    finally:
        cpu_engine.prefill_share = 0.5
    assert every == chunks_1
    alone = run_one(cpu_engine, make_spec(cpu_engine, _long_prompt(cpu_engine, 1), 4))
    assert alone.chunks == shared.chunks


def test_prefill_share_must_be_a_share(model_dir: Path) -> None:
    for share in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="prefill_share"):
            CpuEngine.load(model_dir, prefill_share=share)


@pytest.mark.slow
def test_a_short_prompt_is_not_queued_behind_a_long_ones_chunks(cpu_engine: CpuEngine) -> None:
    """A short prompt that arrives while a long one is being prefilled gets its
    first token from the next step, which runs no chunk of the long one; the
    long one goes on from the step after, and both texts are as alone."""
    long = make_spec(cpu_engine, _long_prompt(cpu_engine, 3), 4)
    chunks = -(-len(long.prompt_ids) // cpu_engine.prefill_chunk)
    cpu_engine.prefill_share = 1.0  # no deferral: the steps are countable
    try:
        outcomes = _short_beside_long(cpu_engine, long, chunks)
    finally:
        cpu_engine.prefill_share = 0.5
    for spec, outcome in outcomes:
        alone = run_one(cpu_engine, attrs.evolve(spec, job_id=next(_ids)))
        assert alone.chunks == outcome.chunks


def _short_beside_long(
    cpu_engine: CpuEngine, long: GenerationSpec, chunks: int
) -> list[tuple[GenerationSpec, Outcome]]:
    assert cpu_engine.step([long], []) == []  # the first chunk
    short = make_spec(cpu_engine, chat("Name a color."), 4)
    first = cpu_engine.step([short], [])
    assert [update.job_id for update in first] == [short.job_id]
    outcomes = {long.job_id: Outcome(), short.job_id: Outcome(first)}
    steps = 0
    while not all(o.updates and isinstance(o.end, Finished) for o in outcomes.values()):
        steps += 1
        for update in cpu_engine.step([], []):
            outcomes[update.job_id].updates.append(update)
            if update.job_id == long.job_id and len(outcomes[long.job_id].updates) == 1:
                # Its other chunks, one step each, the last one with its first token.
                assert steps == chunks - 1
    return [(long, outcomes[long.job_id]), (short, outcomes[short.job_id])]


# -- the samplers of ExLlamaV2's front ends, on the real model ---------------------------

WARM = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, rep_pen=1.0)


def longest_repeat(ids: Sequence[int]) -> int:
    """The length of the longest run of ids that occurs twice (or overlaps itself)."""
    longest = 0
    for length in range(1, len(ids)):
        grams = [tuple(ids[i : i + length]) for i in range(len(ids) - length + 1)]
        if len(set(grams)) == len(grams):
            break
        longest = length
    return longest


@pytest.mark.slow
def test_dry_stops_a_greedy_loop(cpu_engine: CpuEngine) -> None:
    prompt = "I like cats. I like dogs. I like"
    loop = run_one(cpu_engine, make_spec(cpu_engine, prompt, 48)).text
    # Greedy falls into a loop: the same sentence again and again.
    assert loop.count(" I'm a cat.") >= 5, loop
    assert longest_repeat(cpu_engine.encode(loop)) >= 20
    dry = attrs.evolve(GREEDY, dry_multiplier=0.8, dry_sequence_breakers=("\n",))
    free = run_one(cpu_engine, make_spec(cpu_engine, prompt, 48, sampling=dry)).text
    assert free.count(" I'm a cat.") <= 1, free
    assert longest_repeat(cpu_engine.encode(free)) <= 6, free
    # Off by default: the same greedy text.
    assert run_one(cpu_engine, make_spec(cpu_engine, prompt, 48)).text == loop


@pytest.fixture(scope="module")
def model(model_dir: Path) -> tuple[llama.LlamaConfig, llama.LlamaWeights]:
    config = llama.LlamaConfig.from_dir(model_dir)
    weights = llama.LlamaWeights.load(model_dir, config, CpuOptions())
    return config, weights


def sampled_surprises(
    model: tuple[llama.LlamaConfig, llama.LlamaWeights],
    prompt: Sequence[int],
    n: int,
    settings: SamplingSettings,
    seed: int,
) -> list[float]:
    """Sample n tokens from the model functions and the real sampler, one at a
    time with the job's RowState, as the engine does; the surprise (-log2 p)
    of each drawn token in the distribution it was drawn from."""
    from trioserve.engine.sampling import RowState, distribution, make_generator, sample

    config, weights = model
    cpu = torch.device("cpu")
    cache = llama.KVCache(config.n_layers, config.n_kv_heads, config.head_dim, torch.bfloat16, cpu)
    cache.fit(1, len(prompt) + n)
    rope = llama.rope_tables(config, len(prompt) + n, cpu)
    slot = torch.tensor([0])
    state = RowState()
    generator = make_generator(seed)
    surprises = []
    with torch.inference_mode():
        hidden = llama.forward(
            weights,
            config,
            cache,
            rope,
            torch.tensor([list(prompt)]),
            torch.arange(len(prompt))[None],
            slot,
        )
        logits = llama.logits(weights, hidden)
        for position in range(len(prompt), len(prompt) + n):
            probs = distribution(logits, [settings], states=[state])
            token = int(sample(logits, [settings], [generator], states=[state])[0])
            surprises.append(-math.log2(float(probs[0, token])))
            logits = llama.decode_logits(
                weights,
                config,
                cache,
                rope,
                torch.tensor([token]),
                torch.tensor([position]),
                slot,
            )
    return surprises


@pytest.mark.slow
def test_mirostat_keeps_the_surprise_near_tau(
    cpu_engine: CpuEngine, model: tuple[llama.LlamaConfig, llama.LlamaWeights]
) -> None:
    prompt = cpu_engine.encode(chat("Write a short story about a robot."))
    free = sampled_surprises(model, prompt, 96, WARM, seed=1)
    # The model's own surprise is far from the target...
    assert sum(free) / len(free) > 2.8
    for tau in (2.0, 3.0):
        miro = attrs.evolve(WARM, mirostat=True, mirostat_tau=tau, mirostat_eta=0.3)
        # ...mirostat brings it there: over 96 tokens, while mu settles, a
        # run's mean is about 0.1 bit below tau at 2 and 0.14-0.22 below at 3
        # (12 seeds, AVX-512 native kernels and torch's on AVX2), with a
        # standard deviation of 0.05-0.06 bit. Mirostat can only cut choices,
        # not add surprise, so a run that wanders into text the model finds
        # predictable stays below tau whatever it does: one of the 12 did on
        # AVX2 (2.21 at tau 3). The median of three runs is robust to one.
        means = [
            statistics.mean(sampled_surprises(model, prompt, 96, miro, seed=seed))
            for seed in (1, 2, 3)
        ]
        assert abs(statistics.median(means) - tau) < 0.3, (tau, means)


@pytest.mark.slow
def test_xtc_removes_the_top_choice_when_it_fires(
    cpu_engine: CpuEngine, model: tuple[llama.LlamaConfig, llama.LlamaWeights]
) -> None:
    prompt = chat("Tell me a joke.")
    probs = torch.softmax(greedy_logits(model, cpu_engine.encode(prompt)), dim=0)
    top, second = torch.topk(probs, 2).values.tolist()
    # Two first tokens over a 0.1 threshold: "What" (the top choice) and "A".
    assert top > 0.2 and second > 0.12, (top, second)
    greedy_first = run_one(cpu_engine, make_spec(cpu_engine, prompt, 1)).text
    xtc = attrs.evolve(WARM, xtc_probability=1.0, xtc_threshold=0.1)
    plain = [
        run_one(cpu_engine, make_spec(cpu_engine, prompt, 1, sampling=attrs.evolve(WARM, seed=s)))
        for s in range(12)
    ]
    excluded = [
        run_one(cpu_engine, make_spec(cpu_engine, prompt, 1, sampling=attrs.evolve(xtc, seed=s)))
        for s in range(12)
    ]
    assert greedy_first in [o.text for o in plain]
    assert greedy_first not in [o.text for o in excluded]


def greedy_logits(
    model: tuple[llama.LlamaConfig, llama.LlamaWeights], prompt: Sequence[int]
) -> torch.Tensor:
    """The model's float32 logits for the token after ``prompt``."""
    config, weights = model
    cpu = torch.device("cpu")
    cache = llama.KVCache(config.n_layers, config.n_kv_heads, config.head_dim, torch.bfloat16, cpu)
    cache.fit(1, len(prompt))
    rope = llama.rope_tables(config, len(prompt), cpu)
    with torch.inference_mode():
        hidden = llama.forward(
            weights,
            config,
            cache,
            rope,
            torch.tensor([list(prompt)]),
            torch.arange(len(prompt))[None],
            torch.tensor([0]),
        )
        return llama.logits(weights, hidden)[0].float()


def test_logit_bias_bans_and_forces(cpu_engine: CpuEngine) -> None:
    prompt = chat("What is the capital of France?")
    answer = run_one(cpu_engine, make_spec(cpu_engine, prompt, 12)).text
    assert "Paris" in answer
    (paris,) = cpu_engine.encode(" Paris")
    banned = attrs.evolve(GREEDY, logit_bias=((paris, -100.0),))
    assert (
        "Paris" not in run_one(cpu_engine, make_spec(cpu_engine, prompt, 12, sampling=banned)).text
    )
    (london,) = cpu_engine.encode(" London")
    forced = attrs.evolve(WARM, logit_bias=((london, 100.0),), seed=3)
    assert run_one(cpu_engine, make_spec(cpu_engine, prompt, 4, sampling=forced)).text == (
        " London" * 4
    )


def test_rows_with_different_samplers_match_their_runs_alone(cpu_engine: CpuEngine) -> None:
    prompts = [chat("Tell me a joke."), "I like cats. I like dogs. I like", chat("Name a fruit.")]
    mixes = [
        attrs.evolve(GREEDY, dry_multiplier=0.8, dry_sequence_breakers=("\n",)),
        attrs.evolve(WARM, xtc_probability=0.5, xtc_threshold=0.1, seed=1),
        attrs.evolve(WARM, mirostat=True, mirostat_tau=2.0, seed=2),
        attrs.evolve(WARM, min_temp=0.5, max_temp=1.5, smoothing_factor=0.3, seed=3),
        attrs.evolve(GREEDY, logit_bias=((cpu_engine.encode(" I")[0], -100.0),)),
        GREEDY,
    ]

    def specs() -> list[GenerationSpec]:
        return [
            make_spec(cpu_engine, prompts[i % len(prompts)], 12, sampling=s)
            for i, s in enumerate(mixes)
        ]

    together = run_all(cpu_engine, specs())
    alone = [run_one(cpu_engine, spec) for spec in specs()]
    assert [o.text for o in together.values()] == [o.text for o in alone]


def test_a_job_with_a_bias_outside_the_vocabulary_fails_alone(cpu_engine: CpuEngine) -> None:
    good = make_spec(cpu_engine, chat("Hi"), 4)
    bad = make_spec(
        cpu_engine, chat("Hi"), 4, sampling=attrs.evolve(GREEDY, logit_bias=((10**9, 1.0),))
    )
    outcomes = run_all(cpu_engine, [good, bad])
    failed = outcomes[bad.job_id].end
    assert isinstance(failed, Failed)
    assert failed.message == "logit_bias ids must be in [0, 49152), got 1000000000"
    assert isinstance(outcomes[good.job_id].end, Finished)
