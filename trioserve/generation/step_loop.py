"""The engine thread's half of the generation task: the step loop.

It runs on the engine thread while there is work: it takes the jobs admitted
and the cancellations made since the last step from an inbox shared with
trio under a lock, runs one :meth:`Engine.step`, hands the result to trio
(``post``: the scheduler routes it on the trio thread) without waiting, and
goes straight into the next step. With nothing to do it returns, and the
next job starts it again (:meth:`StepLoop.add` says when); told to stop, it
drops every job the engine holds and returns. It knows no trio and no jobs,
only specs and ids: :class:`~trioserve.generation.scheduler.Scheduler` is
the trio half.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs

from trioserve.engine.base import Engine, GenerationSpec, PausingEngine
from trioserve.vocabulary.results import TextUpdate, Update

__all__ = ["StepLoop", "StepRecord", "StepResult"]

log = logging.getLogger("trioserve.scheduler")


@attrs.frozen
class StepRecord:
    """What one engine step did, for observers (metrics)."""

    #: Seconds inside ``Engine.step``.
    duration: float
    #: Jobs in the engine during the step.
    batch: int
    #: Updates the step produced.
    updates: int
    failed: bool
    #: The engine's ``statistics()`` right after the step, read on the engine
    #: thread (None for an engine without one, when it failed, or when no
    #: ``on_step`` observer is set).
    engine_statistics: Any = None


@attrs.define(eq=False)
class StepResult:
    """One step's outcome, as the step loop hands it to trio."""

    updates: list[Update]
    #: Jobs failed because the step raised (the engine drops them next step).
    failed_ids: list[int]
    error: Exception | None
    record: StepRecord


class StepLoop:
    """The inbox and the loop of the engine thread (see the module docstring).

    ``post`` hands each step's result to trio (called on the engine thread);
    ``observed`` says whether a step observer wants the engine's statistics
    read after each step.
    """

    def __init__(
        self,
        engine: Engine,
        post: Callable[[StepResult], None],
        observed: Callable[[], bool],
    ) -> None:
        self.engine = engine
        self._post = post
        self._observed = observed
        self._lock = threading.Lock()
        self._submit: list[GenerationSpec] = []
        self._cancel: list[int] = []
        self._pause: list[int] = []
        #: Jobs the engine holds paused (engine thread; read under the lock):
        #: it keeps their state until they are resumed or cancelled, and the
        #: loop makes it drop them when told to stop, even from idle.
        self._paused: set[int] = set()
        self._stopping = False
        #: Whether the loop is running on the engine thread (under the lock).
        self._active = False

    def add(
        self,
        submit: Sequence[GenerationSpec] = (),
        cancel: int | None = None,
        pause: Sequence[int] = (),
    ) -> bool:
        """Put work in the inbox (trio side); True when the loop is idle and
        must be started. ``pause``: jobs to pause (an engine with
        ``EngineInfo.pausing``); submitting a paused job's spec again resumes
        it. A job paused and resumed, or submitted and paused, before the
        engine saw the first of the two leaves the inbox as the engine last
        saw it."""
        with self._lock:
            for spec in submit:
                if spec.job_id in self._pause:
                    self._pause.remove(spec.job_id)  # paused and resumed: still running
                else:
                    self._submit.append(spec)
            for job_id in pause:
                pending = [spec for spec in self._submit if spec.job_id == job_id]
                if pending:
                    self._submit.remove(pending[0])  # the engine never saw it run
                else:
                    self._pause.append(job_id)
            if cancel is not None:
                self._cancel.append(cancel)
            return not self._active

    def stop(self) -> None:
        """Tell the loop to drop every job and return (trio side)."""
        with self._lock:
            self._stopping = True

    def claim(self) -> bool:
        """Mark the loop as running before :meth:`run` is started; False when
        it is stopping and idle, so that nothing runs in the engine after the
        stop (trio side)."""
        with self._lock:
            if self._stopping and not self._active and not self._paused:
                return False
            self._active = True
            return True

    def run(self) -> None:
        """The engine thread's loop: inbox -> step -> results, until there is
        nothing to do (it returns; the next job starts it again) or it is
        told to stop (it drops every job the engine holds, then returns)."""
        live: set[int] = set()
        paused = self._paused
        drop: list[int] = []
        engine = self.engine
        statistics = getattr(engine, "statistics", None)
        while True:
            with self._lock:
                submits, self._submit = self._submit, []
                cancels, self._cancel = self._cancel, []
                pauses, self._pause = self._pause, []
                stopping = self._stopping
                if not (submits or cancels or pauses or live or drop or stopping):
                    self._active = False
                    return
                paused.difference_update(cancels)
                paused.update(job_id for job_id in pauses if job_id not in cancels)
                paused.difference_update(spec.job_id for spec in submits)
            cancels += drop
            drop = []
            if stopping:
                # Free the engine's slots, so that an engine that outlives this
                # scheduler starts clean. With every job cancelled, the step
                # has no model work to do and returns at once.
                everything = [*live, *paused, *cancels, *(spec.job_id for spec in submits)]
                with self._lock:
                    paused.clear()
                if everything:
                    try:
                        engine.step([], everything)
                    except Exception:
                        log.exception("the engine failed to drop %d jobs", len(everything))
                with self._lock:
                    self._active = False
                return
            if cancels and submits:
                # Cancelled before the engine saw it: it never runs.
                cancelled = set(cancels)
                submits = [spec for spec in submits if spec.job_id not in cancelled]
            live.difference_update(cancels)
            live.difference_update(pauses)
            live.update(spec.job_id for spec in submits)
            batch = len(live)
            started = time.perf_counter()
            error: Exception | None = None
            try:
                if pauses:
                    updates = cast(PausingEngine, engine).step(submits, cancels, pauses)
                else:
                    updates = engine.step(submits, cancels)
            except Exception as exc:
                error = exc
                updates = []
            duration = time.perf_counter() - started
            failed_ids: list[int] = []
            if error is not None:
                failed_ids = sorted(live)
                # Let the engine drop whatever it still holds of these jobs.
                drop = failed_ids
                live.clear()
            else:
                ended = [u.job_id for u in updates if not isinstance(u, TextUpdate)]
                live.difference_update(ended)
                if paused and ended:
                    with self._lock:
                        paused.difference_update(ended)
            engine_statistics = None
            if callable(statistics) and self._observed():
                try:
                    engine_statistics = statistics()
                except Exception:
                    log.debug("the engine's statistics failed", exc_info=True)
            record = StepRecord(
                duration=duration,
                batch=batch,
                updates=len(updates),
                failed=error is not None,
                engine_statistics=engine_statistics,
            )
            self._post(StepResult(updates, failed_ids, error, record))
