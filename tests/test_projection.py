"""The 8-bit vocabulary projection (docs/performance.md, "The 8-bit vocabulary projection").

The last matmul of a decode step, hidden states to logits, reads the whole
lm_head; an 8-bit copy with one scale per vocabulary row halves that read.
Its logits are within a bound of the exact ones (the margin of the float32
refinement widens by twice that bound), so the greedy choice stays the
bfloat16 path's, and the likelihood of real text moves by far less than the
4-bit layers' own effect.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.direct import greedy_ids, mean_nll
from tests.test_cpu_engine import PERPLEXITY_TEXT, chat
from trioserve.engine.cpu import llama, native, quant
from trioserve.engine.cpu.engine import CpuEngine
from trioserve.engine.cpu.options import PROJECTIONS, CpuOptions
from trioserve.engine.tokenizer import Tokenizer
from trioserve.errors import ConfigError

CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    not quant.int8_available(), reason="this torch has no working _weight_int8pack_mm"
)


#: The 8-bit projection's kernels: torch's, and trioserve's where it runs.
KERNELS = [
    pytest.param(False, id="torch"),
    pytest.param(
        True,
        id="native",
        marks=pytest.mark.skipif(native.kernel() is None, reason="no native kernels here"),
    ),
]


def int8_model(
    vocab: int, width: int, seed: int, native_kernel: bool = False
) -> llama.LlamaWeights:
    """A bfloat16 lm_head of ``vocab`` rows, with an 8-bit projection of it."""
    g = torch.Generator().manual_seed(seed)
    # Rows of different sizes, as a real embedding has: each row's scale differs.
    head = (torch.randn(vocab, width, generator=g) * torch.rand(vocab, 1, generator=g)).bfloat16()
    proj = quant.int8_weight(head.float(), lambda w: w, native_kernel=native_kernel)
    assert isinstance(proj, quant.QuantizedWeight) and proj.native == native_kernel
    return llama.LlamaWeights(
        embed=head,
        layers=[],
        norm=torch.ones(width),
        lm_head=head,
        projection=proj,
        projection_error=llama.projection_error(proj),
        projection_input_error=llama.projection_input_error(proj),
    )


@pytest.mark.parametrize("native_kernel", KERNELS)
def test_8bit_logits_stay_within_their_bound_and_the_best_candidate_is_exact(
    native_kernel: bool,
) -> None:
    weights = int8_model(4096, 256, seed=1, native_kernel=native_kernel)
    g = torch.Generator().manual_seed(2)
    hidden = (torch.randn(16, 256, generator=g) * 3).bfloat16()
    exact = hidden.float() @ weights.lm_head.float().T
    raw = quant.linear(hidden, weights.projection).float()  # type: ignore[arg-type]
    h = hidden.float()
    bound = weights.projection_error * h.norm(dim=-1, keepdim=True)
    bound = bound + weights.projection_input_error * h.abs().amax(dim=-1, keepdim=True)
    # The bounds are on the weights' rounding and the kernel's 16-bit inputs;
    # the bfloat16 output adds half a bfloat16 step of the logit.
    assert ((raw - exact).abs() <= bound + exact.abs() * 2.0**-8).all()
    assert (raw != exact).any()  # the projection is not exact: the bound is needed
    out = llama.logits(weights, hidden)
    assert torch.equal(out.argmax(-1), exact.argmax(-1))
    top = exact.argmax(-1, keepdim=True)
    torch.testing.assert_close(out.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("native_kernel", KERNELS)
def test_a_row_of_8bit_logits_does_not_depend_on_the_other_rows(native_kernel: bool) -> None:
    weights = int8_model(1024, 128, seed=3, native_kernel=native_kernel)
    hidden = torch.randn(8, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    together = llama.logits(weights, hidden)
    for i in range(8):
        assert torch.equal(llama.logits(weights, hidden[i : i + 1])[0], together[i])


@pytest.mark.parametrize("vocab", [49152, 1000, 64, 63, 1])
def test_the_recheck_finds_the_candidates_a_full_comparison_would(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    for rows in (1, 3, 8):
        x = torch.randn(rows, vocab, generator=g)
        x[:, ::7] = 2.0  # ties at a floor of 2
        x[0, -1] = float("inf")
        x[-1, vocab // 2] = float("-inf")
        if rows > 1:
            x[1, vocab // 3] = float("nan")
        for floor in (
            x.amax(1, keepdim=True) - torch.rand(rows, 1, generator=g) * 3,  # NaN for row 1
            torch.full((rows, 1), 2.0),
            torch.full((rows, 1), float("-inf")),
        ):
            expected = (x >= floor).nonzero(as_tuple=True)
            found = llama._at_least(x, floor)
            assert torch.equal(found[0], expected[0]) and torch.equal(found[1], expected[1])


def _load(model_dir: Path, projection: str, weights: str = "auto") -> llama.LlamaWeights:
    config = llama.LlamaConfig.from_dir(model_dir)
    return llama.LlamaWeights.load(
        model_dir, config, CpuOptions(weights=weights, vocab_projection=projection)
    )


@pytest.fixture(scope="module")
def projections(model_dir: Path) -> dict[str, llama.LlamaWeights]:
    return {p: _load(model_dir, p) for p in ("bfloat16", "int8")}


def test_the_8bit_projection_halves_the_lm_heads_bytes(
    projections: dict[str, llama.LlamaWeights],
) -> None:
    bf16, int8 = projections["bfloat16"], projections["int8"]
    assert isinstance(int8.projection, quant.QuantizedWeight)
    assert int8.projection.kind == "int8"
    assert int8.projection_error > 0
    assert bf16.projection_error == 0
    head = bf16.lm_head.numel() * 2
    # The bfloat16 projection holds the table in memory, plus a second, packed
    # copy where oneDNN's packed kernel is exact (AVX-512); the 8-bit one holds
    # half a table, and the table itself is mapped from its file on every path.
    assert int8.embed_mapped and not bf16.embed_mapped
    packed = bf16.projection is not None
    assert bf16.nbytes - int8.nbytes >= (2 if packed else 1) * head - head // 2 - head // 64


def test_8bit_projection_perplexity_is_within_half_a_percent_of_bfloat16(
    model_dir: Path, projections: dict[str, llama.LlamaWeights]
) -> None:
    """Measured: 59.81 against 59.85 (0.07 % lower); docs/performance.md."""
    tokenizer = Tokenizer.from_dir(model_dir)
    ids = [tokenizer.bos_token_id or 1, *tokenizer.encode(PERPLEXITY_TEXT)]
    bf16 = mean_nll(model_dir, projections["bfloat16"], ids)
    int8 = mean_nll(model_dir, projections["int8"], ids)
    assert 1.0 < math.exp(bf16) < 100.0
    assert abs(math.exp(int8 - bf16) - 1) <= 0.005, (math.exp(int8), math.exp(bf16))


GREEDY_QUESTIONS = [
    "What is the capital of France?",
    "Name a color.",
    "Who wrote Hamlet? Answer in one long sentence with the year.",
    "Tell me a long story about a dragon who learns to bake bread.",
]


@pytest.mark.slow
def test_8bit_projection_gives_the_bfloat16_greedy_text(
    model_dir: Path, projections: dict[str, llama.LlamaWeights]
) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    for question in GREEDY_QUESTIONS:
        prompt = tokenizer.encode(chat(question))
        want = greedy_ids(model_dir, projections["bfloat16"], prompt, 24)
        assert greedy_ids(model_dir, projections["int8"], prompt, 24) == want, question


@pytest.mark.slow
def test_float_weights_keep_a_bfloat16_projection_unless_asked(model_dir: Path) -> None:
    assert _load(model_dir, "auto", weights="float").projection_error == 0
    asked = _load(model_dir, "int8", weights="float")
    assert isinstance(asked.projection, quant.QuantizedWeight)


def test_a_bad_projection_is_a_clear_error_before_any_file_is_read(tmp_path: Path) -> None:
    # tmp_path holds no model: the options are refused before it is looked at.
    with pytest.raises(ConfigError, match=r"vocab_projection must be one of .* got 'int4'"):
        CpuEngine.load(tmp_path, vocab_projection="int4")
    with pytest.raises(ConfigError, match="vocab_projection 'int8' needs dtype 'bfloat16'"):
        CpuEngine.load(tmp_path, dtype="float32", weights="float", vocab_projection="int8")


def test_the_command_line_offers_the_engines_projections() -> None:
    from trioserve.cli.options import OPTIONS
    from trioserve.engine import EngineOptions

    (option,) = [o for o in OPTIONS if o.name == "vocab_projection"]
    assert tuple(option.choices or ()) == PROJECTIONS
    assert EngineOptions(vocab_projection="int8").cpu().vocab_projection == "int8"
    with pytest.raises(ConfigError, match="vocab_projection must be one of"):
        EngineOptions(vocab_projection="int4")
