"""Every instruction-set path of the native kernels gives the same bits.

The kernels' arithmetic is written once (trioserve/engine/cpu/kernels_arith.h)
and compiled per path; each path's vector interface computes the same
operations in the same order. tests/native/kernels_harness.c runs every kernel
of one path on fixed inputs (no Python, no torch) and writes the outputs:

* on this machine, each x86-64 path it runs (AVX-512, AVX2 with AVX-VNNI and AVX2 on an AVX-512
  CPU) must write the same bytes;
* the ARM64 paths (NEON, and NEON with the dot-product instructions), cross-
  compiled with Debian's ``gcc-aarch64-linux-gnu`` and run under
  ``qemu-aarch64 -cpu max``, must write the bytes the x86-64 paths write.

The x86-64 paths are checked against a float64 reference, for batch
invariance and for the real model's perplexity in tests/test_native.py; equal
bits carry those checks over to ARM64. Without the cross compiler or qemu the
second test skips in ``nox -s tests`` and fails in ``nox -s arm64``
(``TRIOSERVE_REQUIRE_ARM64=1``), naming the packages that bring them:
``apt-get install gcc-aarch64-linux-gnu qemu-user`` (the session installs
nothing).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from trioserve.engine.cpu.native_build import SOURCES

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "native" / "kernels_harness.c"
KERNELS = ROOT / "trioserve" / "engine" / "cpu"
FLAGS = ["-O2", "-fopenmp", "-ffp-contract=off", f"-I{KERNELS}"]
#: The path files (not kernels.c, the Python module).
PATH_SOURCES = [str(p) for p in SOURCES if p.suffix == ".c" and p.name != "kernels.c"]

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
    reason="builds the harness with this x86-64 machine's C compiler",
)


def _build(compiler: str, out: Path, *extra: str) -> Path:
    done = subprocess.run(
        [compiler, *FLAGS, str(HARNESS), *PATH_SOURCES, "-o", str(out), "-lm", *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return out


def _outputs(command: list[str]) -> dict[str, str]:
    """Each path's output digest, for every path the harness lists as runnable."""
    listed = subprocess.run([*command, "list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    digests = {}
    for name in listed.stdout.split():
        run = subprocess.run([*command, name], capture_output=True, timeout=600, check=False)
        if run.returncode == 0:
            digests[name] = hashlib.sha256(run.stdout).hexdigest()
            assert len(run.stdout) > 2_000_000  # every kernel wrote its outputs
        else:  # a path this CPU lacks dies of an illegal instruction: say which
            digests[name] = f"exit {run.returncode}"
    return digests


@pytest.fixture(scope="module")
def x86_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    binary = _build("cc", tmp_path_factory.mktemp("x86") / "harness")
    from trioserve.engine.cpu import native

    module = native.kernel()
    runs = set(module.isas()) if module is not None else {"avx2"}
    return {k: v for k, v in _outputs([str(binary)]).items() if k in runs}


def test_every_x86_path_this_cpu_runs_writes_the_same_bits(x86_outputs: dict[str, str]) -> None:
    assert x86_outputs and not any(v.startswith("exit") for v in x86_outputs.values())
    if len(x86_outputs) < 2:
        pytest.skip(f"this CPU runs one x86-64 path ({', '.join(x86_outputs)})")
    assert len(set(x86_outputs.values())) == 1, x86_outputs


def test_the_arm64_paths_write_the_x86_paths_bits_under_qemu(
    x86_outputs: dict[str, str], tmp_path: Path
) -> None:
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cross is None or qemu is None:
        why = (
            "needs Debian's gcc-aarch64-linux-gnu and qemu-user "
            "(apt-get install gcc-aarch64-linux-gnu qemu-user) to run the ARM64 paths"
        )
        if os.environ.get("TRIOSERVE_REQUIRE_ARM64") == "1":
            pytest.fail(why)
        pytest.skip(why)
    binary = _build(cross, tmp_path / "harness-arm64", "-static")
    # -cpu max: a CPU with the dot-product instructions, so both paths run.
    arm = _outputs([qemu, "-cpu", "max", str(binary)])
    assert set(arm) == {"neon", "neon-dotprod"}
    (want,) = set(x86_outputs.values())
    assert arm == {"neon": want, "neon-dotprod": want}
