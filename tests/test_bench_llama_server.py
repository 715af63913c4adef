"""The llama-server comparison's plumbing (tests/bench/llama_server.py and
server_vs_llama.py): the build uses the instruction sets the noxfile names,
and without a binary the comparison is skipped with the reason, not run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.bench import llama_server, server_vs_llama

ROOT = Path(__file__).resolve().parents[1]


def _noxfile_default_flags() -> str:
    """The default of noxfile.LLAMA_CPP_CMAKE_ARGS, read without importing nox."""
    for node in ast.walk(ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "LLAMA_CPP_CMAKE_ARGS"
        ):
            call = node.value
            assert isinstance(call, ast.Call)
            return str(ast.literal_eval(call.args[1]))
    raise AssertionError("noxfile.py has no LLAMA_CPP_CMAKE_ARGS")


def test_llama_server_builds_with_the_noxfiles_instruction_sets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flags = _noxfile_default_flags()
    assert "-DGGML_NATIVE=OFF" in flags  # a native build dies with SIGILL here
    monkeypatch.delenv("TRIOSERVE_LLAMA_CPP_CMAKE_ARGS", raising=False)
    import importlib

    fresh = importlib.reload(llama_server)
    assert flags == fresh.LLAMA_CPP_CMAKE_ARGS
    # The cache is named by the flags: other flags never reuse this binary.
    monkeypatch.setenv("TRIOSERVE_LLAMA_CPP_CMAKE_ARGS", flags + " -DGGML_AVX512=OFF")
    other = importlib.reload(llama_server).cached_binary()
    monkeypatch.delenv("TRIOSERVE_LLAMA_CPP_CMAKE_ARGS")
    assert other != importlib.reload(llama_server).cached_binary()


def test_without_a_binary_the_comparison_is_skipped_saying_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "llama-server"
    monkeypatch.setenv("TRIOSERVE_LLAMA_SERVER", str(missing))
    path, why = llama_server.find_binary()
    assert path is None
    assert str(missing) in why
    said: list[str] = []
    results: list[dict[str, object]] = []
    server_vs_llama.run(results, say=said.append)
    assert results == [{"section": "llama-server", "skipped": why}]
    assert server_vs_llama.markdown(results) == f"llama-server comparison skipped: {why}"
    assert any(why in line for line in said)


def test_the_table_says_which_goals_are_met() -> None:
    row = {
        "section": "llama-server",
        "metric": "1 stream decode",
        "trioserve": 150.0,
        "llama_server": 146.0,
        "unit": "tok/s",
        "ratio": 1.03,
        "spread": (0.98, 1.1),
        "goal": ">= 1.0",
    }
    rss = {**row, "metric": "RSS after load", "ratio": 1.9, "unit": "MiB", "goal": "<= 1.3"}
    table = server_vs_llama.markdown([row, rss])
    first = "| 1 stream decode | 150 tok/s | 146 tok/s | 1.03 (0.98 to 1.10) | >= 1.0: met |"
    assert first in table.splitlines()
    assert "<= 1.3: **missed**" in table
