"""Whether other processes hold the cores the CPU engine's threads need.

torch splits each operator of a decode step across its threads and waits for
the slowest: a thread whose core another process is using stalls the whole
step. On a shared two-core machine, two threads decode several times slower
than one while the other core is busy (docs/performance.md, "Reading the
numbers"). :func:`measure` watches the CPUs this process may run on while the
engine loads, from Linux's ``/proc/stat``, and :func:`advice` turns what other
processes used into a hint on ``--threads``, logged at startup.

Busy time counts user, nice, system, irq and softirq time and the time the
hypervisor gave the CPUs to other guests (steal); this process's own CPU
time is taken off. Elsewhere than on Linux nothing is measured.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import attrs

__all__ = [
    "Contention",
    "CpuTimes",
    "advice",
    "busy_seconds",
    "contention",
    "measure",
    "sample",
]

#: /proc/stat's columns after the CPU's name: user nice system idle iowait
#: irq softirq steal (guest time is inside user's). The busy ones:
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


@attrs.frozen
class CpuTimes:
    """One reading: the monotonic clock, the busy seconds of the CPUs this
    process may run on (every process's), and this process's CPU seconds
    (its children's it waited for included)."""

    wall: float
    busy: float
    own: float


@attrs.frozen
class Contention:
    """What other processes used over a window: ``others`` cores' worth (on
    average), out of the ``cores`` this process may run on."""

    others: float
    cores: int


def busy_seconds(stat: str, cpus: frozenset[int], ticks_per_second: float) -> float:
    """The busy seconds of ``cpus`` in the text of ``/proc/stat``."""
    total = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        columns = rest.split()
        total += sum(int(columns[i]) for i in _BUSY_COLUMNS if i < len(columns))
    return total / ticks_per_second


def sample() -> CpuTimes | None:
    """A reading now, or None where the system does not tell (not Linux)."""
    try:
        cpus = frozenset(os.sched_getaffinity(0))
        with open("/proc/stat", encoding="ascii") as f:
            stat = f.read()
        ticks = float(os.sysconf("SC_CLK_TCK"))
    except (OSError, AttributeError, ValueError):
        return None
    own = os.times()
    # A child this process waited for (the C compiler building the native
    # kernels) counts as its own.
    seconds = own.user + own.system + own.children_user + own.children_system
    return CpuTimes(time.monotonic(), busy_seconds(stat, cpus, ticks), seconds)


def contention(before: CpuTimes, after: CpuTimes, cores: int) -> Contention | None:
    """What other processes used between two readings (None for a window too
    short to say: under a tenth of a second)."""
    wall = after.wall - before.wall
    if wall < 0.1:
        return None
    others = (after.busy - before.busy) - (after.own - before.own)
    return Contention(max(0.0, others / wall), cores)


@contextlib.contextmanager
def measure() -> Iterator[list[Contention]]:
    """Measures the ``with`` block: the list it gives holds one
    :class:`Contention` after the block, or nothing where it cannot be told."""
    found: list[Contention] = []
    before = sample()
    yield found
    after = sample()
    if before is not None and after is not None:
        with contextlib.suppress(OSError, AttributeError):
            measured = contention(before, after, len(os.sched_getaffinity(0)))
            if measured is not None:
                found.append(measured)


def advice(measured: Contention, threads: int) -> str | None:
    """A hint on the thread count where ``threads`` threads would not each
    have a core to themselves (more than half a core short), else None."""
    free = measured.cores - measured.others
    if threads <= free + 0.5:
        return None
    suggested = max(1, int(free + 0.5))
    if suggested >= threads:
        return None
    return (
        f"other processes kept {measured.others:.1f} of the {measured.cores} cores this process"
        f" may use busy while the model loaded: with {threads} torch threads, every step waits"
        f" for the threads on busy cores and decoding can run several times slower;"
        f" --threads {suggested} suits a machine this busy (docs/deployment.md)"
    )
