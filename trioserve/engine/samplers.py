"""The parts of the samplers that need more than one step's logits: DRY,
which reads the job's history, and the token sets that DRY and XTC take from
the tokenizer.

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

from trioserve.engine.base import SamplingSettings
from trioserve.engine.tokenizer import Tokenizer

__all__ = [
    "DRY_MAX_NGRAM",
    "DryHistory",
    "bias_row",
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
