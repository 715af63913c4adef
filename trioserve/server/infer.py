"""One WebSocket ``infer`` in flight on a connection: its request, its
:class:`~trioserve.generation.Generation`, what its chunk frames have sent,
and the frames it is answered with (:meth:`InferEntry.chunk_frame`,
:meth:`InferEntry.terminal_reply`). The connection runs it and writes them.
"""

from __future__ import annotations

import attrs
import trio

from trioserve import protocol as p
from trioserve.generation import Generation

from .doors import infer_final

__all__ = ["InferEntry"]


@attrs.define(eq=False)
class InferEntry:
    """An ``infer`` in flight on one connection."""

    request: p.InferRequest
    generation: Generation
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    #: Set once the terminal frame is queued for the writer.
    done: trio.Event = attrs.Factory(trio.Event)
    #: A chunk marker for this request is in the outbox, not yet written.
    chunk_pending: bool = False
    #: Length of the response already sent in chunk frames.
    sent: int = 0
    #: Log-probability entries already sent in chunk frames.
    logprobs_sent: int = 0
    #: Why the request was interrupted, for metrics: ``stop``, ``shutdown``,
    #: or (when nobody says) ``disconnect``.
    cancel_cause: str | None = None

    def chunk_frame(self) -> str | None:
        """The chunk frame of everything released since the last one (None
        when nothing was); the writer calls it when it can send."""
        self.chunk_pending = False
        generation = self.generation
        chunk = generation.response[self.sent :]
        if not chunk:
            return None
        self.sent = len(generation.response)
        entries = generation.logprobs[self.logprobs_sent :]
        self.logprobs_sent += len(entries)
        return p.encode_reply(
            p.infer_chunk(
                self.request,
                chunk=chunk,
                util_text=generation.util_text,
                response=generation.response,
                logprobs=entries,
            )
        )

    def unsent_chunk(self) -> bool:
        """Whether released text still needs a chunk frame before the final
        one (and none is on its way)."""
        return (
            self.request.stream
            and not self.chunk_pending
            and len(self.generation.response) > self.sent
        )

    def terminal_reply(self) -> p.Reply:
        """The frame that ends the request, once its generation has ended
        (:meth:`Generation.end <trioserve.generation.Generation.end>`): the
        final frame, or an ``internal`` error when the engine failed it."""
        generation = self.generation
        assert generation.outcome is not None, "end the generation first"
        if generation.outcome == "failed":
            # What the request asked for (its constraint broke down) is its
            # own error; anything else is the engine's.
            request_cause = generation.failure_cause == "request"
            return p.ProtocolError(
                "invalid_request" if request_cause else "internal",
                generation.failure or "the engine failed",
                action="infer",
                echoed=self.request.echoed,
            ).reply()
        return infer_final(self.request, generation)
