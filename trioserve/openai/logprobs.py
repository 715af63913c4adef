"""OpenAI's log-probability fields: reading them from a body, and writing
entries in chat's shape and in the legacy completions' shape. No I/O.

* Chat: ``logprobs: true`` with ``top_logprobs`` 0-20 answers
  ``choices[0].logprobs = {"content": [{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}]}], "refusal": null}``, also in
  each streamed chunk (the entries of that chunk's text).
* Completions: ``logprobs`` 0-5 answers ``{"tokens", "token_logprobs",
  "top_logprobs" (one object of token text -> logprob per token),
  "text_offset"}``. With ``echo: true`` the prompt's tokens come first (the
  first one's logprob and alternatives are null), and ``max_tokens: 0``
  then only scores the prompt: how lm-evaluation-harness asks for
  loglikelihoods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import attrs

from trioserve.vocabulary.results import MAX_TOP_LOGPROBS, TokenLogprob

from .errors import invalid as _invalid

__all__ = [
    "COMPLETIONS_MAX_LOGPROBS",
    "LegacyLogprobs",
    "LogprobsAsked",
    "chat_logprobs",
    "read_chat_logprobs",
    "read_completion_logprobs",
]

#: OpenAI's bound on a completion's ``logprobs``.
COMPLETIONS_MAX_LOGPROBS: Final = 5


@attrs.frozen
class LogprobsAsked:
    """What a request asked for: alternatives per generated token (None: no
    log probabilities), and, for a completion, whether ``max_tokens`` was 0."""

    top: int | None = None
    score_only: bool = False


def _int(name: str, value: Any, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
        raise _invalid(f"{name} must be an integer from 0 to {hi}, got {value!r}"[:200], name)
    return value


def read_chat_logprobs(obj: dict[str, Any]) -> LogprobsAsked:
    """Take ``logprobs`` and ``top_logprobs`` out of a chat body."""
    flag = obj.pop("logprobs", None)
    top = obj.pop("top_logprobs", None)
    if flag is not None and not isinstance(flag, bool):
        raise _invalid(f"logprobs must be true or false, got {flag!r}"[:200], "logprobs")
    if top is not None:
        top = _int("top_logprobs", top, MAX_TOP_LOGPROBS)
        if top > 0 and flag is not True:
            raise _invalid("top_logprobs needs logprobs: true", "top_logprobs")
    return LogprobsAsked(top or 0) if flag else LogprobsAsked()


def read_completion_logprobs(obj: dict[str, Any]) -> LogprobsAsked:
    """Take ``logprobs`` (and ``max_tokens`` 0) out of a completions body."""
    value = obj.pop("logprobs", None)
    top = obj.get("top_logprobs")
    if top is not None and top != 0:
        raise _invalid(
            "top_logprobs is chat's field: a completion takes logprobs: N", "top_logprobs"
        )
    obj.pop("top_logprobs", None)
    asked = None
    if value is not None and value is not False:  # false: OpenAI's old "none"
        asked = _int("logprobs", value, COMPLETIONS_MAX_LOGPROBS)
    max_tokens = obj.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens == 0:
        if asked is None or obj.get("echo") is not True:
            raise _invalid(
                "max_tokens may be 0 only with echo: true and logprobs (to score the prompt)",
                "max_tokens",
            )
        if obj.get("stream") is True:
            raise _invalid("max_tokens 0 scores the prompt and cannot be streamed", "stream")
        del obj["max_tokens"]
        return LogprobsAsked(asked, score_only=True)
    if asked is not None and obj.get("echo") is True and obj.get("stream") is True:
        raise _invalid("echo with logprobs cannot be streamed here", "stream")
    return LogprobsAsked(asked)


def _one(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": entry.text, "logprob": entry.logprob, "bytes": list(entry.bytes)}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs`` object."""
    return {
        "content": [{**_one(e), "top_logprobs": [_one(t) for t in e.top]} for e in entries],
        "refusal": None,
    }


@attrs.define
class LegacyLogprobs:
    """The legacy completions ``logprobs`` object of successive pieces of
    text: ``text_offset`` counts on from piece to piece."""

    offset: int = 0

    def of(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        offsets = []
        for entry in entries:
            offsets.append(self.offset)
            self.offset += len(entry.text)
        return {
            "tokens": [e.text for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            # The prompt's first token has no figures: null, as OpenAI's.
            "top_logprobs": [
                None if e.logprob is None else {t.text: t.logprob for t in e.top} for e in entries
            ],
            "text_offset": offsets,
        }
