"""The startup hint on ``--threads`` (trioserve/engine/cpu/contention.py): what
other processes used of this process's cores while the engine loaded."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from trioserve.engine.cpu.contention import (
    Contention,
    CpuTimes,
    advice,
    busy_seconds,
    contention,
    measure,
)

LINUX = sys.platform.startswith("linux")

STAT = """\
cpu  900 0 300 5000 20 0 10 40 0 0
cpu0 100 5 50 2000 10 1 2 10 7 0
cpu1 300 0 100 1000 10 0 3 20 0 0
cpu12 1000 0 0 0 0 0 0 0 0 0
intr 123456 0 0
ctxt 999
"""


def test_busy_seconds_count_the_busy_columns_of_the_allowed_cpus() -> None:
    # user nice system (idle iowait) irq softirq steal; guest (7) is inside user.
    assert busy_seconds(STAT, frozenset({0}), 100) == (100 + 5 + 50 + 1 + 2 + 10) / 100
    assert busy_seconds(STAT, frozenset({1}), 100) == (300 + 100 + 3 + 20) / 100
    # The aggregate "cpu" line and CPUs outside the set are not counted.
    assert busy_seconds(STAT, frozenset({0, 1}), 50) == (168 + 423) / 50
    assert busy_seconds(STAT, frozenset({12}), 100) == 10.0
    assert busy_seconds(STAT, frozenset({7}), 100) == 0.0


def test_contention_takes_this_process_off() -> None:
    before = CpuTimes(wall=10.0, busy=100.0, own=5.0)
    after = CpuTimes(wall=12.0, busy=104.0, own=7.0)  # 4 busy seconds, 2 of them ours
    assert contention(before, after, 2) == Contention(others=1.0, cores=2)
    # Rounding of the clock ticks never makes a negative share.
    assert contention(before, CpuTimes(12.0, 101.0, 7.0), 2) == Contention(0.0, 2)
    assert contention(before, CpuTimes(10.05, 101.0, 5.0), 2) is None  # too short to tell


@pytest.mark.parametrize(
    ("others", "cores", "threads", "suggested"),
    [
        (1.0, 2, 2, 1),  # the shared 2-core machine: one core is free
        (1.9, 2, 2, 1),  # never fewer than one thread
        (0.3, 2, 2, None),  # a little noise is no reason
        (0.0, 2, 2, None),
        (1.0, 2, 1, None),  # already one thread
        (10.0, 16, 8, 6),
        (8.0, 16, 8, None),  # eight free cores for eight threads
        (3.0, 4, 8, 1),  # more threads than cores, and busy ones
    ],
)
def test_advice_suggests_the_free_cores(
    others: float, cores: int, threads: int, suggested: int | None
) -> None:
    hint = advice(Contention(others, cores), threads)
    if suggested is None:
        assert hint is None
    else:
        assert hint is not None
        assert f"--threads {suggested} " in hint
        assert f"kept {others:.1f} of the {cores} cores" in hint


@contextmanager
def busy_cores() -> Iterator[int]:
    """A spinning process on each core this process may use; their count."""
    cores = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        time.sleep(0.5)  # let them start spinning
        yield cores
    finally:
        for process in spinners:
            process.kill()
            process.wait()


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.skipif(not LINUX, reason="reads /proc/stat")
def test_measure_sees_other_processes() -> None:
    with busy_cores() as cores, measure() as found:
        time.sleep(1.0)
    (seen,) = found
    assert seen.cores == cores
    # The spinners share the cores with whatever else runs, this process
    # sleeping: most of every core is theirs.
    assert seen.others >= 0.6 * cores, seen


@pytest.mark.skipif(not LINUX, reason="reads /proc/stat")
def test_measure_takes_this_process_and_its_children_off() -> None:
    """Windows of this process sleeping and spinning, alternated: spinning
    adds about its own CPU to every process's busy time, and nothing to
    what ``measure`` gives to others (whatever else the machine runs moves
    both kinds of window alike)."""
    asleep, spinning, own_cores = [], [], []
    for _ in range(3):
        with measure() as found:
            time.sleep(0.5)
        asleep.append(found[0].others)
        before = os.times()
        start = time.monotonic()
        with measure() as found:
            _spin(0.5)  # this process
            subprocess.run(  # and a child it waits for
                [
                    sys.executable,
                    "-c",
                    "import time\nend = time.monotonic() + 0.5\nwhile time.monotonic() < end: pass",
                ],
                check=True,
            )
        after = os.times()
        spinning.append(found[0].others)
        used = (after.user + after.system + after.children_user + after.children_system) - (
            before.user + before.system + before.children_user + before.children_system
        )
        own_cores.append(used / (time.monotonic() - start))
    added = statistics.median(spinning) - statistics.median(asleep)
    # Not taken off, the spinning would add about its own share to others'.
    assert added < 0.5 * statistics.median(own_cores), (asleep, spinning, own_cores)


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="reads /proc/stat")
async def test_a_start_on_busy_cores_says_to_use_fewer_threads(
    model_dir: Path, tmp_path: Path
) -> None:
    from .test_cli import started

    with busy_cores() as cores:
        if cores < 2:
            pytest.skip("one core: one thread already")
        async with started(tmp_path, ["--port", "0", "--threads", str(cores)]) as server:
            pass
    log = server.stderr_text()
    found = re.search(
        r" WARNING trioserve\.engine: other processes kept [\d.]+ of the (\d+) cores .*"
        r"with (\d+) torch threads.* --threads (\d+) suits a machine this busy",
        log,
    )
    assert found is not None, log
    assert (int(found.group(1)), int(found.group(2))) == (cores, cores)
    assert 1 <= int(found.group(3)) < cores
