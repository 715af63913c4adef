"""What README.md shows is what the server does: its request, sent to the real
model, gets the frames it shows (all but the timings)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
import trio_websocket

from .helpers import running_server

if TYPE_CHECKING:
    from trioserve.engine.cpu import CpuEngine

ROOT = Path(__file__).resolve().parent.parent


def json_blocks(markdown: str) -> list[str]:
    return re.findall(r"```json\n(.*?)```", markdown, flags=re.DOTALL)


async def test_readme_frames_are_what_the_server_sends(cpu_engine: CpuEngine) -> None:
    request_block, frames_block = json_blocks((ROOT / "README.md").read_text())[:2]
    request = json.loads(request_block)
    shown: list[dict[str, Any]] = [json.loads(line) for line in frames_block.splitlines()]
    async with running_server(cpu_engine) as listening:
        async with trio_websocket.open_websocket_url(listening.url) as ws:
            await ws.send_message(json.dumps(request))
            got: list[dict[str, Any]] = []
            with trio.fail_after(120):
                while not got or got[-1]["response_type"] == "chunk":
                    got.append(json.loads(await ws.get_message()))
    # Timings differ from run to run; their keys do not.
    assert set(got[-1]["timing"]) == set(shown[-1]["timing"])
    for frame in (got[-1], shown[-1]):
        del frame["timing"]
    assert got == shown


def test_skips_say_why_in_the_default_session(tmp_path: Path) -> None:
    """pytest as the project configures it (pyproject.toml, which nox's
    session uses) prints each skip's reason."""
    (tmp_path / "test_skipping.py").write_text(
        "import pytest\n\n\ndef test_skipped():\n    pytest.skip('no frobnicator here')\n"
    )
    config = ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *config, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert "1 skipped" in result.stdout, result.stdout + result.stderr
    assert "SKIPPED [1] test_skipping.py:5: no frobnicator here" in result.stdout, result.stdout
