"""Codex CLI (npm ``@openai/codex``, unchanged) against the Responses door on
the real embedded model.

Codex speaks only the Responses API, streamed, with ``store: false`` (it
resends the conversation each turn). It needs no network when its model
provider points at a local server (``model_providers.<id>.base_url``,
``wire_api = "responses"``). Its default request is about 6,500 tokens of
the embedded model's 8,192 (its instructions, skills, environment and nine
tools, two of them OpenAI's own, which the server skips): it is served, but
a 135M model lost in that much text writes until the context is full. With
its instructions replaced and its optional tools off (the ``-c`` settings
below, about 1,750 tokens) the same binary runs a whole turn.

The ``clients`` nox session installs it and sets ``TRIOSERVE_CODEX`` to its
executable; elsewhere these tests skip.
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

CODEX = os.environ.get("TRIOSERVE_CODEX")
pytestmark = pytest.mark.skipif(
    not CODEX, reason="set TRIOSERVE_CODEX to Codex CLI's executable (nox -s clients)"
)

#: Codex's own prompt cut down to what a 135M model can follow.
TRIMMED = (
    "-c",
    "features.multi_agent=false",
    "-c",
    "features.goals=false",
    "-c",
    'web_search="disabled"',
    "-c",
    "include_permissions_instructions=false",
    "-c",
    "include_environment_context=false",
)


def config(home: Path, port: int) -> None:
    (home / "config.toml").write_text(
        'model = "smollm2"\n'
        'model_provider = "trioserve"\n'
        "[model_providers.trioserve]\n"
        'name = "trioserve"\n'
        f'base_url = "http://127.0.0.1:{port}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "TRIOSERVE_KEY"\n'
    )
    (home / "instructions.md").write_text("You are a helpful assistant. Answer briefly.\n")


async def codex(port: int, home: Path, *args: str) -> tuple[int, str, str]:
    """Codex's exit status, its output, and the last message it wrote."""
    assert CODEX is not None
    config(home, port)
    work = home / "work"
    work.mkdir(exist_ok=True)
    last = home / "last.txt"
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "CODEX_HOME": str(home),
        "TRIOSERVE_KEY": "local",
    }
    with trio.fail_after(600):
        result = await trio.run_process(
            [
                CODEX,
                "exec",
                "--skip-git-repo-check",
                "--ephemeral",
                "-o",
                str(last),
                "-c",
                f'model_instructions_file="{home / "instructions.md"}"',
                *args,
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
            cwd=work,
            stdin=b"",
        )
    output = (result.stdout + result.stderr).decode(errors="replace")
    message = last.read_text() if last.exists() else ""
    return result.returncode, output, message


def answered(server: Any, outcome: str) -> float:
    labels = {"api": "openai", "action": "responses", "outcome": outcome}
    value = server.metrics.registry.get_sample_value("trioserve_requests_total", labels)
    return value or 0.0


async def test_codex_runs_a_turn(cpu_engine: CpuEngine, tmp_path: Path) -> None:
    async with serving(cpu_engine) as (server, listening):
        code, output, message = await codex(
            listening.port, tmp_path, *TRIMMED, "Say hello in one short sentence."
        )
        assert code == 0, output
        assert message.strip() and message.strip() in output, output
        assert answered(server, "eos") + answered(server, "num_tokens") >= 1
        assert answered(server, "invalid_request") == 0
        # store: false, as Codex sends it: nothing is kept.
        assert len(server.responses_store) == 0
