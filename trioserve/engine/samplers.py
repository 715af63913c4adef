"""The parts of the samplers that need more than one step's logits: DRY,
which reads the job's history, and the token sets that DRY and XTC take from
the tokenizer; and the steps after the filters (mirostat, which carries its
mu from step to step in a :class:`RowState`, the temperature after the
filters, and XTC), which :mod:`trioserve.engine.sampling` applies with
:func:`after_filters`.

:mod:`trioserve.engine.sampling` samples a batch from its logits; what it
cannot know -- which earlier tokens a repeat would extend, which ids break a
repeat, which ids XTC must leave alone, a job's ``logit_bias`` -- is computed
here, per job, and handed to it as an additive bias or a mask. Both engines
take their token sets from here, so ExLlamaV2 is given exactly the ids the
CPU engine uses.

DRY follows ExLlamaV2 0.3.2 (``ExLlamaV2Sampler.apply_dry``): it finds the
longest suffix of the context that occurred earlier, and penalises each token
that followed an earlier occurrence of it, once per occurrence. The few places
where the CPU engine differs are in docs/sampling.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs
import torch
from torch import Tensor

from trioserve.engine.tokenizer import Tokenizer
from trioserve.vocabulary.sampling import SamplingSettings

__all__ = [
    "DRY_MAX_NGRAM",
    "DryHistory",
    "RowState",
    "after_filters",
    "bias_row",
    "follow_surprise",
    "mirostat_mus",
    "renormalise",
    "row_param",
    "sequence_breaker_ids",
    "xtc_protected_ids",
]

#: ExLlamaV2's ``dry_max_ngram``: its trie holds n-grams of at most 20 tokens,
#: a repeated suffix and the token after it, so a suffix of at most 19 tokens
#: is measured.
DRY_MAX_NGRAM: Final = 20
_MAX_SUFFIX: Final = DRY_MAX_NGRAM - 1

#: Breaker sets computed, per tokenizer and list of strings. Requests repeat
#: the same few lists; a bound keeps a stream of distinct lists from growing it.
_BREAKER_CACHE_SIZE: Final = 64
_breakers: dict[tuple[int, tuple[str, ...]], frozenset[int]] = {}


def sequence_breaker_ids(tokenizer: Tokenizer, breakers: Sequence[str]) -> frozenset[int]:
    """DRY's sequence breakers as token ids: every id whose text contains
    one of ``breakers``, and every special token (a chat template's turn
    markers end a repeat, as ExLlamaV2's default set has them)."""
    key = (id(tokenizer), tuple(breakers))
    found = _breakers.get(key)
    if found is None:
        found = tokenizer.ids_containing(breakers) | tokenizer.special_ids
        if len(_breakers) >= _BREAKER_CACHE_SIZE:
            _breakers.clear()
        _breakers[key] = found
    return found


def xtc_protected_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids XTC never removes: those whose text holds a newline, and the
    special tokens (ExLlamaV2's ``get_default_xtc_mask_tokens``), so that XTC
    cannot stop a model from ending a line or a turn."""
    return tokenizer.ids_containing(("\n",)) | tokenizer.special_ids


def bias_row(pairs: Sequence[tuple[int, float]], vocab_size: int) -> Tensor:
    """``logit_bias`` as a ``[vocab_size]`` float32 row to add to the logits.
    The ids must be below ``vocab_size`` (the engines check it first)."""
    row = torch.zeros(vocab_size, dtype=torch.float32)
    if pairs:
        ids, values = zip(*pairs, strict=True)
        row[list(ids)] = torch.tensor(values, dtype=torch.float32)
    return row


@attrs.define(eq=False)
class DryHistory:
    """One job's context (prompt and generated ids) as DRY reads it.

    The ids are kept in a tensor sized for the whole job, so each step's
    search is a few vectorised passes over the window, whatever its length.
    """

    #: ``[capacity]`` int64: the context, then room for every new token.
    _tokens: Tensor
    #: ``[vocab]`` bool: the sequence breakers.
    _breaker: Tensor
    _length: int = 0

    @classmethod
    def start(
        cls, context: Sequence[int], capacity: int, breakers: frozenset[int], vocab_size: int
    ) -> DryHistory:
        tokens = torch.zeros(max(capacity, len(context)), dtype=torch.int64)
        tokens[: len(context)] = torch.tensor(list(context), dtype=torch.int64)
        breaker = torch.zeros(vocab_size, dtype=torch.bool)
        inside = [i for i in breakers if i < vocab_size]
        if inside:
            breaker[inside] = True
        return cls(tokens=tokens, breaker=breaker, length=len(context))

    def append(self, token: int) -> None:
        if self._length == self._tokens.numel():
            # More tokens than announced (not in the engines): grow.
            self._tokens = torch.cat([self._tokens, torch.zeros_like(self._tokens)])
        self._tokens[self._length] = token
        self._length += 1

    def penalties(self, settings: SamplingSettings) -> tuple[Tensor, Tensor] | None:
        """DRY's penalties for the next token: ``(ids, values)``, the values
        positive (to be subtracted from the logits), or None when no token
        is penalised.

        The longest suffix of the context (at most 19 tokens, none of them a
        breaker) that also ends at an earlier position q of the window, with
        a token that is not a breaker at q + 1, sets the length L; each token
        that followed such an occurrence of that suffix loses
        ``dry_multiplier * dry_base ** (L - dry_allowed_length)`` per
        occurrence, if L >= dry_allowed_length.
        """
        n = self._length
        if n < 2 or not settings.dry:
            return None
        tokens = self._tokens[:n]
        breaker = self._breaker
        last = int(tokens[n - 1])
        if breaker[last]:
            return None  # every suffix holds a breaker
        start = 0 if settings.dry_range == 0 else max(0, n - settings.dry_range)
        # Ends of earlier occurrences of the last token, each followed by a
        # token of the context (the follower may be the last token itself:
        # "A A" is a repeat of "A" that "A" would extend).
        ends = torch.nonzero(tokens[start : n - 1] == last).flatten() + start
        if ends.numel() == 0:
            return None
        followers = tokens[ends + 1]
        usable = ~breaker[followers]
        ends, followers = ends[usable], followers[usable]
        if ends.numel() == 0:
            return None
        length = torch.ones_like(ends)
        alive = torch.ones_like(ends, dtype=torch.bool)
        for back in range(1, min(_MAX_SUFFIX, n - 1)):
            reference = int(tokens[n - 1 - back])
            if breaker[reference]:
                break
            earlier = ends - back
            alive &= earlier >= start
            alive &= tokens[earlier.clamp(min=0)] == reference
            if not bool(alive.any()):
                break
            length += alive
        best = int(length.max())
        if best < settings.dry_allowed_length:
            return None
        ids, counts = torch.unique(followers[length == best], return_counts=True)
        scale = settings.dry_multiplier * settings.dry_base ** (best - settings.dry_allowed_length)
        return ids, counts.to(torch.float32) * scale


# --- the steps after the filters ------------------------------------------------


@attrs.define(eq=False)
class RowState:
    """What the sampler carries for one job from one step to the next."""

    #: Mirostat's cut-off, in bits: None until the job's first mirostat draw,
    #: which starts from ``2 * mirostat_tau`` as ExLlamaV2 does.
    mu: float | None = None


def mirostat_mus(
    settings: Sequence[SamplingSettings], states: Sequence[RowState] | None, rows: Sequence[int]
) -> list[float]:
    """Each row's mirostat mu (0 for rows without mirostat)."""
    mus = []
    for s, row in zip(settings, rows, strict=True):
        mu = None if states is None else states[row].mu
        mus.append(0.0 if not s.mirostat else 2.0 * s.mirostat_tau if mu is None else mu)
    return mus


def follow_surprise(
    probs: torch.Tensor,
    chosen: torch.Tensor,
    settings: Sequence[SamplingSettings],
    mus: Sequence[float],
    states: Sequence[RowState],
) -> None:
    """Mirostat's update after the draw: ``mu += eta * (tau - surprise)``,
    the surprise being ``-log2 p`` of the drawn token in the distribution it
    was drawn from."""
    total = probs.sum(dim=1)
    picked = probs.gather(1, chosen.unsqueeze(1)).squeeze(1) / total
    surprise = (-torch.log2(picked)).tolist()
    for s, mu, state, bits in zip(settings, mus, states, surprise, strict=True):
        if s.mirostat:
            state.mu = mu + s.mirostat_eta * (s.mirostat_tau - bits)


def after_filters(
    probs: torch.Tensor,
    ids: torch.Tensor,
    settings: Sequence[SamplingSettings],
    mus: Sequence[float],
    protected: torch.Tensor | None,
) -> torch.Tensor:
    """The steps after the filters, in ExLlamaV2's order: mirostat, the
    temperature after the filters (``temperature_last`` or dynamic), then
    XTC. None of them needs the candidates in order: each works on values
    (a threshold, the row's maximum, its least likely token over a
    threshold), so rows drawn in id order need no sort for them. Rows that
    use none of them cost one look at their settings."""
    if any(s.mirostat for s in settings):
        probs = _mirostat(probs, settings, mus)
    if any(s.temperature_last or s.dynamic_temperature for s in settings):
        probs = _late_temperature(probs, settings)
    if any(s.xtc_probability > 0 for s in settings):
        guarded = None if protected is None else protected[ids]
        probs = _xtc(probs, settings, guarded)
    return probs


def _mirostat(
    probs: torch.Tensor, settings: Sequence[SamplingSettings], mus: Sequence[float]
) -> torch.Tensor:
    """Mirostat v2's cut: keep the tokens whose surprise ``-log2 p`` is at
    most mu (p >= 2**-mu), and the likeliest token always."""
    device = probs.device
    on = torch.tensor([s.mirostat for s in settings], device=device).unsqueeze(1)
    target = torch.exp2(-torch.tensor(mus, dtype=torch.float64, device=device)).unsqueeze(1)
    keep = (probs >= target) | (probs == probs.amax(dim=1, keepdim=True)) | ~on
    return renormalise(probs, keep)


def _late_temperature(probs: torch.Tensor, settings: Sequence[SamplingSettings]) -> torch.Tensor:
    """``p ** (1 / T)``, renormalised, with T the row's temperature
    (``temperature_last``) or, when ``max_temp > min_temp``, the dynamic one:
    ``min_temp + (max_temp - min_temp) * (H / ln n) ** temp_exponent``, H the
    entropy of the kept tokens and n their number. Rows with neither keep
    their probabilities."""
    device = probs.device
    rows: list[float] = []
    kept = probs > 0
    normalised: list[float] = []
    if any(s.dynamic_temperature for s in settings):
        entropy = -torch.special.xlogy(probs, probs).sum(dim=1)
        count = kept.sum(dim=1).to(torch.float64)
        # One kept token: nothing to spread (ExLlamaV2 skips the step there).
        ratio = torch.where(count > 1, entropy / count.log().clamp(min=1e-300), 0.0)
        normalised = ratio.clamp(0.0, 1.0).tolist()
    for i, s in enumerate(settings):
        if s.dynamic_temperature:
            h = normalised[i]
            rows.append(s.min_temp + (s.max_temp - s.min_temp) * h**s.temp_exponent)
        elif s.temperature_last:
            rows.append(s.temperature)
        else:
            rows.append(1.0)
    temperature = torch.tensor(rows, dtype=torch.float64, device=device).unsqueeze(1)
    # In log space against the row's maximum: a tiny temperature sends every
    # smaller probability to 0 and keeps the maximum, instead of 0/0.
    log_probs = torch.log(probs)
    top = log_probs.amax(dim=1, keepdim=True)
    bent = torch.exp((log_probs - top) / temperature.clamp(min=1e-300))
    bent = torch.where(kept, bent, 0.0)
    same = temperature == 1.0
    return torch.where(same, probs, bent / bent.sum(dim=1, keepdim=True))


def _xtc(
    probs: torch.Tensor, settings: Sequence[SamplingSettings], protected: torch.Tensor | None
) -> torch.Tensor:
    """Exclude Top Choices: where at least two tokens (not protected) have
    ``p >= xtc_threshold``, all of them but the least likely are removed with
    probability ``xtc_probability``.

    Applied as ExLlamaV2 applies it, to the distribution rather than by a
    second random number: the row draws from ``(1 - q) * p + q * p'``, p'
    being p without those tokens, renormalised -- the same distribution as
    removing them when a coin of probability q says so, and the row still
    takes one uniform per step."""
    device = probs.device
    chance = row_param(settings, "xtc_probability", device)
    threshold = row_param(settings, "xtc_threshold", device)
    over = (probs >= threshold) & (probs > 0) & (chance > 0)
    if protected is not None:
        over &= ~protected
    least = torch.where(over, probs, float("inf")).amin(dim=1, keepdim=True)
    # Every token tied for the least likely over the threshold stays.
    removed = over & (probs > least)
    fires = removed.any(dim=1, keepdim=True)
    if not bool(fires.any()):
        return probs
    without = renormalise(probs, ~removed)
    mixed = (1.0 - chance) * probs + chance * without
    return torch.where(fires, mixed, probs)


def renormalise(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``probs`` where ``keep`` (``[B, C]`` bool), each row summing to 1."""
    kept = probs * keep
    return kept / kept.sum(dim=1, keepdim=True)


def row_param(
    settings: Sequence[SamplingSettings], name: str, device: torch.device
) -> torch.Tensor:
    """The setting ``name`` of each row, as a ``[B, 1]`` float64 column."""
    return torch.tensor(
        [float(getattr(s, name)) for s in settings], dtype=torch.float64, device=device
    ).unsqueeze(1)
