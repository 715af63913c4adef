"""Streaming text for one job: incremental detokenisation and stop strings.

A :class:`TextStream` turns a job's generated ids, a few at a time, into text
that is safe to send: never half a character, never the start of what may
become a stop string, never the text that token healing re-generated. Three
stages, in this order:

1. **Decoding.** Ids cannot be decoded one at a time: a byte-level BPE token
   may hold part of a UTF-8 character, and SentencePiece-style decoders drop
   the leading space of the first token they see. As in HF TGI and vLLM, the
   stream decodes a short window of recent ids (starting with ids whose text
   was already passed on, for context) and passes on what the window adds.
   A window ending in U+FFFD ends in an incomplete character: its complete
   part is passed on and the rest is held until the character completes.
2. **Skipping** (token healing): the healed first token re-generates the
   text of the prompt's last token; exactly that prefix is dropped.
3. **Stop strings.** Text that could still be the start of a stop string is
   held; on a match, the text before it is released and the stream ends.
   With ``hold_stops`` (a request's ``min_tokens``), the text of the first
   that many ids pushed is released as it is and never looked at: a stop
   string counts only within the text of later ids.

Cost per push is a decode of a window of a few tokens, whatever the length of
the generation (after each release the window restarts at the ids just
released), plus amortised O(1) per new character for the stop strings,
whatever their number (an Aho-Corasick matcher, :mod:`trioserve.engine.stops`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import attrs

from trioserve.engine.stops import stop_automaton
from trioserve.errors import ConfigError, TrioserveError

__all__ = ["StreamEndedError", "StreamPiece", "TextStream"]

logger = logging.getLogger("trioserve.engine")

_REPLACEMENT = "\ufffd"

#: Context ids kept from the prompt: enough for any decoder's first-token
#: rules (a leading space, a byte sequence), few enough to decode cheaply.
_MAX_CONTEXT_IDS = 8

#: When more ids than this are held (the window keeps ending in U+FFFD), the
#: window is restarted near its end, so that the cost per push stays bounded.
#: A UTF-8 character has at most four bytes, hence spans at most four tokens.
_MAX_HELD_IDS = 8
_MAX_CHAR_TOKENS = 4


class StreamEndedError(TrioserveError):
    """``push`` was called after a stop string matched or after ``flush``."""


@attrs.frozen
class StreamPiece:
    """What one :meth:`TextStream.push` released."""

    #: Newly released text; ``''`` while everything new is held back.
    text: str
    #: The stop string that matched, if one did; ``text`` is then everything
    #: before it and the stream has ended.
    stop_string: str | None = None


class TextStream:
    """UTF-8-safe incremental detokenisation plus stop-string hold-back for one job.

    ``decode`` is the tokenizer's decode (special tokens written as text).
    ``context_ids`` are the last few prompt ids: they give the decoder its
    context (a leading space, an unfinished character) and are never emitted;
    only the last eight are used. ``skip_prefix`` is the text of the prompt
    token that token healing removed: the generated text starts with it again
    and it is dropped once. ``hold_stops``: stop strings are looked for only
    in the text that ids after the first ``hold_stops`` pushed add.

    Not thread-safe; one job's stream is used by one thread at a time.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop_strings: Sequence[str] = (),
        *,
        context_ids: Sequence[int] = (),
        skip_prefix: str = "",
        hold_stops: int = 0,
    ) -> None:
        if any(not s for s in stop_strings):
            raise ConfigError(f"stop strings must not be empty, got {list(stop_strings)!r}")
        self._decode = decode
        self._stops = tuple(dict.fromkeys(stop_strings))
        # The matcher reads each new character once, however many stop
        # strings there are (engine.stops), and keeps the rule of
        # earliest_stop / partial_stop_length.
        self._matcher = stop_automaton(self._stops).matcher() if self._stops else None
        # Decoding state: ids[prefix:read] were passed on already and give
        # context; prefix_text is their text on its own; `sent` counts the
        # characters after prefix_text in the current window that were passed
        # on too (the complete part of a window ending in an incomplete
        # character); `tail` is the rest of the window, held.
        self._ids: list[int] = list(context_ids)[-_MAX_CONTEXT_IDS:]
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = decode(self._ids) if self._ids else ""
        self._sent = 0
        self._tail = ""
        # Skipping state: text kept while it may still be the healed prefix.
        self._skip = skip_prefix
        self._skip_buffer = ""
        self._skipping = bool(skip_prefix)
        # Stop-string state: text that may be the start of a stop string,
        # and how many ids are still to be pushed before stops count.
        self._pending = ""
        self._hold = hold_stops
        self._ended = False
        self._stop_string: str | None = None

    @property
    def held(self) -> str:
        """Text held back now: a possible stop-string prefix, then an
        incomplete UTF-8 tail written as U+FFFD."""
        if self._ended:
            return ""
        return self._pending + self._skip_buffer + self._tail

    @property
    def stop_pending(self) -> int:
        """Characters held now as the possible start of a stop string: they
        came out of decoding (and token healing's skip) and wait to be released."""
        return 0 if self._ended else len(self._pending)

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the stream (found by ``push`` or, in the
        last held text, by ``flush``), else None."""
        return self._stop_string

    @property
    def ended(self) -> bool:
        """True once a stop string matched or ``flush`` was called."""
        return self._ended

    def push(self, ids: Sequence[int]) -> StreamPiece:
        """Add newly generated ids (usually one) and release what is safe."""
        if self._ended:
            raise StreamEndedError(
                "cannot push ids to a text stream that has ended "
                f"(stop string {self._stop_string!r})"
            )
        self._ids.extend(ids)
        self._hold -= len(ids)
        decoded = self._advance()
        return self._stop_stage(self._skip_stage(decoded, final=False), final=False)

    def flush(self) -> str:
        """End the stream and release everything held (an incomplete
        character as U+FFFD), so that nothing generated is lost.

        Used at ``max_new_tokens`` and on cancellation. If the held text
        completes a stop string after all, only the text before it is returned
        and :attr:`stop_string` says which. Idempotent: later calls return ``''``.
        """
        if self._ended:
            return ""
        tail, self._tail = self._tail, ""
        piece = self._stop_stage(self._skip_stage(tail, final=True), final=True)
        self._ended = True
        return piece.text

    # -- stage 1: decoding ---------------------------------------------------

    def _advance(self) -> str:
        """Decode the window and return the text it newly makes safe."""
        window = self._decode(self._ids[self._prefix :])
        start = len(self._prefix_text) + self._sent
        if not window.endswith(_REPLACEMENT):
            self._tail = ""
            if len(window) > start:
                # Everything decoded is final: restart the window at the ids
                # just passed on, which become the next window's context.
                self._prefix, self._read = self._read, len(self._ids)
                self._prefix_text = self._decode(self._ids[self._prefix : self._read])
                self._sent = 0
                return window[start:]
            return self._cut_long_window(window, "")
        # An incomplete character (or invalid bytes) at the end: the part
        # before the trailing U+FFFD run is final, because a decoder that
        # reads left to right never changes complete characters it has
        # already produced.
        stable = window.rstrip(_REPLACEMENT)
        new = ""
        if len(stable) > start:
            new = stable[start:]
            self._sent = len(stable) - len(self._prefix_text)
            start = len(stable)
        self._tail = window[start:]
        return self._cut_long_window(window, new)

    def _cut_long_window(self, window: str, new: str) -> str:
        """Bound the window when many ids are held, by restarting it a few
        ids before the end with the same bookkeeping TGI uses after a release.

        Ids are held that long only when the window keeps ending in U+FFFD:
        invalid bytes, or token boundaries that keep splitting characters (a
        run of emoji or CJK text can do that). The cut goes at the last token
        boundary j whose text (``left``, the window's ids before j decoded)
        was all passed on already; if there is none among the last four ids,
        at ``len - 4``: four tokens hold at least four bytes, so every
        character that started before j has completed or turned invalid, and
        ``left`` is final and passed on now. The new window starts three ids
        before j, so that a character split at j is decoded whole in it, as
        in the old one; a check that both windows agree on the text after j
        guards the rest (a decoder with other rules keeps the window whole).
        """
        if len(self._ids) - self._read <= _MAX_HELD_IDS:
            return new
        passed = len(self._prefix_text) + self._sent
        last = len(self._ids) - _MAX_CHAR_TOKENS
        cut = len(self._ids) - 1
        left = self._decode(self._ids[self._prefix : cut])
        while len(left) > passed and cut > last:
            cut -= 1
            left = self._decode(self._ids[self._prefix : cut])
        start = max(self._prefix, cut - (_MAX_CHAR_TOKENS - 1))
        context = self._decode(self._ids[start:cut])
        restarted = self._decode(self._ids[start:])
        if restarted[len(context) :] != window[len(left) :]:
            return new
        if len(left) > passed:
            new += window[passed : len(left)]
            passed = len(left)
        self._prefix, self._read = start, cut
        self._prefix_text = context
        self._sent = passed - len(left)
        self._tail = restarted[len(context) + self._sent :]
        return new

    # -- stage 2: skipping the healed prefix ------------------------------------

    def _skip_stage(self, text: str, *, final: bool) -> str:
        if not self._skipping:
            return text
        buffer = self._skip_buffer + text
        if buffer.startswith(self._skip):
            self._skipping = False
            self._skip_buffer = ""
            return buffer[len(self._skip) :]
        if self._skip.startswith(buffer) and not final:
            self._skip_buffer = buffer
            return ""
        # The decoded text does not start with the removed token's text (the
        # decoder joined it differently with the prompt's end, or the
        # constraint was not applied). Dropping anything then could drop
        # generated text, so everything is emitted.
        logger.debug(
            "token healing: generated text %r does not start with %r; nothing dropped",
            buffer,
            self._skip,
        )
        self._skipping = False
        self._skip_buffer = ""
        return buffer

    # -- stage 3: stop strings ---------------------------------------------------

    def _stop_stage(self, text: str, *, final: bool) -> StreamPiece:
        if self._matcher is None or self._hold >= 0:
            # No stop strings, or text of the ids that min_tokens holds them for.
            return StreamPiece(text)
        pending = self._pending
        match = self._matcher.feed(text)
        if match is not None:
            index = len(pending) + match.start
            self._pending = self._tail = self._skip_buffer = ""
            self._ended = True
            self._stop_string = match.stop_string
            return StreamPiece((pending + text)[:index], match.stop_string)
        buffer = pending + text
        keep = 0 if final else self._matcher.partial_length
        self._pending = buffer[len(buffer) - keep :]
        return StreamPiece(buffer[: len(buffer) - keep])
