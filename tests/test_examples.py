"""The examples in docs/examples run as a user runs them, and do what the docs
say they do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"


def run_example(name: str) -> subprocess.CompletedProcess[str]:
    # The project may be used from its source tree without being installed.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
    )


def test_embed_serves_answers_and_shuts_down(model_dir: Path) -> None:
    result = run_example("embed.py")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    answer, reason, served = result.stdout.splitlines()
    assert "Paris" in answer
    assert reason.startswith("stop reason eos, ")
    assert served == "served 1, failed 0"
    log = result.stderr.splitlines()
    # Its own task ran beside the server...
    assert any(line.startswith("INFO embed: connections ") for line in log)
    # ...and the cancellation ended the server before the engine was closed.
    assert log[-1] == "INFO embed: the server has shut down"


def test_every_example_is_tested() -> None:
    tested = {"embed.py"}
    assert {path.name for path in EXAMPLES.glob("*.py")} == tested
