"""``pip install`` builds the native kernels, and installs without them where
it cannot (setup.py): a wheel is built here from a copy of the project's
tracked files, once with no C compiler and once with this machine's.

The build runs without isolation (``--no-build-isolation``: the test
environment's setuptools, no index needed), as pip runs setup.py's
``build_ext`` in both an install and a wheel build."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps"]
PIP_WHEEL += ["--no-index"]

pytestmark = [
    pytest.mark.skipif(
        shutil.which("git") is None or not (ROOT / ".git").exists(),
        reason="copies the project's tracked files (git ls-files): needs git and a clone",
    ),
    pytest.mark.skipif(
        subprocess.run([sys.executable, "-c", "import setuptools"], check=False).returncode != 0,
        reason="builds without isolation: needs setuptools in this environment",
    ),
]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tracked files, nothing built."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    )
    copy = tmp_path_factory.mktemp("project")
    for name in listed.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    return copy


def _wheel(project: Path, out: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    shutil.rmtree(project / "build", ignore_errors=True)
    done = subprocess.run(
        [*PIP_WHEEL, str(project), "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("trioserve-*.whl")
    return done, wheel


def _kernels(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist() if "_trioserve_cpu" in name}


def test_without_a_compiler_the_install_succeeds_and_warns_saying_what_is_lost(
    project: Path, tmp_path: Path
) -> None:
    done, wheel = _wheel(project, tmp_path, CC=str(tmp_path / "no-such-cc"))
    output = done.stdout + done.stderr
    assert "WARNING: trioserve's native CPU kernels were not built: no C compiler" in output
    assert "To get them:" in output and "no-such-cc" in output
    assert _kernels(wheel) == {}
    with zipfile.ZipFile(wheel) as archive:  # the package itself is all there
        assert "trioserve/engine/cpu/native.py" in archive.namelist()


#: A compiler that answers ``--version`` and "compiles" by writing a few
#: bytes to the ``-o`` path (what is checked is setup.py's wiring, not the
#: kernels: tests/test_native.py builds and loads the real ones).
_FAKE_CC = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "fakecc (Test) 1.0"; exit 0; fi
out=""
while [ $# -gt 0 ]; do
    if [ "$1" = "-o" ]; then out="$2"; fi
    shift
done
printf 'built by fakecc' > "$out"
"""


def test_with_a_compiler_the_wheel_holds_the_kernels_and_their_record(
    project: Path, tmp_path: Path
) -> None:
    cc = tmp_path / "cc"
    cc.write_text(_FAKE_CC)
    cc.chmod(0o755)
    done, wheel = _wheel(project, tmp_path / "out", CC=str(cc))
    assert "WARNING" not in done.stderr
    kernels = _kernels(wheel)
    (library,) = (name for name in kernels if name.endswith(".so"))
    assert kernels[library] == b"built by fakecc"
    record = json.loads(kernels[library + ".json"])
    assert record["sha256"] == hashlib.sha256(kernels[library]).hexdigest()
    assert record["compiler"].endswith("fakecc (Test) 1.0")
    from trioserve.engine.cpu.native_build import sources_digest

    assert record["sources"] == sources_digest()  # by which the server knows it is current
