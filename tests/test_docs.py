"""What README.md shows is what the server does: its request, sent to the real
model, gets the frames it shows (all but the timings)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio_websocket

from .helpers import running_server

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

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


@pytest.mark.slow
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


# -- numbers and lists the docs take from the code ----------------------------------------


def doc(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def test_documented_defaults_are_the_declared_ones() -> None:
    from trioserve import openai as oa
    from trioserve.server import ServerConfig
    from trioserve.server.access import MAX_VALUE_CHARS
    from trioserve.server.server import default_max_message_bytes

    config = ServerConfig()
    quickstart = doc("docs/quickstart.md")
    assert f"| `--port N` | `{config.port}` |" in quickstart
    assert f"| `--host ADDR` | `{config.host}` |" in quickstart
    assert f"| `--shutdown-grace S` | {config.shutdown_grace:g} |" in quickstart
    assert f"`--shutdown-grace` seconds ({config.shutdown_grace:g} by default)" in quickstart
    # 413: "16 bytes per token of the context, at least 256 KiB".
    assert "16 bytes per token of the context, at least 256 KiB" in doc("docs/openai.md")
    assert default_max_message_bytes(1) == 256 * 1024
    assert default_max_message_bytes(10**6) == 16 * 10**6
    assert f"completions generate up to {oa.COMPLETIONS_MAX_TOKENS} tokens" in doc("docs/openai.md")
    assert f"longer than\n{MAX_VALUE_CHARS} characters is cut to {MAX_VALUE_CHARS}" in doc(
        "docs/deployment.md"
    )


def test_quickstart_lists_the_declared_dependencies_and_the_tests_marker() -> None:
    import tomllib

    project = tomllib.loads(doc("pyproject.toml"))["project"]
    names = [re.split(r"[<>=\[ ]", d, maxsplit=1)[0] for d in project["dependencies"]]
    listed = re.search(r"with its dependencies: ([^.]+)\.", doc("docs/quickstart.md"))
    assert listed is not None
    said = [name.strip() for name in listed.group(1).replace("\n", " ").split(",")]
    assert said == [n for n in names if n != "torch"]
    # The noxfile's own marker logic, without importing nox (the test session
    # does not install it): its BASE_MARKERS and pytest_args, executed alone.
    tree = ast.parse(doc("noxfile.py"))
    wanted: list[ast.stmt] = [
        node
        for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name == "pytest_args")
        or (isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "BASE_MARKERS")
    ]
    assert len(wanted) == 2
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "noxfile.py", "exec"), namespace)
    pytest_args = namespace["pytest_args"]
    _, expression, _, plugin = pytest_args([])
    quickstart = doc("docs/quickstart.md").replace("\n", " ")
    assert f'`pytest -m "{expression}" -p {plugin}`' in quickstart
    # The fast lane narrows the same expression.
    assert pytest_args(["-m", "not slow"])[1] == f"({expression}) and (not slow)"
    assert 'nox -s tests -- -m "not slow"' in quickstart


def _shape(line: str) -> str:
    """A log line without what differs between runs and machines: the time,
    numbers, torch's version, the folders of paths, where the native kernels
    came from (an install's extension or the cache's build, by this machine's
    compiler) and why they are not used (the reason depends on the machine)."""
    line = re.sub(r"^\S+ \S+ ", "", line)
    line = re.sub(r"(native CPU kernels not used): .*", r"\1: REASON", line)
    line = re.sub(r"(native CPU kernels): .*", r"\1: SOURCE", line)
    line = re.sub(r"kernels: torch \(.*\), KV cache", "kernels: torch (REASON), KV cache", line)
    line = re.sub(r"torch \S+ sees", "torch VERSION sees", line)
    line = re.sub(r"/\S*/", "PATH/", line)  # a path's folders; its last name stays
    return re.sub(r"\d+(\.\d+)?", "N", line)


def _log_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line[:1].isdigit()]


@pytest.mark.slow
async def test_the_quickstart_startup_log_is_what_a_start_writes(
    model_dir: Path, tmp_path: Path
) -> None:
    """The quickstart's log is a real start's, line for line (times, numbers,
    paths and the native kernels' reason aside): the first block as a CPU with
    trioserve's native kernels logs it, the second the two lines that differ
    where they are not used, the third the warning of a busy machine, which
    any start may add (and the line saying that an editable install's
    kernels are stale, which a start after an edit of kernels.c adds)."""
    from trioserve.engine.cpu import native

    from .test_cli import started
    from .test_doc_blocks import blocks_named

    full, without_native, busy = (_log_lines(b.text) for b in blocks_named("startup-log"))
    assert len(full) == 9 and len(without_native) == 2 and len(busy) == 1
    expected = [_shape(line) for line in full]
    if native.kernel() is None:  # built (and cached) here first: the start does not build
        # Where the kernels came from, then the engine's line: why not, then the engine's.
        (engine_line,) = [i for i, line in enumerate(expected) if "cpu engine:" in line]
        assert "native CPU kernels: SOURCE" in expected[engine_line - 1]
        expected[engine_line - 1 : engine_line + 1] = [_shape(line) for line in without_native]
    async with started(tmp_path, ["--port", "0"]) as server:
        pass
    written = [_shape(line) for line in _log_lines(server.stderr_text())]
    written = [
        line
        for line in written
        if line != _shape(busy[0]) and "the installed native CPU kernels are not used" not in line
    ]
    assert written == expected, server.stderr_text()
