"""Speculative decoding by prompt lookup, for the CPU engine.

A decoding job often writes again what its context already holds: a
summary quotes its source, an edited program repeats most of the program,
a list repeats its pattern. Prompt lookup (llama.cpp's ``lookup`` and
vLLM's ``ngram`` method) bets on that: the last few tokens of the job's
context (its prompt, then every token it sampled) are looked up earlier in
the same context, and the tokens that followed them there are the *drafts*.
The engine feeds the pending token and its drafts in one forward (a row of
the batch each, all in the job's slot) and samples position after position
with the job's own sampler, exactly as plain decoding would, as long as each
sampled token equals the draft fed after it: each agreement is one more
token from the same forward; the first token that differs is kept (it is
what plain decoding samples there) and ends the job's step. The keys and
values of the drafts after it stay in the slot past ``cached`` and are
written over later.

Why this changes no output, for any sampler. Each position is sampled from
logits bit for bit those of a plain decode step (each draft row attends
over the slot as a decode row does: see ``trioserve.engine.cpu.attention._spans``),
by the same call with the same state (penalty counts, DRY history,
mirostat's mu, the constraint's matcher, the text stream and its stop
strings, all updated by the tokens accepted before it), and each sampled
row draws the same one uniform from the job's generator as plain decoding.
So a seeded or greedy job gives token for token the text it gives without
speculation. For a sampled job this is the speculative-sampling rule for a
draft that is a point mass: accepting the draft ``t`` when the sample from
the full distribution ``p`` equals it happens with probability ``p(t)``,
and a sample that differs is a draw from ``p`` without ``t``, renormalized:
the residual distribution. Nothing falls back to plain decoding; what
speculation costs is the rows of drafts that are not accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs

from trioserve.vocabulary.results import Failed, TextUpdate, Update

__all__ = [
    "DEFAULT_DRAFT_TOKENS",
    "LONGEST_NGRAM",
    "SHORTEST_NGRAM",
    "SPECULATIVE_MODES",
    "DraftCounts",
    "NgramIndex",
    "SpeculativeMode",
    "draft_budget",
    "merged",
]

SpeculativeMode = Literal["off", "ngram"]
#: What the engine's ``speculative`` setting accepts.
SPECULATIVE_MODES: tuple[SpeculativeMode, ...] = ("off", "ngram")
#: Rows of a forward that cost little more than one (measured on the
#: embedded model, one thread, the forward and the vocabulary projection:
#: each of the second to fourth rows adds a small part of one row's time, a
#: fifth nearly doubles it).
ROW_BLOCK = 4
#: Drafts fed after a job's pending token, at most, per step: one job's
#: rows then fill one block.
DEFAULT_DRAFT_TOKENS = ROW_BLOCK - 1
#: The context's last n tokens are looked up for n from the longest to the
#: shortest (vLLM's ``prompt_lookup_max`` and ``prompt_lookup_min``): a
#: single token recurs everywhere in prose and predicts little.
LONGEST_NGRAM = 3
SHORTEST_NGRAM = 2


class NgramIndex:
    """Where each n-gram of a job's context last ended, for n from
    ``shortest`` to ``longest``, kept up to date as the context grows.

    The context is only ever appended to (a job's prompt, then its tokens),
    so each call indexes the n-grams that ended since the last one: a step
    costs a few dictionary operations per new token, whatever the context's
    length, after one pass over the prompt at the job's first draft.
    """

    def __init__(self, shortest: int = SHORTEST_NGRAM, longest: int = LONGEST_NGRAM) -> None:
        if not 1 <= shortest <= longest:
            raise ValueError(f"need 1 <= shortest <= longest, got {shortest!r}, {longest!r}")
        self.shortest = shortest
        self.longest = longest
        #: n-gram -> the position of its last token, at its latest occurrence
        #: among the positions indexed.
        self._ends: dict[tuple[int, ...], int] = {}
        #: The n-grams ending before this position are indexed.
        self._indexed = 0

    def draft(self, tokens: Sequence[int], most: int) -> tuple[int, ...]:
        """Up to ``most`` tokens that followed, at its latest earlier
        occurrence in ``tokens``, the longest suffix of ``tokens`` that
        occurred before (``longest`` tokens down to ``shortest``); none when
        no such suffix did. ``tokens`` must extend the previous call's."""
        last = len(tokens) - 1
        ends = self._ends
        # Index the n-grams ending before the last token: an occurrence of
        # the suffix ending there is the suffix itself.
        for end in range(self._indexed, last):
            for n in range(self.shortest, min(self.longest, end + 1) + 1):
                ends[tuple(tokens[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, last)
        if most <= 0:
            return ()
        for n in range(min(self.longest, last), self.shortest - 1, -1):
            found = ends.get(tuple(tokens[last + 1 - n :]))
            if found is not None:
                return tuple(tokens[found + 1 : found + 1 + most])
        return ()


def draft_budget(rows: int, draft_tokens: int) -> int:
    """The draft rows a step may add to its ``rows`` decoding jobs' rows:
    those that fill its last block of ``max(ROW_BLOCK, draft_tokens + 1)``
    rows. One stream gets ``draft_tokens`` drafts; four streams (with the
    default) get none, as their forward has no cheap row left: a draft that
    is not taken would cost them nearly a block's time."""
    if draft_tokens <= 0:
        return 0
    return -rows % max(ROW_BLOCK, draft_tokens + 1)


@attrs.define
class DraftCounts:
    """Draft tokens fed and accepted since the engine started."""

    drafted: int = 0
    accepted: int = 0


def merged(updates: Sequence[Update]) -> list[Update]:
    """One job's updates of one step, in order (a TextUpdate per accepted
    token, then perhaps an end), as the one update plain decoding's steps add
    up to: texts and log-probability entries concatenated, the last held text
    and token count. A failure is not merged: it follows the text before it."""
    if not updates:
        return []
    first = updates[0]
    for update in updates[1:]:
        if not isinstance(first, TextUpdate):
            raise ValueError(f"an update follows the end of job {first.job_id!r}")
        if isinstance(update, Failed):
            return [first, update]
        text = first.text + update.text
        if isinstance(update, TextUpdate):
            first = TextUpdate(
                update.job_id,
                text,
                update.held,
                update.generated_tokens,
                first.logprobs + update.logprobs,
            )
        else:
            first = attrs.evolve(update, text=text, logprobs=first.logprobs + update.logprobs)
    return [first]
