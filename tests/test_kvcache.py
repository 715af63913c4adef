"""The CPU engine's KV cache in 8 bits (``kv_cache_dtype="int8"``): the
quantization itself, and the engine's exactness with it (greedy text
batch-invariant, identical with and without the prefix cache) on the real
embedded model. Its perplexity and speed: docs/performance.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch

from tests.direct import perplexity_ratio, token_nlls
from tests.test_cpu_engine import (
    BATCH_QUESTIONS,
    PERPLEXITY_FILE,
    _ids,
    chat,
    make_spec,
    run_all,
    run_one,
    story_chat,
)
from trioserve.engine.cpu import llama
from trioserve.engine.cpu.engine import CpuEngine
from trioserve.engine.cpu.kvcache import KVCache, dequantize, quantize
from trioserve.errors import ConfigError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def int8_engine(model_dir: Path) -> Iterator[CpuEngine]:
    engine = CpuEngine.load(model_dir, max_batch=8, kv_cache_dtype="int8")
    yield engine
    engine.close()


# --- the quantization ---------------------------------------------------------------


def test_quantize_rounds_each_row_to_its_scale() -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(50, 64, generator=g) * torch.linspace(0.01, 8, 50)[:, None]).to(torch.bfloat16)
    x[7] = 0  # an all-zero row: its values stay 0
    packed = quantize(x)
    assert packed.dtype == torch.int8
    assert packed.shape == (50, 64 + 2)
    back = dequantize(packed, 64, torch.float32)
    scales = packed[:, 64:].view(torch.bfloat16).float()  # [N, 1]
    # Half a step at most, plus the bfloat16 rounding of the product.
    err = (back - x.float()).abs()
    assert bool((err <= scales / 2 + x.float().abs() * 2**-8 + 1e-12).all())
    assert bool((scales[:, 0] * 127 >= x.float().abs().amax(-1) * (1 - 2**-8)).all())
    assert not bool(back[7].any())
    assert dequantize(packed, 64, torch.bfloat16).dtype == torch.bfloat16


def test_int8_cache_reads_and_writes_rows_as_stored() -> None:
    cache = KVCache(2, 3, 64, torch.bfloat16, CPU, quantized=True)
    cache.fit(3, 20)
    assert cache.bytes_per_position == 2 * 2 * 3 * (64 + 2)  # 2 layers, 2K heads
    assert cache.nbytes == 3 * 256 * cache.bytes_per_position
    data = quantize(torch.randn(2 * 6 * 5, 64).to(torch.bfloat16)).view(2, 6, 5, 66)
    cache.write(2, 7, data)
    assert torch.equal(cache.read(2, 7, 12), data)  # the prefix cache's blocks stay 8-bit
    values = dequantize(data, 64, torch.bfloat16)
    assert torch.equal(cache.kv[:, 2, :, 7:12], values)
    cache.move(2, 0)
    assert torch.equal(cache.read(0, 7, 12), data)
    k, v = cache.attended(1, 0, torch.tensor([0]), 12)
    assert torch.equal(k[0, :, 7:12], values[1, :3])
    assert torch.equal(v[0, :, 7:12], values[1, 3:])


def test_int8_cache_is_about_half_of_bfloat16() -> None:
    float_cache = KVCache(30, 3, 64, torch.bfloat16, CPU)
    int8_cache = KVCache(30, 3, 64, torch.bfloat16, CPU, quantized=True)
    ratio = int8_cache.bytes_per_position / float_cache.bytes_per_position
    assert ratio == 66 / 128  # 64 int8 values and a bfloat16 scale against 64 bfloat16


def test_bad_kv_cache_dtype_is_a_clear_error(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"kv_cache_dtype .*'int4'"):
        CpuEngine.load(model_dir, kv_cache_dtype="int4")


# --- exactness on the real model ----------------------------------------------------


def test_int8_text_alone_equals_text_beside_seven_others(int8_engine: CpuEngine) -> None:
    specs = [make_spec(int8_engine, chat(q), 16) for q in BATCH_QUESTIONS]
    together = run_all(int8_engine, specs)
    for spec in specs:
        alone = run_one(int8_engine, attrs.evolve(spec, job_id=next(_ids)))
        assert alone.chunks == together[spec.job_id].chunks


def test_int8_reused_prefix_gives_the_same_greedy_text(int8_engine: CpuEngine) -> None:
    spec = make_spec(int8_engine, story_chat(201, "Who came on the boat?"), 12)
    cold = run_one(int8_engine, spec)
    assert cold.finished.cached_tokens == 0
    warm = run_one(int8_engine, attrs.evolve(spec, job_id=next(_ids)))
    assert warm.finished.cached_tokens > 0
    assert warm.chunks == cold.chunks
    stats = int8_engine.statistics().prefix_cache
    # The prefix cache keeps the 8-bit rows: a block costs 66/128 of a bfloat16 one.
    per_position = 2 * 30 * 3 * 66
    assert stats.bytes == stats.blocks * stats.block_tokens * per_position


def test_int8_cache_holds_about_half_the_bytes_while_jobs_run(
    cpu_engine: CpuEngine, int8_engine: CpuEngine
) -> None:
    sizes = []
    for engine in (cpu_engine, int8_engine):
        spec = make_spec(engine, chat("Name a color."), 4)
        engine.step([spec], [])
        sizes.append(engine.statistics().kv_cache_bytes)
        engine.step([], [spec.job_id])
    assert sizes[1] * 128 == sizes[0] * 66


def test_int8_perplexity_is_within_one_percent_of_bfloat16(
    cpu_engine: CpuEngine, model_dir: Path
) -> None:
    """Over the 960-token guard text (:func:`tests.direct.perplexity_ratio`);
    over four texts, 4,559 tokens, see docs/performance.md."""
    ids = [cpu_engine.info.bos_token_id or 1]
    ids += cpu_engine.encode(PERPLEXITY_FILE.read_text(encoding="utf-8"))
    weights = cpu_engine._weights
    assert weights is not None

    def nlls(quantized: bool) -> torch.Tensor:
        return token_nlls(model_dir, weights, ids, logits=llama.exact_logits, quantized=quantized)

    bf16, int8 = nlls(False), nlls(True)
    assert 1.0 < math.exp(float(bf16.mean())) < 100.0
    ratio = perplexity_ratio(int8, bf16, 0.01)
    assert abs(ratio - 1) <= 0.01, ratio
