"""The compact Llama model against a plain full-sequence implementation.

A small random model (float32) is run through the cached, chunked, batched
path and through a straightforward reference written here the textbook way
(K/V repeated per query head, ``is_causal`` attention, rotate-half rope, no
cache); both must give the same logits.
"""

from __future__ import annotations

import math
from typing import Literal

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from trioserve.engine.cpu import llama, native, quant
from trioserve.errors import ModelError

CONFIG = llama.LlamaConfig(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    n_layers=2,
    n_heads=6,
    n_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)
CPU = torch.device("cpu")


def random_weights(config: llama.LlamaConfig, seed: int = 0) -> llama.LlamaWeights:
    g = torch.Generator().manual_seed(seed)
    d, f = config.hidden_size, config.intermediate_size
    qkv_rows = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    layers = [
        llama.LayerWeights(
            attn_norm=1 + rand(d, scale=0.1),
            wqkv=rand(qkv_rows, d),
            wo=rand(d, config.n_heads * config.head_dim),
            mlp_norm=1 + rand(d, scale=0.1),
            w_gate_up=rand(2 * f, d),
            w_down=rand(d, f),
        )
        for _ in range(config.n_layers)
    ]
    embed = rand(config.vocab_size, d, scale=1.0)
    return llama.LlamaWeights(embed=embed, layers=layers, norm=1 + rand(d), lm_head=embed)


def to_bfloat16(layer: llama.LayerWeights) -> llama.LayerWeights:
    """The layer with bfloat16 matmul weights (norm weights stay float32)."""
    return attrs.evolve(
        layer,
        wqkv=as_tensor(layer.wqkv).bfloat16(),
        wo=as_tensor(layer.wo).bfloat16(),
        w_gate_up=as_tensor(layer.w_gate_up).bfloat16(),
        w_down=as_tensor(layer.w_down).bfloat16(),
    )


def as_tensor(w: quant.Linear) -> torch.Tensor:
    assert isinstance(w, torch.Tensor)
    return w


def dense(w: quant.Linear) -> torch.Tensor:
    """The float32 weights of a plain or quantized linear layer."""
    if isinstance(w, quant.QuantizedWeight):
        return quant.dequantize(w, torch.float32)
    return w.float()


def reference_logits(
    weights: llama.LlamaWeights, config: llama.LlamaConfig, ids: list[int]
) -> torch.Tensor:
    """Logits [T, V] of every position, computed without a cache."""
    h, k, e = config.n_heads, config.n_kv_heads, config.head_dim
    t = len(ids)
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, e, 2, dtype=torch.float64) / e)
    angles = torch.outer(torch.arange(t, dtype=torch.float64), inv_freq).float()
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, -1)
        return torch.cat([-x2, x1], -1)

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * w

    x = weights.embed[torch.tensor(ids)].float()
    for layer in weights.layers:
        y = norm(x, layer.attn_norm) @ dense(layer.wqkv).T
        q, kk, v = torch.split(y, [h * e, k * e, k * e], dim=-1)
        q = q.view(t, h, e).transpose(0, 1)
        kk = kk.view(t, k, e).transpose(0, 1)
        v = v.view(t, k, e).transpose(0, 1)
        q = q * cos + rotate_half(q) * sin
        kk = kk * cos + rotate_half(kk) * sin
        kk = kk.repeat_interleave(h // k, 0)
        v = v.repeat_interleave(h // k, 0)
        att = F.scaled_dot_product_attention(q, kk, v, is_causal=True)
        x = x + att.transpose(0, 1).reshape(t, h * e) @ dense(layer.wo).T
        gate, up = (norm(x, layer.mlp_norm) @ dense(layer.w_gate_up).T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ dense(layer.w_down).T
    return norm(x, weights.norm) @ weights.lm_head.float().T


def new_cache() -> llama.KVCache:
    return llama.KVCache(CONFIG.n_layers, CONFIG.n_kv_heads, CONFIG.head_dim, torch.float32, CPU)


def prefill(
    weights: llama.LlamaWeights,
    cache: llama.KVCache,
    rope: tuple[torch.Tensor, torch.Tensor],
    ids: list[int],
    slot: int,
    chunk: int,
) -> torch.Tensor:
    hidden = torch.empty(0)
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        hidden = llama.forward(
            weights,
            CONFIG,
            cache,
            rope,
            torch.tensor([part]),
            torch.arange(start, start + len(part))[None],
            torch.tensor([slot]),
        )
    return llama.logits(weights, hidden)[0]


@given(
    ids=st.lists(st.integers(0, CONFIG.vocab_size - 1), min_size=1, max_size=40),
    chunk=st.integers(1, 16),
)
def test_chunked_prefill_matches_the_reference(ids: list[int], chunk: int) -> None:
    weights = random_weights(CONFIG)
    cache = new_cache()
    cache.fit(2, len(ids))
    rope = llama.rope_tables(CONFIG, 64, CPU)
    with torch.inference_mode():
        got = prefill(weights, cache, rope, ids, slot=1, chunk=chunk)
        want = reference_logits(weights, CONFIG, ids)[-1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_batched_decode_over_uneven_slots_matches_each_sequence_alone() -> None:
    weights = random_weights(CONFIG, seed=1)
    rope = llama.rope_tables(CONFIG, 64, CPU)
    cache = new_cache()
    prompts = [[5, 9, 14], [3] * 11, [40, 41, 42, 43, 44, 45, 1]]
    continuations = [[7, 8, 9, 10], [11, 12, 13, 14], [1, 2, 3, 4]]
    with torch.inference_mode():
        cache.fit(3, 20)
        for slot, prompt in enumerate(prompts):
            prefill(weights, cache, rope, prompt, slot, chunk=4)
        lengths = [len(p) for p in prompts]
        for step in range(4):
            tokens = torch.tensor([c[step] for c in continuations])
            positions = torch.tensor(lengths)
            out = llama.decode_logits(
                weights, CONFIG, cache, rope, tokens, positions, torch.arange(3)
            )
            for row in range(3):
                full = prompts[row] + continuations[row][: step + 1]
                want = reference_logits(weights, CONFIG, full)[-1]
                torch.testing.assert_close(out[row], want, rtol=1e-4, atol=1e-4)
            lengths = [n + 1 for n in lengths]


def test_decode_over_scattered_slots_and_after_a_move() -> None:
    weights = random_weights(CONFIG, seed=2)
    rope = llama.rope_tables(CONFIG, 64, CPU)
    cache = new_cache()
    a, b = [1, 2, 3, 4, 5], [9, 8, 7]
    with torch.inference_mode():
        cache.fit(4, 8)
        prefill(weights, cache, rope, a, slot=0, chunk=8)
        prefill(weights, cache, rope, b, slot=3, chunk=8)
        # Rows in non-consecutive slots take the gathered path.
        out = llama.decode_logits(
            weights,
            CONFIG,
            cache,
            rope,
            torch.tensor([6, 6]),
            torch.tensor([5, 3]),
            torch.tensor([0, 3]),
        )
        want_a = reference_logits(weights, CONFIG, [*a, 6])[-1]
        want_b = reference_logits(weights, CONFIG, [*b, 6])[-1]
        torch.testing.assert_close(out[0], want_a, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out[1], want_b, rtol=1e-4, atol=1e-4)
        # Moving a slot and growing the cache keep its contents.
        cache.move(3, 1)
        cache.fit(4, 300)
        assert cache.length == 512
        out = llama.decode_logits(
            weights, CONFIG, cache, rope, torch.tensor([2]), torch.tensor([4]), torch.tensor([1])
        )
        want = reference_logits(weights, CONFIG, [*b, 6, 2])[-1]
        torch.testing.assert_close(out[0], want, rtol=1e-4, atol=1e-4)


def test_cache_grows_in_blocks_and_gives_memory_back() -> None:
    cache = new_cache()
    assert cache.nbytes == 0
    cache.fit(1, 10)
    assert (cache.slots, cache.length) == (1, 256)
    cache.fit(3, 257)
    assert (cache.slots, cache.length) == (3, 512)
    data = torch.full((CONFIG.n_layers, 2 * CONFIG.n_kv_heads, 5, CONFIG.head_dim), 7.0)
    cache.write(0, 0, data)
    cache.fit(4, 600)  # grows layer by layer, keeping every slot's contents
    assert (cache.slots, cache.length) == (4, 768)
    assert torch.equal(cache.read(0, 0, 5), data)
    assert bool((cache.k[:, 0, :, :5] == 7.0).all())
    cache.fit(1, 20)  # the long jobs left
    assert (cache.slots, cache.length) == (1, 256)
    assert bool((cache.k[:, 0, :, :5] == 7.0).all())
    per_position = 2 * CONFIG.n_layers * CONFIG.n_kv_heads * CONFIG.head_dim * 4
    assert cache.nbytes == per_position * 256
    cache.release()
    assert cache.nbytes == 0


def test_bfloat16_logits_refine_the_top_candidates_exactly() -> None:
    weights = random_weights(CONFIG, seed=3)
    bf16 = llama.LlamaWeights(
        embed=weights.embed.bfloat16(),
        layers=weights.layers,
        norm=weights.norm.bfloat16(),
        lm_head=weights.lm_head.bfloat16(),
    )
    hidden = torch.randn(2, CONFIG.hidden_size).bfloat16()
    out = llama.logits(bf16, hidden)
    exact = hidden.float() @ bf16.lm_head.float().T
    # The best candidate and everything near it are exact.
    top = exact.topk(1, dim=-1).indices
    torch.testing.assert_close(out.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(out.argmax(-1), exact.argmax(-1))


def test_llama3_rope_scaling_keeps_high_and_slows_low_frequencies() -> None:
    base = attrs.evolve(CONFIG, head_dim=128, rope_theta=500000.0)
    scaled = llama.LlamaConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 128,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert scaled.rope_scaling is not None
    cos_base, sin_base = llama.rope_tables(base, 2, CPU)
    cos_scaled, sin_scaled = llama.rope_tables(scaled, 2, CPU)
    # Position 1's angles are the frequencies (the second half of the tables
    # holds +sin).
    half = base.head_dim // 2
    freq_base = torch.atan2(sin_base[1, half:], cos_base[1, half:])
    freq_scaled = torch.atan2(sin_scaled[1, half:], cos_scaled[1, half:])
    assert math.isclose(float(freq_scaled[0]), float(freq_base[0]), rel_tol=1e-6)
    assert math.isclose(float(freq_scaled[-1]), float(freq_base[-1]) / 8, rel_tol=1e-4)
    assert bool((freq_scaled <= freq_base + 1e-7).all())


def test_unsupported_architecture_is_named() -> None:
    with pytest.raises(ModelError, match="MambaForCausalLM"):
        llama.LlamaConfig.from_dict({"architectures": ["MambaForCausalLM"], "model_type": "mamba"})
    with pytest.raises(ModelError, match="rope_scaling type 'yarn'"):
        llama.LlamaConfig.from_dict(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
            }
        )
    with pytest.raises(ModelError, match=r"lacks .num_attention_heads"):
        llama.LlamaConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 10})


def test_packed_bfloat16_weights_give_the_plain_results_bit_for_bit() -> None:
    plain = random_weights(CONFIG, seed=4)
    bf16_layers = [to_bfloat16(layer) for layer in plain.layers]
    embed = plain.embed.bfloat16()
    unpacked = llama.LlamaWeights(embed=embed, layers=bf16_layers, norm=plain.norm, lm_head=embed)
    pack = quant.packer(torch.bfloat16, CPU, CONFIG.hidden_size)
    packed = llama.LlamaWeights(
        embed=embed,
        layers=[
            attrs.evolve(
                layer,
                wqkv=pack(as_tensor(layer.wqkv)),
                wo=pack(as_tensor(layer.wo)),
                w_gate_up=pack(as_tensor(layer.w_gate_up)),
                w_down=pack(as_tensor(layer.w_down)),
            )
            for layer in bf16_layers
        ],
        norm=unpacked.norm,
        lm_head=embed,
        projection=pack(embed),
    )
    if not as_tensor(packed.layers[0].wqkv).is_mkldnn:
        pytest.skip("this torch build does not pack weights (no exact oneDNN kernel)")
    rope = llama.rope_tables(CONFIG, 64, CPU)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])
    positions = torch.arange(8).expand(2, 8)
    results = []
    with torch.inference_mode():
        for weights in (unpacked, packed):
            cache = llama.KVCache(
                CONFIG.n_layers, CONFIG.n_kv_heads, CONFIG.head_dim, torch.bfloat16, CPU
            )
            cache.fit(2, 8)
            hidden = llama.forward(weights, CONFIG, cache, rope, ids, positions, torch.arange(2))
            results.append(llama.logits(weights, hidden))
    assert torch.equal(results[0], results[1])


# --- quantized weights ---------------------------------------------------------

Q4_CONFIG = attrs.evolve(
    CONFIG, hidden_size=64, intermediate_size=96, n_heads=4, n_kv_heads=2, head_dim=16
)


#: The 4-bit kernels a CPU may run: torch's (every x86-64 and ARM64 CPU, its
#: layout and arithmetic set by the instruction set torch dispatches to) and
#: trioserve's own (AVX-512 VNNI and BF16). Another instruction set of
#: torch's is a process-wide choice: ``nox -s isa`` runs the suite under it.
Q4_KERNELS = [
    "torch",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(
            native.kernel() is None, reason=f"native kernels: {native.unavailable_reason()}"
        ),
    ),
]


def q4_weights(
    config: llama.LlamaConfig, seed: int, kernel: Literal["native", "torch"] = "torch"
) -> llama.LlamaWeights:
    """Random 4-bit layers (as a GGUF's Q4_1 groups: d * q + m) with bfloat16
    embeddings, for ``kernel``; raises pytest's skip where the 4-bit kernel is
    missing."""
    g = torch.Generator().manual_seed(seed)
    d, f = config.hidden_size, config.intermediate_size
    qkv_rows = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim

    def q4(n: int, k: int) -> quant.Linear:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = torch.rand(n, k // quant.Q4_GROUP, generator=g) * 0.04 + 0.01
        low = -8 * scale + torch.randn(n, k // quant.Q4_GROUP, generator=g) * 0.01
        w = quant.q4_weight(q, scale, low, lambda t: t, kernel)
        if not isinstance(w, quant.QuantizedWeight):
            pytest.skip("this torch build has no working 4-bit CPU kernel")
        return w

    layers = [
        llama.LayerWeights(
            attn_norm=1 + torch.randn(d, generator=g) * 0.1,
            wqkv=q4(qkv_rows, d),
            wo=q4(d, config.n_heads * config.head_dim),
            mlp_norm=1 + torch.randn(d, generator=g) * 0.1,
            w_gate_up=q4(2 * f, d),
            w_down=q4(d, f),
        )
        for _ in range(config.n_layers)
    ]
    embed = torch.randn(config.vocab_size, d, generator=g).bfloat16()
    return llama.LlamaWeights(embed=embed, layers=layers, norm=torch.ones(d), lm_head=embed)


@pytest.mark.parametrize("kernel", Q4_KERNELS)
def test_q4_layers_compute_their_dequantized_weights(kernel: Literal["native", "torch"]) -> None:
    weights = q4_weights(Q4_CONFIG, seed=5, kernel=kernel)
    w = weights.layers[0].w_gate_up
    assert isinstance(w, quant.QuantizedWeight)
    x = torch.randn(5, Q4_CONFIG.hidden_size).bfloat16()
    exact = x.float() @ quant.dequantize(w, torch.float32).T
    got = quant.linear(x, w).float()
    # Only the bfloat16 output rounding (8-bit mantissa) stands between them.
    torch.testing.assert_close(got, exact, rtol=2**-7, atol=1e-2)
    # The bfloat16 dequantization is the float32 one rounded.
    assert torch.equal(quant.dequantize(w), quant.dequantize(w, torch.float32).bfloat16())


@pytest.mark.parametrize("kernel", Q4_KERNELS)
def test_q4_model_matches_the_reference_on_its_dequantized_weights(
    kernel: Literal["native", "torch"],
) -> None:
    weights = q4_weights(Q4_CONFIG, seed=6, kernel=kernel)
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    cache = llama.KVCache(
        Q4_CONFIG.n_layers, Q4_CONFIG.n_kv_heads, Q4_CONFIG.head_dim, torch.bfloat16, CPU
    )
    cache.fit(1, len(ids))
    rope = llama.rope_tables(Q4_CONFIG, 64, CPU)
    with torch.inference_mode():
        hidden = llama.forward(
            weights,
            Q4_CONFIG,
            cache,
            rope,
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            torch.tensor([0]),
        )
        got = llama.logits(weights, hidden)[0]
    want = reference_logits(weights, Q4_CONFIG, ids)[-1]
    # bfloat16 activations and KV against a float32 reference.
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())
    assert int(got.argmax()) == int(want.argmax())


@pytest.mark.parametrize("kernel", Q4_KERNELS)
def test_q4_rows_do_not_depend_on_the_chunk_they_run_in(kernel: Literal["native", "torch"]) -> None:
    """The property prefix reuse rests on: a position's keys and values, and
    the last hidden state, come out bit for bit the same whether the prompt
    runs in one chunk, resumes after a cached prefix at any split, or feeds
    its last positions one decode step at a time."""
    weights = q4_weights(Q4_CONFIG, seed=7, kernel=kernel)
    rope = llama.rope_tables(Q4_CONFIG, 128, CPU)
    ids = torch.randint(
        0, Q4_CONFIG.vocab_size, (1, 70), generator=torch.Generator().manual_seed(1)
    )
    schedules = [[(0, 70)], [(0, 37), (37, 70)], [(0, 64), (64, 70)]]
    schedules.append([(0, 60)] + [(p, p + 1) for p in range(60, 70)])
    caches, hiddens = [], []
    for schedule in schedules:
        cache = llama.KVCache(
            Q4_CONFIG.n_layers, Q4_CONFIG.n_kv_heads, Q4_CONFIG.head_dim, torch.bfloat16, CPU
        )
        cache.fit(2, 70)
        with torch.inference_mode():
            for start, end in schedule:
                hidden = llama.forward(
                    weights,
                    Q4_CONFIG,
                    cache,
                    rope,
                    ids[:, start:end],
                    torch.arange(start, end)[None],
                    torch.tensor([1]),
                )
        caches.append(cache.kv[:, 1, :, :70].clone())
        hiddens.append(hidden)
    for schedule, cache_kv, hidden in zip(schedules[1:], caches[1:], hiddens[1:], strict=True):
        assert torch.equal(cache_kv, caches[0]), schedule
        assert torch.equal(hidden, hiddens[0]), schedule


def test_q4_unpacking_reads_the_kernels_layout() -> None:
    """torch's packed layout depends on the instruction set it dispatches to
    (blocks of 64 rows with AVX-512, 32 with AVX2, pairs without either): the
    row counts cover whole blocks and narrower last ones of each."""
    for n in (16, 48, 64, 96, 192, 208):
        q = torch.randint(0, 16, (n, 64), generator=torch.Generator().manual_seed(n))
        data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        assert torch.equal(quant._q4_unpack(data, n, 64), q.to(torch.uint8))


def test_quantizing_at_load_stays_close_to_the_float_weights() -> None:
    g = torch.Generator().manual_seed(8)
    w = torch.randn(96, 64, generator=g) * 0.05
    q, d, m = quant.quantize_q4(w)
    assert int(q.max()) <= 15
    back = (q.view(96, -1, quant.Q4_GROUP).float() * d[..., None] + m[..., None]).view(96, 64)
    # Half a step of each group at most.
    steps = d.repeat_interleave(quant.Q4_GROUP, dim=1)
    assert bool(((back - w).abs() <= steps / 2 + 1e-6).all())
    int8 = quant.int8_weight(w, lambda t: t)
    if isinstance(int8, quant.QuantizedWeight):
        back8 = quant.dequantize(int8, torch.float32)
        assert float((back8 - w).abs().max()) <= float(w.abs().max()) / 127


def test_kv_cache_reads_and_writes_a_slots_positions() -> None:
    cache = new_cache()
    cache.fit(3, 20)
    data = torch.randn(CONFIG.n_layers, 2 * CONFIG.n_kv_heads, 5, CONFIG.head_dim)
    cache.write(2, 7, data)
    assert torch.equal(cache.read(2, 7, 12), data)
    assert torch.equal(cache.k[:, 2, :, 7:12], data[:, : CONFIG.n_kv_heads])
    assert torch.equal(cache.v[:, 2, :, 7:12], data[:, CONFIG.n_kv_heads :])
    assert not bool(cache.kv[:, :2].any())
