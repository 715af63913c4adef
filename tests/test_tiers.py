"""The fast tier (``nox -s unit``): the test modules marked ``unit`` import
without torch, which that session does not install, so that a module that
starts needing it fails here, in the default suite, by name."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent
#: The line that puts a module in the fast tier (noxfile.py selects by it too).
UNIT = re.compile(r"^pytestmark = pytest\.mark\.unit$", re.MULTILINE)


def unit_modules() -> list[str]:
    return sorted(
        f"tests.{path.stem}"
        for path in TESTS.glob("test_*.py")
        if UNIT.search(path.read_text(encoding="utf-8"))
    )


def test_the_unit_modules_import_without_torch() -> None:
    modules = unit_modules()
    assert len(modules) >= 20, modules
    # None in sys.modules makes every `import torch` raise ImportError.
    script = (
        "import importlib, sys\n"
        "sys.modules['torch'] = None\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "assert 'torch' not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_module_that_imports_torch_fails_that_check() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['torch'] = None; import tests.test_llama"],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert "torch" in done.stderr
