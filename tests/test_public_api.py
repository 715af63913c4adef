"""The public API: ``trioserve.__all__`` is pinned, every name resolves to the
object its home module defines, and importing the package stays cheap."""

from __future__ import annotations

import re
import subprocess
import sys

import attrs
import pytest

import trioserve

pytestmark = pytest.mark.unit

PUBLIC = {
    # serving
    "serve": "trioserve.server.server",
    "Server": "trioserve.server.server",
    "ServerConfig": "trioserve.server.server",
    "ServerStatistics": "trioserve.server.server",
    "Listening": "trioserve.server.server",
    "Models": "trioserve.server.models",
    "ModelSettings": "trioserve.server.served",
    # the generation task
    "Scheduler": "trioserve.generation.scheduler",
    "SchedulerStatistics": "trioserve.generation.scheduler",
    "Job": "trioserve.generation.scheduler",
    "QueueFull": "trioserve.generation.scheduler",
    "SchedulerClosed": "trioserve.generation.scheduler",
    "EngineThread": "trioserve.generation.engine_thread",
    "EngineThreadClosed": "trioserve.generation.engine_thread",
    "open_engine_thread": "trioserve.generation.engine_thread",
    # engines and the contract between them and the server
    "Engine": "trioserve.engine.base",
    "EngineInfo": "trioserve.engine.base",
    "GenerationSpec": "trioserve.engine.base",
    # the request vocabulary both doors, the scheduler and the engines share
    "SamplingSettings": "trioserve.vocabulary.sampling",
    "TextUpdate": "trioserve.vocabulary.results",
    "Finished": "trioserve.vocabulary.results",
    "FinishReason": "trioserve.vocabulary.results",
    "Failed": "trioserve.vocabulary.results",
    "Update": "trioserve.vocabulary.results",
    "EngineOptions": "trioserve.engine",
    "load_engine": "trioserve.engine",
    # the client
    "open_client": "trioserve.client.library",
    "Client": "trioserve.client.library",
    "InferStream": "trioserve.client.library",
    "ServerError": "trioserve.client.library",
    "ConnectionFailed": "trioserve.client.library",
    "ConnectionClosed": "trioserve.client.library",
    "InferChunk": "trioserve.protocol",
    "InferFinal": "trioserve.protocol",
    "ProtocolError": "trioserve.protocol",
    # errors
    "TrioserveError": "trioserve.errors",
    "ConfigError": "trioserve.errors",
    "ModelError": "trioserve.errors",
    "ListenError": "trioserve.errors",
    "EngineError": "trioserve.errors",
    "__version__": "trioserve._version",
}


def test_all_is_pinned() -> None:
    assert sorted(trioserve.__all__) == sorted(PUBLIC)
    assert len(set(trioserve.__all__)) == len(trioserve.__all__)


def test_every_public_name_is_its_home_modules_object() -> None:
    import importlib

    for name, home in PUBLIC.items():
        assert getattr(trioserve, name) is getattr(importlib.import_module(home), name), name
    assert set(PUBLIC) <= set(dir(trioserve))


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from trioserve import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(PUBLIC)


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        trioserve.no_such_name  # type: ignore[attr-defined]  # noqa: B018


def test_errors_share_one_base() -> None:
    for error in (
        trioserve.ConfigError,
        trioserve.ModelError,
        trioserve.ListenError,
        trioserve.EngineError,
        trioserve.ServerError,
        trioserve.ConnectionFailed,
        trioserve.ConnectionClosed,
        trioserve.QueueFull,
        trioserve.SchedulerClosed,
    ):
        assert issubclass(error, trioserve.TrioserveError), error


def test_version_is_a_release_number() -> None:
    # pyproject.toml reads the package's version from here.
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc|\.dev|\.post)?\d*", trioserve.__version__)


def test_config_values_are_frozen() -> None:
    config = trioserve.ServerConfig(port=0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]
    assert attrs.evolve(config, port=1).port == 1


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_does_not_import_torch() -> None:
    # Also with everything a client or a host application touches resolved.
    out = _run(
        "import sys, trioserve\n"
        "for name in trioserve.__all__: getattr(trioserve, name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    assert out.strip() == "[]"


def test_client_module_runs_once_under_dash_m() -> None:
    # `python -m trioserve.client` imports the package first; the package must
    # not have imported the client already, or runpy executes it twice.
    result = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "trioserve.client", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "usage: python -m trioserve.client" in result.stdout
    assert result.stderr == ""
