"""The token sampler of the CPU engine, in torch and vectorised over the batch.

One call samples one token for every running job. The protocol's fields are
applied in ExLlamaV2's order, with the standard definition of each filter
(``docs/sampling.md`` lists every difference from ExLlamaV2):

1. repetition, frequency and presence penalties over the job's whole context;
2. the caller's additive ``bias`` (``logit_bias`` and DRY, from
   :mod:`trioserve.engine.samplers`), banned ids, then the ``allowed`` mask
   (token healing's constraint);
3. ``temperature == 0``: the argmax, with no randomness and no filters;
   otherwise temperature (1 with ``temperature_last``; quadratic with
   ``smoothing_factor``), softmax, then top_k, top_p, top_a, min_p, typical
   and mirostat, renormalising after each, then the temperature after the
   filters (``temperature_last`` or the dynamic one) and XTC;
4. one uniform number per job from the job's own generator, skewed as
   ExLlamaV2 skews it, and an inverse-CDF draw over the filtered candidates in
   descending order of probability; mirostat's mu then follows the surprise
   of the drawn token (kept in the job's :class:`RowState`).

Ties between equal logits (common with bf16 logits) are broken towards the
lower token id everywhere -- in the argmax, at the top_k boundary and in the
order of the draw -- so a job's result does not depend on which other jobs
share its batch (up to floating-point summation order).

Cost: every step touches the whole vocabulary a few times (penalties, masks,
one ``topk``), but sorts only the top ``max(top_k)`` candidates. A full sort
of the vocabulary (about 4 ms per row on one CPU core) happens only for rows
with ``top_k == 0`` that need their candidates in order (a filter or skew)
and whose top_p, top_a or min_p do not bound them to a few thousand.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable, Sequence
from typing import Literal, TypeAlias

import numpy as np
import torch

from trioserve.engine.samplers import (
    RowState,
    after_filters,
    follow_surprise,
    mirostat_mus,
    renormalise,
    row_param,
)
from trioserve.errors import EngineError, TrioserveError
from trioserve.vocabulary.sampling import SamplingSettings, setting_bounds

__all__ = [
    "RowState",
    "SamplingError",
    "distribution",
    "make_generator",
    "penalise",
    "sample",
    "settings_problem",
]

#: Candidate counts tried, in turn, for rows with ``top_k == 0`` whose top_p,
#: top_a or min_p bound the kept set, before a full sort of the vocabulary
#: (a full sort of 49152 logits costs about 15 times a top-512).
_UNBOUNDED_TRIES = (512, 4096)

#: How a row is sampled: the argmax; its top_k bounds the candidates; it needs
#: them in descending order (filters or skew) without a bound; or neither.
_Kind: TypeAlias = Literal["greedy", "top_k", "ordered", "plain"]
_KINDS: tuple[_Kind, ...] = ("greedy", "top_k", "ordered", "plain")

logger = logging.getLogger("trioserve.engine")

_NEG_INF = float("-inf")
_BOUNDS = setting_bounds()
#: The smallest positive float32: a temperature below it would round to 0
#: in float32 and turn the row's maximum into 0/0.
_TINY32 = torch.finfo(torch.float32).tiny
_FLOAT32_EXP_FLOOR = -100.0
_NEUTRAL = SamplingSettings(temperature=0.0, rep_pen=1.0)


class SamplingError(TrioserveError):
    """Some rows of a batch could not be sampled (their logits are all masked,
    NaN or infinite, or their settings are invalid).

    The other rows *were* sampled, and their generators advanced exactly as in
    a call without the bad rows: :attr:`ids` holds their tokens (``-1`` at the
    failed rows), so an engine can fail just the jobs in :attr:`rows` and keep
    the step's other tokens. :attr:`reasons` maps each failed row to why.
    """

    def __init__(self, reasons: dict[int, str], ids: torch.Tensor | None) -> None:
        self.reasons = dict(sorted(reasons.items()))
        self.rows = tuple(self.reasons)
        self.ids = ids
        detail = "; ".join(f"row {row}: {why}" for row, why in self.reasons.items())
        super().__init__(f"cannot sample rows {list(self.rows)!r}: {detail}")


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A job's own random generator, so that a seed reproduces its draws
    whatever the other jobs do.

    ``None`` draws a fresh 64-bit seed from the operating system. An int seed
    is reduced modulo 2**64 (torch's seed range), so every int is accepted.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(secrets.randbits(64) if seed is None else seed % 2**64)
    return generator


def settings_problem(settings: SamplingSettings) -> str | None:
    """What is wrong with ``settings`` (one lowercase sentence), or None.

    The protocol layer validates requests against the same ranges (declared
    once, on :class:`SamplingSettings`); this is the sampler's own guard, so
    that a bad value fails one job instead of producing NaNs or overflowing
    a tensor of the whole batch.
    """
    for name, allowed in _BOUNDS.items():
        value = getattr(settings, name)
        if name == "seed" and value is None:
            continue
        if not allowed.contains(value):
            shown = repr(value)
            if len(shown) > 100:  # a list of 100,000 breakers is not shown whole
                shown = (
                    f"{shown[:80]}... ({len(value) if hasattr(value, '__len__') else '?'} items)"
                )
            return f"{name} must be {allowed.describe()}, got {shown}"
    return None


def sample(
    logits: torch.Tensor,
    settings: Sequence[SamplingSettings],
    generators: Sequence[torch.Generator],
    *,
    counts: torch.Tensor | None = None,
    banned: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    states: Sequence[RowState] | None = None,
    xtc_protected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample one token id per row.

    ``logits`` is ``[B, V]`` of any float dtype (computed in float32);
    ``settings`` and ``generators`` have one entry per row. ``counts`` (``[B,
    V]`` int) says how often each id occurs in the row's context so far, for
    the penalties; ``bias`` (``[B, V]`` float32) is added to the penalised
    logits (``logit_bias``, DRY); ``banned`` (``[B, V]`` bool) ids are never
    sampled; where ``allowed`` (``[B, V]`` bool) is given, only its ids may be
    sampled (a row of all True is no constraint). ``states`` (one per row)
    carry mirostat's mu from step to step and are updated by the draw;
    without them each call starts mirostat afresh. ``xtc_protected`` (``[V]``
    bool) ids are never removed by XTC. Returns ``[B]`` int64 ids on the
    logits' device.

    Every non-greedy row draws exactly one float64 uniform from its
    generator; greedy rows draw nothing.

    Raises :class:`SamplingError` when some rows cannot be sampled (it carries
    the others' ids), and :class:`~trioserve.errors.EngineError` when the
    arguments do not fit together (a bug in the caller).
    """
    if len(generators) != len(settings):
        raise EngineError(
            f"generators must have one entry per row ({len(settings)}), got {len(generators)!r}"
        )
    if states is not None and len(states) != len(settings):
        raise EngineError(
            f"states must have one entry per row ({len(settings)}), got {len(states)!r}"
        )
    x, usable, reasons = _prepare(logits, settings, counts, banned, allowed, bias)
    protected = _protected(xtc_protected, x.shape[1], x.device)
    batch = x.shape[0]
    device = x.device

    out = torch.full((batch,), -1, dtype=torch.int64, device=device)
    for kind, index in _groups(usable, reasons, device):
        sub = x if index.numel() == batch else x.index_select(0, index)
        rows = index.tolist()
        if kind == "greedy":
            out[index] = _argmax(sub)
            continue
        # Each row's one uniform is drawn first, so that a row sampled again
        # alone (below) uses the same number and its generator advances once.
        uniforms = [_uniform(generators[r]) for r in rows]

        def draw(
            part: torch.Tensor,
            part_rows: list[int],
            part_uniforms: list[float],
            kind: _Kind = kind,
        ) -> None:
            row_settings = [usable[r] for r in part_rows]
            mus = mirostat_mus(row_settings, states, part_rows)
            probs, ids = _candidates(part, row_settings, kind, mus, protected)
            picked, chosen = _draw(probs, ids, row_settings, part_uniforms)
            out[torch.tensor(part_rows, dtype=torch.int64, device=device)] = picked
            if states is not None and any(s.mirostat for s in row_settings):
                follow_surprise(probs, chosen, row_settings, mus, [states[r] for r in part_rows])

        _rows_apart(sub, rows, uniforms, draw, reasons)

    if reasons:
        raise SamplingError(reasons, out)
    return out


def _rows_apart(
    sub: torch.Tensor,
    rows: list[int],
    uniforms: list[float],
    work: Callable[[torch.Tensor, list[int], list[float]], None],
    reasons: dict[int, str],
) -> None:
    """``work`` on the rows together; if it fails, on each row alone, so that
    a failure the checks before did not foresee fails only its own row (and
    its job), never the batch. The rows that fail alone get a reason."""
    if len(rows) > 1:
        try:
            work(sub, rows, uniforms)
            return
        except Exception:
            logger.warning("sampling %d rows together failed; sampling them one by one", len(rows))
    for position, row in enumerate(rows):
        try:
            work(sub[position : position + 1], [row], uniforms[position : position + 1])
        except Exception as exc:
            logger.exception("sampling row %d failed", row)
            reasons[row] = f"{type(exc).__name__}: {exc}"[:200]


def distribution(
    logits: torch.Tensor,
    settings: Sequence[SamplingSettings],
    *,
    counts: torch.Tensor | None = None,
    banned: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    states: Sequence[RowState] | None = None,
    xtc_protected: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``[B, V]`` float64 probabilities that :func:`sample` draws from
    (before ``skew`` bends the draw): one-hot at the argmax for greedy rows.

    The same code path as :func:`sample`, for tests, and for callers that
    want log-probabilities; ``states`` are read, not updated. Raises
    :class:`SamplingError` (with ``ids`` None) when some rows cannot be
    sampled.
    """
    x, usable, reasons = _prepare(logits, settings, counts, banned, allowed, bias)
    protected = _protected(xtc_protected, x.shape[1], x.device)
    batch, vocab = x.shape
    out = torch.zeros((batch, vocab), dtype=torch.float64, device=x.device)
    for kind, index in _groups(usable, reasons, x.device):
        sub = x if index.numel() == batch else x.index_select(0, index)
        rows = index.tolist()

        def fill(
            part: torch.Tensor, part_rows: list[int], _: list[float], kind: _Kind = kind
        ) -> None:
            rows_out = torch.zeros((len(part_rows), vocab), dtype=torch.float64, device=x.device)
            if kind == "greedy":
                rows_out.scatter_(1, _argmax(part)[:, None], 1.0)
            else:
                row_settings = [usable[r] for r in part_rows]
                mus = mirostat_mus(row_settings, states, part_rows)
                probs, ids = _candidates(part, row_settings, kind, mus, protected)
                rows_out.scatter_(1, ids, probs)
            out[torch.tensor(part_rows, dtype=torch.int64, device=x.device)] = rows_out

        _rows_apart(sub, rows, [0.0] * len(rows), fill, reasons)
    if reasons:
        raise SamplingError(reasons, None)
    return out


def _fill_where(x: torch.Tensor, mask: torch.Tensor, value: float) -> None:
    """``x.masked_fill_(mask, value)`` for [B, V] tensors. On the CPU through
    numpy's ``copyto``: 0.03 ms for [8, 49152] float32 on a Zen 4 EPYC where
    torch's ``masked_fill_`` took 0.17 ms (2 threads)."""
    if x.device.type == "cpu" and mask.device.type == "cpu" and x.is_contiguous():
        np.copyto(x.numpy(), np.float32(value), where=mask.numpy())
    else:
        x.masked_fill_(mask, value)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, int64 [B]: the first maximum, so ties go to the
    lower id. On the CPU through numpy, the same answer: torch's CPU argmax
    over the last dimension is a scalar loop (0.17 to 0.34 ms for [8, 49152]
    float32 on a Zen 4 EPYC with 2 threads, numpy's vectorised one 0.03 ms)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.numpy().argmax(axis=1)).to(torch.int64)
    return x.argmax(dim=1)


def _protected(mask: torch.Tensor | None, vocab: int, device: torch.device) -> torch.Tensor | None:
    if mask is not None and (mask.shape != (vocab,) or mask.dtype != torch.bool):
        raise EngineError(
            f"xtc_protected must be a [{vocab}] bool tensor, got {tuple(mask.shape)!r} "
            f"of {mask.dtype}"
        )
    return None if mask is None else mask.to(device)


def penalise(
    logits: torch.Tensor, counts: torch.Tensor, settings: Sequence[SamplingSettings]
) -> torch.Tensor:
    """The float32 logits after each row's repetition, frequency and presence
    penalties, for the ids with ``counts > 0``; the input is not changed.

    Repetition divides positive logits by ``rep_pen`` and multiplies negative
    ones by it; frequency subtracts ``freq_pen * count``; presence subtracts
    ``pres_pen`` once.
    """
    if logits.dim() != 2 or counts.shape != logits.shape or len(settings) != logits.shape[0]:
        raise EngineError(
            f"logits and counts must be [batch, vocab] with one settings per row, got "
            f"{tuple(logits.shape)!r}, {tuple(counts.shape)!r} and {len(settings)!r} settings"
        )
    return _apply_penalties(logits.to(torch.float32, copy=True), counts, settings)


def _prepare(
    logits: torch.Tensor,
    settings: Sequence[SamplingSettings],
    counts: torch.Tensor | None,
    banned: torch.Tensor | None,
    allowed: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, list[SamplingSettings], dict[int, str]]:
    """Penalties, biases and masks on a float32 copy of the logits; the rows
    that cannot be sampled, each with its reason."""
    _check_shapes(logits, settings, counts, banned, allowed, bias)
    # A copy, always: the caller's logits stay untouched.
    x = logits.to(torch.float32, copy=True)

    reasons: dict[int, str] = {}
    for row, s in enumerate(settings):
        problem = settings_problem(s)
        if problem is not None:
            reasons[row] = problem
    # Rows with bad settings are skipped; a neutral stand-in keeps the per-row
    # parameter tensors well defined.
    usable = [s if row not in reasons else _NEUTRAL for row, s in enumerate(settings)]

    if counts is not None and any(s.penalised for s in usable):
        x = _apply_penalties(x, counts, usable)
    if bias is not None:
        # ExLlamaV2 adds its token_bias, then DRY's penalties, after the
        # repetition penalties; a bad row's bias is as harmless as its logits.
        x += bias.to(torch.float32)
    if banned is not None:
        _fill_where(x, banned, _NEG_INF)
    if allowed is not None:
        _fill_where(x, ~allowed, _NEG_INF)

    # amax propagates NaN and +inf, so one reduction finds every bad row.
    row_max = x.amax(dim=1)
    for row, ok in enumerate(torch.isfinite(row_max).tolist()):
        if not ok and row not in reasons:
            value = float(row_max[row])
            if math.isnan(value):
                reasons[row] = "the logits contain nan"
            elif value > 0:
                reasons[row] = "the logits contain +inf"
            else:
                reasons[row] = "every token is banned or outside the allowed mask"
    return x, usable, reasons


def _groups(
    settings: Sequence[SamplingSettings], reasons: dict[int, str], device: torch.device
) -> list[tuple[_Kind, torch.Tensor]]:
    """The rows that can be sampled, grouped by kind. Rows whose top_k bounds
    the candidates never pay for a full sort, even when other rows of the
    batch have ``top_k == 0``."""
    kinds = {r: _kind(s) for r, s in enumerate(settings) if r not in reasons}
    groups = []
    for kind in _KINDS:
        rows = [r for r, k in kinds.items() if k == kind]
        if rows:
            groups.append((kind, torch.tensor(rows, dtype=torch.int64, device=device)))
    return groups


def _kind(s: SamplingSettings) -> _Kind:
    if s.temperature == 0:
        return "greedy"
    if s.top_k > 0:
        return "top_k"
    filters = 0 < s.top_p < 1 or s.top_a > 0 or s.min_p > 0 or 0 < s.typical < 1
    return "ordered" if filters or s.skew != 0 else "plain"


def _check_shapes(
    logits: torch.Tensor,
    settings: Sequence[SamplingSettings],
    counts: torch.Tensor | None,
    banned: torch.Tensor | None,
    allowed: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> None:
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise EngineError(
            f"logits must be a [batch, vocab] float tensor, got {tuple(logits.shape)!r} "
            f"of {logits.dtype}"
        )
    batch = logits.shape[0]
    if len(settings) != batch:
        raise EngineError(f"settings must have one entry per row ({batch}), got {len(settings)!r}")
    for name, mask in (
        ("counts", counts),
        ("banned", banned),
        ("allowed", allowed),
        ("bias", bias),
    ):
        if mask is not None and mask.shape != logits.shape:
            raise EngineError(
                f"{name} must have the logits' shape {tuple(logits.shape)!r}, "
                f"got {tuple(mask.shape)!r}"
            )
    for name, mask in (("banned", banned), ("allowed", allowed)):
        if mask is not None and mask.dtype != torch.bool:
            raise EngineError(f"{name} must be a bool tensor, got {mask.dtype}")
    if bias is not None and not bias.dtype.is_floating_point:
        raise EngineError(f"bias must be a float tensor, got {bias.dtype}")


def _apply_penalties(
    x: torch.Tensor, counts: torch.Tensor, settings: Sequence[SamplingSettings]
) -> torch.Tensor:
    """Repetition, frequency and presence penalties, on the ids of each row's
    context only.

    A context holds at most a few thousand distinct ids, so working on the
    nonzero entries is about three times cheaper than dense [B, V] arithmetic.
    """
    device = x.device
    rep = torch.tensor([s.rep_pen for s in settings], dtype=torch.float32, device=device)
    freq = torch.tensor([s.freq_pen for s in settings], dtype=torch.float32, device=device)
    pres = torch.tensor([s.pres_pen for s in settings], dtype=torch.float32, device=device)
    rows, cols = counts.nonzero(as_tuple=True)
    if rows.numel() == 0:
        return x
    value = x[rows, cols]
    count = counts[rows, cols].to(torch.float32)
    r = rep[rows]
    # Negative counts would make no sense; nonzero() also finds them, so
    # treat only positive counts as present.
    present = count > 0
    count = count.clamp(min=0)
    penalised = torch.where(value > 0, value / r, value * r)
    penalised = penalised - freq[rows] * count - pres[rows]
    x[rows, cols] = torch.where(present, penalised, value)
    return x


def _top_candidates(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of each row and their ids, ordered by value
    descending and, among equal values, by id ascending.

    ``torch.topk`` gives neither a defined order among ties nor a defined
    choice of which tied ids make it in when ties straddle position k; both are
    fixed here, so the candidates are a prefix of one total order per row and
    do not depend on k (nor on the other rows of the batch).
    """
    vocab = x.shape[1]
    if k >= vocab:
        values, ids = torch.sort(x, dim=1, descending=True, stable=True)
        return values, ids
    # One more than needed shows, at no extra cost, which rows have ties
    # straddling position k; only those pay for a look at the whole row.
    values, ids = torch.topk(x, k + 1, dim=1, largest=True, sorted=True)
    straddling = torch.nonzero(values[:, k - 1] == values[:, k]).flatten().tolist()
    values, ids = values[:, :k], ids[:, :k]
    for row in straddling:
        last = values[row, k - 1]
        take = int((values[row] == last).sum())
        ids[row, k - take :] = torch.nonzero(x[row] == last).flatten()[:take]
    # Stable sorts: ids ascending first, then values descending.
    by_id = torch.argsort(ids, dim=1)
    ids = ids.gather(1, by_id)
    values = values.gather(1, by_id)
    by_value = torch.sort(values, dim=1, descending=True, stable=True).indices
    return values.gather(1, by_value), ids.gather(1, by_value)


def _candidates(
    x: torch.Tensor,
    settings: Sequence[SamplingSettings],
    kind: _Kind,
    mus: Sequence[float],
    protected: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature and filters for rows of one (non-greedy) kind, each with
    temperature > 0 and a finite maximum: ``[b, C]`` float64 probabilities and
    the ``[b, C]`` ids they belong to, in the order the draw walks them."""
    device = x.device
    vocab = x.shape[1]
    # temperature_last moves the temperature after the filters (ExLlamaV2
    # passes 1.0 to its softmax then); smoothing_factor divides it.
    temperature = torch.tensor(
        [1.0 if s.temperature_last else s.temperature for s in settings],
        dtype=torch.float64,
        device=device,
    ).unsqueeze(1)
    smoothing = any(s.smoothing_factor > 0 for s in settings)
    factor = row_param(settings, "smoothing_factor", device) if smoothing else None

    if kind == "top_k":
        k_max = min(max(s.top_k for s in settings), vocab)
        values, ids = _top_candidates(x, k_max)
        scaled = _scale(values.to(torch.float64) - values[:, :1].to(torch.float64), factor)
        scaled = scaled / temperature
        # The other kinds take probabilities from a float32 softmax, where
        # exp() of less than about -103 is 0. Dropping such candidates here
        # too (e^-100 is 4e-44: never drawn) keeps top_k a filter that only
        # removes tokens from what the same row without top_k could draw.
        scaled = scaled.masked_fill(scaled < _FLOAT32_EXP_FLOOR, _NEG_INF)
        if any(s.top_k < k_max for s in settings):
            top_k = torch.tensor([s.top_k for s in settings], device=device).unsqueeze(1)
            position = torch.arange(k_max, device=device).unsqueeze(0)
            scaled = scaled.masked_fill(position >= top_k, _NEG_INF)
        probs = torch.softmax(scaled, dim=1)
        return after_filters(_filter(probs, settings), ids, settings, mus, protected), ids

    shifted = _scale(x - x.amax(dim=1, keepdim=True), factor)
    scaled32 = shifted / temperature.to(torch.float32).clamp(min=_TINY32)
    probs_full = torch.softmax(scaled32, dim=1)
    if kind == "plain":
        # Nothing to filter and no skew: the order of the draw does not change
        # the distribution, so id order saves a full sort (the filters after
        # the others need no order either).
        ids = torch.arange(vocab, device=device).expand(x.shape[0], vocab)
        return after_filters(probs_full.to(torch.float64), ids, settings, mus, protected), ids
    probs, ids = _ordered_candidates(x, probs_full, settings)
    return after_filters(_filter(probs, settings), ids, settings, mus, protected), ids


def _scale(shifted: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """Logits less the row's maximum, made quadratic where a row has a
    smoothing factor: ``-factor * (logit - max)**2`` (ExLlamaV2 squares them
    in its softmax and divides the temperature by the factor). Multiplied in
    this order so that the maximum stays 0 and never becomes 0 * inf."""
    if factor is None:
        return shifted
    quadratic = -(shifted * shifted) * factor.to(shifted.dtype)
    return torch.where(factor.to(shifted.dtype) > 0, quadratic, shifted)


def _ordered_candidates(
    x: torch.Tensor, probs_full: torch.Tensor, settings: Sequence[SamplingSettings]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates in descending order for rows with ``top_k == 0``: only a
    prefix of them when the rows' filters provably drop everything after it,
    else the whole vocabulary.

    The kept set of top_p, top_a and min_p is a prefix of the descending order:
    top_p keeps the smallest prefix with mass >= top_p, top_a and min_p keep
    every probability above a threshold. If each row's kept set fits into the
    first k candidates, the rest is never needed (typical, which comes later,
    only removes tokens from the kept set). The probabilities stay those of the
    whole vocabulary, so top_p sees the true mass.
    """
    vocab = x.shape[1]
    for k in _UNBOUNDED_TRIES:
        if k >= vocab:
            break
        ids = _top_candidates(x, k)[1]
        probs = probs_full.gather(1, ids).to(torch.float64)
        if all(_fits(probs[i], s) for i, s in enumerate(settings)):
            return probs, ids
    ids = torch.sort(x, dim=1, descending=True, stable=True).indices
    return probs_full.gather(1, ids).to(torch.float64), ids


def _fits(probs: torch.Tensor, s: SamplingSettings) -> bool:
    """Whether the filters of ``s`` keep only tokens among ``probs`` (the
    first candidates of one row, descending, with the probabilities of the
    whole vocabulary), and give them the same final probabilities as if the
    rest were there.

    top_p's prefix fits when its mass is reached. Otherwise top_a's threshold
    (relative to the probabilities as top_p left them, so only when top_p is
    off) and min_p's (scale-free: a fraction of the maximum) bound the set;
    they fit when the last candidate is already below them.
    """
    top_p = 0 < s.top_p < 1
    if top_p and float(probs.sum()) >= s.top_p:
        return True
    pmax = float(probs[0])
    threshold = s.min_p * pmax
    if not top_p:
        threshold = max(threshold, s.top_a * pmax * pmax)
    elif s.top_a > 0:
        return False
    return threshold > 0 and float(probs[-1]) < threshold


def _filter(probs: torch.Tensor, settings: Sequence[SamplingSettings]) -> torch.Tensor:
    """top_p, top_a, min_p and typical on probabilities whose columns are in
    descending order, so column 0 is each row's argmax. Each filter leaves at
    least one token and renormalises."""
    device = probs.device
    inf = float("inf")

    if any(0 < s.top_p < 1 for s in settings):
        top_p = torch.tensor(
            [s.top_p if 0 < s.top_p < 1 else inf for s in settings],
            dtype=torch.float64,
            device=device,
        ).unsqueeze(1)
        # The smallest prefix whose mass reaches top_p: keep a token while the
        # mass before it is still short of top_p.
        before = probs.cumsum(dim=1) - probs
        keep = before < top_p
        keep[:, 0] = True
        probs = renormalise(probs, keep)

    if any(s.top_a > 0 for s in settings):
        top_a = row_param(settings, "top_a", device)
        pmax = probs[:, :1]
        keep = probs >= top_a * pmax * pmax
        keep[:, 0] = True
        probs = renormalise(probs, keep)

    if any(s.min_p > 0 for s in settings):
        min_p = row_param(settings, "min_p", device)
        keep = probs >= min_p * probs[:, :1]
        keep[:, 0] = True
        probs = renormalise(probs, keep)

    if any(0 < s.typical < 1 for s in settings):
        mass = torch.tensor(
            [s.typical if 0 < s.typical < 1 else inf for s in settings],
            dtype=torch.float64,
            device=device,
        ).unsqueeze(1)
        # Locally typical sampling (Meister et al. 2022): order tokens by how far
        # their surprisal is from the entropy, keep the smallest such set whose
        # mass reaches `typical`.
        surprisal = -torch.log(probs)
        entropy = -torch.special.xlogy(probs, probs).sum(dim=1, keepdim=True)
        distance = (surprisal - entropy).abs()  # inf for zero-probability tokens
        order = torch.argsort(distance, dim=1, stable=True)
        in_order = probs.gather(1, order)
        before = in_order.cumsum(dim=1) - in_order
        keep_in_order = before < mass
        keep_in_order[:, 0] = True
        keep = torch.zeros_like(keep_in_order).scatter_(1, order, keep_in_order)
        probs = renormalise(probs, keep)

    return probs


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=generator.device))


def _draw(
    probs: torch.Tensor,
    ids: torch.Tensor,
    settings: Sequence[SamplingSettings],
    uniforms: Sequence[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw, one uniform per row, over candidates in descending
    order of probability; ``skew`` bends the uniform as ExLlamaV2 does
    (``u ** exp(-skew)``: skew > 0 leans to less likely tokens). Returns the
    ids drawn and their columns in ``probs``."""
    device = probs.device
    u = torch.tensor(list(uniforms), dtype=torch.float64, device=device).unsqueeze(1)
    if any(s.skew != 0 for s in settings):
        u = u ** torch.exp(-row_param(settings, "skew", device))
    cdf = probs.cumsum(dim=1)
    total = cdf[:, -1:].contiguous()
    index = torch.searchsorted(cdf, u * total, right=True)
    # Rounding may put the target at the very top of the CDF; the last
    # candidate with a nonzero probability (the first to reach the total) is
    # then the right answer, never a zero-probability one, which may be banned.
    last = torch.searchsorted(cdf, total, right=False)
    index = torch.minimum(index, last)
    return ids.gather(1, index).squeeze(1), index.squeeze(1)
