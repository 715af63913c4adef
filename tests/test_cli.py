"""``python -m trioserve`` as a user runs it: a real process, its output, its
exit status, signals.

Every start uses ``--offline`` (the ``model_dir`` fixture has already put the
converted model in the cache, so nothing is downloaded) and a short context,
and starts are few: each loads the model.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio

from trioserve import ConnectionClosed, ConnectionFailed, InferChunk, InferFinal, open_client
from trioserve.cli import build_parser

from .helpers import wait_until

QUESTION = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
STORY = "<|im_start|>user\nTell me a long story about a dragon.<|im_end|>\n<|im_start|>assistant\n"
EOS = 2
START = ["--port", "0", "--offline", "--context-length", "512"]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trioserve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


def assert_one_clean_error(result: subprocess.CompletedProcess[str], status: int) -> str:
    """The process failed with ``status`` and said why in exactly one line."""
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = error_lines(result.stderr)
    return line


def test_help_lists_every_option() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: python -m trioserve")
    options = {
        option
        for action in build_parser()._actions
        for option in action.option_strings
        if option.startswith("--")
    }
    # The options the docs and the protocol promise are among them.
    assert {
        "--host",
        "--port",
        "--api-key",
        "--allowed-origin",
        "--model",
        "--engine",
        "--context-length",
        "--max-batch",
        "--offline",
        "--cache-type",
        "--cache-size",
        "--gpu-split",
        "--tensor-parallel",
        "--max-message-bytes",
        "--max-requests-per-connection",
        "--max-waiting-jobs",
        "--max-new-tokens",
        "--ping-interval",
        "--ping-timeout",
        "--shutdown-grace",
    } <= options
    for option in options:
        assert re.search(rf"{re.escape(option)}\b", result.stdout), option


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--port", "70000"], "--port"),
        (["--max-batch", "0"], "--max-batch"),
        (["--gpu-split", "x"], "--gpu-split"),
        # Passes argparse, fails EngineOptions' check: still a usage error.
        (["--cache-size", "100"], "cache size must be a positive multiple of 256, got 100"),
        (["--shutdown-grace", "-1"], "shutdown grace must be >= 0, got -1.0"),
        (["--engine", "tpu"], "--engine"),
    ],
)
def test_bad_options_are_one_usage_error(args: list[str], says: str) -> None:
    line = assert_one_clean_error(run_cli(*args), 2)
    assert line.startswith("python -m trioserve: error:")
    assert says in line


def exllamav2_may_run() -> bool:
    # Cheap first: without the package there is no need to import torch.
    if importlib.util.find_spec("exllamav2") is None:
        return False
    import torch

    return torch.cuda.is_available()


def test_exllamav2_without_a_gpu_is_one_clear_error() -> None:
    if exllamav2_may_run():
        pytest.skip("exllamav2 and CUDA are here: the engine would load")
    line = assert_one_clean_error(run_cli("--engine", "exllamav2", "--offline"), 1)
    assert line.startswith("trioserve: error: the exllamav2 engine cannot run here")


def test_a_busy_port_is_one_clear_error_before_the_model_loads() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli(*START, "--port", str(port))
    line = assert_one_clean_error(result, 1)
    assert line.startswith(f"trioserve: error: cannot listen on 127.0.0.1:{port}")
    assert "in use" in line
    assert result.stdout == ""
    # Said at once: no engine was chosen, let alone loaded.
    assert "trioserve.engine" not in result.stderr


def test_an_address_of_another_machine_is_one_clear_error() -> None:
    # 192.0.2.0/24 is reserved for documentation: never an address of this machine.
    result = run_cli(*START, "--host", "192.0.2.1", "--port", "7862")
    line = assert_one_clean_error(result, 1)
    assert line.startswith("trioserve: error: cannot listen on 192.0.2.1:7862")
    assert "trioserve.engine" not in result.stderr


@attrs.define
class Started:
    process: trio.Process
    url: str
    stderr: Path

    def stderr_text(self) -> str:
        return self.stderr.read_text()


@asynccontextmanager
async def started(
    tmp_path: Path, args: Sequence[str], env: dict[str, str] | None = None
) -> AsyncIterator[Started]:
    """``python -m trioserve ARGS`` until it prints where it listens."""
    stderr = tmp_path / "stderr.txt"
    with stderr.open("wb") as err:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "trioserve", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
        )
    try:
        assert process.stdout is not None
        output = b""
        with trio.fail_after(120):
            while b"\n" not in output:
                data = await process.stdout.receive_some()
                assert data, f"exited before listening: {stderr.read_text()}"
                output += data
        line = output.decode().splitlines()[0]
        found = re.search(r"listening on (ws://\S+) \(engine cpu", line)
        assert found, line
        yield Started(process, found.group(1), stderr)
    finally:
        if process.returncode is None:
            process.kill()
        with trio.move_on_after(10):
            await process.wait()


async def test_start_answer_and_sigint(tmp_path: Path, model_dir: Path) -> None:
    env = {**os.environ, "TRIOSERVE_API_KEY": "from-the-env"}
    async with started(tmp_path, START, env) as server:
        # The key in the environment turned authentication on.
        with pytest.raises(ConnectionFailed) as caught:
            async with open_client(server.url):
                pass  # pragma: no cover - the handshake fails
        assert caught.value.status_code == 401
        async with open_client(server.url, api_key="from-the-env") as client:
            info = await client.info()
            assert info.model.context_length == 512
            final = await client.generate(QUESTION, 40, temperature=0)
        assert "Paris" in final.response
        server.process.send_signal(signal.SIGINT)
        # A hang guard, not a timing check: an idle server has nothing to wait for.
        with trio.fail_after(60):
            status = await server.process.wait()
    assert status == 0
    assert "SIGINT: shutting down" in server.stderr_text()
    assert "Traceback" not in server.stderr_text()


async def test_sigterm_during_infers_sends_their_final_frames(
    tmp_path: Path, model_dir: Path
) -> None:
    grace = ["--shutdown-grace", "2"]
    async with started(tmp_path, [*START, *grace]) as server:
        async with open_client(server.url) as client:
            asked = {"short": 12, "long": 480}
            streams = {
                "short": client.infer(QUESTION, asked["short"], stream=True, bann_bann=[EOS]),
                "long": client.infer(STORY, asked["long"], stream=True, bann_bann=[EOS]),
            }
            finals: dict[str, InferFinal] = {}
            chunks: dict[str, list[str]] = {name: [] for name in streams}
            running = {name: trio.Event() for name in streams}

            async def read(name: str) -> None:
                async with streams[name] as stream:
                    async for message in stream:
                        if isinstance(message, InferChunk):
                            chunks[name].append(message.chunk)
                            running[name].set()
                finals[name] = stream.final

            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for name in streams:
                        nursery.start_soon(read, name)
                    await running["long"].wait()
                    server.process.send_signal(signal.SIGTERM)
                # The connection is closed after the final frames, as "going away".
                await wait_until(lambda: client.closed, within=60)
                with pytest.raises(ConnectionClosed) as caught:
                    await client.echo()
            assert caught.value.code == 1001
        with trio.fail_after(60):
            status = await server.process.wait()
    assert status == 0
    for name, final in finals.items():
        # Which one ends which way depends on the machine's speed; what holds
        # is that a job that ran out its tokens within the grace period says
        # so, and every other one says it was interrupted, with its text.
        generated = final.usage.generated_tokens
        if final.stop_reason == "num_tokens":
            assert generated == asked[name]
        else:
            assert final.stop_reason == "interrupted"
            assert 0 < generated < asked[name]
        assert "".join(chunks[name]) == final.response
    assert "SIGTERM: shutting down" in server.stderr_text()
