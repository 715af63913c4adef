"""The generation task, on the scripted engine (the real model is in test_e2e.py)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio

from trioserve.engine.base import GenerationSpec
from trioserve.generation.engine_thread import open_engine_thread
from trioserve.generation.scheduler import Job, QueueFull, Scheduler
from trioserve.vocabulary.results import Failed, Finished, TextUpdate
from trioserve.vocabulary.sampling import SamplingSettings

from .helpers import EOS, ScriptedEngine

pytestmark = pytest.mark.unit


def make_spec(
    scheduler: Scheduler, engine: ScriptedEngine, prompt: str, n: int = 32
) -> GenerationSpec:
    return GenerationSpec(
        job_id=scheduler.new_job_id(),
        prompt_ids=tuple(engine.encode(prompt)),
        max_new_tokens=n,
        sampling=SamplingSettings(temperature=0),
        stop_token_ids=frozenset({EOS}),
    )


async def collect(job: Job) -> tuple[str, Finished | Failed]:
    text = ""
    async for update in job.updates:
        if isinstance(update, TextUpdate):
            text += update.text
        else:
            if isinstance(update, Finished):
                text += update.text
            return text, update
    raise AssertionError("the job's channel closed without a result")


async def test_jobs_finish_with_their_text() -> None:
    engine = ScriptedEngine()
    scheduler = Scheduler(engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        job = scheduler.open_job(make_spec(scheduler, engine, "say:abc", n=10))
        text, end = await collect(job)
        assert text == "abc"
        assert isinstance(end, Finished)
        assert end.reason == "stop_token" and end.stop_token == EOS
        assert end.generated_tokens == 4
        nursery.cancel_scope.cancel()
    stats = scheduler.statistics()
    assert (stats.served, stats.running, stats.waiting, stats.failed) == (1, 0, 0, 0)


async def test_more_jobs_than_slots_wait_in_arrival_order() -> None:
    engine = ScriptedEngine(max_batch=2)
    scheduler = Scheduler(engine)
    async with trio.open_nursery() as nursery:
        jobs = [
            scheduler.open_job(make_spec(scheduler, engine, f"say:{i}{i}{i}")) for i in range(6)
        ]
        assert scheduler.statistics().waiting == 6
        await nursery.start(scheduler.run)
        results = []
        for job in jobs:
            results.append(await collect(job))
        nursery.cancel_scope.cancel()
    assert [text for text, _ in results] == [f"{i}" * 3 for i in range(6)]
    starts = [job.started_at for job in jobs if job.started_at is not None]
    assert len(starts) == len(jobs)
    assert starts == sorted(starts)
    # Never more than two at once: the third job started only after a step
    # in which the first ones finished.
    assert starts[0] == starts[1] < starts[2]


async def test_full_queue_is_refused_at_once() -> None:
    engine = ScriptedEngine()
    scheduler = Scheduler(engine, max_waiting=3)
    for _ in range(3):
        scheduler.open_job(make_spec(scheduler, engine, "x"))
    with pytest.raises(QueueFull, match="3 jobs are already waiting"):
        scheduler.open_job(make_spec(scheduler, engine, "x"))


async def test_cancelled_queued_job_never_reaches_the_engine() -> None:
    engine = ScriptedEngine(max_batch=1)
    scheduler = Scheduler(engine)
    first = scheduler.open_job(make_spec(scheduler, engine, "say:one"))
    second = scheduler.open_job(make_spec(scheduler, engine, "FAIL if run"))
    scheduler.cancel(second)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        text, _end = await collect(first)
        assert text == "one"
        await scheduler.wait_idle()
        nursery.cancel_scope.cancel()
    # The cancelled job produced no update at all and was never run.
    with pytest.raises(trio.EndOfChannel):
        second.updates.receive_nowait()
    stats = scheduler.statistics()
    assert (stats.served, stats.failed, stats.cancelled) == (1, 0, 1)


async def test_cancelling_a_running_job_frees_its_slot() -> None:
    engine = ScriptedEngine(max_batch=1, step_delay=0.01)
    scheduler = Scheduler(engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        endless = scheduler.open_job(make_spec(scheduler, engine, "no script", n=200))
        await endless.updates.receive()  # it runs
        waiting = scheduler.open_job(make_spec(scheduler, engine, "say:next"))
        scheduler.cancel(endless)
        text, end = await collect(waiting)
        assert text == "next" and isinstance(end, Finished)
        await scheduler.wait_idle()
        nursery.cancel_scope.cancel()
    assert engine.running_jobs == 0


async def test_a_failing_job_fails_alone() -> None:
    engine = ScriptedEngine()
    scheduler = Scheduler(engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        bad = scheduler.open_job(make_spec(scheduler, engine, "FAIL"))
        good = scheduler.open_job(make_spec(scheduler, engine, "say:fine"))
        _, bad_end = await collect(bad)
        text, good_end = await collect(good)
        nursery.cancel_scope.cancel()
    assert isinstance(bad_end, Failed) and bad_end.message == "scripted failure"
    assert text == "fine" and isinstance(good_end, Finished)


async def test_an_engine_crash_fails_its_jobs_and_the_task_goes_on() -> None:
    engine = ScriptedEngine()
    scheduler = Scheduler(engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        crashing = scheduler.open_job(make_spec(scheduler, engine, "CRASH"))
        _, end = await collect(crashing)
        assert isinstance(end, Failed) and "scripted engine crash" in end.message
        later = scheduler.open_job(make_spec(scheduler, engine, "say:still here"))
        text, later_end = await collect(later)
        nursery.cancel_scope.cancel()
    assert text == "still here" and isinstance(later_end, Finished)
    assert engine.running_jobs == 0


async def test_stopping_the_task_fails_what_is_left() -> None:
    engine = ScriptedEngine(max_batch=1, step_delay=0.01)
    scheduler = Scheduler(engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        running = scheduler.open_job(make_spec(scheduler, engine, "endless", n=200))
        queued = scheduler.open_job(make_spec(scheduler, engine, "endless", n=200))
        await running.updates.receive()
        nursery.cancel_scope.cancel()
    for job in (running, queued):
        _, end = await collect(job)
        assert isinstance(end, Failed) and "shutting down" in end.message


async def test_a_burst_fills_free_slots_before_it_counts_against_the_queue() -> None:
    engine = ScriptedEngine(max_batch=4, step_delay=0.01)
    scheduler = Scheduler(engine, max_waiting=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        # Four free slots and one queue place: five jobs are accepted.
        jobs = [
            scheduler.open_job(make_spec(scheduler, engine, "endless", n=200), owner=i)
            for i in range(5)
        ]
        stats = scheduler.statistics()
        assert (stats.running, stats.waiting) == (4, 1)
        with pytest.raises(QueueFull):
            scheduler.open_job(make_spec(scheduler, engine, "endless"), owner=99)
        for job in jobs:
            scheduler.cancel(job)
        nursery.cancel_scope.cancel()


async def test_a_cancelled_queued_job_frees_its_place_at_once() -> None:
    engine = ScriptedEngine(max_batch=1, step_delay=0.01)
    scheduler = Scheduler(engine, max_waiting=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        running = scheduler.open_job(make_spec(scheduler, engine, "endless", n=500), owner="a")
        queued = [
            scheduler.open_job(make_spec(scheduler, engine, "endless"), owner="a") for _ in range(2)
        ]
        with pytest.raises(QueueFull):
            scheduler.open_job(make_spec(scheduler, engine, "say:x"), owner="b")
        for job in queued:
            scheduler.cancel(job)
        assert scheduler.statistics().waiting == 0
        # Both places are free again while the slot is still busy.
        others = [scheduler.open_job(make_spec(scheduler, engine, "say:x"), owner="b")]
        others.append(scheduler.open_job(make_spec(scheduler, engine, "say:y"), owner="c"))
        scheduler.cancel(running)
        texts = [(await collect(job))[0] for job in others]
        assert texts == ["x", "y"]
        nursery.cancel_scope.cancel()


async def test_admission_is_round_robin_and_keeps_a_slot_for_another_owner() -> None:
    engine = ScriptedEngine(max_batch=4, step_delay=0.005)
    scheduler = Scheduler(engine)
    assert scheduler.max_running_per_owner == 3
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        flood = [
            scheduler.open_job(make_spec(scheduler, engine, "endless", n=400), owner="flood")
            for _ in range(10)
        ]
        # The flood holds three slots; the fourth stays free for another owner.
        assert scheduler.statistics().running == 3
        polite = scheduler.open_job(make_spec(scheduler, engine, "say:hi"), owner="polite")
        assert polite.started_at is not None, "the newcomer must start at once"
        text, end = await collect(polite)
        assert text == "hi" and isinstance(end, Finished)
        for job in flood:
            scheduler.cancel(job)
        nursery.cancel_scope.cancel()


async def test_owners_take_turns_for_freed_slots() -> None:
    engine = ScriptedEngine(max_batch=2, step_delay=0.002)
    scheduler = Scheduler(engine, max_running_per_owner=2)
    started: list[str] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        jobs = []
        for owner in ("a", "a", "a", "a", "b", "b"):
            job = scheduler.open_job(make_spec(scheduler, engine, f"say:{owner}"), owner=owner)
            jobs.append((owner, job))
        for _, job in jobs:
            await collect(job)
        nursery.cancel_scope.cancel()
    order = sorted(jobs, key=lambda pair: (pair[1].started_at, pair[1].job_id))
    started = [owner for owner, _ in order]
    # a took both free slots; then the freed slots alternate b, a, b, a.
    assert started[:2] == ["a", "a"]
    assert started[2:4] in (["b", "a"], ["a", "b"])
    assert started.count("b") == 2 and started.index("b") <= 3


async def test_every_engine_call_runs_on_the_engine_thread() -> None:
    threads: set[int] = set()

    class Recording(ScriptedEngine):
        def step(self, submit: Any, cancel: Any, pause: Any = ()) -> list[Any]:
            threads.add(threading.get_ident())
            return super().step(submit, cancel, pause)

    engine = Recording(max_batch=2)
    async with open_engine_thread() as thread:
        scheduler = Scheduler(engine, engine_thread=thread)
        async with trio.open_nursery() as nursery:
            await nursery.start(scheduler.run)
            for round_ in range(3):
                job = scheduler.open_job(make_spec(scheduler, engine, f"say:{round_}"))
                await collect(job)
                await scheduler.wait_idle()
                # Idle: the step loop has given the thread back.
                assert await thread.run_sync(threading.get_ident) == thread.ident
            nursery.cancel_scope.cancel()
    assert threads == {thread.ident}


async def test_no_step_runs_after_the_task_ends() -> None:
    engine = ScriptedEngine(max_batch=2, step_delay=0.01)
    scheduler = Scheduler(engine)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        job = scheduler.open_job(make_spec(scheduler, engine, "endless", n=500))
        await job.updates.receive()
        nursery.cancel_scope.cancel()
    steps = engine.steps
    await trio.sleep(0.05)
    assert engine.steps == steps
    assert engine.running_jobs == 0


async def test_a_routing_bug_ends_the_task_with_its_error_and_fails_the_jobs() -> None:
    """Routing runs outside any task (docs/performance.md, "Where the gap goes"): an error
    there must not reach trio's loop. The task ends raising it, and the jobs
    are failed, so no owner is left waiting."""

    class Garbled(ScriptedEngine):
        def step(self, submit: Any, cancel: Any, pause: Any = ()) -> list[Any]:
            return [*super().step(submit, cancel, pause), "not an update"]

    engine = Garbled(step_delay=0.01)
    scheduler = Scheduler(engine)
    ends: list[Finished | Failed] = []

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(scheduler.run)
            job = scheduler.open_job(make_spec(scheduler, engine, "endless", n=200))
            nursery.start_soon(lambda: _keep_end(job, ends))

    with pytest.raises(BaseExceptionGroup) as caught:
        await run()
    assert caught.group_contains(AttributeError)
    (end,) = ends
    assert isinstance(end, Failed) and "shutting down" in end.message


async def _keep_end(job: Job, ends: list[Finished | Failed]) -> None:
    ends.append((await collect(job))[1])
