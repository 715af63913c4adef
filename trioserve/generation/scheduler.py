"""The generation task: the one owner of the engine.

Two halves meet here. On the trio side, request handlers queue jobs
(:meth:`Scheduler.open_job`) and cancel them (:meth:`Scheduler.cancel`), both
synchronous; the scheduler admits waiting jobs into the engine's free slots,
fairly across owners (connections), and routes each step's updates to the
jobs' own result channels with ``send_nowait``: it never waits on a client.

On the engine thread (:mod:`trioserve.generation.engine_thread`), a step loop takes the jobs
admitted and the cancellations made since the last step from a thread-safe
inbox, runs one :meth:`Engine.step`, hands its updates back to trio without
waiting, and goes straight into the next step. Routing and frame sending
overlap the next step instead of sitting between steps.

Guarantees:

* a cancelled job produces no update after :meth:`Scheduler.cancel` returns
  (routing happens on the trio thread, which is where cancels happen);
* a cancelled job frees its place at once: a queued one leaves the queue, a
  running one its slot (the engine drops it before its next step);
* an engine step that raises fails the jobs of that step only;
* when the generation task ends, every job still running or queued is failed
  with an update, the engine drops them all, and the step loop has returned:
  no step runs after that.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Hashable, Sequence

import attrs
import trio

from trioserve.engine.base import Engine, GenerationSpec
from trioserve.errors import TrioserveError
from trioserve.vocabulary.results import Failed, Finished, TextUpdate, Update

from .engine_thread import EngineThread, open_engine_thread
from .fairness import FairQueue
from .step_loop import StepLoop, StepRecord, StepResult

__all__ = ["Job", "QueueFull", "Scheduler", "SchedulerClosed", "SchedulerStatistics", "StepRecord"]

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
    #: Who the job belongs to (a connection): admission is fair across one
    #: client's owners. ``None``: the job is its own owner.
    owner: Hashable | None = None
    #: The client the owner belongs to (an API key, an address): admission is
    #: fair across clients first, and a client's slots are capped. ``None``:
    #: the owner is its own client.
    client: Hashable | None = None
    #: trio.current_time() when the job was queued, and when the engine took it.
    queued_at: float = 0.0
    started_at: float | None = None
    cancelled: bool = False
    #: Set while the job gave its slot to another client's job and waits to
    #: resume (the engine keeps its state: nothing is recomputed or lost).
    paused: bool = False
    #: Times the job was paused.
    pauses: int = 0
    #: Set when the job's last update (Finished or Failed) was delivered.
    done: bool = False

    @property
    def job_id(self) -> int:
        return self.spec.job_id

    @property
    def fair_key(self) -> Hashable:
        return self if self.owner is None else self.owner

    @property
    def client_key(self) -> Hashable:
        return self.fair_key if self.client is None else self.client


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
    #: Engine steps run since start, and the seconds spent inside them.
    steps: int
    step_seconds: float = 0.0
    #: Of ``waiting``, the jobs paused for another client; and the pauses
    #: made since start.
    paused: int = 0
    pauses: int = 0


class Scheduler:
    """Owns an engine and runs its generation task (:meth:`run`).

    ``max_waiting`` bounds the jobs not yet taken by the engine: a job that
    finds no free slot and a full queue makes :meth:`open_job` raise
    :class:`QueueFull` at once instead of making a client wait without bound.
    Free engine slots take jobs at once, so a burst on an idle engine fills its
    slots before it counts against the queue.

    A free slot goes to the waiting client holding the fewest slots (in
    turn among equals), then to that client's owners (its connections) in
    turn, and one client holds at most ``max_running_per_owner`` slots.

    With an engine that pauses jobs (``EngineInfo.pausing``), the default cap
    is every slot and fairness is work-conserving: a lone client uses the
    whole engine, and a client whose job finds no slot free takes one at once
    from the client holding the most (at least two more than it), whose
    newest job is paused, its state and keys and values kept by the engine,
    and resumes first of its connection's jobs when a slot frees. Without
    one, the default cap is all but one slot, so that another client's
    request starts at once even while one client floods the engine, through
    either door.

    ``engine_thread``: the thread that steps the engine (use the one that
    loaded it, see :mod:`trioserve.generation.engine_thread`); without one, the step loop runs
    in a worker thread of its own.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_waiting: int = 256,
        max_running_per_owner: int | None = None,
        engine_thread: EngineThread | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
    ) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.capacity = max(1, engine.info.max_batch)
        #: Whether a job is paused to give its slot to another client.
        self.pausing = engine.info.pausing and self.capacity > 1
        if max_running_per_owner is None:
            max_running_per_owner = self.capacity if self.pausing else max(1, self.capacity - 1)
        if max_running_per_owner < 1:
            raise ValueError(f"max_running_per_owner must be >= 1, got {max_running_per_owner!r}")
        self.max_running_per_owner = max_running_per_owner
        self._fair: FairQueue[Job] = FairQueue(max_running_per_owner)
        self.engine_thread = engine_thread
        #: Called on the trio thread after each step (metrics); must not block.
        self.on_step = on_step
        #: Why jobs still running or queued when the scheduler stops fail.
        self.closing_message = "the server is shutting down"
        # Trio side: jobs admitted to the engine (in the inbox or stepping),
        # and jobs waiting, per owner in arrival order.
        self._running: dict[int, Job] = {}
        # Jobs paused for another client, waiting (in _fair) to resume.
        self._paused: dict[int, Job] = {}
        self._pauses = 0
        # The engine thread's half: its inbox, its loop.
        self._loop = StepLoop(engine, self._post, lambda: self.on_step is not None)
        #: Set (on the trio side) when the step loop must be started.
        self._work_ready = trio.Event()
        # Routing's error, if it ever fails (a bug): it ends the generation task.
        self._route_error: Exception | None = None
        self._run_scope: trio.CancelScope | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._idle = trio.Event()
        self._served = 0
        self._cancelled = 0
        self._failed = 0
        self._steps = 0
        self._step_seconds = 0.0
        self._started = False
        self._closed = False

    # -- used by request handlers -------------------------------------------------

    def new_job_id(self) -> int:
        return next(_job_ids)

    def open_job(
        self,
        spec: GenerationSpec,
        *,
        owner: Hashable | None = None,
        client: Hashable | None = None,
    ) -> Job:
        """Create a job for ``spec`` and queue it; raise :class:`QueueFull`
        when it finds neither a free slot nor room in the queue, and
        :class:`SchedulerClosed` after the generation task has ended."""
        if self._closed:
            raise SchedulerClosed("the generation task is not running")
        # Unbounded: the generation task must never wait on a slow client; a
        # job's updates are bounded by its max_new_tokens, and its owner reads
        # them as they come (it never waits on its client either).
        send, receive = trio.open_memory_channel[Update](math.inf)
        job = Job(
            spec=spec,
            send=send,
            updates=receive,
            owner=owner,
            client=client,
            queued_at=trio.current_time(),
        )
        self.submit_nowait(job)
        return job

    def submit_nowait(self, job: Job) -> None:
        """Queue ``job`` for the engine, or raise :class:`QueueFull` at once."""
        if self._closed:
            raise SchedulerClosed("the generation task is not running")
        self._fair.push(job)
        self._admit()
        # Jobs paused for another client do not count: they held slots.
        if self._fair.waiting - len(self._paused) > self.max_waiting and job in self._fair:
            self._fair.remove(job)
            raise QueueFull(
                f"{self.max_waiting} jobs are already waiting for the engine; retry later"
            )

    def has_room(self, client: Hashable | None = None) -> bool:
        """Whether a job submitted now would be accepted (a free slot for
        ``client``, or room in the queue): checked before costly work such as
        tokenizing a long prompt."""
        if self._closed:
            return False
        if self._fair.waiting - len(self._paused) < self.max_waiting:
            return True
        free = self.capacity - len(self._running)
        return free > 0 and (client is None or self._fair.may_run(client))

    def cancel(self, job: Job) -> None:
        """Cancel ``job``: synchronous, idempotent, safe in ``finally`` blocks.

        The job produces no further update. A queued job leaves the queue at
        once; a running job's engine slot is freed before the next engine step.
        """
        if job.done or job.cancelled:
            return
        job.cancelled = True
        self._cancelled += 1
        job._send.close()
        if self._running.pop(job.job_id, None) is not None:
            self._release_slot(job)
            self._post_to_loop(cancel=job.job_id)
            self._admit()
        elif job in self._fair:
            self._fair.remove(job)
            if self._paused.pop(job.job_id, None) is not None:
                # The engine holds its state: let it go.
                self._post_to_loop(cancel=job.job_id)
        self._notify_idle()

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            running=len(self._running),
            waiting=self._fair.waiting,
            served=self._served,
            cancelled=self._cancelled,
            failed=self._failed,
            steps=self._steps,
            step_seconds=self._step_seconds,
            paused=len(self._paused),
            pauses=self._pauses,
        )

    @property
    def busy(self) -> bool:
        """True while any job is running or waiting."""
        return bool(self._running) or self._fair.waiting > 0

    async def wait_idle(self) -> None:
        """Return once no job is running or waiting."""
        while self.busy:
            if self._idle.is_set():
                self._idle = trio.Event()
            await self._idle.wait()

    def _notify_idle(self) -> None:
        if not self.busy:
            self._idle.set()

    # -- queue and admission (trio side) --------------------------------------------

    def _release_slot(self, job: Job) -> None:
        self._fair.release(job)

    def _admit(self) -> None:
        """Move waiting jobs into free engine slots, fairly (see the class
        docstring); with a pausing engine, pause jobs of the clients holding
        the most slots for waiting clients that hold fewer."""
        if not self._started or self._closed:
            return
        admitted: list[Job] = []
        paused: list[int] = []
        now = trio.current_time()
        while self._fair:
            if len(self._running) >= self.capacity:
                victim = self._victim()
                if victim is None:
                    break
                del self._running[victim.job_id]
                self._fair.push_paused(victim)
                self._paused[victim.job_id] = victim
                victim.paused = True
                victim.pauses += 1
                self._pauses += 1
                paused.append(victim.job_id)
                continue
            job = self._fair.pop()
            if job is None:
                break
            if job.paused:
                # Resumed: the engine goes on where it stopped.
                del self._paused[job.job_id]
                job.paused = False
            else:
                job.started_at = now
            self._running[job.job_id] = job
            admitted.append(job)
        if admitted or paused:
            self._post_to_loop(submit=admitted, pause=paused)

    def _victim(self) -> Job | None:
        """The running job to pause for a waiting client, or None."""
        if not self.pausing:
            return None
        running = sorted(self._running.values(), key=lambda job: (job.started_at, job.job_id))
        return self._fair.victim(running)

    def _post_to_loop(
        self, *, submit: Sequence[Job] = (), cancel: int | None = None, pause: Sequence[int] = ()
    ) -> None:
        """Put work in the step loop's inbox; start the loop if it is idle."""
        if self._loop.add([job.spec for job in submit], cancel, pause):
            self._work_ready.set()

    # -- the generation task ------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the generation task until cancelled.

        The step loop runs on ``engine_thread`` while there is work and
        returns when there is none, so that the thread is free for other
        engine calls while the engine is idle. Without an ``engine_thread``
        the scheduler opens one of its own for as long as it runs.

        Cancellation: the step loop is told to stop and ends after the step in
        progress (which is not interrupted); the engine drops every job it
        still holds, and jobs still running or queued are failed with an
        update, so their owners are never left waiting. ``run`` returns once
        the step loop has returned.
        """
        if self._started:
            raise RuntimeError("a Scheduler runs once")
        self._token = trio.lowlevel.current_trio_token()
        try:
            if self.engine_thread is None:
                async with open_engine_thread("trioserve-scheduler") as thread:
                    self.engine_thread = thread
                    await self._run(task_status)
            else:
                await self._run(task_status)
        finally:
            self._close()
        if self._route_error is not None:
            raise self._route_error

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        async with trio.open_nursery() as nursery:
            self._run_scope = nursery.cancel_scope
            nursery.start_soon(self._drive_step_loop, nursery.cancel_scope)
            self._started = True
            self._admit()
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._loop.stop()
                self._work_ready.set()

    async def _drive_step_loop(self, cancel_scope: trio.CancelScope) -> None:
        """Start the step loop on the engine thread whenever work arrives."""
        thread = self.engine_thread
        assert thread is not None
        try:
            while True:
                # Not cancellable: run() stops the loop through StepLoop.stop, and
                # the loop must have dropped its jobs before the task ends.
                with trio.CancelScope(shield=True):
                    await self._work_ready.wait()
                self._work_ready = trio.Event()
                if not self._loop.claim():
                    # Stopping, and nothing runs in the engine while the loop is idle.
                    return
                await thread.run_sync(self._loop.run)
        finally:
            # The loop ended (stopped, or broken): no job can be served now.
            # Its results were routed before this: run_sync_soon keeps order.
            cancel_scope.cancel()

    def _post(self, result: StepResult) -> None:
        """Hand a step's result to trio (called on the engine thread)."""
        assert self._token is not None
        self._token.run_sync_soon(self._deliver, result)

    def _deliver(self, result: StepResult) -> None:
        """Route a step's result: on the trio thread, outside any task, in
        the order the engine thread posted them. Routing here rather than in
        a task of its own saves a task switch per step (for one stream, 458
        calls on the trio thread per token instead of 509, docs/performance.md).
        It must never raise into trio's loop: an error (a bug) is kept, and
        the generation task ends and raises it."""
        if self._closed or self._route_error is not None:
            return  # the jobs were failed by _close
        try:
            self._route(result)
        except Exception as exc:
            log.exception("routing a step's results failed")
            self._route_error = exc
            if self._run_scope is not None:
                self._run_scope.cancel()

    def _route(self, result: StepResult) -> None:
        self._steps += 1
        self._step_seconds += result.record.duration
        if result.error is not None:
            log.error(
                "engine step failed; failing its %d jobs",
                len(result.failed_ids),
                exc_info=result.error,
            )
        for update in self._updates_of(result):
            job = self._running.get(update.job_id)
            if job is None:
                job = self._paused.get(update.job_id)
            if job is None:
                # Cancelled while the step ran: its owner has already answered.
                continue
            if isinstance(update, TextUpdate):
                job._send.send_nowait(update)
                continue
            if job.paused:
                # It ended in the step that ran while it was being paused:
                # it waits no more, and the engine forgets the pause.
                del self._paused[update.job_id]
                self._fair.remove(job)
                self._post_to_loop(cancel=update.job_id)
            else:
                del self._running[update.job_id]
                self._release_slot(job)
            self._end(job, update)
        self._admit()
        self._notify_idle()
        if self.on_step is not None:
            try:
                self.on_step(result.record)
            except Exception:
                log.exception("a step observer failed")

    @staticmethod
    def _updates_of(result: StepResult) -> Sequence[Update]:
        if result.error is None:
            return result.updates
        message = f"the engine failed: {result.error}"
        return [Failed(job_id=job_id, message=message) for job_id in result.failed_ids]

    def _end(self, job: Job, update: Finished | Failed) -> None:
        job.done = True
        if isinstance(update, Finished):
            self._served += 1
        else:
            self._failed += 1
        job._send.send_nowait(update)
        job._send.close()

    def _close(self) -> None:
        """Fail every job still running or queued: no owner is left waiting."""
        self._closed = True
        leftover = [*self._running.values(), *self._fair.drain()]
        self._running.clear()
        self._paused.clear()
        for job in leftover:
            if not job.cancelled and not job.done:
                self._end(job, Failed(job_id=job.job_id, message=self.closing_message))
        self._notify_idle()
