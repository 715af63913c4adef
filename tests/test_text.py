"""Tests of trioserve.engine.text on real tokenizers trained here.

Two `tokenizers` tokenizers are trained on a few hundred lines of mixed ASCII,
CJK and emoji text: a byte-level BPE (as SmolLM2 and Llama 3 use; its tokens
can hold part of a UTF-8 character) and a Metaspace BPE (SentencePiece style:
its decoder drops the leading space of the first token it sees).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trioserve.engine.text import StreamEndedError, StreamPiece, TextStream
from trioserve.errors import ConfigError, TrioserveError

pytestmark = pytest.mark.unit

FFFD = "\ufffd"
ASCII_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "hello",
    "world",
    "stop",
    "end",
    "token",
    "stream",
    "alpha",
    "beta",
    "gamma",
    "delta",
    "said",
    "done",
]
CJK = "中文字符测试你好世界日本語のテキスト한국어텍스트"
EMOJI = ["😀", "🎉", "🚀", "🌍", "👍🏽", "❤️‍🔥", "🇫🇷"]
SPECIALS = ["<|endoftext|>", "<|im_start|>"]


def _corpus() -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(400):
        parts = []
        for _ in range(rng.randint(3, 12)):
            r = rng.random()
            if r < 0.5:
                parts.append(rng.choice(ASCII_WORDS))
            elif r < 0.8:
                parts.append("".join(rng.choice(CJK) for _ in range(rng.randint(1, 4))))
            else:
                parts.append("".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 2))))
        lines.append(" ".join(parts) + rng.choice([".", "!", "?", "", "\n"]))
    return lines


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok


def _metaspace() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>"], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok


BYTE_LEVEL = _byte_level()
METASPACE = _metaspace()


def bl_decode(ids: Sequence[int]) -> str:
    return BYTE_LEVEL.decode(list(ids), skip_special_tokens=False)


def bl_encode(text: str) -> list[int]:
    return BYTE_LEVEL.encode(text, add_special_tokens=False).ids


def ms_decode(ids: Sequence[int]) -> str:
    return METASPACE.decode(list(ids), skip_special_tokens=False)


def _byte_token(byte: int) -> int:
    """The byte-level token of one raw byte (GPT-2's byte-to-character map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if byte in printable:
        char = chr(byte)
    else:
        char = chr(256 + [b for b in range(256) if b not in printable].index(byte))
    token = BYTE_LEVEL.token_to_id(char)
    assert token is not None
    return token


class RecordingDecode:
    """The byte-level decode, recording the longest window it was asked for."""

    def __init__(self) -> None:
        self.longest = 0

    def __call__(self, ids: Sequence[int]) -> str:
        self.longest = max(self.longest, len(ids))
        return bl_decode(ids)


# Texts: the corpus' words and characters, any other character (split into
# bytes by the tokenizer), and the special tokens' text.
pieces = st.one_of(
    st.sampled_from(ASCII_WORDS),
    st.sampled_from(list(CJK)),
    st.sampled_from(EMOJI),
    st.sampled_from([" ", "\n", ".", "!", " 中", "é", *SPECIALS]),
    st.characters(codec="utf-8", exclude_characters=FFFD),
)
texts = st.lists(pieces, max_size=25).map("".join)


def _push_all(stream: TextStream, ids: Sequence[int]) -> tuple[list[StreamPiece], list[str]]:
    """Push ids one by one; return the pieces and the held text after each."""
    out: list[StreamPiece] = []
    held: list[str] = []
    for token in ids:
        piece = stream.push([token])
        out.append(piece)
        held.append(stream.held)
        if piece.stop_string is not None:
            break
    return out, held


@given(texts)
@settings(deadline=None)
def test_chunks_concatenate_to_the_decoded_text(text: str) -> None:
    ids = bl_encode(text)
    assert bl_decode(ids) == text  # byte-level BPE round-trips
    stream = TextStream(bl_decode)
    pieces_, held = _push_all(stream, ids)
    released = ""
    for n, (piece, now_held) in enumerate(zip(pieces_, held, strict=True), start=1):
        assert piece.stop_string is None
        assert FFFD not in piece.text
        released += piece.text
        # Only an incomplete character is held, and nothing is lost.
        assert set(now_held) <= {FFFD}
        assert released + now_held == bl_decode(ids[:n])
    rest = stream.flush()
    assert released + rest == text
    assert stream.flush() == ""
    assert stream.held == ""


def _expected_stop(ids: Sequence[int], stops: Sequence[str]) -> tuple[str, str] | None:
    """Reference: the first token after which the text contains a stop
    string; of the stop strings found then, the one that starts first (at
    equal starts the longest); and the text before it."""
    for n in range(1, len(ids) + 1):
        text = bl_decode(ids[:n]).rstrip(FFFD)
        found = [(text.find(s), -len(s), s) for s in stops if s in text]
        if found:
            index, _, stop = min(found)
            return text[:index], stop
    return None


@given(
    texts,
    st.lists(st.tuples(st.integers(0, 40), st.integers(1, 8)), min_size=1, max_size=2),
    st.lists(st.text(min_size=1, max_size=4), max_size=2),
)
@settings(deadline=None)
def test_stop_strings_cut_at_the_first_occurrence(
    text: str, cuts: list[tuple[int, int]], others: list[str]
) -> None:
    stops = [text[start : start + length] for start, length in cuts if start < len(text)]
    assume(stops and FFFD not in "".join(others))
    stops += others
    ids = bl_encode(text)
    stream = TextStream(bl_decode, stops)
    pieces_, held = _push_all(stream, ids)

    expected = _expected_stop(ids, stops)
    assert expected is not None  # the stop strings were cut from the text
    released = "".join(p.text for p in pieces_)
    assert [p.stop_string for p in pieces_ if p.stop_string is not None] == [expected[1]]
    assert pieces_[-1].stop_string == expected[1]
    assert released == expected[0]
    if len(stops) == 1:
        assert released == text[: text.find(stops[0])]
    assert stream.ended
    assert stream.held == ""
    assert stream.flush() == ""
    for now_held in held[:-1]:
        # Held: a proper prefix of a stop string, then an incomplete character.
        waiting = now_held.rstrip(FFFD)
        assert waiting == "" or any(s.startswith(waiting) and s != waiting for s in stops)
    with pytest.raises(StreamEndedError):
        stream.push(ids[:1])


@given(texts, st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=3))
@settings(deadline=None)
def test_without_a_match_flush_returns_the_rest(text: str, stops: list[str]) -> None:
    assume(not any(s in text for s in stops))
    ids = bl_encode(text)
    stream = TextStream(bl_decode, stops)
    pieces_, _ = _push_all(stream, ids)
    assert all(p.stop_string is None for p in pieces_)
    released = "".join(p.text for p in pieces_)
    held = stream.held
    assert released + held == text
    assert stream.flush() == held
    assert stream.stop_string is None


def test_stop_string_spanning_tokens_and_ending_inside_one() -> None:
    text = "hello world said the quick brown fox"
    ids = bl_encode(text)
    # "ld sa" starts inside the token of "world" and ends inside "said".
    pieces_ = [p.text for p in _push_all(TextStream(bl_decode, ["ld sa"]), ids)[0]]
    assert "".join(pieces_) == "hello wor"
    assert len(ids) > 4


def test_stop_string_held_then_released_when_it_does_not_match() -> None:
    stream = TextStream(bl_decode, ["world peace"])
    ids = bl_encode("hello world said")
    pieces_, held = _push_all(stream, ids)
    assert "".join(p.text for p in pieces_) == "hello world said"
    assert any(h.startswith(" world") or h.startswith("world") for h in held)


def test_earliest_then_longest_stop_string_wins() -> None:
    ids = bl_encode("alpha beta gamma")
    pieces_, _ = _push_all(TextStream(bl_decode, ["gamma", "beta", "beta g", "a b"]), ids)
    # "a b" starts at 4, before "beta" at 6.
    assert "".join(p.text for p in pieces_) == "alph"
    assert pieces_[-1].stop_string == "a b"
    # Token by token, "beta" completes first and ends the stream ...
    pieces_, _ = _push_all(TextStream(bl_decode, ["beta", "beta g"]), ids)
    assert "".join(p.text for p in pieces_) == "alpha "
    assert pieces_[-1].stop_string == "beta"
    # ... but when both complete in one push, the longer one wins the tie.
    piece = TextStream(bl_decode, ["beta", "beta g"]).push(ids)
    assert piece == StreamPiece(text="alpha ", stop_string="beta g")


def test_flush_finds_a_stop_string_in_the_held_text() -> None:
    # The stop string ends in an incomplete character: its bytes complete
    # only with the next token, so the match shows up at flush.
    stream = TextStream(bl_decode, [f"x{FFFD}"])
    released = stream.push(bl_encode("ab x")).text
    released += stream.push([_byte_token(0xE4)]).text
    assert stream.held.endswith(FFFD)
    assert released + stream.flush() == "ab "
    assert stream.stop_string == f"x{FFFD}"


def test_incomplete_character_is_held_then_released_whole() -> None:
    utf8 = "中".encode()
    stream = TextStream(bl_decode)
    first = stream.push([_byte_token(utf8[0])])
    assert first.text == ""
    assert stream.held == FFFD
    second = stream.push([_byte_token(utf8[1])])
    assert second.text == ""
    third = stream.push([_byte_token(utf8[2])])
    assert third.text == "中"
    assert stream.held == ""


def test_flush_releases_an_incomplete_character_as_replacement() -> None:
    stream = TextStream(bl_decode)
    assert stream.push(bl_encode("ok ")).text == "ok "
    assert stream.push([_byte_token(0xF0), _byte_token(0x9F)]).text == ""
    assert stream.flush() == bl_decode([_byte_token(0xF0), _byte_token(0x9F)])
    with pytest.raises(StreamEndedError):
        stream.push([1])


def test_invalid_bytes_keep_the_window_bounded() -> None:
    decode = RecordingDecode()
    stream = TextStream(decode)
    garbage = [_byte_token(0x80)] * 200
    ids = [*bl_encode("start "), *garbage, _byte_token(0xE4), *bl_encode("end 中文")]
    released = "".join(p.text for p in _push_all(stream, ids)[0]) + stream.flush()
    assert released == bl_decode(ids)
    assert decode.longest <= 24


@pytest.mark.parametrize("text", ["🌍" * 40, "❤️‍🔥" * 20, "中文字符测试" * 20, "👍🏽 " * 30])
def test_runs_that_split_characters_at_token_boundaries(text: str) -> None:
    # Byte-level merges over such runs give tokens that end inside a
    # character again and again, so the window keeps ending in U+FFFD.
    decode = RecordingDecode()
    stream = TextStream(decode)
    ids = bl_encode(text)
    pieces_, held = _push_all(stream, ids)
    assert all(FFFD not in p.text for p in pieces_)
    assert all(len(h) <= 1 for h in held)  # one incomplete character at most
    assert "".join(p.text for p in pieces_) + stream.flush() == text
    assert decode.longest <= 24


@given(texts)
@settings(deadline=None)
def test_window_stays_bounded_on_long_generations(text: str) -> None:
    decode = RecordingDecode()
    stream = TextStream(decode, ["never matches \x00"])
    ids = bl_encode(text * 20)
    released = "".join(p.text for p in _push_all(stream, ids)[0]) + stream.flush()
    assert released == text * 20
    assert decode.longest <= 24


words = st.lists(
    st.sampled_from([*ASCII_WORDS, "中文", "你好", "世界", "テキスト"]), min_size=1, max_size=12
)


@given(words, words)
@settings(deadline=None)
def test_metaspace_keeps_the_leading_space_with_context(prompt: list[str], gen: list[str]) -> None:
    prompt_ids = METASPACE.encode(" ".join(prompt)).ids
    gen_ids = METASPACE.encode(" ".join(gen)).ids
    stream = TextStream(ms_decode, context_ids=prompt_ids)
    released = "".join(p.text for p in _push_all(stream, gen_ids)[0]) + stream.flush()
    whole = ms_decode([*prompt_ids, *gen_ids])
    assert released == whole[len(ms_decode(prompt_ids)) :]
    assert released == " " + " ".join(gen)


def test_metaspace_without_context_matches_plain_decode() -> None:
    ids = METASPACE.encode("hello world 中文").ids
    stream = TextStream(ms_decode)
    released = "".join(p.text for p in _push_all(stream, ids)[0]) + stream.flush()
    assert released == ms_decode(ids) == "hello world 中文"


@given(st.lists(pieces, min_size=3, max_size=25).map("".join), st.data())
@settings(deadline=None)
def test_skip_prefix_drops_the_healed_token_text(text: str, data: st.DataObject) -> None:
    ids = bl_encode(text)
    assume(len(ids) >= 3)
    cut = data.draw(st.integers(2, len(ids) - 1), label="prompt length")
    prompt_text = bl_decode(ids[:cut])
    before = bl_decode(ids[: cut - 1])
    assume(not prompt_text.endswith(FFFD) and not before.endswith(FFFD))
    removed = prompt_text[len(before) :]
    assume(removed)
    # Token healing ran the prompt without its last token and regenerated it.
    stream = TextStream(bl_decode, context_ids=ids[: cut - 1], skip_prefix=removed)
    released = "".join(p.text for p in _push_all(stream, ids[cut - 1 :])[0]) + stream.flush()
    assert released == text[len(prompt_text) :]


def test_skip_prefix_that_does_not_match_drops_nothing() -> None:
    stream = TextStream(bl_decode, skip_prefix="zz")
    pieces_ = [stream.push([i]).text for i in bl_encode("zebra")]
    assert "".join(pieces_) + stream.flush() == "zebra"


def test_skip_prefix_is_held_while_it_may_still_match() -> None:
    stream = TextStream(bl_decode, skip_prefix="hello")
    assert stream.push(bl_encode("he")).text == ""
    assert stream.held == "he"
    assert stream.push(bl_encode("llo there")).text == " there"


def test_special_tokens_are_text() -> None:
    ids = bl_encode("a<|im_start|>b")
    assert BYTE_LEVEL.token_to_id("<|im_start|>") in ids
    pieces_, _ = _push_all(TextStream(bl_decode, ["<|im_start|>"]), ids)
    assert "".join(p.text for p in pieces_) == "a"
    assert pieces_[-1].stop_string == "<|im_start|>"


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ConfigError, match="stop strings must not be empty"):
        TextStream(bl_decode, ["ok", ""])
    assert issubclass(StreamEndedError, TrioserveError)
