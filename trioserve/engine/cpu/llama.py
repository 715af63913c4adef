"""A compact torch model of the Llama family, over a slotted KV cache.

Loads Hugging Face Llama directories (``config.json`` + ``*.safetensors``):
tied or untied embeddings, grouped-query attention, ``rope_theta`` and llama3
or linear rope scaling. The model is a handful of pure functions over a weights
object; one :func:`forward` serves both chunked prefill (one job, many
positions) and batched decode (many jobs, one position each). The linear
layers' weight forms (quantized, oneDNN-packed) and their matmul are in
:mod:`trioserve.engine.cpu.quant`, the cache in :mod:`trioserve.engine.cpu.kvcache`.

Shapes in comments: B batch rows (jobs), C positions per row, D hidden size,
H query heads, K key/value heads, G = H // K queries per KV head, E head dim,
T attended positions, V vocabulary, S cache slots, L layers.

Grouped-query attention is done without copying K and V per query head: the G
query heads of one KV head are laid out as extra query rows of that KV head,
so ``scaled_dot_product_attention`` sees K heads and G*C queries each.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from trioserve.engine.cpu import int8_layout, native
from trioserve.engine.cpu.attention import (
    attention,
    native_attention,
    native_attention_for,
    prepare,
)
from trioserve.engine.cpu.kvcache import KVCache
from trioserve.engine.cpu.mapped import file_backed
from trioserve.engine.cpu.options import DTYPE_NAMES, CpuOptions
from trioserve.engine.cpu.quant import (
    Q4_FILE,
    Linear,
    QuantizedWeight,
    int8_available,
    int8_weight,
    linear,
    packer,
    q4_available,
    q4_parts,
    q4_weight,
    quantize_q4,
    use_native,
    weight_kind,
)
from trioserve.engine.cpu.weights_plan import plan_weights
from trioserve.engine.progress import report
from trioserve.errors import ModelError

__all__ = [
    "DTYPES",
    # Re-exported: the CPU engine allocates the model's cache as llama.KVCache.
    "KVCache",
    "LayerWeights",
    "LlamaConfig",
    "LlamaWeights",
    "RopeScaling",
    "decode_logits",
    "exact_logits",
    "forward",
    "logits",
    "rope_tables",
]

_ARCHITECTURES = frozenset({"LlamaForCausalLM"})


@attrs.frozen
class RopeScaling:
    """Rope frequency scaling from ``config.json``'s ``rope_scaling``."""

    kind: str  # "llama3" or "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@attrs.frozen
class LlamaConfig:
    """The hyperparameters the forward pass needs, read from ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Raises ModelError for an unsupported architecture or a missing key."""
        archs = raw.get("architectures") or [raw.get("model_type")]
        if not any(a in _ARCHITECTURES for a in archs) and raw.get("model_type") != "llama":
            raise ModelError(
                f"model architecture {archs!r} is not supported; supported: "
                f"{sorted(_ARCHITECTURES)!r} (model_type 'llama')"
            )
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                n_layers=int(raw["num_hidden_layers"]),
                n_heads=heads,
                n_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                rope_scaling=_rope_scaling(raw.get("rope_scaling")),
            )
        except KeyError as exc:
            raise ModelError(f"config.json lacks {exc.args[0]!r}") from exc

    @classmethod
    def from_dir(cls, path: Path) -> LlamaConfig:
        try:
            raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read config.json in {str(path)!r}: {exc}") from exc
        return cls.from_dict(raw)


def _rope_scaling(raw: Any) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(raw["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(raw["factor"]),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
        )
    raise ModelError(f"rope_scaling type {kind!r} is not supported; supported: 'llama3', 'linear'")


def rope_tables(config: LlamaConfig, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Rotary tables, float32 [length, E]: cos of every position's angles, and
    sin with the sign of its half folded in (-sin for the first half), each
    repeated over the two halves of a head, so that :func:`apply_rope` is a
    multiply and a fused multiply-add."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(half, dtype=torch.float64, device=device) / half)
    )
    scaling = config.rope_scaling
    if scaling is not None and scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None and scaling.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, and the band
        # between is blended smoothly (Llama 3.1's published recipe).
        old = scaling.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = torch.where(
            wavelen > low_wavelen,
            inv_freq / scaling.factor,
            torch.where(wavelen < high_wavelen, inv_freq, blended),
        )
    angles = torch.outer(torch.arange(length, dtype=torch.float64, device=device), inv_freq)
    cos, sin = angles.cos().float(), angles.sin().float()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


#: The bfloat16 token-embedding table of a quantized model, mapped from this
#: file of its directory (written on first load; trioserve.engine.cpu.mapped).
EMBED_FILE = "trioserve/embed_tokens.bf16"

#: The torch dtype of each of :data:`~trioserve.engine.cpu.options.DTYPE_NAMES`.
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


@attrs.define(eq=False)
class LayerWeights:
    attn_norm: Tensor  # [D] float32
    wqkv: Linear  # [(H + 2K) * E, D]: q, k and v projections fused into one matmul
    wo: Linear  # [D, H * E]
    mlp_norm: Tensor  # [D] float32
    w_gate_up: Linear  # [2 * F, D]: gate and up projections fused
    w_down: Linear  # [D, F]


@attrs.define(eq=False)
class LlamaWeights:
    embed: Tensor  # [V, D]
    layers: list[LayerWeights]
    norm: Tensor  # [D] float32
    lm_head: Tensor  # [V, D]; the same tensor as embed when tied
    #: lm_head in the form the vocabulary projection runs on, when not plain:
    #: oneDNN-packed bfloat16, or 8 bits per row (see
    #: :data:`~trioserve.engine.cpu.options.PROJECTIONS`).
    #: The plain one stays for the embedding and the float32 refinement.
    projection: Linear | None = None
    #: For an 8-bit projection: a bound on its logits' error from rounding
    #: the weights, per unit of the hidden state's norm (see :func:`logits`).
    projection_error: float = 0.0
    #: For an 8-bit projection on trioserve's kernel: a bound on what writing
    #: the hidden state in 16 bits adds to a logit's error, per unit of its
    #: largest magnitude (:func:`projection_input_error`).
    projection_input_error: float = 0.0
    #: Whether ``embed`` (and the tied ``lm_head``) is mapped from a file
    #: (:func:`trioserve.engine.cpu.mapped.file_backed`) rather than held in memory.
    embed_mapped: bool = False
    #: Whether the residual adds and RMS norms run on trioserve's kernel
    #: (:func:`trioserve.engine.cpu.native.add_rms_norm`), one call per norm.
    native_norm: bool = False
    #: For :func:`trioserve.engine.cpu.native.forward_layers`: every layer's
    #: addresses, where all of them run on trioserve's kernels (else None).
    layer_table: Tensor | None = None

    def __attrs_post_init__(self) -> None:
        # The kernel's 16-bit inputs need their bound in the recheck's margin,
        # however these weights were made.
        if isinstance(self.projection, QuantizedWeight) and not self.projection_input_error:
            self.projection_input_error = projection_input_error(self.projection)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def kinds(self) -> dict[str, int]:
        """How many linear layers run on each kind of weight (for logs and tests)."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
                kind = weight_kind(w)
                counts[kind] = counts.get(kind, 0) + 1
        return counts

    @property
    def nbytes(self) -> int:
        """Bytes the weights hold in memory (a tied lm_head counted once; a
        table mapped from a file, :attr:`embed_mapped`, not at all: only the
        rows read are resident, as clean pages the kernel may drop)."""
        total = 0
        seen: set[int] = {id(self.embed)} if self.embed_mapped else set()
        tensors: list[Linear] = [self.embed, self.norm, self.lm_head]
        if self.projection is not None:
            tensors.append(self.projection)
        for layer in self.layers:
            tensors += [layer.attn_norm, layer.mlp_norm, layer.wqkv, layer.wo]
            tensors += [layer.w_gate_up, layer.w_down]
        for w in tensors:
            if id(w) in seen:
                continue
            seen.add(id(w))
            if isinstance(w, QuantizedWeight):
                total += w.nbytes
            elif not w.is_mkldnn:
                total += w.numel() * w.element_size()
            else:
                total += w.numel() * 2  # oneDNN-packed bfloat16
        return total

    @classmethod
    def load(cls, path: Path, config: LlamaConfig, options: CpuOptions) -> LlamaWeights:
        """Read the model directory ``path``: every ``*.safetensors`` file, cast to
        ``options.dtype`` on ``options.device``, in the form the weights plan
        (:func:`~trioserve.engine.cpu.weights_plan.plan_weights`) chooses for
        ``options.weights``, ``options.vocab_projection`` and
        ``options.cpu_kernels`` here.

        Raises:
            ModelError: no safetensors file, a tensor is missing, or no
                working kernel for the quantized weights asked for.
        """
        from safetensors import safe_open

        path = Path(path)
        dtype, device = DTYPES[options.dtype], torch.device(options.device)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelError(f"no *.safetensors file in {str(path)!r}")
        q4_file = path / Q4_FILE
        plan = plan_weights(
            options,
            has_q4_file=q4_file.is_file(),
            native_kernels=use_native,
            torch_q4=q4_available,
            torch_int8=int8_available,
        )
        mode, use_file, kernel = plan.mode, plan.q4_file, plan.kernel
        native_kernels = plan.kernel == "native"
        # Tensors are read one at a time and cast at once, so that loading
        # never holds the file's dtype and the run dtype of the whole model;
        # the float linear weights are not read at all when the 4-bit file
        # serves them.
        with contextlib.ExitStack() as stack:
            handles = [stack.enter_context(safe_open(str(f), "pt", device="cpu")) for f in files]
            where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118
            q4_handle = (
                stack.enter_context(safe_open(str(q4_file), "pt", device="cpu"))
                if use_file
                else None
            )

            def raw(name: str) -> Tensor:
                handle = where.get(name)
                if handle is None:
                    raise ModelError(f"tensor {name!r} is missing from {str(path)!r}")
                tensor: Tensor = handle.get_tensor(name)
                return tensor

            def take(name: str) -> Tensor:
                return raw(name).to(device=device, dtype=dtype)

            def take_norm(name: str) -> Tensor:
                return raw(name).to(device=device, dtype=torch.float32)

            pack = packer(dtype, device, config.hidden_size)

            def dense(names: list[str]) -> Tensor:
                return pack(torch.cat([take(n) for n in names]))

            def linear_of(names: list[str]) -> Linear:
                if q4_handle is not None:
                    parts = [q4_parts(q4_handle, n, path) for n in names]
                    q, d, m = (torch.cat([part[i] for part in parts]) for i in range(3))
                    return q4_weight(q, d, m, pack, kernel)
                if mode == "q4":
                    w = torch.cat([raw(n).float() for n in names])
                    return q4_weight(*quantize_q4(w), pack, kernel)
                if mode == "int8":
                    w = torch.cat([raw(n).float() for n in names])
                    return int8_weight(w, pack, native_kernel=native_kernels)
                return dense(names)

            embed = take("model.embed_tokens.weight")
            layers = []
            for i in range(config.n_layers):
                p = f"model.layers.{i}."
                layers.append(
                    LayerWeights(
                        attn_norm=take_norm(p + "input_layernorm.weight"),
                        wqkv=linear_of([p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
                        wo=linear_of([p + "self_attn.o_proj.weight"]),
                        mlp_norm=take_norm(p + "post_attention_layernorm.weight"),
                        w_gate_up=linear_of([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                        w_down=linear_of([p + "mlp.down_proj.weight"]),
                    )
                )
                report(i + 1, config.n_layers + 1)
            untied = "lm_head.weight" in where and not config.tie_word_embeddings
            lm_head = take("lm_head.weight") if untied else embed
            int8 = plan.int8_projection
            proj = (
                int8_weight(lm_head, pack, native_kernel=native_kernels) if int8 else pack(lm_head)
            )
            error = projection_error(proj) if isinstance(proj, QuantizedWeight) else 0.0
            mapped = False
            if int8 and lm_head is embed and use_file:
                # Read a few rows at a time from here on: mapped, not heap. On
                # either kernel path, else the 8-bit copy would add to the
                # table instead of replacing the bfloat16 projection's.
                table = file_backed(path / EMBED_FILE, embed)
                mapped = table is not embed
                embed = lm_head = table
            return cls(
                embed=embed,
                layers=layers,
                norm=take_norm("model.norm.weight"),
                lm_head=lm_head,
                projection=proj if proj is not lm_head else None,
                projection_error=error,
                embed_mapped=mapped,
                native_norm=native_kernels and config.hidden_size % 16 == 0,
                layer_table=native.layer_table(layers) if native_kernels else None,
            )


def projection_error(w: QuantizedWeight) -> float:
    """A bound on an 8-bit projection's logit error per unit of the hidden
    state's norm, from rounding its weights: each row's error is a sum of D
    roundings of at most half its scale, weighted by the hidden state; as
    independent uniform errors its standard deviation is at most
    ``max(scale) * |h| / sqrt(12)``, and six of those are taken (a logit
    further off than that has a probability under 1e-8; measured on the
    embedded model, the largest error over all 49,152 logits of 338
    positions of three texts was 3.0 of them)."""
    return 6.0 * float(w.scales.float().amax()) / math.sqrt(12.0)


def projection_input_error(w: QuantizedWeight) -> float:
    """For an 8-bit projection on trioserve's kernel (0 for any other): a
    bound on what writing the hidden state in 16 bits adds to a logit's
    error, per unit of the state's largest magnitude: each value is off by at
    most half a step, so a logit by at most that times its row's ``scale *
    sum(|q|)`` (:func:`trioserve.engine.cpu.int8_layout.input_error`); a bound,
    not an estimate. On the embedded model's test text it was a 27th of
    :func:`projection_error`'s term (median over 88 positions; at most a
    19th), and a row's candidates went from 8.0 to 8.6 on average."""
    if not (w.native and w.kind == "int8"):
        return 0.0
    sums = int8_layout.row_sums(w.data, w.out_features).double() * w.scales.double()
    return float(sums.max()) * int8_layout.input_error(w.in_features)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., D] float32 (the residual stream) -> normalised and scaled by
    ``weight`` (float32), in float32: one fused kernel."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def mlp(x: Tensor, layer: LayerWeights, native_kernels: bool = False) -> Tensor:
    gate_up = linear(x, layer.w_gate_up)
    f = gate_up.shape[-1] // 2
    if native_kernels and f % 16 == 0:
        return linear(native.silu_mul(gate_up), layer.w_down)
    return linear(F.silu(gate_up[..., :f]) * gate_up[..., f:], layer.w_down)


def forward(
    weights: LlamaWeights,
    config: LlamaConfig,
    cache: KVCache,
    rope: tuple[Tensor, Tensor],
    tokens: Tensor,
    positions: Tensor,
    slots: Tensor,
    *,
    every_position: bool = False,
) -> Tensor:
    """Run ``tokens`` [B, C] at ``positions`` [B, C] of cache ``slots`` [B].

    Writes their keys and values into the cache and returns the final-norm
    hidden state of each row's last position, [B, D], in the weights' dtype
    (with ``every_position``, of every position: [B, C, D]).
    Each row attends to its own slot's positions up to its own position; the
    cache must already fit ``max(positions) + 1`` positions (:meth:`KVCache.fit`).

    The residual stream is float32 whatever the weights' dtype; matmuls take
    their input in the weights' dtype. 4-bit layers run the 4-bit kernel at
    every row count, prefill included: its rows do not depend on the other
    rows, so a position's keys and values come out the same from a decode
    step, a prefill chunk of any size or a chunk resumed after a cached
    prefix, and the prefix cache can serve them all without changing a
    greedy result. (Its bfloat16 dequantization would prefill faster on
    CPUs with bfloat16 matrix units, but gives other numbers.)
    """
    dtype = weights.dtype
    eps = config.rms_norm_eps
    b, c = tokens.shape
    # Hidden states as [B * C, D] rows throughout: matmuls take them as they are.
    x = F.embedding(tokens.reshape(-1), weights.embed).float()
    if weights.native_norm:
        # Each residual add and the norm after it in one call (x += out in place);
        # attention in one call per layer where the cache is bfloat16.
        step = (
            None
            if native_attention_for(weights, config, cache)
            else prepare(weights, config, cache, rope, positions, slots)
        )
        rows = (
            slots.to(torch.int64).repeat_interleave(c).contiguous(),
            positions.to(torch.int64).reshape(-1).contiguous(),
        )
        if step is None and weights.layer_table is not None:
            # The whole stack in one call (the same kernels in the same order).
            caches = torch.tensor([t.data_ptr() for t, _ in cache.layer_views], dtype=torch.int64)
            native.forward_layers(
                x,
                weights.layer_table,
                caches,
                rope,
                *rows,
                heads=config.n_heads,
                kv_heads=config.n_kv_heads,
                intermediate=config.intermediate_size,
                cache_shape=(cache.slots, cache.length),
                eps=eps,
            )
            return _final_norm(weights, x, b, c, every_position, eps)
        out: Tensor | None = None
        for i, layer in enumerate(weights.layers):
            h = native.add_rms_norm(x, out, layer.attn_norm, eps)
            if step is None:
                out = native_attention(h, layer, config, cache, i, rope, rows)
            else:
                out = attention(h, layer, config, i, cache, step)
            h = native.add_rms_norm(x, out, layer.mlp_norm, eps)
            out = mlp(h, layer, native_kernels=True)
        if out is not None:  # (a model has layers)
            x.add_(out)
        return _final_norm(weights, x, b, c, every_position, eps)
    step = prepare(weights, config, cache, rope, positions, slots)
    for i, layer in enumerate(weights.layers):
        h = rms_norm(x, layer.attn_norm, eps).to(dtype)
        x.add_(attention(h, layer, config, i, cache, step))
        h = rms_norm(x, layer.mlp_norm, eps).to(dtype)
        x.add_(mlp(h, layer))
    x = x.view(b, c, -1)
    return rms_norm(x if every_position else x[:, -1], weights.norm, eps).to(dtype)


def _final_norm(
    weights: LlamaWeights, x: Tensor, b: int, c: int, every_position: bool, eps: float
) -> Tensor:
    if every_position:
        return native.add_rms_norm(x, None, weights.norm, eps).view(b, c, -1)
    return native.add_rms_norm(x.view(b, c, -1)[:, -1].contiguous(), None, weights.norm, eps)


def logits(weights: LlamaWeights, hidden: Tensor) -> Tensor:
    """hidden [B, D] -> float32 logits [B, V].

    A bfloat16 matmul rounds its output to bfloat16, whose step is 0.125 at
    the logit sizes of a confident model: enough to flip a greedy choice
    between close candidates (SmolLM2 then answers a different first word).
    Every candidate that rounding could have put below the best (those within
    two rounding steps of a row's maximum) is recomputed in float32: usually a
    handful of dot products, far cheaper than a float32 vocabulary projection,
    and the choices that matter become exact. An 8-bit projection widens the
    margin by twice its weights' error bound (:func:`projection_error`), and
    on trioserve's kernel (float32 logits from activations in 16 bits) by
    twice the bound on its inputs' (:func:`projection_input_error`), so that
    the greedy choice is the bfloat16 path's (5 to 17 candidates a row on the
    embedded model's test texts).
    """
    projection = weights.lm_head if weights.projection is None else weights.projection
    if isinstance(projection, QuantizedWeight) and projection.native and projection.kind == "int8":
        # The kernel's sums as they are, in float32.
        out = native.int8_mm(hidden, projection.data, projection.scales, torch.float32)
    else:
        out = linear(hidden, projection).float()  # [B, V]
    if hidden.dtype == torch.float32:
        return out
    top = out.amax(dim=-1, keepdim=True)  # [B, 1]
    # Two bfloat16 steps at the row maximum's magnitude (8-bit mantissa).
    margin = torch.clamp(top.abs() * 2.0**-6, min=0.25)
    if weights.projection_error or weights.projection_input_error:
        # Both the best candidate and the true best may be off by the bounds.
        h = hidden.float()
        margin = margin + 2 * weights.projection_error * h.norm(dim=-1, keepdim=True)
        if weights.projection_input_error:
            bound = weights.projection_input_error * h.abs().amax(dim=-1, keepdim=True)
            margin = margin + 2 * bound
    rows, cols = _at_least(out, top - margin)  # [N] each
    exact = (hidden[rows].float() * weights.lm_head[cols].float()).sum(-1)  # [N]
    out[rows, cols] = exact
    return out


def _at_least(x: Tensor, floor: Tensor) -> tuple[Tensor, Tensor]:
    """The rows and columns where ``x`` [B, V] >= ``floor`` [B, 1], in order.

    The few candidates of a wide row are found through the maxima of its
    blocks of 64: only the blocks that reach the floor are compared element
    by element. The same as ``(x >= floor).nonzero()``, in about a third of
    its time on [8, 49152] float32 (0.10 against 0.26 ms on a Zen 4 EPYC, 2
    threads: torch's nonzero of the whole mask is most of it)."""
    b, v = x.shape
    wide = v - v % _BLOCK
    blocks = x[:, :wide].view(b, wide // _BLOCK, _BLOCK)
    peaks = blocks.amax(dim=-1)  # NaN where a block holds one: compared in full
    rows, index = ((peaks >= floor) | peaks.isnan()).nonzero(as_tuple=True)
    hit, lane = (blocks[rows, index] >= floor[rows]).nonzero(as_tuple=True)
    rows, cols = rows[hit], index[hit] * _BLOCK + lane
    if wide == v:
        return rows, cols
    tail_rows, tail_cols = (x[:, wide:] >= floor).nonzero(as_tuple=True)
    rows, cols = torch.cat([rows, tail_rows]), torch.cat([cols, tail_cols + wide])
    order = torch.argsort(rows * v + cols)
    return rows[order], cols[order]


#: Columns of :func:`_at_least`'s blocks.
_BLOCK = 64


def exact_logits(weights: LlamaWeights, hidden: Tensor, ids: Tensor | None = None) -> Tensor:
    """hidden [B, D] -> float32 logits computed in float32 from the bfloat16
    hidden state and head, with no bfloat16 rounding of the output: of the
    ids [B, K] (-> [B, K]), or of the whole vocabulary (-> [B, V], a block of
    the head at a time). For log probabilities, where every logit counts."""
    head = weights.lm_head
    h = hidden.float()
    if ids is not None:
        return torch.einsum("bd,bkd->bk", h, head[ids].float())
    out = torch.empty((h.shape[0], head.shape[0]), dtype=torch.float32, device=h.device)
    for start in range(0, head.shape[0], _EXACT_BLOCK):
        block = head[start : start + _EXACT_BLOCK].float()
        out[:, start : start + block.shape[0]] = h @ block.T
    return out


#: Rows of the head converted to float32 at a time by :func:`exact_logits`.
_EXACT_BLOCK = 4096


def decode_logits(
    weights: LlamaWeights,
    config: LlamaConfig,
    cache: KVCache,
    rope: tuple[Tensor, Tensor],
    tokens: Tensor,
    positions: Tensor,
    slots: Tensor,
) -> Tensor:
    """One decode step: tokens [B] at positions [B] of slots [B] -> logits [B, V]."""
    hidden = forward(weights, config, cache, rope, tokens[:, None], positions[:, None], slots)
    return logits(weights, hidden)
