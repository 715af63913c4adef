"""The examples in docs/examples run as a user runs them, and do what the docs
say they do."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

from .helpers import running_server

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"


def example_env() -> dict[str, str]:
    # The project may be used from its source tree without being installed.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


@pytest.mark.slow
def test_embed_serves_answers_and_shuts_down(model_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "embed.py")],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=ROOT,
        env=example_env(),
    )
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


@pytest.mark.slow
def test_batch_uses_the_scheduler_alone(model_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "batch.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
        env=example_env(),
    )
    assert result.returncode == 0, result.stderr
    *answers, summary = result.stdout.splitlines()
    assert len(answers) == 3
    assert answers[0].startswith("What is the capital of France? -> ")
    assert "Paris" in answers[0]
    assert all(" -> " in line and not line.endswith(" -> ") for line in answers)
    found = re.fullmatch(r"3 jobs, (\d+) tokens in (\d+) engine steps", summary)
    assert found, summary
    tokens, steps = map(int, found.groups())
    # Three jobs that ran together: one batched step serves all of them.
    assert steps < tokens


async def run_against_server(engine: CpuEngine, command: list[str]) -> str:
    async with running_server(engine) as listening:
        with trio.fail_after(120):
            result = await trio.run_process(
                [*command, listening.url],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env=example_env(),
            )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stderr == b""
    return result.stdout.decode()


async def test_raw_websockets_client(cpu_engine: CpuEngine) -> None:
    out = await run_against_server(
        cpu_engine, [sys.executable, str(EXAMPLES / "raw_websockets.py")]
    )
    count, answer, end = out.splitlines()
    spec = importlib.util.spec_from_file_location("raw_websockets", EXAMPLES / "raw_websockets.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert count == f"the prompt is {len(cpu_engine.encode(example.QUESTION))} tokens"
    assert "Paris" in answer
    assert end.startswith("[eos, ")


def node_websocket_flags() -> list[str] | None:
    """How to run node with the standard WebSocket, or None without one."""
    node = shutil.which("node")
    if node is None:
        return None
    for flags in ([], ["--experimental-websocket"]):
        probe = subprocess.run(
            [node, *flags, "-p", "typeof WebSocket"],
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.stdout.strip() == "function":
            return [node, *flags]
    return None


async def test_javascript_client(cpu_engine: CpuEngine) -> None:
    node = node_websocket_flags()
    if node is None:
        pytest.skip("needs node with the standard WebSocket API (node 20.10+)")
    out = await run_against_server(cpu_engine, [*node, str(EXAMPLES / "ask.js")])
    answer, end = out.splitlines()
    assert "Paris" in answer
    assert end.startswith("[eos, ")


@pytest.mark.parametrize(
    ("doc", "example"),
    [
        ("embedding.md", "embed.py"),
        ("embedding.md", "batch.py"),
        ("quickstart.md", "raw_websockets.py"),
        ("quickstart.md", "ask.js"),
    ],
)
def test_docs_show_the_examples_verbatim(doc: str, example: str) -> None:
    # What the docs show is what the tests above run.
    fence = "```python\n" if example.endswith(".py") else "```js\n"
    text = (EXAMPLES / example).read_text()
    assert fence + text + "```\n" in (ROOT / "docs" / doc).read_text()


def test_every_example_is_tested() -> None:
    tested = {"embed.py", "batch.py", "raw_websockets.py", "ask.js"}
    assert {path.name for path in EXAMPLES.iterdir() if path.is_file()} == tested
