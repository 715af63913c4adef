"""The model functions alone (no engine, no sampler, no scheduler): greedy
ids and a text's negative log-likelihood straight from :mod:`trioserve.engine.cpu.llama`,
the references the engine's tests compare against."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from trioserve.engine.cpu import llama

CPU = torch.device("cpu")


def _cache(config: llama.LlamaConfig, positions: int, quantized: bool) -> llama.KVCache:
    cache = llama.KVCache(
        config.n_layers,
        config.n_kv_heads,
        config.head_dim,
        torch.bfloat16,
        CPU,
        quantized=quantized,
    )
    cache.fit(1, positions)
    return cache


def greedy_ids(
    model_dir: Path, weights: llama.LlamaWeights, prompt: Sequence[int], n: int
) -> list[int]:
    """``n`` greedy ids after ``prompt``: one prefill, then one decode step a token."""
    config = llama.LlamaConfig.from_dir(model_dir)
    cache = _cache(config, len(prompt) + n, quantized=False)
    rope = llama.rope_tables(config, len(prompt) + n, CPU)
    slot = torch.tensor([0])
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
        ids = [int(llama.logits(weights, hidden).argmax())]
        while len(ids) < n:
            position = torch.tensor([len(prompt) + len(ids) - 1])
            out = llama.decode_logits(
                weights, config, cache, rope, torch.tensor(ids[-1:]), position, slot
            )
            ids.append(int(out.argmax()))
    return ids


def mean_nll(
    model_dir: Path,
    weights: llama.LlamaWeights,
    ids: Sequence[int],
    *,
    logits: Callable[[llama.LlamaWeights, Tensor], Tensor] = llama.logits,
    quantized: bool = False,
) -> float:
    """Mean negative log-likelihood of ``ids[1:]`` (see :func:`token_nlls`)."""
    return float(token_nlls(model_dir, weights, ids, logits=logits, quantized=quantized).mean())


def token_nlls(
    model_dir: Path,
    weights: llama.LlamaWeights,
    ids: Sequence[int],
    *,
    logits: Callable[[llama.LlamaWeights, Tensor], Tensor] = llama.logits,
    quantized: bool = False,
) -> Tensor:
    """The negative log-likelihood of each of ``ids[1:]`` (float64 [N]) in one
    prefill, its logits by ``logits`` (the engine's own path by default:
    projection and refinement), the KV cache in 8 bits when ``quantized``."""
    config = llama.LlamaConfig.from_dir(model_dir)
    cache = _cache(config, len(ids), quantized)
    rope = llama.rope_tables(config, len(ids), CPU)
    with torch.inference_mode():
        hidden = llama.forward(
            weights,
            config,
            cache,
            rope,
            torch.tensor([list(ids)]),
            torch.arange(len(ids))[None],
            torch.tensor([0]),
            every_position=True,
        )[0, :-1]
        logprobs = torch.log_softmax(logits(weights, hidden), dim=-1)
        return -logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].double()


def perplexity_ratio(nlls: Tensor, reference: Tensor, bound: float) -> float:
    """The ratio of two paths' perplexities over the same tokens (``nlls``
    against ``reference``, per token), after checking that the text is long
    enough for a claim within ``bound`` (0.01: 1 %).

    Both paths round activations to bfloat16, and how each sum is ordered
    depends on the instruction set (AVX-512, AVX2, none): single tokens' NLL
    move by about 0.03 nats either way, on every path, and over n tokens the
    mean by sd / sqrt(n). On 89 tokens that was 0.3 % of perplexity a standard
    error, and two machines measured +1.02 % and -1.03 % for one comparison.
    So the bound must be at least four standard errors of the per-token
    differences, or the comparison says nothing about the paths."""
    diff = nlls - reference
    standard_error = float(diff.std()) / math.sqrt(len(diff))
    assert 4 * standard_error < math.log1p(bound), (standard_error, len(diff))
    return math.exp(float(diff.mean()))
