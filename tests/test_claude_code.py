"""Claude Code (npm ``@anthropic-ai/claude-code``, unchanged) against the
Messages door on the real embedded model.

Claude Code needs no network when ``ANTHROPIC_BASE_URL`` points at a local
server and its nonessential traffic is off. Its default request is about
20,000 tokens (its system prompt and 24 tools, 76 KB of JSON) where the
embedded model's context is 8,192: the server answers ``prompt is too long``
and Claude Code says so in its own words (it would compact a longer
conversation). With its own tools and system prompt cut down (``--bare
--system-prompt ... --tools ""``) the same binary runs a whole turn. (With
a tool left on, the 135M model at Claude Code's temperature sometimes calls
it with arguments thousands of tokens long, and the next turn is then too
long for its context: a turn test that fails by chance.)

The ``clients`` nox session installs it and sets ``TRIOSERVE_CLAUDE_CODE``
to its executable; elsewhere these tests skip.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

from .helpers import serving

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

CLAUDE = os.environ.get("TRIOSERVE_CLAUDE_CODE")
pytestmark = pytest.mark.skipif(
    not CLAUDE, reason="set TRIOSERVE_CLAUDE_CODE to Claude Code's executable (nox -s clients)"
)


async def claude(port: int, home: Path, *args: str) -> tuple[int, str]:
    assert CLAUDE is not None
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
        "ANTHROPIC_API_KEY": "local",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    with trio.fail_after(600):
        result = await trio.run_process(
            [CLAUDE, "-p", *args, "--model", "smollm2"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
            cwd=home,
        )
    return result.returncode, (result.stdout + result.stderr).decode(errors="replace")


def answered(server: Any, outcome: str) -> float:
    labels = {"api": "anthropic", "action": "messages", "outcome": outcome}
    value = server.metrics.registry.get_sample_value("trioserve_requests_total", labels)
    return value or 0.0


async def test_claude_code_runs_a_turn(cpu_engine: CpuEngine, tmp_path: Path) -> None:
    async with serving(cpu_engine) as (server, listening):
        code, output = await claude(
            listening.port,
            tmp_path,
            "What is the capital of France? Answer in one sentence.",
            "--bare",
            "--system-prompt",
            "You are a helpful assistant.",
            "--tools",
            "",
        )
        assert code == 0, output
        assert output.strip() and "API Error" not in output, output
        assert answered(server, "eos") + answered(server, "num_tokens") >= 1


async def test_claude_codes_full_request_is_too_long_and_says_so(
    cpu_engine: CpuEngine, tmp_path: Path
) -> None:
    async with serving(cpu_engine) as (server, listening):
        _, output = await claude(listening.port, tmp_path, "Say hi")
        assert "Prompt is too long" in output, output
        assert answered(server, "invalid_request") >= 1
        assert answered(server, "eos") + answered(server, "num_tokens") == 0
