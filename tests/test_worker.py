"""The engine thread: one OS thread, its calls in order, its lifetime a block."""

from __future__ import annotations

import threading

import pytest
import trio

from trioserve.generation.engine_thread import EngineThread, EngineThreadClosed, open_engine_thread

pytestmark = pytest.mark.unit


async def test_every_call_runs_on_one_thread_in_order() -> None:
    seen: list[tuple[int, int]] = []
    async with open_engine_thread() as thread:
        for index in range(5):
            await thread.run_sync(lambda i=index: seen.append((i, threading.get_ident())))
        assert thread.ident is not None and thread.ident != threading.get_ident()
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert {ident for _, ident in seen} == {thread.ident}


async def test_errors_reach_the_caller_and_the_thread_goes_on() -> None:
    def fail() -> None:
        raise ValueError("boom")

    async with open_engine_thread() as thread:
        with pytest.raises(ValueError, match="boom"):
            await thread.run_sync(fail)
        assert await thread.run_sync(lambda: 42) == 42


async def test_a_call_queued_after_a_cancellation_still_runs() -> None:
    """A cancellation that arrives before the thread's task first ran must not
    keep the thread from starting: a call queued meanwhile would wait forever
    (a scheduler whose host cancelled it at once hung this way)."""
    ran: list[int] = []

    def work() -> int:
        ran.append(1)
        return 42

    async with trio.open_nursery() as nursery:

        async def use() -> None:
            async with open_engine_thread() as thread:
                nursery.cancel_scope.cancel()
                assert await thread.run_sync(work) == 42

        nursery.start_soon(use)
    assert ran == [1]


async def test_no_call_after_the_block() -> None:
    async with open_engine_thread() as thread:
        pass
    kept: EngineThread = thread
    with pytest.raises(EngineThreadClosed):
        await kept.run_sync(lambda: None)


async def test_the_thread_ends_with_the_block() -> None:
    async with open_engine_thread("probe-thread") as thread:
        await thread.run_sync(lambda: None)
        assert any(t.name == "probe-thread" for t in threading.enumerate())
    # The block waited for the thread to end its work; trio may keep the OS
    # thread in its cache, but it is no longer the engine thread.
    assert not any(t.name == "probe-thread" for t in threading.enumerate())
