"""Tokenizing and chat templates for the event loop: short inputs inline,
long ones in a worker thread of their own limiter."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import trio

from trioserve.chat_template import ChatTemplate
from trioserve.engine.base import Engine

__all__ = ["INLINE_CHARS", "Tokenizing"]

#: Texts (or message lists) longer than this many characters are tokenized
#: (rendered) in a worker thread rather than on the event loop.
INLINE_CHARS: Final = 2048


class Tokenizing:
    """Runs an engine's tokenizer and the chat template for the event loop:
    short inputs inline (a few microseconds), long ones in a worker thread of
    its own limiter, so that neither ever takes a thread the engine or
    anything else needs. The engine's tokenizer releases the GIL on long
    texts, so the event loop keeps running meanwhile."""

    def __init__(
        self, engine: Engine, *, inline_chars: int = INLINE_CHARS, threads: int = 1
    ) -> None:
        self.engine = engine
        self.inline_chars = inline_chars
        self.limiter = trio.CapacityLimiter(threads)

    async def encode(self, text: str) -> list[int]:
        if len(text) <= self.inline_chars:
            return self.engine.encode(text)
        return await trio.to_thread.run_sync(self.engine.encode, text, limiter=self.limiter)

    async def decode(self, ids: list[int]) -> str:
        if len(ids) <= self.inline_chars // 4:
            return self.engine.decode(ids)
        return await trio.to_thread.run_sync(self.engine.decode, ids, limiter=self.limiter)

    async def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each id's text, decoded alone (a piece of a multi-byte character
        comes out as U+FFFD)."""

        def texts() -> list[str]:
            return [self.engine.decode([i]) for i in ids]

        if len(ids) <= self.inline_chars // 64:
            return texts()
        return await trio.to_thread.run_sync(texts, limiter=self.limiter)

    async def render(
        self,
        template: ChatTemplate,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """``messages`` (and ``tools``, and the template's own ``variables``)
        through ``template``; raises :class:`ChatTemplateError`."""
        listed = [dict(m) for m in messages]
        size = sum(len(str(m.get("content") or "")) for m in listed) + len(str(tools or ""))

        def render() -> str:
            return template.render(listed, tools=tools, **(variables or {}))

        if size <= self.inline_chars:
            return render()
        return await trio.to_thread.run_sync(render, limiter=self.limiter)
