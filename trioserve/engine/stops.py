"""Stop strings: the one rule both engines use to find them, and a matcher
that applies it in time proportional to the new text.

A job ends at the first stop string to appear in its generated text. Text
arrives a token at a time, so "first" means the match that starts earliest in
the text not yet released; among matches that start at the same place the
longest wins (it is the same cut, and the longest names what the model wrote).
Both engines report the matched string with this rule, so the same text gives
the same ``stop_string`` on the CPU and through ExLlamaV2.

:func:`earliest_stop` and :func:`partial_stop_length` state the rule plainly;
they cost O(number of stop strings x text) per call. A job's stream instead
feeds each new piece of text to a :class:`StopMatcher`, an Aho-Corasick
automaton over the job's stop strings (built once, and shared between jobs
with the same small set): each character costs amortised O(1) whatever the
number or length of the stop strings, and the matcher gives exactly the answers
of the two functions on the text held so far (a property test checks it).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import attrs

__all__ = [
    "StopAutomaton",
    "StopMatch",
    "StopMatcher",
    "earliest_stop",
    "partial_stop_length",
    "stop_automaton",
]


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


@attrs.frozen
class StopMatch:
    """A stop string found by :meth:`StopMatcher.feed`."""

    #: Where the match starts, relative to the start of the text passed to
    #: this ``feed`` call: negative when it starts in text fed before (the
    #: text a caller held back as a possible stop-string prefix).
    start: int
    stop_string: str


class StopAutomaton:
    """An Aho-Corasick automaton over a set of stop strings. Immutable once
    built, so one automaton serves any number of jobs (each with its own
    :class:`StopMatcher`).

    States are the distinct prefixes of the stop strings (state 0 is the empty
    prefix). For each state the automaton keeps its depth (the prefix's
    length), its failure link (the state of its longest proper suffix that is
    also a prefix) and the length of the longest stop string that ends there
    (0 when none does). Building costs O(total length of the stop strings).
    Empty strings are ignored: they never match, as in :func:`earliest_stop`.
    """

    __slots__ = ("_depth", "_fail", "_out", "_stops", "_terminal", "_trans")

    def __init__(self, stop_strings: Iterable[str]) -> None:
        stops = tuple(dict.fromkeys(s for s in stop_strings if s))
        self._stops = stops
        # A dict of edges per state: about twice as fast to build as one dict
        # keyed by (state, character), for a little more memory.
        trans: list[dict[str, int]] = [{}]
        depth = [0]
        terminal: dict[int, str] = {}
        for stop in stops:
            state = 0
            for char in stop:
                edges = trans[state]
                child = edges.get(char)
                if child is None:
                    child = edges[char] = len(depth)
                    trans.append({})
                    depth.append(depth[state] + 1)
                state = child
            terminal[state] = stop
        fail = [0] * len(depth)
        out = [0] * len(depth)
        # Breadth first, so that a state's failure target is finished first.
        queue = list(trans[0].values())
        head = 0
        while head < len(queue):
            state = queue[head]
            head += 1
            out[state] = depth[state] if state in terminal else out[fail[state]]
            for char, child in trans[state].items():
                target = fail[state]
                while target and char not in trans[target]:
                    target = fail[target]
                fail[child] = trans[target].get(char, 0)
                queue.append(child)
        self._trans = trans
        self._depth = depth
        self._fail = fail
        self._terminal = terminal
        self._out = out

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The non-empty stop strings, first occurrences in order."""
        return self._stops

    @property
    def states(self) -> int:
        return len(self._depth)

    def matcher(self) -> StopMatcher:
        """A fresh matcher at the start of a text."""
        return StopMatcher(self)


#: Automata of at most this many characters in all are cached: the same few
#: stop sets (a chat template's end markers, a client's fixed list) come with
#: request after request. Larger ones are built per job and dropped with it,
#: so that hostile stop sets cannot pin memory in the cache.
_CACHED_CHARS = 4096


@functools.lru_cache(maxsize=64)
def _cached_automaton(stop_strings: tuple[str, ...]) -> StopAutomaton:
    return StopAutomaton(stop_strings)


def stop_automaton(stop_strings: Sequence[str]) -> StopAutomaton:
    """The automaton of ``stop_strings``, shared when the set is small."""
    key = tuple(stop_strings)
    if sum(map(len, key)) <= _CACHED_CHARS:
        return _cached_automaton(key)
    return StopAutomaton(key)


class StopMatcher:
    """The stop-string state of one text fed piece by piece.

    :meth:`feed` returns the match :func:`earliest_stop` would find in the
    text held so far plus the new piece (earliest start, longest at a tie),
    provided the caller held back exactly :attr:`partial_length` characters
    after each feed without a match, as a stream does; without a match,
    :attr:`partial_length` is then :func:`partial_stop_length` of that text.
    After a match the matcher is spent: the caller ends its stream.

    Cost: amortised O(1) per character fed (each failure-link step undoes one
    step of depth gained earlier), independent of the number of stop strings.
    """

    __slots__ = ("_automaton", "_state")

    def __init__(self, automaton: StopAutomaton) -> None:
        self._automaton = automaton
        self._state = 0

    @property
    def partial_length(self) -> int:
        """Length of the longest suffix of the text fed so far that is a
        prefix of a stop string (a proper prefix, when the last feed found no
        match): the text to hold back."""
        return self._automaton._depth[self._state]

    def feed(self, text: str) -> StopMatch | None:
        """Advance over ``text``; the earliest match that ends in it, if any."""
        automaton = self._automaton
        trans = automaton._trans
        fail = automaton._fail
        depth = automaton._depth
        out = automaton._out
        state = self._state
        best_start = best_length = best_state = 0
        for index, char in enumerate(text):
            while True:
                child = trans[state].get(char)
                if child is not None:
                    state = child
                    break
                if state == 0:
                    break
                state = fail[state]
            length = out[state]
            if length:
                start = index - length + 1
                if (
                    not best_length
                    or start < best_start
                    or (start == best_start and length > best_length)
                ):
                    best_start, best_length, best_state = start, length, state
            if best_length and index - depth[state] + 1 > best_start:
                # Every match still growing starts after the best one: none
                # can beat it, so the rest of the text need not be read.
                break
        self._state = state
        if not best_length:
            return None
        # The stop string is the one ending at the state where the match was
        # seen: follow failure links (ever shorter suffixes) to its length.
        while depth[best_state] != best_length:
            best_state = fail[best_state]
        return StopMatch(best_start, automaton._terminal[best_state])
