"""A float32 reference for another engine's greedy tokens: the CPU engine's own model code.

The GPU check compares ExLlamaV2's greedy tokens with what trioserve's CPU
engine computes on the same converted model directory (the float16
safetensors both engines load), in float32 on the CPU. A wrong attention mask,
a wrong RoPE, a wrong cache offset between prefill chunks: each makes the
GPU's tokens leave the reference's where the reference has a clear favourite.
Float16 on the GPU against float32 here may still pick the other of two
near-equal candidates, so a different token is accepted only at a near-tie
of the reference's logits (:data:`NEAR_TIE`).

The reference's logits come from one forward pass over the prompt and the
GPU's tokens (teacher forcing): every generated token is checked in the
context the GPU had, so one accepted near-tie does not end the comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from trioserve.engine.cpu import llama
from trioserve.engine.cpu.options import CpuOptions

__all__ = ["NEAR_TIE", "Divergence", "GreedyReference", "check_greedy", "divergences"]

#: Logits (float32, of the reference) within which two candidates count as a
#: tie that float16 rounding may break either way. Measured on SmolLM2-135M
#: (tests/test_exllamav2.py, the float16-vs-float32 test): float16 weights
#: and matmuls move its logits by well under this; a context seen wrongly
#: moves them by whole units.
NEAR_TIE = 0.5


@attrs.frozen
class Divergence:
    """A generated token that is not the reference's greedy choice."""

    #: Index among the generated tokens (0: the first).
    position: int
    token: int
    reference_token: int
    #: How far below the reference's best logit the token's logit is.
    gap: float


@attrs.define
class GreedyReference:
    """The CPU engine's Llama code in float32 over a model directory's float weights."""

    config: llama.LlamaConfig
    weights: llama.LlamaWeights

    @classmethod
    def load(cls, model_dir: Path, *, dtype: torch.dtype = torch.float32) -> GreedyReference:
        """``dtype`` other than float32 only to measure what rounding does."""
        config = llama.LlamaConfig.from_dir(model_dir)
        # "float": the safetensors' own values (float16, exactly what
        # ExLlamaV2 loads), not the directory's 4-bit copy the CPU engine
        # prefers by default.
        options = CpuOptions(dtype=str(dtype).removeprefix("torch."), weights="float")
        weights = llama.LlamaWeights.load(model_dir, config, options)
        return cls(config, weights)

    def _cache(self, length: int) -> tuple[llama.KVCache, tuple[torch.Tensor, torch.Tensor]]:
        device = torch.device("cpu")
        cache = llama.KVCache(
            self.config.n_layers,
            self.config.n_kv_heads,
            self.config.head_dim,
            self.weights.dtype,
            device,
        )
        cache.fit(1, length)
        return cache, llama.rope_tables(self.config, length, device)

    def logits(self, prompt: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
        """Float32 logits [len(generated), vocab]: row j is the reference's
        prediction for ``generated[j]`` after the prompt and ``generated[:j]``."""
        if not prompt or not generated:
            raise ValueError("the prompt and the generated tokens must not be empty")
        ids = [*prompt, *generated[:-1]]
        n = len(ids)
        cache, rope = self._cache(n)
        with torch.inference_mode():
            hidden = llama.forward(
                self.weights,
                self.config,
                cache,
                rope,
                torch.tensor([ids], dtype=torch.long),
                torch.arange(n)[None, :],
                torch.tensor([0]),
                every_position=True,
            )  # [1, n, D]
            rows = llama.logits(self.weights, hidden[0, len(prompt) - 1 :])
        return rows.float()

    def greedy(self, prompt: Sequence[int], steps: int) -> list[int]:
        """The reference's own greedy continuation of ``steps`` tokens (stop
        tokens are not special here)."""
        n = len(prompt)
        cache, rope = self._cache(n + steps)
        slot = torch.tensor([0])
        tokens: list[int] = []
        with torch.inference_mode():
            hidden = llama.forward(
                self.weights,
                self.config,
                cache,
                rope,
                torch.tensor([list(prompt)], dtype=torch.long),
                torch.arange(n)[None, :],
                slot,
            )
            row = llama.logits(self.weights, hidden)[0]
            for position in range(n, n + steps):
                tokens.append(int(row.argmax()))
                if len(tokens) == steps:
                    break
                row = llama.decode_logits(
                    self.weights,
                    self.config,
                    cache,
                    rope,
                    torch.tensor([tokens[-1]]),
                    torch.tensor([position]),
                    slot,
                )[0]
        return tokens


def divergences(logits: torch.Tensor, tokens: Sequence[int]) -> list[Divergence]:
    """Every token of ``tokens`` that is not the argmax of its row of ``logits``."""
    if logits.shape[0] != len(tokens):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(tokens)} tokens")
    found = []
    for position, (row, token) in enumerate(zip(logits, tokens, strict=True)):
        best = int(row.argmax())
        if token != best:
            gap = float(row[best] - row[token])
            found.append(Divergence(position, token, best, gap))
    return found


def check_greedy(
    logits: torch.Tensor, tokens: Sequence[int], *, near_tie: float = NEAR_TIE
) -> str | None:
    """None when every token is the reference's greedy choice or within
    ``near_tie`` of it; else what is wrong (the first token that is not)."""
    for d in divergences(logits, tokens):
        if d.gap > near_tie:
            return (
                f"generated token {d.position} is {d.token}, whose logit is {d.gap:.2f} below "
                f"the reference's choice {d.reference_token} (a near-tie is <= {near_tie})"
            )
    return None
