"""The GPU check's own scripts (tests/gpu/), in the parts that run without a GPU.

The check runs on a lent machine with minutes of device time and no second
try, so what can go wrong in its plumbing is tested here: the summary's
verdicts, ninja's log, and the early exits of ``device_check.sh``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.gpu import build_exllamav2, summarize

GPU = Path(__file__).resolve().parent / "gpu"


def _junit(path: Path, passed: int = 0, failed: int = 0, skipped: int = 0) -> None:
    cases = [f'<testcase classname="t" name="ok{i}"/>' for i in range(passed)]
    cases += [
        f'<testcase classname="t" name="bad{i}"><failure message="x"/></testcase>'
        for i in range(failed)
    ]
    cases += [
        f'<testcase classname="t" name="skip{i}"><skipped message="no"/></testcase>'
        for i in range(skipped)
    ]
    path.write_text(
        f'<testsuites><testsuite name="pytest">{"".join(cases)}</testsuite></testsuites>'
    )


def _summary(tmp_path: Path, *args: str) -> tuple[int, dict[str, object]]:
    rc = summarize.main(["--out", str(tmp_path), "--stage", str(tmp_path), *args])
    return rc, json.loads((tmp_path / "summary.json").read_text())


def test_summary_passes_only_when_every_test_ran(tmp_path: Path) -> None:
    _junit(tmp_path / "junit.xml", passed=5)
    (tmp_path / "call1.json").write_text('{"build": "ok", "extension": "jit"}')
    (tmp_path / "bench.json").write_text('{"ratio": 0.97, "batching": false, "extra": 1}')
    rc, summary = _summary(tmp_path, "--pytest-rc", "0")
    assert rc == 0
    assert summary["status"] == "passed"
    assert summary["call1"] == {"build": "ok", "extension": "jit"}
    assert summary["bench"] == {
        "raw_single_stream_tok_s": None,
        "trioserve_single_stream_tok_s": None,
        "ratio": 0.97,
        "ratios": None,
        "trioserve_aggregate_tok_s": None,
        "batching": False,
        "max_batch": None,
        "cuda_graphs": None,
        "note": None,
    }


def test_summary_of_skipped_gpu_tests_is_a_failure(tmp_path: Path) -> None:
    _junit(tmp_path / "junit.xml", passed=2, skipped=3)
    rc, summary = _summary(tmp_path, "--pytest-rc", "0")
    assert rc == 1
    assert (summary["status"], summary["why"]) == ("failed", "gpu tests were skipped")


def test_summary_says_when_only_the_run_without_graphs_passed(tmp_path: Path) -> None:
    _junit(tmp_path / "junit.xml", passed=4, failed=1)
    _junit(tmp_path / "junit-nographs.xml", passed=5)
    rc, summary = _summary(tmp_path, "--pytest-rc", "1")
    assert rc == 0
    assert summary["status"] == "passed without CUDA graphs"
    pytest_counts = summary["pytest"]
    assert isinstance(pytest_counts, dict)
    assert pytest_counts["failed"] == ["t::bad0"]


def test_summary_of_a_failed_run(tmp_path: Path) -> None:
    _junit(tmp_path / "junit.xml", passed=4, failed=1)
    _junit(tmp_path / "junit-nographs.xml", passed=4, failed=1)
    rc, summary = _summary(tmp_path, "--pytest-rc", "1")
    assert (rc, summary["status"], summary["why"]) == (1, "failed", "pytest exited 1")


def test_summary_without_any_test_run_is_a_failure(tmp_path: Path) -> None:
    rc, summary = _summary(tmp_path, "--why", "model wheel sha256 mismatch")
    assert rc == 1
    assert (summary["status"], summary["why"]) == ("failed", "model wheel sha256 mismatch")
    assert summary["pytest"] is None


def test_ninja_log_times_slowest_first(tmp_path: Path) -> None:
    (tmp_path / ".ninja_log").write_text(
        "# ninja log v5\n"
        "0\t5000\t1\tq_gemm.cuda.o\tabc\n"
        "10\t95010\t1\tunit_exl2_1a.cuda.o\tdef\n"
        "5000\t5100\t1\texllamav2_ext.so\tghi\n"
    )
    times = build_exllamav2._ninja_times(tmp_path)
    assert times == [
        (95.0, "unit_exl2_1a.cuda.o"),
        (5.0, "q_gemm.cuda.o"),
        (0.1, "exllamav2_ext.so"),
    ]
    assert build_exllamav2._ninja_times(tmp_path / "missing") == []


def _device_check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "OUT": str(tmp_path / "out"),
        "STAGE": str(tmp_path / "stage"),
        "HOME": str(tmp_path),
        # Never a checkout's staged .gpu/: these tests must stop early.
        "CALL1": str(tmp_path / "call1"),
        "CALL2": str(tmp_path / "call2"),
    }
    return subprocess.run(
        ["bash", str(GPU / "device_check.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_device_check_without_a_mode_says_how_to_call_it(tmp_path: Path) -> None:
    done = _device_check(tmp_path)
    assert done.returncode == 2
    assert "usage" in done.stderr


def test_call_2_on_a_cold_machine_stops_at_once_with_a_summary(tmp_path: Path) -> None:
    # Call 1's files are not in the stage directory: the machine was given
    # back between the calls.
    done = _device_check(tmp_path, "run")
    assert done.returncode == 3
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "call 1" in summary["why"]
    assert "call 1's files are not on this machine" in (tmp_path / "out" / "log.txt").read_text()


def test_call_1_without_its_carried_files_stops_at_once(tmp_path: Path) -> None:
    done = _device_check(tmp_path, "build")
    assert done.returncode == 2
    assert "call1 is incomplete" in (tmp_path / "out" / "log.txt").read_text()
