"""Stop strings: the one rule both engines use to find them.

A job ends at the first stop string to appear in its generated text. Text
arrives a token at a time, so "first" means the match that starts earliest in
the text not yet released; among matches that start at the same place the
longest wins (it is the same cut, and the longest names what the model wrote).
Both engines report the matched string with this rule, so the same text gives
the same ``stop_string`` on the CPU and through ExLlamaV2.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["earliest_stop", "partial_stop_length"]


def earliest_stop(text: str, stop_strings: Sequence[str]) -> tuple[int, str] | None:
    """The stop string that occurs first in ``text`` and where it starts.

    Among stop strings that start at the same index, the longest wins. Empty
    stop strings never match. Returns ``None`` when none occurs.
    """
    best: tuple[int, str] | None = None
    for stop in stop_strings:
        if not stop:
            continue
        index = text.find(stop)
        if index < 0:
            continue
        if best is None or (index, -len(stop)) < (best[0], -len(best[1])):
            best = (index, stop)
    return best


def partial_stop_length(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a
    stop string: text that must be held, because a match may complete there."""
    longest = 0
    for stop in stop_strings:
        if not stop:
            continue
        # Only suffixes longer than the best so far matter, and a suffix must
        # start with the stop string's first character.
        first = max(len(text) - len(stop) + 1, 0)
        for begin in range(first, len(text) - longest):
            if text[begin] == stop[0] and stop.startswith(text[begin:]):
                longest = len(text) - begin
                break
    return longest
