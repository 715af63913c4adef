"""One started API request on the wire, whichever API's reply it writes:
follows its generations, writes what the reply makes of them (a whole body,
or Server-Sent Events as text is released), and ends the jobs, counts and
logs the request however it ends.

The reply is sans-IO (:class:`WireReply`: OpenAI's
:class:`~trioserve.openai.Reply`, Anthropic's
:class:`~trioserve.anthropic.MessageReply`); this module is the only place
that waits on the generations and the socket for it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import attrs
import trio

from trioserve.generation import (
    Generation,
    InvalidGeneration,
    Overloaded,
    follow_choices,
    start_choices,
)

from .http_types import BodyWriter, Response

__all__ = ["Exchange", "WireReply", "start_request"]

P = TypeVar("P")
E = TypeVar("E", bound=Exception)


async def start_request(
    open_request: Callable[[], Awaitable[tuple[P, list[Generation]]]],
    *,
    arrived: float,
    invalid: Callable[[InvalidGeneration], Exception],
    overloaded: Callable[[Overloaded], Exception],
    api_error: type[E],
    refused: Callable[[Sequence[Generation], E], None],
) -> tuple[P, list[Generation]]:
    """Every API door's start: ``open_request`` reads the request and opens
    its generations (raising the API's own error, ``api_error``), then they
    are started (the pipeline's errors in the API's terms: ``invalid``,
    ``overloaded``). A request refused on the way has its generations
    closed and ``refused`` counts and logs it; anything else (a disconnect)
    closes them and goes on."""
    choices: list[Generation] = []
    try:
        parsed, choices = await open_request()
        for choice in choices:
            choice.received = arrived
        try:
            await start_choices(choices)
        except InvalidGeneration as exc:
            raise invalid(exc) from None
        except Overloaded as exc:
            raise overloaded(exc) from None
    except api_error as exc:
        for choice in choices:
            choice.close()
        refused(choices, exc)
        raise
    except BaseException:
        for choice in choices:
            choice.close()
        raise
    return parsed, choices


log = logging.getLogger("trioserve.routes")


class WireReply(Protocol):
    """What an API's reply gives the exchange (see :class:`~trioserve.openai.Reply`)."""

    @property
    def finished(self) -> bool: ...

    @property
    def broken(self) -> bool: ...

    @property
    def complete(self) -> bool: ...

    def body(self) -> bytes: ...

    def opening(self) -> bytes: ...

    def advance(self) -> bytes: ...

    def end(self) -> bytes: ...

    def error(self, error: Any) -> bytes: ...

    def outcome(self) -> str: ...

    def failure(self, *, draining: bool, message: str = ...) -> tuple[str, Exception]: ...


@attrs.define(eq=False)
class Exchange:
    """One started request: ``finish(outcome)`` counts and logs its end
    (once); ``draining()`` says whether the server is shutting down;
    ``keepalive`` (with ``keepalive_s``) is what a stream sends while no
    text comes (Anthropic's ``ping``)."""

    reply: WireReply
    choices: Sequence[Generation]
    finish: Callable[[str], None]
    draining: Callable[[], bool]
    #: Why a request is cut short while draining (the shutdown, or its
    #: model's unload); None: the reply's own words for the shutdown.
    drain_message: Callable[[], str] | None = None
    keepalive: Callable[[], bytes] | None = None
    keepalive_s: float = 10.0
    done: bool = False

    def _end(self, outcome: str) -> None:
        if not self.done:
            self.done = True
            self.finish(outcome)

    def _failure(self) -> Exception:
        if self.drain_message is None:
            outcome, error = self.reply.failure(draining=self.draining())
        else:
            outcome, error = self.reply.failure(
                draining=self.draining(), message=self.drain_message()
            )
        if outcome == "internal":
            log.error("generation failed: %s", getattr(error, "message", error))
        self._end(outcome)
        return error

    async def whole(self) -> Response:
        try:
            await follow_choices(self.choices)
        finally:
            self._release()
        if not self.reply.finished:
            raise self._failure()
        self._end(self.reply.outcome())
        return Response(200, self.reply.body())

    async def stream(self, out: BodyWriter) -> None:
        """Send the reply as Server-Sent Events. Text released while a write
        waits on the client is sent as one event with the next write (never
        lost, never reordered): a slow reader gets fewer, larger events, and
        the generation never waits on the socket."""
        reply = self.reply
        # Set: the first choice may have released text before the stream began.
        wake = trio.Event()
        wake.set()

        def released(_text: str) -> None:
            wake.set()

        for generation in self.choices:
            generation.on_text = released
        try:
            async with trio.open_nursery() as nursery:

                async def follow() -> None:
                    try:
                        await follow_choices(self.choices)
                    finally:
                        wake.set()

                nursery.start_soon(follow)
                await out.send(reply.opening())
                while True:
                    if self.keepalive is None:
                        await wake.wait()
                    else:
                        with trio.move_on_after(self.keepalive_s):
                            await wake.wait()
                        if not wake.is_set():
                            await out.send(self.keepalive())
                            continue
                    wake = trio.Event()
                    data = reply.advance()
                    if reply.broken:
                        await out.send(data + reply.error(self._failure()))
                        return
                    if reply.complete:
                        self._end(reply.outcome())
                        await out.send(data + reply.end())
                        return
                    if data:
                        await out.send(data)
        finally:
            self._release()

    def _release(self) -> None:
        """The jobs' end, in a ``finally``: a choice that has no outcome yet
        is being abandoned by its client."""
        abandoned = [generation.end() for generation in self.choices]
        if any(abandoned) and not self.done:
            self._end("interrupted")
