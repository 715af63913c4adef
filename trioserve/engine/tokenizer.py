"""The tokenizer of a Hugging Face model directory, on ``tokenizer.json``.

One encoding for everything (protocol section 3.2): no BOS is added, and
special-token strings in the text become their ids. Decoding writes special
tokens as their text, so that ``decode(encode(text)) == text`` for ordinary text.

Token healing needs each token's raw bytes (a byte-level token may be part of a
UTF-8 character, so its decoded text is not enough) and the ids whose bytes
start with a given prefix; both are computed once at load.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import json
import threading
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import attrs
from tokenizers import Tokenizer as HfTokenizer

from trioserve.errors import ModelError

__all__ = ["Tokenizer"]


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted: each byte is written
    as one printable character in byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(decoder: Any) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_is_byte_level(d) for d in decoder.get("decoders", ()))


def _piece_bytes(piece: str, byte_level: bool) -> bytes:
    if byte_level:
        table = _byte_level_alphabet()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return piece.encode("utf-8")
    # SentencePiece-style vocabularies: byte-fallback pieces and "▁" for space.
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode("utf-8")


def _ids_from(value: Any) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {str(path)!r}: {exc}") from exc
    return value if isinstance(value, dict) else {}


def _token_name(value: Any) -> str | None:
    # tokenizer_config.json writes a token either as a string or as an
    # AddedToken dict with a "content" key.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


#: Above these sizes, encode and decode release the GIL (the batch calls do;
#: below, the single calls are faster and short enough not to matter).
_GIL_FREE_CHARS = 2048
_GIL_FREE_IDS = 512


#: Tokenizers by the content of their files, most recently used last.
_LOADED: collections.OrderedDict[str, Tokenizer] = collections.OrderedDict()
_LOADED_LOCK = threading.Lock()
_LOADED_MAX = 16
#: The files a tokenizer is read from (tokenizer.json, then the special ids').
_TOKENIZER_FILES = (
    "tokenizer.json",
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
)


def _content_key(path: Path) -> str:
    """The sha256 of the tokenizer's files (a missing one counts as absent)."""
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        file = path / name
        if name == "tokenizer.json" or file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


@attrs.define(eq=False)
class Tokenizer:
    """A model's tokenizer. Thread-safe: the Rust tokenizer is only read, and
    the tables built at load never change."""

    _tok: HfTokenizer
    bos_token_id: int | None
    #: Every end-of-sequence id: config.json, generation_config.json and the
    #: tokenizer's own EOS token.
    eos_token_ids: frozenset[int]
    #: Ids the tokenizer knows (added tokens included).
    vocab_size: int
    special_ids: frozenset[int]
    _token_bytes: tuple[bytes, ...]
    # Ids sorted by their bytes, for prefix lookups by bisection.
    _sorted_bytes: list[bytes]
    _sorted_ids: list[int]
    #: Byte value -> the ids whose bytes contain it; built at the first
    #: :meth:`ids_containing` (a fraction of a second, once).
    _ids_by_byte: list[frozenset[int]] | None = attrs.field(default=None, init=False)

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Load ``tokenizer.json`` and the special ids of the model directory
        ``path``. The same files (by content) give the same tokenizer back,
        without parsing them again: the Rust tokenizer's parse holds the GIL
        for a fraction of a second, which a server that unloads and loads
        models beside others would otherwise pay on every load.

        Raises:
            ModelError: there is no readable ``tokenizer.json``.
        """
        path = Path(path)
        try:
            key = _content_key(path)
        except OSError as exc:
            raise ModelError(
                f"cannot load tokenizer {str(path / 'tokenizer.json')!r}: {exc}"
            ) from exc
        with _LOADED_LOCK:
            cached = _LOADED.get(key)
            if cached is not None:
                _LOADED.move_to_end(key)
                return cached
        tokenizer = cls._parse(path)
        with _LOADED_LOCK:
            _LOADED[key] = tokenizer
            while len(_LOADED) > _LOADED_MAX:
                _LOADED.popitem(last=False)
        return tokenizer

    @classmethod
    def _parse(cls, path: Path) -> Tokenizer:
        file = path / "tokenizer.json"
        try:
            tok = HfTokenizer.from_file(str(file))
            # The decoder's JSON alone: parsing the whole file again (megabytes,
            # in one C call) would hold the GIL, stalling a server that loads
            # a model beside others.
            decoder = tok.decoder
            raw = {"decoder": json.loads(decoder.__getstate__()) if decoder is not None else None}
        except Exception as exc:  # the Rust side raises plain Exception
            raise ModelError(f"cannot load tokenizer {str(file)!r}: {exc}") from exc
        config = _read_json(path / "config.json")
        generation = _read_json(path / "generation_config.json")
        token_config = _read_json(path / "tokenizer_config.json")

        eos = _ids_from(config.get("eos_token_id")) | _ids_from(generation.get("eos_token_id"))
        bos_ids = _ids_from(generation.get("bos_token_id")) or _ids_from(config.get("bos_token_id"))
        if (name := _token_name(token_config.get("eos_token"))) is not None:
            eos_id = tok.token_to_id(name)
            if eos_id is not None:
                eos.add(eos_id)
        if not bos_ids and (name := _token_name(token_config.get("bos_token"))) is not None:
            bos_id = tok.token_to_id(name)
            if bos_id is not None:
                bos_ids = {bos_id}

        size = tok.get_vocab_size(with_added_tokens=True)
        byte_level = _is_byte_level(raw.get("decoder"))
        added = tok.get_added_tokens_decoder()
        special = frozenset(i for i, t in added.items() if t.special)
        pieces: list[bytes] = []
        for i in range(size):
            piece = tok.id_to_token(i)
            if piece is None:
                pieces.append(b"")
            elif i in added:
                pieces.append(added[i].content.encode("utf-8"))
            else:
                pieces.append(_piece_bytes(piece, byte_level))
        order = sorted(range(size), key=pieces.__getitem__)
        return cls(
            tok=tok,
            bos_token_id=min(bos_ids) if bos_ids else None,
            eos_token_ids=frozenset(eos),
            vocab_size=size,
            special_ids=special,
            token_bytes=tuple(pieces),
            sorted_bytes=[pieces[i] for i in order],
            sorted_ids=order,
        )

    def encode(self, text: str) -> list[int]:
        """Protocol section 3.2: no BOS added; special-token strings become their ids.

        Long texts go through ``encode_batch``, which releases the GIL while
        it works (``encode`` holds it for the whole call, which froze every
        other thread, the event loop's included, for seconds on a long text).
        """
        if len(text) > _GIL_FREE_CHARS:
            # The fast variant computes no offsets: half the time, and a much
            # smaller result to convert and free under the GIL afterwards.
            return list(self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids)
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int] | Iterable[int]) -> str:
        """Decode ``ids``, writing special tokens as their text (long runs of
        ids without holding the GIL, as :meth:`encode`)."""
        ids = list(ids)
        if len(ids) > _GIL_FREE_IDS:
            return self._tok.decode_batch([ids], skip_special_tokens=False)[0]
        return self._tok.decode(ids, skip_special_tokens=False)

    def skipped_special(self, kept: Iterable[str] = ()) -> frozenset[int]:
        """The special ids whose text a reply leaves out (vLLM's
        ``skip_special_tokens``): every one but those whose text occurs in
        one of ``kept`` (the markers a reply is parsed by, the request's stop
        strings, which must still be seen to match)."""
        kept = tuple(kept)
        return frozenset(
            i
            for i in self.special_ids
            if not any(self._token_bytes[i].decode("utf-8", "replace") in k for k in kept)
        )

    def decoder(self, skipped: frozenset[int] = frozenset()) -> Callable[[Sequence[int]], str]:
        """A decode for one job's text: :meth:`decode`, leaving out the
        text of the ids in ``skipped`` (:meth:`skipped_special`)."""
        if not skipped:
            return self.decode

        def decode(ids: Sequence[int]) -> str:
            return self.decode([i for i in ids if i not in skipped])

        return decode

    @property
    def max_token_bytes(self) -> int:
        """The most bytes one token stands for: a bound on the characters of
        text one token can cover."""
        return max(len(piece) for piece in self._token_bytes)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` stands for (its text for special tokens)."""
        return self._token_bytes[token_id]

    def ids_with_prefix(self, prefix: bytes) -> list[int]:
        """Ordinary (non-special) ids whose bytes start with ``prefix``, which
        token healing allows as the first generated token."""
        lo = bisect.bisect_left(self._sorted_bytes, prefix)
        found: list[int] = []
        for i in range(lo, len(self._sorted_bytes)):
            if not self._sorted_bytes[i].startswith(prefix):
                break
            if self._sorted_ids[i] not in self.special_ids:
                found.append(self._sorted_ids[i])
        return found

    def ids_containing(self, needles: Iterable[str]) -> frozenset[int]:
        """Ids whose bytes (their text, for special tokens) contain one of
        ``needles`` as UTF-8: DRY's sequence breakers and the tokens XTC
        leaves alone are chosen this way.

        A needle is looked for only among the ids that hold its rarest byte,
        so a handful of short needles costs milliseconds.
        """
        by_byte = self._ids_by_byte
        if by_byte is None:
            sets: list[set[int]] = [set() for _ in range(256)]
            for token_id, piece in enumerate(self._token_bytes):
                for byte in set(piece):
                    sets[byte].add(token_id)
            by_byte = self._ids_by_byte = [frozenset(ids) for ids in sets]
        found: set[int] = set()
        for needle in needles:
            data = needle.encode("utf-8")
            if not data:
                continue
            holders = min((by_byte[byte] for byte in set(data)), key=len)
            if len(data) == 1:
                found |= holders
            else:
                found.update(i for i in holders if data in self._token_bytes[i])
        return frozenset(found)
