"""A compact torch model of the Llama family, with a slotted KV cache.

Loads Hugging Face Llama directories (``config.json`` + ``*.safetensors``):
tied or untied embeddings, grouped-query attention, ``rope_theta`` and llama3
or linear rope scaling. The model is a handful of pure functions over a weights
object; one :func:`forward` serves both chunked prefill (one job, many
positions) and batched decode (many jobs, one position each).

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from trioserve.errors import ModelError

__all__ = [
    "KVCache",
    "LayerWeights",
    "LlamaConfig",
    "LlamaWeights",
    "RopeScaling",
    "decode_logits",
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


@attrs.define(eq=False)
class LayerWeights:
    attn_norm: Tensor  # [D]
    wqkv: Tensor  # [(H + 2K) * E, D]: q, k and v projections fused into one matmul
    wo: Tensor  # [D, H * E]
    mlp_norm: Tensor  # [D]
    w_gate_up: Tensor  # [2 * F, D]: gate and up projections fused
    w_down: Tensor  # [D, F]


@attrs.define(eq=False)
class LlamaWeights:
    embed: Tensor  # [V, D]
    layers: list[LayerWeights]
    norm: Tensor  # [D]
    lm_head: Tensor  # [V, D]; the same tensor as embed when tied
    #: lm_head in oneDNN's packed layout for the vocabulary projection (the
    #: plain one stays for the embedding and the float32 refinement).
    lm_head_packed: Tensor | None = None

    @classmethod
    def load(
        cls, path: Path, config: LlamaConfig, *, dtype: torch.dtype, device: torch.device
    ) -> LlamaWeights:
        """Read every ``*.safetensors`` file of ``path``, cast to ``dtype`` on ``device``.

        Raises:
            ModelError: no safetensors file, or a tensor is missing.
        """
        from safetensors import safe_open

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ModelError(f"no *.safetensors file in {str(path)!r}")
        # Tensors are read one at a time and cast at once, so that loading
        # never holds the file's dtype and the run dtype of the whole model.
        with contextlib.ExitStack() as stack:
            handles = [stack.enter_context(safe_open(str(f), "pt", device="cpu")) for f in files]
            where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118

            def take(name: str) -> Tensor:
                handle = where.pop(name, None)
                if handle is None:
                    raise ModelError(f"tensor {name!r} is missing from {str(path)!r}")
                tensor: Tensor = handle.get_tensor(name)
                return tensor.to(device=device, dtype=dtype)

            return cls._assemble(config, take, untied="lm_head.weight" in where)

    @classmethod
    def _assemble(
        cls, config: LlamaConfig, take: Callable[[str], Tensor], *, untied: bool
    ) -> LlamaWeights:
        embed = take("model.embed_tokens.weight")
        pack = _packer(embed)
        layers = []
        for i in range(config.n_layers):
            p = f"model.layers.{i}."
            layers.append(
                LayerWeights(
                    attn_norm=take(p + "input_layernorm.weight"),
                    wqkv=pack(torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])),
                    wo=pack(take(p + "self_attn.o_proj.weight")),
                    mlp_norm=take(p + "post_attention_layernorm.weight"),
                    w_gate_up=pack(
                        torch.cat(
                            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
                        )
                    ),
                    w_down=pack(take(p + "mlp.down_proj.weight")),
                )
            )
        lm_head = take("lm_head.weight") if untied and not config.tie_word_embeddings else embed
        packed = pack(lm_head)
        return cls(
            embed=embed,
            layers=layers,
            norm=take("model.norm.weight"),
            lm_head=lm_head,
            lm_head_packed=packed if packed is not lm_head else None,
        )


#: Rows the packed layout is tuned for; any row count works.
_PACK_ROWS_HINT = 8


def _packer(like: Tensor) -> Callable[[Tensor], Tensor]:
    """A function that puts weights into oneDNN's packed layout where that is
    exact, else leaves them as they are.

    On CPU, bfloat16 matmuls against packed weights run 1.5 to 2 times faster
    at the few rows of a batched decode step than ``F.linear`` does. The probe
    checks that the packed kernel gives bit for bit what ``F.linear`` and
    ``torch.mv`` give at every row count, so that batch-invariant greedy text
    (see :func:`_spans`) survives; on builds without oneDNN, on other devices
    or dtypes, weights stay plain.
    """

    def plain(w: Tensor) -> Tensor:
        return w

    if like.device.type != "cpu" or like.dtype != torch.bfloat16:
        return plain
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return plain
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(96, like.shape[1], generator=generator).to(like.dtype)
    x = torch.randn(8, like.shape[1], generator=generator).to(like.dtype)
    try:
        packed = _mkldnn_pack(w)
        same = all(
            torch.equal(_mkldnn_linear(x[:n], packed), F.linear(x[:n], w)) for n in (1, 3, 8)
        ) and torch.equal(_mkldnn_linear(x[:1], packed)[0], torch.mv(w, x[0]))
    except (RuntimeError, AttributeError):
        return plain
    return _mkldnn_pack if same else plain


def _mkldnn_pack(w: Tensor) -> Tensor:
    packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _PACK_ROWS_HINT)
    return packed


def _mkldnn_linear(x: Tensor, packed: Tensor) -> Tensor:
    out: Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return out


@attrs.define(eq=False)
class KVCache:
    """Keys and values of every slot, grown in blocks as sequences grow.

    Nothing is reserved up front: the cache holds ``slots x length`` positions
    where both are the current needs rounded up (length to ``block``), so 8
    short jobs cost 8 short rows, not 8 full contexts.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    block: int = 256
    k: Tensor = attrs.field(init=False)  # [L, S, K, T, E]
    v: Tensor = attrs.field(init=False)  # [L, S, K, T, E]

    def __attrs_post_init__(self) -> None:
        self.k = self._empty(0, 0)
        self.v = self._empty(0, 0)

    def _empty(self, slots: int, length: int) -> Tensor:
        shape = (self.n_layers, slots, self.n_kv_heads, length, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def slots(self) -> int:
        return int(self.k.shape[1])

    @property
    def length(self) -> int:
        return int(self.k.shape[3])

    def fit(self, slots: int, length: int) -> None:
        """Make room for ``slots`` slots of ``length`` positions; give memory back
        when the needs fell to half of what is held. Slots keep their contents."""
        want_len = -(-length // self.block) * self.block if length else 0
        grow = slots > self.slots or want_len > self.length
        shrink = self.slots > 2 * slots or self.length > 2 * max(want_len, self.block)
        if not (grow or shrink):
            return
        new_slots = slots if shrink and slots < self.slots else max(slots, self.slots)
        new_len = want_len if shrink and want_len < self.length else max(want_len, self.length)
        keep_s, keep_t = min(new_slots, self.slots), min(new_len, self.length)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = self._empty(new_slots, new_len)
            new[:, :keep_s, :, :keep_t] = old[:, :keep_s, :, :keep_t]
            setattr(self, name, new)

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src`` into slot ``dst`` (to keep the used slots packed)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def release(self) -> None:
        self.k = self._empty(0, 0)
        self.v = self._empty(0, 0)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def linear(x: Tensor, w: Tensor) -> Tensor:
    """x [..., in] @ w[out, in].T, for plain or packed (:func:`_packer`) weights.

    With plain weights a single row goes through ``torch.mv``: on CPUs its
    bfloat16 kernel streams the weight about twice as fast as the
    matrix-matrix path does for one row, and decoding one job is exactly that.
    """
    if w.is_mkldnn:
        return _mkldnn_linear(x.contiguous(), w)
    if x.numel() == x.shape[-1]:
        return torch.mv(w, x.reshape(-1)).view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # In float32: bfloat16's 8-bit mantissa loses too much in the mean of squares.
    # The fused kernel: one op instead of five, 30 layers x 2 norms per step.
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x) * weight


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, C, heads, E]; cos, sin [B, C, 1, E] from :func:`rope_tables`. The two
    halves of each head rotate as pairs (Hugging Face's layout):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    xf = x.float()
    swapped = xf.view(*xf.shape[:-1], 2, -1).flip(-2).view(xf.shape)  # (x2, x1)
    return torch.addcmul(xf * cos, swapped, sin).type_as(x)


@attrs.frozen
class _Span:
    """Consecutive rows of a forward pass that attend over the same length."""

    rows: slice
    #: The rows' first cache slot when their slots are consecutive (a view of
    #: the cache then serves them), else None and ``slots`` is gathered.
    first_slot: int | None
    slots: Tensor  # [n]
    length: int
    #: [n, 1, G * C, length] in the model dtype: 0 where a query sees a key,
    #: -inf elsewhere (built once per forward, not by each layer's attention).
    mask: Tensor


#: Decode rows attend over their length rounded up to this (see :func:`_spans`).
ATTENTION_BUCKET = 64


def _spans(
    positions: Tensor,
    slots: list[int],
    g: int,
    cache: KVCache,
    dtype: torch.dtype,
    *,
    bucket: bool,
) -> list[_Span]:
    """Split the rows into runs that attend over one length each.

    Prefill (one row) attends over exactly its positions. Decode rows attend
    over their own length rounded up to :data:`ATTENTION_BUCKET`, never over
    the batch's longest: the attention kernel's sums then see the same masked
    padding whether a row runs alone or beside others, so a job's greedy text
    does not depend on its companions (with bfloat16, whose matmuls are
    batch-invariant on CPU).
    """
    b, c = positions.shape
    ends = (positions.amax(dim=1) + 1).tolist()  # [B]
    if bucket:
        step = ATTENTION_BUCKET
        ends = [min(-(-n // step) * step, cache.length) for n in ends]
    else:
        ends = [max(ends)] * b
    device = positions.device
    spans: list[_Span] = []
    r0 = 0
    for r1 in range(1, b + 1):
        if r1 < b and ends[r1] == ends[r0]:
            continue
        length = ends[r0]
        run = slots[r0:r1]
        consecutive = run == list(range(run[0], run[0] + len(run)))
        visible = torch.arange(length, device=device) <= positions[r0:r1, :, None]  # [n, C, T]
        bias = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(
            ~visible, float("-inf")
        )
        n = r1 - r0
        spans.append(
            _Span(
                rows=slice(r0, r1),
                first_slot=run[0] if consecutive else None,
                slots=torch.tensor(run, device=device),
                length=length,
                mask=bias[:, None].expand(n, g, c, length).reshape(n, 1, g * c, length),
            )
        )
        r0 = r1
    return spans


def _span_rows(cache: Tensor, span: _Span) -> Tensor:
    """cache [S, K, T, E] -> [n, K, span.length, E] for the span's slots."""
    if span.first_slot is not None:
        n = span.rows.stop - span.rows.start
        return cache[span.first_slot : span.first_slot + n, :, : span.length]
    return cache[span.slots, :, : span.length]


def attention(
    x: Tensor,
    layer: LayerWeights,
    config: LlamaConfig,
    layer_index: int,
    cache: KVCache,
    slots: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    spans: list[_Span],
) -> Tensor:
    b, c, _ = x.shape  # x [B, C, D]
    h, k, e = config.n_heads, config.n_kv_heads, config.head_dim
    g = h // k
    qkv = linear(x, layer.wqkv).view(b, c, h + 2 * k, e)
    qk = apply_rope(qkv[:, :, : h + k], cos, sin)  # [B, C, H + K, E]
    q, new_k, new_v = qk[:, :, :h], qk[:, :, h:], qkv[:, :, h + k :]
    # Write this step's keys and values at (slot, position) of every row.
    rows = slots[:, None].expand(b, c)
    cache.k[layer_index][rows, :, positions] = new_k
    cache.v[layer_index][rows, :, positions] = new_v
    # [B, C, H, E] -> [B, K, G * C, E]: the G query heads of a KV head become rows.
    q = q.permute(0, 2, 1, 3).reshape(b, k, g * c, e)
    outs = [
        F.scaled_dot_product_attention(
            q[span.rows],
            _span_rows(cache.k[layer_index], span),  # [n, K, T, E]
            _span_rows(cache.v[layer_index], span),
            attn_mask=span.mask,
        )
        for span in spans
    ]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [B, K, G * C, E]
    out = out.view(b, k, g, c, e).permute(0, 3, 1, 2, 4).reshape(b, c, h * e)
    return linear(out, layer.wo)


def mlp(x: Tensor, layer: LayerWeights) -> Tensor:
    gate, up = linear(x, layer.w_gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, layer.w_down)


def forward(
    weights: LlamaWeights,
    config: LlamaConfig,
    cache: KVCache,
    rope: tuple[Tensor, Tensor],
    tokens: Tensor,
    positions: Tensor,
    slots: Tensor,
) -> Tensor:
    """Run ``tokens`` [B, C] at ``positions`` [B, C] of cache ``slots`` [B].

    Writes their keys and values into the cache and returns the final-norm
    hidden state of each row's last position, [B, D]. Each row attends to its
    own slot's positions up to its own position; the cache must already fit
    ``max(positions) + 1`` positions (:meth:`KVCache.fit`).
    """
    c = tokens.shape[1]
    g = config.n_heads // config.n_kv_heads
    spans = _spans(positions, slots.tolist(), g, cache, weights.embed.dtype, bucket=c == 1)
    cos, sin = (table[positions][:, :, None, :] for table in rope)  # [B, C, 1, E]
    x = F.embedding(tokens, weights.embed)  # [B, C, D]
    for i, layer in enumerate(weights.layers):
        h = rms_norm(x, layer.attn_norm, config.rms_norm_eps)
        x = x + attention(h, layer, config, i, cache, slots, positions, cos, sin, spans)
        x = x + mlp(rms_norm(x, layer.mlp_norm, config.rms_norm_eps), layer)
    return rms_norm(x[:, -1], weights.norm, config.rms_norm_eps)


def logits(weights: LlamaWeights, hidden: Tensor) -> Tensor:
    """hidden [B, D] -> float32 logits [B, V].

    A bfloat16 matmul rounds its output to bfloat16, whose step is 0.125 at
    the logit sizes of a confident model: enough to flip a greedy choice
    between close candidates (SmolLM2 then answers a different first word).
    Every candidate that rounding could have put below the best (those within
    two rounding steps of a row's maximum) is recomputed in float32: usually a
    handful of dot products, far cheaper than a float32 vocabulary projection,
    and the choices that matter become exact.
    """
    projection = weights.lm_head if weights.lm_head_packed is None else weights.lm_head_packed
    out = linear(hidden, projection).float()  # [B, V]
    if hidden.dtype == torch.float32:
        return out
    top = out.amax(dim=-1, keepdim=True)  # [B, 1]
    # Two bfloat16 steps at the row maximum's magnitude (8-bit mantissa).
    margin = torch.clamp(top.abs() * 2.0**-6, min=0.25)
    rows, cols = (out >= top - margin).nonzero(as_tuple=True)  # [N] each
    exact = (hidden[rows].float() * weights.lm_head[cols].float()).sum(-1)  # [N]
    out[rows, cols] = exact
    return out


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
