"""DRY over a job's history (trioserve.engine.samplers), on hand-built
sequences and against a brute-force reading of its definition; and the token
sets DRY and XTC take from the embedded model's tokenizer."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trioserve.engine.models import default_model_dir
from trioserve.engine.samplers import (
    DRY_MAX_NGRAM,
    DryHistory,
    bias_row,
    sequence_breaker_ids,
    xtc_protected_ids,
)
from trioserve.engine.tokenizer import Tokenizer
from trioserve.vocabulary.sampling import SamplingSettings

VOCAB = 10
BREAK = 9
DRY = SamplingSettings(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2)


def penalties(
    tokens: list[int], s: SamplingSettings = DRY, breakers: frozenset[int] = frozenset({BREAK})
) -> dict[int, float]:
    history = DryHistory.start(tokens[:1], len(tokens), breakers, VOCAB)
    for token in tokens[1:]:  # appended one by one, as the engine does
        history.append(token)
    found = history.penalties(s)
    if found is None:
        return {}
    return dict(zip(found[0].tolist(), found[1].tolist(), strict=True))


def test_the_token_that_would_extend_a_repeat_is_penalised() -> None:
    # 1 2 3 4 ... 1 2 3: "1 2 3" (3 tokens) was followed by 4.
    assert penalties([1, 2, 3, 4, 5, 1, 2, 3]) == {4: 1.0 * 2.0 ** (3 - 2)}


def test_repeats_shorter_than_the_allowed_length_are_free() -> None:
    assert penalties([1, 2, 5, 6, 1]) == {}
    assert penalties([1, 2, 5, 6, 1, 2]) == {5: 1.0}


def test_each_earlier_occurrence_counts() -> None:
    # "7 8" was followed by 1 twice and by 2 once.
    assert penalties([7, 8, 1, 7, 8, 1, 7, 8, 2, 3, 7, 8]) == {1: 2.0, 2: 1.0}


def test_only_the_longest_repeat_sets_the_penalty() -> None:
    # "5 7 8" occurred before (followed by 1); "7 8" alone also by 2. The
    # longest suffix wins, as in ExLlamaV2: only 1 is penalised.
    assert penalties([6, 7, 8, 2, 5, 7, 8, 1, 4, 5, 7, 8]) == {1: 2.0}


def test_a_one_token_loop_is_penalised() -> None:
    assert penalties([3, 3, 3]) == {3: 1.0}
    assert penalties([3, 3, 3, 3]) == {3: 2.0}


def test_breakers_end_repeats() -> None:
    # The breaker inside the suffix: only "1 2" after it can repeat.
    assert penalties([1, 2, 4, 9, 1, 2, 5, 1, 2]) == {4: 1.0, 5: 1.0}
    # A breaker as the last token, or as the follower, is never a repeat.
    assert penalties([1, 2, 9, 1, 2, 9]) == {}
    assert penalties([1, 2, 9, 1, 2]) == {}


def test_dry_range_bounds_how_far_back_it_looks() -> None:
    far = [1, 2, 3] + [4] * 30 + [1, 2]
    assert penalties(far) == {3: 1.0}
    # The last 21 tokens hold no earlier "1 2".
    assert penalties(far, SamplingSettings(dry_multiplier=1.0, dry_base=2.0, dry_range=21)) == {}
    assert penalties(far, SamplingSettings(dry_multiplier=1.0, dry_base=2.0, dry_range=35)) == {
        3: 1.0
    }


def test_repeats_are_measured_up_to_19_tokens() -> None:
    phrase = list(range(1, 9)) * 3 + [0]  # 25 tokens without a breaker
    got = penalties(phrase * 2)
    assert got == {phrase[0]: 2.0 ** (DRY_MAX_NGRAM - 1 - 2)}


def test_off_by_default_and_needs_two_tokens() -> None:
    assert penalties([1, 1, 1, 1], SamplingSettings()) == {}
    assert penalties([1]) == {}


def reference(tokens: list[int], s: SamplingSettings, breakers: set[int]) -> dict[int, float]:
    """DRY from its definition, by brute force over suffix lengths."""
    n = len(tokens)
    start = 0 if s.dry_range == 0 else max(0, n - s.dry_range)
    for length in range(min(DRY_MAX_NGRAM - 1, n - 1), 0, -1):
        suffix = tokens[n - length :]
        if breakers & set(suffix):
            continue
        followers = [
            tokens[end + 1]
            for end in range(start + length - 1, n - 1)
            if tokens[end - length + 1 : end + 1] == suffix and tokens[end + 1] not in breakers
        ]
        if followers:
            if length < s.dry_allowed_length:
                return {}
            scale = s.dry_multiplier * s.dry_base ** (length - s.dry_allowed_length)
            return {t: c * scale for t, c in Counter(followers).items()}
    return {}


@given(
    st.lists(st.integers(0, 9), min_size=1, max_size=60),
    st.integers(1, 6),
    st.sampled_from([0, 21, 25, 40]),
)
def test_matches_the_definition(tokens: list[int], allowed: int, window: int) -> None:
    s = SamplingSettings(
        dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=allowed, dry_range=window
    )
    want = reference(tokens, s, {BREAK})
    got = penalties(tokens, s)
    assert got.keys() == want.keys()
    for token, value in want.items():
        assert got[token] == pytest.approx(value, rel=1e-6)


# -- token sets from the real tokenizer ----------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir(offline=True))


def test_breakers_are_the_ids_whose_text_holds_a_breaker(tokenizer: Tokenizer) -> None:
    ids = sequence_breaker_ids(tokenizer, ("\n", "ab"))
    for token in range(tokenizer.vocab_size):
        piece = tokenizer.token_bytes(token)
        expected = b"\n" in piece or b"ab" in piece or token in tokenizer.special_ids
        assert (token in ids) == expected, (token, piece)


def test_xtc_leaves_newlines_and_special_tokens(tokenizer: Tokenizer) -> None:
    ids = xtc_protected_ids(tokenizer)
    assert tokenizer.special_ids <= ids
    assert set(tokenizer.encode("\n\n")) <= ids
    assert not set(tokenizer.encode(" Paris")) & ids


def test_bias_row() -> None:
    row = bias_row(((1, -100.0), (4, 2.5)), 6)
    assert row.tolist() == [0.0, -100.0, 0.0, 0.0, 2.5, 0.0]
    assert row.dtype == torch.float32
    assert not bias_row((), 3).any()
