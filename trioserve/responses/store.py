"""Stored responses, bounded: what ``previous_response_id``, ``GET`` and
``DELETE /v1/responses/{id}`` read. Sans-IO (the clock is given).

Bounds: the bytes all entries take (each entry's response object and its
conversation, :func:`~.items.turns_nbytes`), the number of entries, and a
time to live counted from an entry's last use. Over a bound, the least
recently used entry of the owner holding the most bytes goes first: one
client that floods the store evicts its own responses before anyone
else's. An entry is seen only by its owner (the API key, or the address
without keys): another's id is as unknown as a made-up one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Final

import attrs

from .items import Turns, turns_nbytes

__all__ = ["DEFAULT_STORE_MIB", "DEFAULT_STORE_TTL_S", "ResponseStore", "StoredResponse"]

DEFAULT_STORE_MIB: Final = 64
DEFAULT_STORE_TTL_S: Final = 24 * 3600.0
DEFAULT_MAX_ENTRIES: Final = 16384


@attrs.frozen
class StoredResponse:
    id: str
    owner: Hashable
    #: The ``response`` object, as ``GET`` returns it.
    body: bytes
    #: The conversation it leaves (without the instructions).
    turns: Turns
    nbytes: int


@attrs.define(eq=False)
class ResponseStore:
    """Responses by id, bounded in bytes, entries and time."""

    max_bytes: int = DEFAULT_STORE_MIB << 20
    ttl_s: float = DEFAULT_STORE_TTL_S
    max_entries: int = DEFAULT_MAX_ENTRIES
    clock: Callable[[], float] = time.monotonic
    #: id -> (entry, last use), least recently used first.
    _entries: OrderedDict[str, tuple[StoredResponse, float]] = attrs.field(
        init=False, factory=OrderedDict
    )
    #: owner -> their ids, least recently used first, and their bytes.
    _owners: dict[Hashable, OrderedDict[str, None]] = attrs.field(init=False, factory=dict)
    _owner_bytes: dict[Hashable, int] = attrs.field(init=False, factory=dict)
    nbytes: int = attrs.field(init=False, default=0)
    evicted: int = attrs.field(init=False, default=0)

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, id: str, owner: Hashable, body: bytes, turns: Turns) -> bool:
        """Keep a response; False when it alone is over the byte bound (or
        the store is off)."""
        nbytes = len(body) + turns_nbytes(turns) + 512
        if nbytes > self.max_bytes or self.max_entries < 1:
            return False
        self._expire()
        self._drop(id)
        entry = StoredResponse(id, owner, body, turns, nbytes)
        self._entries[id] = (entry, self.clock())
        self._owners.setdefault(owner, OrderedDict())[id] = None
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + nbytes
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes or len(self._entries) > self.max_entries:
            self._evict()
        return True

    def get(self, id: str, owner: Hashable) -> StoredResponse | None:
        """The owner's response ``id`` (a use: it is kept longer), or None
        when unknown, expired or another's."""
        found = self._entries.get(id)
        if found is None or found[0].owner != owner:
            return None
        entry, used = found
        if self.clock() - used > self.ttl_s:
            self._drop(id)
            return None
        self._entries[id] = (entry, self.clock())
        self._entries.move_to_end(id)
        self._owners[owner].move_to_end(id)
        return entry

    def delete(self, id: str, owner: Hashable) -> bool:
        if self.get(id, owner) is None:
            return False
        self._drop(id)
        return True

    def _drop(self, id: str) -> None:
        found = self._entries.pop(id, None)
        if found is None:
            return
        entry = found[0]
        ids = self._owners[entry.owner]
        del ids[id]
        self._owner_bytes[entry.owner] -= entry.nbytes
        if not ids:
            del self._owners[entry.owner]
            del self._owner_bytes[entry.owner]
        self.nbytes -= entry.nbytes

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            id, (_, used) = next(iter(self._entries.items()))
            if now - used <= self.ttl_s:
                return
            self._drop(id)

    def _evict(self) -> None:
        """The least recently used entry of the owner holding the most bytes."""
        owner = max(self._owner_bytes, key=self._owner_bytes.__getitem__)
        self._drop(next(iter(self._owners[owner])))
        self.evicted += 1
