"""A bounded, least-recently-used cache of token prefixes' keys and values.

Multi-turn chats send the whole history with every turn; so do OpenAI-style
clients. The CPU engine keeps the KV of finished jobs here, cut into blocks of
:attr:`PrefixCache.block_tokens` tokens, and a new job starts from the longest
run of cached blocks its prompt begins with (as vLLM's automatic prefix caching
and llama.cpp's ``cache_prompt`` do).

A block is found by a digest of its own tokens chained to its parent's digest,
so a block matches only where everything before it matches too. Memory is
bounded in bytes: inserting past the bound evicts the least recently used
blocks, and a lookup or an insert refreshes a chain from its deepest block to
its first, so that a chain's tail goes before its head and a head is never
evicted while its tail stays reachable only through it.

Knows nothing of the model: a block's KV is an opaque tensor that the engine
reads out of its KV cache and writes back.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

import attrs
from torch import Tensor

from trioserve.errors import ConfigError

__all__ = ["PrefixCache", "PrefixCacheStatistics"]

#: The digest a first block chains to.
_ROOT = b""


@attrs.frozen
class PrefixCacheStatistics:
    """What the prefix cache holds and how often it served (since it was made)."""

    #: Lookups that found at least one block.
    hits: int
    #: Lookups that found none (including prompts shorter than a block).
    misses: int
    #: Prompt tokens served from the cache, over all hits.
    hit_tokens: int
    #: Blocks (and their bytes) held now.
    blocks: int
    bytes: int
    #: The bound on ``bytes``.
    capacity_bytes: int
    #: Blocks evicted to stay within the bound.
    evictions: int
    #: Tokens per block.
    block_tokens: int


@attrs.define(eq=False)
class _Block:
    kv: Tensor
    nbytes: int


class PrefixCache:
    """See the module docstring. Not thread-safe: the engine's step thread owns it.

    Raises:
        ConfigError: a negative capacity or a block size below 1.
    """

    def __init__(self, capacity_bytes: int, block_tokens: int = 64) -> None:
        if capacity_bytes < 0:
            raise ConfigError(f"prefix cache capacity must be >= 0 bytes, got {capacity_bytes!r}")
        if block_tokens < 1:
            raise ConfigError(f"prefix cache block must be >= 1 token, got {block_tokens!r}")
        self.capacity_bytes = capacity_bytes
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._hit_tokens = self._evictions = 0

    def _digests(self, tokens: Sequence[int], n_blocks: int) -> list[bytes]:
        digests = []
        parent = _ROOT
        size = self.block_tokens
        for i in range(n_blocks):
            block = tokens[i * size : (i + 1) * size]
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in block))
            parent = h.digest()
            digests.append(parent)
        return digests

    def lookup(self, tokens: Sequence[int], limit: int) -> list[Tensor]:
        """The KV of the longest run of cached blocks that ``tokens`` starts
        with, covering at most ``limit`` tokens, in order; refreshes them."""
        if not self.capacity_bytes:
            return []
        n_blocks = min(limit, len(tokens)) // self.block_tokens
        found: list[bytes] = []
        for digest in self._digests(tokens, n_blocks):
            if digest not in self._blocks:
                break
            found.append(digest)
        if not found:
            self._misses += 1
            return []
        self._hits += 1
        self._hit_tokens += len(found) * self.block_tokens
        self._refresh(found)
        return [self._blocks[d].kv for d in found]

    def insert(self, tokens: Sequence[int], read: Callable[[int, int], Tensor]) -> None:
        """Cache the whole blocks of ``tokens``, whose KV ``read(start, end)``
        returns (a copy the cache may keep); reads only the blocks not cached
        yet. Evicts least recently used blocks to stay within the bound; a
        block larger than the whole bound is not kept."""
        if not self.capacity_bytes:
            return
        digests = self._digests(tokens, len(tokens) // self.block_tokens)
        size = self.block_tokens
        for i, digest in enumerate(digests):
            if digest in self._blocks:
                continue
            kv = read(i * size, (i + 1) * size)
            nbytes = int(kv.numel() * kv.element_size())
            if nbytes > self.capacity_bytes:
                break
            self._blocks[digest] = _Block(kv, nbytes)
            self._bytes += nbytes
        self._refresh([d for d in digests if d in self._blocks])
        protected = set(digests)
        while self._bytes > self.capacity_bytes:
            # The least recently used block that is not part of this insert,
            # else this insert's own least recent (its deepest) block.
            victim = next((d for d in self._blocks if d not in protected), None)
            if victim is None:
                victim = next(iter(self._blocks))
            self._bytes -= self._blocks.pop(victim).nbytes
            self._evictions += 1

    def _refresh(self, chain: list[bytes]) -> None:
        # Deepest first, head last: the head becomes the most recent.
        for digest in reversed(chain):
            self._blocks.move_to_end(digest)

    def clear(self) -> None:
        """Drop every block (statistics of past lookups stay)."""
        self._blocks.clear()
        self._bytes = 0

    def statistics(self) -> PrefixCacheStatistics:
        return PrefixCacheStatistics(
            hits=self._hits,
            misses=self._misses,
            hit_tokens=self._hit_tokens,
            blocks=len(self._blocks),
            bytes=self._bytes,
            capacity_bytes=self.capacity_bytes,
            evictions=self._evictions,
            block_tokens=self.block_tokens,
        )
