"""How far a model's load has come: reported by the code that loads (on the
model's engine thread), read by the server (on the event loop).

A loader does not take a progress argument: the thread that loads has a
:class:`LoadProgress` while :func:`reporting_to` holds, and the loading code
calls :func:`report` as it goes (the CPU engine per layer read, ExLlamaV2
per module, through its ``load`` callback). :func:`span` maps a part of the
load (a GGUF conversion, the weights, a warm-up) onto a part of the whole,
so that each part reports its own ``done`` of ``total`` and the whole still
rises from 0 to 1. Code that loads outside a server reports to no one: every
call here is then a no-op.

Thread safety: the loading thread writes one float, the event loop reads it;
a float attribute's assignment is atomic in CPython. The fraction never goes
down (a part reporting out of order cannot move it back).

A load also gives way: where its :class:`LoadProgress` has a ``give_way``
that says so (on a server, other models have work), each report pauses the
load :data:`GIVE_WAY` times as long as its last part took. The models
serving then share the memory bandwidth and the cores with a load that runs
a third of the time, and the load takes about three times as long (on two
cores, a model streaming while another loaded in a loop kept 0.80 of its
tokens per second without the pauses; docs/performance.md has it with
them). A load with the machine to itself goes at full speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = [
    "LoadProgress",
    "Reporting",
    "here",
    "report",
    "reporting_to",
    "span",
]


#: The longest pause a report makes to give way (seconds).
MAX_PAUSE = 0.5
#: A load that gives way pauses this many times as long as its last part took.
GIVE_WAY = 2.0


class LoadProgress:
    """One load's progress: :attr:`fraction`, from 0 to 1. ``give_way``
    (called on the loading thread; None: never) says whether the load should
    pause to leave the machine to others."""

    __slots__ = ("_last", "fraction", "give_way")

    def __init__(self, give_way: Callable[[], bool] | None = None) -> None:
        self.fraction = 0.0
        self.give_way = give_way
        self._last: float | None = None


class _Reporting(threading.local):
    progress: LoadProgress | None = None
    low: float = 0.0
    high: float = 1.0


_here = _Reporting()


@contextmanager
def reporting_to(progress: LoadProgress) -> Iterator[LoadProgress]:
    """This thread's loading code reports to ``progress`` inside the block."""
    saved = (_here.progress, _here.low, _here.high)
    _here.progress, _here.low, _here.high = progress, 0.0, 1.0
    try:
        yield progress
    finally:
        _here.progress, _here.low, _here.high = saved


#: Where a thread reports: its progress and the span it is in.
Reporting = tuple[LoadProgress | None, float, float]


def here() -> Reporting:
    """Where this thread reports now: its progress (None: no one listens)
    and the part of the whole the current span is."""
    return (_here.progress, _here.low, _here.high)


@contextmanager
def span(start: float, end: float) -> Iterator[None]:
    """Inside the block, :func:`report`'s 0 to 1 is ``start`` to ``end`` of
    the enclosing span (fractions of it, 0 <= start <= end <= 1); the
    progress stands at ``end`` when the block ends without an error."""
    if not 0.0 <= start <= end <= 1.0:
        raise ValueError(f"a span is 0 <= start <= end <= 1, got {start!r}, {end!r}")
    low, high = _here.low, _here.high
    width = high - low
    _here.low, _here.high = low + start * width, low + end * width
    try:
        yield
        report(1, 1)
    finally:
        _here.low, _here.high = low, high


def report(done: int | float, total: int | float) -> None:
    """``done`` of ``total`` of the current span is loaded (no-op when no
    one listens on this thread, or ``total`` is not positive)."""
    progress = _here.progress
    if progress is None or not total > 0:
        return
    part = min(max(done / total, 0.0), 1.0)
    fraction = _here.low + part * (_here.high - _here.low)
    if fraction > progress.fraction:
        progress.fraction = fraction
    now = time.perf_counter()
    last, give_way = progress._last, progress.give_way
    if last is not None and give_way is not None and give_way():
        time.sleep(min((now - last) * GIVE_WAY, MAX_PAUSE))
    progress._last = time.perf_counter()
