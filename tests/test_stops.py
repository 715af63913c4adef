"""The stop-string rule (earliest start, longest at a tie) and the incremental
matcher that applies it in O(new text) per piece."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trioserve.engine.stops import (
    StopAutomaton,
    StopMatch,
    earliest_stop,
    partial_stop_length,
    stop_automaton,
)

pytestmark = pytest.mark.unit

# A small alphabet makes overlaps, shared prefixes and repeats common.
_text = st.text(alphabet="abcé😀", max_size=40)
_stops = st.lists(st.text(alphabet="abcé😀", min_size=1, max_size=6), min_size=1, max_size=8)


def simulate(stops: list[str], pieces: list[str]) -> list[tuple[str, object]]:
    """What a stream sees, piece by piece: the simple functions on the held
    text plus the new piece, and the matcher fed only the new piece."""
    matcher = StopAutomaton(stops).matcher()
    held = ""
    seen: list[tuple[str, object]] = []
    for piece in pieces:
        buffer = held + piece
        expected = earliest_stop(buffer, stops)
        got = matcher.feed(piece)
        if expected is not None:
            assert got is not None
            assert (len(held) + got.start, got.stop_string) == expected
            seen.append(("match", expected))
            return seen
        assert got is None
        keep = partial_stop_length(buffer, stops)
        assert matcher.partial_length == keep
        held = buffer[len(buffer) - keep :]
        seen.append(("held", held))
    return seen


@given(_stops, st.lists(_text, max_size=8))
def test_the_matcher_agrees_with_the_simple_rule(stops: list[str], pieces: list[str]) -> None:
    simulate(stops, pieces)


@given(_stops, _text, st.data())
def test_any_split_of_a_text_finds_the_same_stop(
    stops: list[str], text: str, data: st.DataObject
) -> None:
    # Fed one character at a time or in arbitrary pieces, the first match is
    # the one earliest_stop finds in the shortest prefix that holds a match.
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    simulate(stops, pieces)
    simulate(stops, list(text))


@pytest.mark.parametrize(
    ("stops", "pieces", "expected"),
    [
        # A later-ending match that starts earlier wins.
        (["abcd", "bc"], ["abcd"], StopMatch(0, "abcd")),
        # But not one that has not completed in the text seen so far.
        (["abcd", "bc"], ["ab", "c"], StopMatch(-1, "bc")),
        # At the same start the longest wins.
        (["ab", "abc"], ["xabc"], StopMatch(1, "abc")),
        # A match that began in held text: its start is negative.
        (["hello"], ["say hel", "lo!"], StopMatch(-3, "hello")),
        # Shared suffixes of the same length are told apart.
        (["xab", "yab"], ["y", "ab"], StopMatch(-1, "yab")),
        # Duplicates and empty strings change nothing.
        (["", "b", "b"], ["ab"], StopMatch(1, "b")),
    ],
)
def test_examples(stops: list[str], pieces: list[str], expected: StopMatch) -> None:
    matcher = StopAutomaton(stops).matcher()
    results = [matcher.feed(piece) for piece in pieces]
    assert results[:-1] == [None] * (len(pieces) - 1)
    assert results[-1] == expected


def test_held_text_is_the_longest_live_prefix() -> None:
    matcher = StopAutomaton(["\n\nUser:", "###"]).matcher()
    assert matcher.feed("Hello\n") is None
    assert matcher.partial_length == 1
    assert matcher.feed("\nUs") is None
    assert matcher.partial_length == 4
    assert matcher.feed("ually") is None
    assert matcher.partial_length == 0


def test_no_stop_strings_never_match() -> None:
    matcher = StopAutomaton([""]).matcher()
    assert matcher.feed("anything") is None
    assert matcher.partial_length == 0


def test_small_automata_are_shared_and_large_ones_are_not() -> None:
    small = ("</s>", "\n\n")
    assert stop_automaton(small) is stop_automaton(list(small))
    large = tuple(f"{i:05d}" * 200 for i in range(8))
    assert stop_automaton(large) is not stop_automaton(large)


def test_many_long_stop_strings_build_and_match() -> None:
    # The protocol's limits: 64 stop strings of 256 characters.
    stops = [f"{i:02d}" + "x" * 254 for i in range(64)]
    automaton = StopAutomaton(stops)
    # The root, seven first digits, 64 two-digit prefixes, then 254 each.
    assert automaton.states == 1 + 7 + 64 + 64 * 254
    matcher = automaton.matcher()
    assert matcher.feed("x" * 5000) is None
    assert matcher.partial_length == 0
    assert matcher.feed("07" + "x" * 253) is None
    assert matcher.partial_length == 255
    assert matcher.feed("xyz") == StopMatch(-255, stops[7])
