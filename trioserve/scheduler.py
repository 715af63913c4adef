"""The generation task: the one owner of the engine.

Jobs arrive on a bounded memory channel (the queue of jobs waiting for the
engine, shared by all connections). The generation task takes as many as the
engine has room for, applies cancellations, runs one blocking
:meth:`Engine.step` in a worker thread, and routes each update to its job's own
result channel with ``send_nowait``: it never waits on a client.

Cancelling a job is synchronous (:meth:`Scheduler.cancel`), so that it can be
called from a ``finally`` block of a cancelled task: a queued job is skipped
when it is taken off the queue, a running job is dropped by the engine before
its next step.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
from collections.abc import Sequence

import attrs
import trio

from .engine.base import Engine, Failed, Finished, GenerationSpec, TextUpdate, Update
from .errors import TrioserveError

__all__ = ["Job", "QueueFull", "Scheduler", "SchedulerStatistics"]

log = logging.getLogger("trioserve.scheduler")

# Job ids are unique in the process, not per scheduler: an engine may outlive
# a server and serve the next one (tests and embedding applications do that).
_job_ids = itertools.count(1)


class QueueFull(TrioserveError):
    """The queue of jobs waiting for the engine is full; retry later."""


class SchedulerClosed(TrioserveError):
    """The generation task is not running (any more); no job can be submitted."""


@attrs.define(eq=False)
class Job:
    """One generation request on its way through the engine.

    Created by :meth:`Scheduler.open_job`. The owner reads updates from
    ``updates`` until a :class:`Finished` or :class:`Failed` arrives (then the
    channel is closed by the generation task).
    """

    spec: GenerationSpec
    #: The generation task's end of the job's result channel.
    _send: trio.MemorySendChannel[Update] = attrs.field(repr=False)
    #: The owner's end.
    updates: trio.MemoryReceiveChannel[Update] = attrs.field(repr=False)
    #: trio.current_time() when the job was queued, and when the engine took it.
    queued_at: float = 0.0
    started_at: float | None = None
    cancelled: bool = False
    done: bool = False

    @property
    def job_id(self) -> int:
        return self.spec.job_id


@attrs.frozen
class SchedulerStatistics:
    """A snapshot of the generation task's state."""

    #: Jobs the engine is working on.
    running: int
    #: Jobs queued for the engine.
    waiting: int
    #: Jobs that finished normally, were cancelled, or failed, since start.
    served: int
    cancelled: int
    failed: int
    #: Engine steps run since start.
    steps: int


class Scheduler:
    """Owns an engine and runs its generation task (:meth:`run`).

    ``max_waiting`` bounds the queue of jobs not yet taken by the engine; a full
    queue makes :meth:`submit_nowait` raise :class:`QueueFull` at once instead of
    making a client wait without bound.
    """

    def __init__(self, engine: Engine, *, max_waiting: int = 256) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        # The queue itself: a buffer of max_waiting, so that submit_nowait
        # fails exactly when that many jobs wait.
        self._queue_send, self._queue_receive = trio.open_memory_channel[Job](max_waiting)
        self._running: dict[int, Job] = {}
        self._cancels: list[int] = []
        # Jobs already taken off the queue while the task was idle.
        self._front: collections.deque[Job] = collections.deque()
        self._idle = trio.Event()
        self._waiting = 0
        self._served = 0
        self._cancelled = 0
        self._failed = 0
        self._steps = 0
        self._closed = False

    # -- used by request handlers -------------------------------------------------

    def new_job_id(self) -> int:
        return next(_job_ids)

    def open_job(self, spec: GenerationSpec) -> Job:
        """Create a job for ``spec`` and queue it (see :meth:`submit_nowait`)."""
        # Unbounded: the generation task must never wait on a slow client; a
        # job's updates are bounded by its max_new_tokens anyway.
        send, receive = trio.open_memory_channel[Update](math.inf)
        job = Job(spec=spec, send=send, updates=receive, queued_at=trio.current_time())
        self.submit_nowait(job)
        return job

    def submit_nowait(self, job: Job) -> None:
        """Queue ``job`` for the engine, or raise :class:`QueueFull` at once."""
        if self._closed:
            raise SchedulerClosed("the generation task is not running")
        try:
            self._queue_send.send_nowait(job)
        except trio.WouldBlock:
            raise QueueFull(
                f"{self.max_waiting} jobs are already waiting for the engine; retry later"
            ) from None
        self._waiting += 1

    def cancel(self, job: Job) -> None:
        """Cancel ``job``: synchronous, idempotent, safe in ``finally`` blocks.

        The job produces no further update. A running job's engine slot is
        freed before the next engine step.
        """
        if job.done or job.cancelled:
            return
        job.cancelled = True
        self._cancelled += 1
        job._send.close()
        if self._running.pop(job.job_id, None) is not None:
            self._cancels.append(job.job_id)
        self._notify_idle()

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            running=len(self._running),
            waiting=self._waiting,
            served=self._served,
            cancelled=self._cancelled,
            failed=self._failed,
            steps=self._steps,
        )

    @property
    def busy(self) -> bool:
        """True while any job is running or waiting."""
        return bool(self._running) or self._waiting > 0

    async def wait_idle(self) -> None:
        """Return once no job is running or waiting."""
        while self.busy:
            if self._idle.is_set():
                self._idle = trio.Event()
            await self._idle.wait()

    def _notify_idle(self) -> None:
        if not self.busy:
            self._idle.set()

    # -- the generation task ------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the generation task until cancelled.

        Cancellation: the task stops between engine steps (a step already in
        its worker thread runs to its end first). Jobs still running or queued
        are failed with an update, so their owners are never left waiting.
        """
        capacity = max(1, self.engine.info.max_batch)
        task_status.started()
        try:
            while True:
                submits = self._take_jobs(capacity - len(self._running))
                if not submits and not self._running and not self._cancels:
                    await self._wait_for_work()
                    continue
                cancels, self._cancels = self._cancels, []
                now = trio.current_time()
                for job in submits:
                    job.started_at = now
                    self._running[job.job_id] = job
                specs = [job.spec for job in submits]
                try:
                    updates = await trio.to_thread.run_sync(self.engine.step, specs, cancels)
                except Exception as exc:
                    updates = self._fail_running(exc)
                except BaseException:
                    # Cancelled before the step started: _close must still
                    # tell the engine about these.
                    self._cancels.extend(cancels)
                    raise
                self._steps += 1
                self._route(updates)
        finally:
            self._close()

    def _take_jobs(self, room: int) -> list[Job]:
        taken: list[Job] = []
        while len(taken) < room:
            if self._front:
                job = self._front.popleft()
            else:
                try:
                    job = self._queue_receive.receive_nowait()
                except trio.WouldBlock:
                    break
            self._waiting -= 1
            if not job.cancelled:
                taken.append(job)
        self._notify_idle()
        return taken

    async def _wait_for_work(self) -> None:
        """Sleep until a job is queued.

        Nothing else can need the engine while it is idle: cancellations only
        concern running jobs, and there are none.
        """
        job = await self._queue_receive.receive()
        # The generation task is the queue's only reader, so the job simply
        # becomes the first of the next step.
        self._front.append(job)

    def _fail_running(self, exc: Exception) -> list[Update]:
        log.error("engine step failed; failing its %d jobs", len(self._running), exc_info=exc)
        updates: list[Update] = []
        for job_id in list(self._running):
            updates.append(Failed(job_id=job_id, message=f"the engine failed: {exc}"))
            # Let the engine drop whatever it still holds of these jobs.
            self._cancels.append(job_id)
        return updates

    def _route(self, updates: Sequence[Update]) -> None:
        for update in updates:
            job = self._running.get(update.job_id)
            if job is None:
                # Cancelled while the step ran: its owner has already answered.
                continue
            if isinstance(update, TextUpdate):
                job._send.send_nowait(update)
                continue
            del self._running[update.job_id]
            self._end(job, update)

    def _end(self, job: Job, update: Finished | Failed) -> None:
        job.done = True
        if isinstance(update, Finished):
            self._served += 1
        else:
            self._failed += 1
        job._send.send_nowait(update)
        job._send.close()
        self._notify_idle()

    def _close(self) -> None:
        """Fail every job still running or queued: no owner is left waiting."""
        self._closed = True
        engine_jobs = [*self._running, *self._cancels]
        if engine_jobs:
            # Free the engine's slots now, so that an engine that outlives this
            # scheduler starts clean. With every job cancelled, the step has no
            # model work to do and returns at once.
            try:
                self.engine.step([], engine_jobs)
            except Exception:
                log.exception("the engine failed to drop %d jobs at shutdown", len(engine_jobs))
        leftover = list(self._running.values()) + list(self._front)
        self._running.clear()
        self._front.clear()
        while True:
            try:
                leftover.append(self._queue_receive.receive_nowait())
            except (trio.WouldBlock, trio.ClosedResourceError):
                break
        self._waiting = 0
        for job in leftover:
            if not job.cancelled and not job.done:
                self._end(job, Failed(job_id=job.job_id, message="the server is shutting down"))
