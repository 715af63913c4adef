"""Log probabilities for the CPU engine: computing them for the rows that ask,
and releasing each generated token's entry together with its text.

Which distribution (docs/sampling.md, "Log probabilities"): the model's
log-softmax over the vocabulary after the request's ``logit_bias``, its
banned ids, token healing's mask and its constraint's mask, before the
repetition, frequency and presence penalties, DRY, temperature and every
filter: what the model and the request's hard rules say, not how the
sampler then bends it (vLLM's default, ``raw_logprobs``, also leaves out
the penalties and temperature). Prompt tokens' entries are the model's
plain log-softmax: no bias or mask applies to a prompt.

**Which entries go out with which text.** A generated token's entry is
released in the update whose text completes the token's own text: the text
stream holds back the start of a possible stop string, so an entry waits
while any of its token's text is held. When a stop string ends the job, the
tokens whose text starts before the stop string (the released text) keep
their entries, and the tokens whose text lies wholly within the stop string
or after it carry none; the stop token (EOS, or a request's stop token id)
carries none either, as its text is never emitted. A token that ends inside
an incomplete UTF-8 character has produced no text yet: its entry goes out
with the text before it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from functools import lru_cache

import torch
from torch import Tensor

from trioserve.engine.tokenizer import Tokenizer
from trioserve.vocabulary.results import TokenLogprob

__all__ = ["EntryQueue", "Exact", "RawLogprob", "TokenTexts", "prompt_logprobs", "row_logprobs"]

#: One token's figures before they get their texts: its id, its log
#: probability, and the top alternatives as (id, logprob).
RawLogprob = tuple[int, float, list[tuple[int, float]]]
#: The exact float32 logits of ids ``[R, K]`` of rows ``[R]`` (-> ``[R, K]``).
Exact = Callable[[Tensor, Tensor], Tensor]

_NEG_INF = float("-inf")
#: Prompt positions whose log-softmax is computed at once.
_PROMPT_ROWS = 128


def row_logprobs(
    logits: Tensor,
    rows: Sequence[int],
    ids: Sequence[int],
    tops: Sequence[int],
    *,
    bias: Sequence[Tensor | None],
    banned: Tensor | None,
    allowed: Tensor | None,
    exact: Exact | None = None,
) -> list[RawLogprob]:
    """The entries of the sampled ``ids`` (one per row of ``rows``, rows of
    ``logits``), each with its row's ``tops`` alternatives: one
    log-softmax over the rows that ask, vectorised. ``bias`` (one per row of
    ``rows``) is each row's ``logit_bias`` row; ``banned`` and ``allowed``
    (``[B, V]`` over all of ``logits``' rows) are the step's masks.

    ``logits`` are rounded to bfloat16 away from each row's maximum (see
    ``llama.logits``); with ``exact``, the sampled token's and the
    alternatives' logits are computed exactly first, so that the figures
    reported carry no rounding but the normaliser's (the rest of the
    vocabulary's rounding, a few thousandths at most in practice)."""
    index = torch.tensor(list(rows), dtype=torch.int64, device=logits.device)
    x = logits.index_select(0, index).float()  # a copy: index_select makes one
    shift = None
    if any(b is not None for b in bias):
        zero = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
        shift = torch.stack([zero if b is None else b.to(x.device) for b in bias])
        x += shift
    masked = banned is not None or allowed is not None
    if banned is not None:
        x.masked_fill_(banned.index_select(0, index.to(banned.device)), _NEG_INF)
    if allowed is not None:
        x.masked_fill_(~allowed.index_select(0, index.to(allowed.device)), _NEG_INF)
    k = max(tops, default=0)
    wanted = torch.tensor([list(ids)], device=x.device).T  # [R, 1]: the sampled ids
    if k > 0:
        wanted = torch.cat([wanted, x.topk(k, dim=-1).indices], dim=1)  # [R, 1 + k]
    if exact is None:
        fine = x.gather(1, wanted)
    else:
        # Few calls on purpose: each small torch call costs a thread wake-up.
        fine = exact(index, wanted)
        if shift is not None:
            fine += shift.gather(1, wanted)
        if masked:
            fine = torch.where(torch.isfinite(x.gather(1, wanted)), fine, _NEG_INF)
        x.scatter_(1, wanted, fine)
    values = (fine - torch.logsumexp(x, dim=-1, keepdim=True)).tolist()
    chosen = wanted.tolist()
    out: list[RawLogprob] = []
    for i, token in enumerate(ids):
        # The k best by the step's logits, ordered by their exact figures
        # (ties towards the lower id); masked tokens (-inf) are no
        # alternatives, so a constrained row may list fewer.
        top = sorted(
            (
                (other, v)
                for other, v in zip(chosen[i][1:], values[i][1:], strict=True)
                if v != _NEG_INF
            ),
            key=lambda pair: (-pair[1], pair[0]),
        )
        out.append((token, values[i][0], top[: tops[i]]))
    return out


def _top(lp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest per row, largest first, ties towards the lower id
    (topk alone does not promise an order among equal values)."""
    values, indices = lp.topk(k, dim=-1)
    # A stable sort by value after sorting by id puts equal values in id order.
    order = torch.argsort(indices, dim=-1)
    values, indices = values.gather(1, order), indices.gather(1, order)
    order = torch.argsort(values, dim=-1, descending=True, stable=True)
    return values.gather(1, order), indices.gather(1, order)


def prompt_logprobs(logits_of: Tensor, targets: Sequence[int], top: int) -> list[RawLogprob]:
    """The entries of ``targets`` given the logits ``logits_of`` (``[N, V]``,
    row i predicts ``targets[i]``): the plain log-softmax, computed
    :data:`_PROMPT_ROWS` rows at a time and keeping only the figures asked for."""
    out: list[RawLogprob] = []
    for start in range(0, len(targets), _PROMPT_ROWS):
        part = targets[start : start + _PROMPT_ROWS]
        lp = torch.log_softmax(logits_of[start : start + len(part)].float(), dim=-1)
        chosen = lp.gather(1, torch.tensor([list(part)], device=lp.device).T)[:, 0].tolist()
        ids: list[list[int]] = [[] for _ in part]
        values: list[list[float]] = [[] for _ in part]
        if top > 0:
            v, i = _top(lp, top)
            ids, values = i.tolist(), v.tolist()
        for row, token in enumerate(part):
            out.append((token, chosen[row], list(zip(ids[row], values[row], strict=True))))
    return out


class TokenTexts:
    """Each token's text and bytes, for entries (cached: a step's entries
    name the same few thousand tokens again and again)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cached = lru_cache(maxsize=65536)(self._text)

    def _text(self, token: int) -> tuple[str, bytes]:
        raw = self._tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw

    def first(self, token: int) -> TokenLogprob:
        """The entry of a prompt's first token: no log probability."""
        text, data = self._cached(token)
        return TokenLogprob(token, text, data, None)

    def entry(self, raw: RawLogprob) -> TokenLogprob:
        token, value, top = raw
        text, data = self._cached(token)
        alternatives = []
        for other, other_value in top:
            other_text, other_data = self._cached(other)
            alternatives.append(TokenLogprob(other, other_text, other_data, other_value))
        return TokenLogprob(token, text, data, value, tuple(alternatives))


class EntryQueue:
    """A job's generated tokens' entries waiting for their text (the rule is
    in the module docstring). Positions count characters of the job's text
    after token healing's skip: ``start`` and ``end`` of each token's part."""

    def __init__(self) -> None:
        self._waiting: deque[tuple[int, int, TokenLogprob]] = deque()
        #: Characters produced so far (released plus held for stop strings).
        self._produced = 0

    def add(self, entry: TokenLogprob, produced: int) -> None:
        """Queue the entry of a token after which ``produced`` characters
        have come out of the text stream (released or held as a possible
        stop string)."""
        start = self._produced
        self._produced = max(start, produced)
        self._waiting.append((start, self._produced, entry))

    def release(self, released: int) -> tuple[TokenLogprob, ...]:
        """The entries whose text lies within the first ``released`` characters."""
        out = []
        while self._waiting and self._waiting[0][1] <= released:
            out.append(self._waiting.popleft()[2])
        return tuple(out)

    def cut(self, released: int) -> tuple[TokenLogprob, ...]:
        """A stop string ended the text after ``released`` characters: the
        entries of the tokens whose text starts before it; the rest are dropped."""
        out = tuple(entry for start, _, entry in self._waiting if start < released)
        self._waiting.clear()
        return out

    def flush(self) -> tuple[TokenLogprob, ...]:
        """Everything held was released: every entry goes."""
        out = tuple(entry for _, _, entry in self._waiting)
        self._waiting.clear()
        return out
