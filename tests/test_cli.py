"""``python -m trioserve`` as a user runs it: a real process, its output, its
exit status, signals.

Every start uses ``--offline`` (the ``model_dir`` fixture has already put the
converted model in the cache, so nothing is downloaded) and a short context,
and starts are few: each loads the model.
"""

from __future__ import annotations

import importlib.util
import json
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

from trioserve import (
    ConnectionClosed,
    ConnectionFailed,
    EngineOptions,
    InferChunk,
    InferFinal,
    ServerConfig,
    open_client,
)
from trioserve.cli import NOT_OPTIONS, OPTIONS, OTHER_ENV, build_parser, resolve

from .helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
STORY = "<|im_start|>user\nTell me a long story about a dragon.<|im_end|>\n<|im_start|>assistant\n"
EOS = 2
START = ["--port", "0", "--offline", "--context-length", "512"]
SECRET = "sk-live-0b5e1d-never-print-me"


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without trioserve's option variables (a
    developer's TRIOSERVE_API_KEY must not change what a test sees), plus
    ``extra``."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("TRIOSERVE_") or name in OTHER_ENV
    }
    return {**env, **extra}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trioserve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=clean_env() if env is None else env,
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
    assert "TRIOSERVE_CACHE" in result.stdout
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


def test_help_has_help_and_one_default_for_every_option_and_leaks_no_secret() -> None:
    # Secrets in every variable that could feed an option: none may show.
    env = clean_env(**{option.env: SECRET for option in OPTIONS})
    result = run_cli("--help", env=env)
    assert result.returncode == 0
    assert SECRET not in result.stdout + result.stderr
    assert "(default: None)" not in result.stdout
    for action in build_parser()._actions:
        if action.dest in ("help", "version"):
            continue
        assert action.help, action.option_strings
        # One default, said once: no argparse default tacked onto ours.
        assert action.help.count("(default:") == 1, action.help
        assert "%(default)" not in action.help
    # The units and values an operator needs are there.
    text = " ".join(result.stdout.split())
    for needle in ("--ping-interval SECONDS", "--ping-timeout SECONDS", "--cache-type"):
        assert needle in text
    assert "KV cache precision" in text


def test_every_config_field_is_an_option() -> None:
    """A setting added to ServerConfig or EngineOptions needs a row in
    trioserve.cli.OPTIONS (or a place in NOT_OPTIONS)."""
    for target in (ServerConfig, EngineOptions):
        fields = {field.name for field in attrs.fields(target)} - NOT_OPTIONS
        rows = {option.name for option in OPTIONS if option.target is target}
        assert fields == rows, target.__name__


def test_deployment_docs_list_every_option_and_its_variable() -> None:
    docs = (ROOT / "docs" / "deployment.md").read_text()
    table = [line for line in docs.splitlines() if line.startswith("| `--")]
    for option in OPTIONS:
        rows = [line for line in table if f"`{option.flag}`" in line]
        assert len(rows) == 1, option.flag
        assert f"`{option.env}`" in rows[0], option.flag


def test_environment_sets_every_option_and_the_command_line_wins() -> None:
    values = {
        "host": ("0.0.0.0", "0.0.0.0"),
        "port": ("8000", 8000),
        "api_key": (SECRET, SECRET),
        "allowed_origins": (
            "https://a.example, https://b.example",
            ("https://a.example", "https://b.example"),
        ),
        "model": ("~/models/m", Path("~/models/m").expanduser()),
        "engine": ("cpu", "cpu"),
        "dtype": ("float32", "float32"),
        "device": ("cuda:1", "cuda:1"),
        "threads": ("3", 3),
        "weights": ("float", "float"),  # int8 would need bfloat16 on the CPU
        "tool_call_format": ("mistral", "mistral"),
        "vocab_projection": ("bfloat16", "bfloat16"),
        "cpu_kernels": ("torch", "torch"),
        "kv_cache_dtype": ("int8", "int8"),
        "prefix_cache_mib": ("0", 0),
        "prefill_share": ("0.25", 0.25),
        "speculative": ("ngram", "ngram"),  # off by default
        "draft_tokens": ("6", 6),
        "context_length": ("512", 512),
        "max_batch": ("4", 4),
        "offline": ("yes", True),
        "cache_type": ("q4", "q4"),
        "cache_size": ("4096", 4096),
        "gpu_split": ("20,24.5", (20.0, 24.5)),
        "tensor_parallel": ("1", True),
        "max_message_bytes": ("1024", 1024),
        "max_connections": ("10", 10),
        "max_requests_per_connection": ("2", 2),
        "max_running_per_client": ("3", 3),
        "max_requests_per_client": ("5", 5),
        "max_n": ("4", 4),
        "responses_store_mib": ("16", 16),
        "responses_ttl": ("60", 60.0),
        "chat_template": ("/etc/trioserve/template.jinja", "/etc/trioserve/template.jinja"),
        "reasoning_format": ("none", "none"),
        "reasoning_budget": ("256", 256),
        "trusted_proxies": ("10.0.0.0/8, ::1", ("10.0.0.0/8", "::1")),
        "max_waiting_jobs": ("7", 7),
        "max_output_bytes": ("65536", 65536),
        "max_new_tokens": ("100", 100),
        "ping_interval": ("5", 5.0),
        "ping_timeout": ("2.5", 2.5),
        "send_timeout": ("4", 4.0),
        "handshake_timeout": ("1.5", 1.5),
        "close_timeout": ("0.5", 0.5),
        "shutdown_grace": ("0", 0.0),
        "log_level": ("DEBUG", "debug"),
        "log_format": ("json", "json"),
        "log_prompts": ("on", True),
        "public_metrics": ("yes", True),
        "admin_key": ("admin-" + SECRET, "admin-" + SECRET),
        "models_dir": ("~/models", Path("~/models").expanduser()),
        "models_preset": ("~/models.toml", Path("~/models.toml").expanduser()),
        "models_max": ("3", 3),
        "models_autoload": ("off", False),
        "unload_timeout": ("5", 5.0),
        "sleep_idle_seconds": ("600", 600.0),
    }
    assert set(values) == {option.name for option in OPTIONS}
    environ = {option.env: values[option.name][0] for option in OPTIONS}
    settings = resolve(build_parser().parse_args([]), environ)
    for option in OPTIONS:
        if option.target is ServerConfig:
            got = getattr(settings.server, option.name)
        elif option.target is EngineOptions:
            got = getattr(settings.engine, option.name)
        else:
            got = getattr(settings, option.name)
        assert got == values[option.name][1], option.name
        assert settings.source(option.name) == option.env
    assert settings.server.allow_loopback_origins is True
    # The command line wins; an empty variable is no setting at all.
    flags = ["--port", "9", "--no-offline", "--allowed-origin", "https://x.example"]
    settings = resolve(build_parser().parse_args(flags), {**environ, "TRIOSERVE_MAX_BATCH": ""})
    assert settings.server.port == 9
    assert settings.engine.offline is False
    assert settings.server.allowed_origins == ("https://x.example",)
    assert settings.engine.max_batch is None
    assert settings.source("port") == "--port"
    # 'none' is no origin: it removes the loopback origins, from either source.
    for args, env in (
        (["--allowed-origin", "none"], {}),
        ([], {"TRIOSERVE_ALLOWED_ORIGIN": "none"}),
    ):
        settings = resolve(build_parser().parse_args(args), env)
        assert settings.server.allowed_origins == ()
        assert settings.server.allow_loopback_origins is False
    # Nothing set: the config classes' own defaults.
    settings = resolve(build_parser().parse_args([]), {})
    assert settings.server == ServerConfig()
    assert settings.engine == EngineOptions()
    assert (settings.log_level, settings.log_format) == ("info", "text")


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--port", "70000"], {}, "--port"),
        (["--max-batch", "0"], {}, "argument --max-batch: max_batch must be >= 1, got 0"),
        (["--gpu-split", "x"], {}, "--gpu-split"),
        # Passes argparse, fails EngineOptions' check: still a usage error.
        (["--cache-size", "100"], {}, "cache size must be a positive multiple of 256, got 100"),
        (["--shutdown-grace", "-1"], {}, "shutdown grace must be >= 0, got -1.0"),
        (["--ping-timeout", "nan"], {}, "argument --ping-timeout: expected a finite number"),
        (["--engine", "tpu"], {}, "--engine"),
        (["--api-key", ""], {}, "argument --api-key: expected a value"),
        (["--allowed-origin", "app.example"], {}, "argument --allowed-origin: allowed origins"),
        (["--trusted-proxy", "10.0.0.0/33"], {}, "argument --trusted-proxy: trusted proxies"),
        ([], {"TRIOSERVE_TRUSTED_PROXY": "a.b.c.d"}, "TRIOSERVE_TRUSTED_PROXY: trusted proxies"),
        ([], {"TRIOSERVE_MAX_BATCH": "0"}, "TRIOSERVE_MAX_BATCH: max_batch must be >= 1, got 0"),
        ([], {"TRIOSERVE_PORT": "http"}, "TRIOSERVE_PORT: expected a port number, got 'http'"),
        ([], {"TRIOSERVE_OFFLINE": "maybe"}, "TRIOSERVE_OFFLINE: expected one of 1, true"),
        ([], {"TRIOSERVE_ENGINE": "tpu"}, "TRIOSERVE_ENGINE: invalid choice: 'tpu'"),
        ([], {"TRIOSERVE_SHUTDOWN_GRACE": "-2"}, "TRIOSERVE_SHUTDOWN_GRACE: shutdown grace"),
        (["--device", "meta"], {}, "--device 'meta' cannot run the cpu engine"),
        ([], {"TRIOSERVE_DEVICE": "tpu:0"}, "TRIOSERVE_DEVICE 'tpu:0' cannot run the cpu engine"),
        (["--model", "/nonexistent/model"], {}, "--model '/nonexistent/model' does not exist"),
        (["--model", __file__], {}, "is neither a model directory nor a .gguf file"),
    ],
)
def test_bad_options_are_one_usage_error(args: list[str], env: dict[str, str], says: str) -> None:
    result = run_cli(*args, env=clean_env(**env))
    line = assert_one_clean_error(result, 2)
    assert line.startswith("python -m trioserve: error:")
    assert says in line
    # The usage block, then that one line: nothing was loaded or logged.
    assert result.stderr.startswith("usage: python -m trioserve")
    assert result.stderr.rstrip("\n").endswith(line)


@pytest.mark.slow
def test_cuda_without_cuda_is_refused_before_loading() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = assert_one_clean_error(run_cli("--device", "cuda", "--offline"), 2)
    assert "--device 'cuda': torch" in line and "sees no CUDA device" in line


def test_a_model_directory_without_its_files_says_what_it_must_hold(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "weights.gguf").write_bytes(b"")
    line = assert_one_clean_error(run_cli("--model", str(tmp_path)), 2)
    assert f"--model {str(tmp_path)!r} lacks tokenizer.json, *.safetensors" in line
    assert "a model directory holds config.json, tokenizer.json and one or more" in line
    assert f"--model {tmp_path / 'weights.gguf'}" in line


def exllamav2_may_run() -> bool:
    # Cheap first: without the package there is no need to import torch.
    if importlib.util.find_spec("exllamav2") is None:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow
def test_exllamav2_without_a_gpu_is_one_clear_error() -> None:
    if exllamav2_may_run():
        pytest.skip("exllamav2 and CUDA are here: the engine would load")
    line = assert_one_clean_error(run_cli("--engine", "exllamav2", "--offline", "--port", "0"), 1)
    assert line.startswith("python -m trioserve: error: the exllamav2 engine cannot run here")


def test_a_busy_port_is_one_clear_error_before_the_model_loads() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli(*START, "--port", str(port))
    line = assert_one_clean_error(result, 1)
    assert line.startswith(f"python -m trioserve: error: cannot listen on 127.0.0.1:{port}")
    assert "in use" in line
    assert result.stdout == ""
    # Said at once: no engine was chosen, let alone loaded.
    assert "trioserve.engine" not in result.stderr


def test_an_address_of_another_machine_is_one_clear_error() -> None:
    # 192.0.2.0/24 is reserved for documentation: never an address of this machine.
    result = run_cli(*START, "--host", "192.0.2.1", "--port", "7862")
    line = assert_one_clean_error(result, 1)
    assert line.startswith("python -m trioserve: error: cannot listen on 192.0.2.1:7862")
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
            env=clean_env() if env is None else env,
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


@pytest.mark.slow
async def test_start_answer_and_sigint(tmp_path: Path, model_dir: Path) -> None:
    # Settings from the environment, as a container or a systemd unit gives them.
    env = clean_env(
        TRIOSERVE_API_KEY=SECRET,
        TRIOSERVE_CONTEXT_LENGTH="512",
        TRIOSERVE_LOG_FORMAT="json",
        TRIOSERVE_MAX_BACTH="4",  # misspelt: warned about, not silently ignored
    )
    async with started(tmp_path, ["--port", "0", "--offline"], env) as server:
        # The key in the environment turned authentication on.
        with pytest.raises(ConnectionFailed) as caught:
            async with open_client(server.url):
                pass  # pragma: no cover - the handshake fails
        assert caught.value.status_code == 401
        async with open_client(server.url, api_key=SECRET) as client:
            info = await client.info()
            assert info.model.context_length == 512
            final = await client.generate(QUESTION, 40, temperature=0)
        assert "Paris" in final.response
        server.process.send_signal(signal.SIGINT)
        # A hang guard, not a timing check: an idle server has nothing to wait for.
        with trio.fail_after(60):
            status = await server.process.wait()
    assert status == 0
    stderr = server.stderr_text()
    assert SECRET not in stderr
    # Every line is one JSON object (no traceback, no stray text).
    records = [json.loads(line) for line in stderr.splitlines()]
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    messages = [r["message"] for r in records]
    assert any(m.startswith("SIGINT: shutting down") for m in messages)
    assert any("TRIOSERVE_MAX_BACTH is not a trioserve setting" in m for m in messages)
    # The startup phases, each with its duration; then where it listens.
    ends = {r["phase"]: r for r in records if "duration_s" in r}
    assert set(ends) == {"model", "load"}
    assert ends["load"]["engine"] == "cpu"
    assert ends["load"]["model"] == "SmolLM2-135M-Instruct"
    (listening,) = [r for r in records if r.get("phase") == "listen"]
    assert listening["url"] == server.url
    assert listening["context_length"] == 512
    assert listening["startup_s"] >= ends["load"]["duration_s"]


@pytest.mark.slow
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
                    # Both have generated before the signal (on a loaded machine
                    # the short one may otherwise still be waiting for its first).
                    for event in running.values():
                        await event.wait()
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
