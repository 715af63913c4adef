"""The engine thread: one OS thread that makes every call into the engine.

torch keeps per-thread state that matters for speed and correctness: each
thread that runs CPU operations gets its own OpenMP team (a model stepped
from a thread other than the one that loaded it ran about 15 % slower, the
loading thread's team spinning on the cores), and CUDA streams and contexts
are per thread too. So an engine is loaded, warmed up, stepped and closed on
one thread: :class:`EngineThread`.

The thread is started through ``trio.to_thread.run_sync`` inside
:func:`open_engine_thread`, so its lifetime is a block of the program like any
other trio resource: it ends when the block ends, after the call it is running.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import attrs
import trio

from trioserve.errors import TrioserveError

__all__ = ["EngineThread", "EngineThreadClosed", "open_engine_thread", "open_loaded_engine"]

_T = TypeVar("_T")


class EngineThreadClosed(TrioserveError):
    """The engine thread has ended (or is ending); it takes no more calls."""


@attrs.define(eq=False)
class _Call:
    fn: Callable[[], Any]
    done: trio.Event
    token: trio.lowlevel.TrioToken
    value: Any = None
    error: BaseException | None = None


class EngineThread:
    """A thread that runs the calls it is given, one at a time, in order.

    Made by :func:`open_engine_thread`. :meth:`run_sync` runs a function on it
    and returns its result; the scheduler runs its whole step loop as one such
    call. Calls never overlap, so an engine used only through one
    ``EngineThread`` is used from one thread.
    """

    def __init__(self, name: str = "trioserve-engine") -> None:
        self.name = name
        self._cond = threading.Condition()
        self._calls: collections.deque[_Call] = collections.deque()
        self._closing = False
        self._ident: int | None = None

    @property
    def ident(self) -> int | None:
        """The thread's identifier (``threading.get_ident()`` on it), once started."""
        return self._ident

    def on_thread(self) -> bool:
        """True when called from this engine thread."""
        return self._ident is not None and threading.get_ident() == self._ident

    async def run_sync(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on the engine thread and return its result.

        Cancellation: not cancellable once queued, like
        ``trio.to_thread.run_sync``: an engine call (a load, a step loop) must
        not be abandoned half done, because its result owns memory or device
        state that only this thread may free.
        """
        call = _Call(
            fn=lambda: fn(*args), done=trio.Event(), token=trio.lowlevel.current_trio_token()
        )
        with self._cond:
            if self._closing:
                raise EngineThreadClosed(f"the engine thread {self.name!r} has ended")
            self._calls.append(call)
            self._cond.notify()
        with trio.CancelScope(shield=True):
            await call.done.wait()
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[no-any-return]

    # -- the thread ---------------------------------------------------------------

    def _main(self) -> None:
        self._ident = threading.get_ident()
        # trio's worker threads are cached and reused: the name is lent.
        current = threading.current_thread()
        cached_name, current.name = current.name, self.name
        try:
            self._serve_calls()
        finally:
            current.name = cached_name

    def _serve_calls(self) -> None:
        while True:
            with self._cond:
                while not self._calls and not self._closing:
                    self._cond.wait()
                if not self._calls:
                    return
                call = self._calls.popleft()
            try:
                call.value = call.fn()
            except BaseException as exc:  # handed to the caller, whatever it is
                call.error = exc
            call.token.run_sync_soon(call.done.set)

    def _close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()


@asynccontextmanager
async def open_engine_thread(name: str = "trioserve-engine") -> AsyncIterator[EngineThread]:
    """Start an :class:`EngineThread` for the duration of the block.

    Resource handling: on leaving the block the thread finishes the calls
    already queued (a running step loop must have been told to stop by its
    owner first), then ends; the block is left only after it has ended, so no
    thread outlives it.
    """
    thread = EngineThread(name)

    async def run_thread() -> None:
        # Shielded: a cancellation that arrives before this task first runs
        # must not keep the thread from starting, or a call queued meanwhile
        # would wait forever. The thread ends once _close() is called below.
        with trio.CancelScope(shield=True):
            # Its own limiter: the engine thread never waits for, nor takes,
            # one of the default limiter's threads (tokenization uses those).
            await trio.to_thread.run_sync(thread._main, limiter=trio.CapacityLimiter(1))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_thread)
        try:
            yield thread
        finally:
            thread._close()


_E = TypeVar("_E", bound="Closeable")


class Closeable(Protocol):
    def close(self) -> None: ...


@asynccontextmanager
async def open_loaded_engine(
    load: Callable[[], _E], name: str = "trioserve-engine"
) -> AsyncIterator[tuple[_E, EngineThread]]:
    """Open the engine thread, call ``load`` on it, and yield the engine with
    its thread: every torch (and CUDA) call of the model is then made by that
    one thread (faster on a CPU, required by CUDA). The one place a server's
    engine thread is opened (``serve``, the command line); a
    :class:`~trioserve.generation.scheduler.Scheduler` given no thread opens
    one of its own for as long as it runs.

    Resource handling: the engine is closed on its thread when the block is
    left, cancelled or not, then the thread ends.
    """
    async with open_engine_thread(name) as thread:
        engine = await thread.run_sync(load)
        try:
            yield engine, thread
        finally:
            with trio.CancelScope(shield=True):
                await thread.run_sync(engine.close)
