"""The prefix cache alone: matching, bounds and eviction order.

A block's "KV" here is a small tensor that records which tokens it was read
for, so every test can see exactly what was stored and returned.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trioserve.engine.cpu.prefix import PrefixCache
from trioserve.errors import ConfigError

BLOCK = 4
#: Bytes of one block as :func:`reader` makes them (BLOCK int64 values).
BLOCK_BYTES = BLOCK * 8


def reader(tokens: list[int], calls: list[tuple[int, int]] | None = None):  # type: ignore[no-untyped-def]
    def read(start: int, end: int) -> torch.Tensor:
        if calls is not None:
            calls.append((start, end))
        return torch.tensor(tokens[start:end], dtype=torch.int64)

    return read


def served(blocks: list[torch.Tensor]) -> list[int]:
    return [int(t) for block in blocks for t in block]


def test_the_longest_cached_run_of_whole_blocks_is_served() -> None:
    cache = PrefixCache(10 * BLOCK_BYTES, BLOCK)
    tokens = list(range(100, 114))  # 3 whole blocks and 2 tokens
    calls: list[tuple[int, int]] = []
    cache.insert(tokens, reader(tokens, calls))
    assert calls == [(0, 4), (4, 8), (8, 12)]
    assert cache.statistics().blocks == 3
    assert served(cache.lookup(tokens, len(tokens))) == tokens[:12]
    # The limit caps what is served, in whole blocks.
    assert served(cache.lookup(tokens, 11)) == tokens[:8]
    # A prompt that diverges inside block 2 gets blocks 0 and 1.
    other = [*tokens[:9], 0, *tokens[10:]]
    assert served(cache.lookup(other, len(other))) == tokens[:8]
    # One that diverges in block 0 gets nothing.
    assert cache.lookup([0, *tokens[1:]], 14) == []
    stats = cache.statistics()
    assert (stats.hits, stats.misses, stats.hit_tokens) == (3, 1, 12 + 8 + 8)


def test_a_block_matches_only_after_the_same_prefix() -> None:
    cache = PrefixCache(10 * BLOCK_BYTES, BLOCK)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    cache.insert(a, reader(a))
    # Block 1's tokens, but after another block 0: no match at all.
    assert cache.lookup([9, 9, 9, 9, 5, 6, 7, 8], 8) == []


def test_only_missing_blocks_are_read() -> None:
    cache = PrefixCache(10 * BLOCK_BYTES, BLOCK)
    first = list(range(8))
    cache.insert(first, reader(first))
    calls: list[tuple[int, int]] = []
    longer = list(range(16))
    cache.insert(longer, reader(longer, calls))
    assert calls == [(8, 12), (12, 16)]
    assert cache.statistics().bytes == 4 * BLOCK_BYTES


def test_the_bound_evicts_least_recently_used_tails_first() -> None:
    cache = PrefixCache(3 * BLOCK_BYTES, BLOCK)
    a = [1] * 8  # two blocks
    b = [2] * 8
    cache.insert(a, reader(a))
    cache.insert(b, reader(b))
    stats = cache.statistics()
    assert stats.bytes <= 3 * BLOCK_BYTES
    assert stats.evictions == 1
    # a's tail went, its head stayed: a is still served one block.
    assert served(cache.lookup(a, 8)) == a[:4]
    assert served(cache.lookup(b, 8)) == b
    # b was used last, so inserting c evicts what remains of a.
    c = [3] * 4
    cache.insert(c, reader(c))
    assert cache.lookup(a, 8) == []
    assert served(cache.lookup(b, 8)) == b


def test_an_insert_larger_than_the_bound_keeps_its_head() -> None:
    cache = PrefixCache(2 * BLOCK_BYTES, BLOCK)
    long = list(range(20))
    cache.insert(long, reader(long))
    assert served(cache.lookup(long, 20)) == long[:8]
    assert cache.statistics().bytes == 2 * BLOCK_BYTES


def test_zero_capacity_keeps_nothing_and_bad_settings_are_refused() -> None:
    cache = PrefixCache(0, BLOCK)
    tokens = list(range(8))
    calls: list[tuple[int, int]] = []
    cache.insert(tokens, reader(tokens, calls))
    assert calls == []
    assert cache.lookup(tokens, 8) == []
    assert cache.statistics().blocks == 0
    with pytest.raises(ConfigError, match="capacity"):
        PrefixCache(-1)
    with pytest.raises(ConfigError, match="block"):
        PrefixCache(100, 0)


@given(
    inserts=st.lists(st.lists(st.integers(0, 3), max_size=14), max_size=12),
    capacity=st.integers(0, 8),
)
def test_what_is_served_is_always_a_true_prefix_within_the_bound(
    inserts: list[list[int]], capacity: int
) -> None:
    cache = PrefixCache(capacity * BLOCK_BYTES, BLOCK)
    for tokens in inserts:
        cache.insert(tokens, reader(tokens))
        assert cache.statistics().bytes <= capacity * BLOCK_BYTES
        for probe in inserts:
            got = served(cache.lookup(probe, len(probe)))
            assert got == probe[: len(got)]
            assert len(got) % BLOCK == 0
    if capacity and inserts and len(inserts[-1]) >= BLOCK:
        # The latest insert's first block is always there.
        assert served(cache.lookup(inserts[-1], BLOCK)) == inserts[-1][:BLOCK]
