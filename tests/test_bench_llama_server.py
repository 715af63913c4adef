"""The llama-server comparison's plumbing (tests/bench/llama_server.py and
server_vs_llama.py): the build names the instruction sets this CPU has,
and without a binary the comparison is skipped with the reason, not run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench import llama_server, server_vs_llama

ROOT = Path(__file__).resolve().parents[1]


def test_llama_server_builds_for_the_instruction_sets_this_cpu_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    widest = llama_server.WIDEST_CMAKE_ARGS
    assert "-DGGML_NATIVE=OFF" in widest  # a native build dies with SIGILL here
    assert "-DGGML_AMX_INT8=OFF" in widest
    xeon = frozenset(
        [
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512_vnni",
            "avx512_bf16",
            "amx_int8",
        ]
    )
    assert llama_server.for_cpu(widest, xeon) == widest
    # An AVX2-only CPU (an AMD EPYC of Zen 2, most desktops): every AVX-512
    # option off, the rest as named.
    epyc = frozenset(["avx", "avx2", "fma", "f16c", "bmi2"])
    avx2 = llama_server.for_cpu(widest, epyc)
    assert "=ON" not in avx2.replace("-DGGML_AVX2=ON", "").replace("-DGGML_FMA=ON", "").replace(
        "-DGGML_F16C=ON", ""
    )
    assert avx2.split()[1:4] == [
        "-DGGML_AVX512=OFF",
        "-DGGML_AVX512_VNNI=OFF",
        "-DGGML_AVX512_BF16=OFF",
    ]
    # AVX-512 without BF16 (Ice Lake, Zen 4 has it): only that option off.
    icelake = xeon - {"avx512_bf16"}
    assert llama_server.for_cpu(widest, icelake) == widest.replace(
        "-DGGML_AVX512_BF16=ON", "-DGGML_AVX512_BF16=OFF"
    )
    # The noxfile has no instruction sets of its own: it asks this module.
    noxfile = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    assert "-DGGML_AVX512" not in noxfile
    assert "tests.bench.llama_server import LLAMA_CPP_CMAKE_ARGS" in noxfile
    import importlib

    monkeypatch.delenv("TRIOSERVE_LLAMA_CPP_CMAKE_ARGS", raising=False)
    fresh = importlib.reload(llama_server)
    assert fresh.for_cpu(widest, fresh.cpu_flags()) == fresh.LLAMA_CPP_CMAKE_ARGS
    # An override is taken as given, and the cache is named by the flags:
    # other flags never reuse this binary.
    given = widest + " -DGGML_AVX512=OFF"
    monkeypatch.setenv("TRIOSERVE_LLAMA_CPP_CMAKE_ARGS", given)
    other = importlib.reload(llama_server)
    assert given == other.LLAMA_CPP_CMAKE_ARGS
    other_binary = other.cached_binary()
    monkeypatch.delenv("TRIOSERVE_LLAMA_CPP_CMAKE_ARGS")
    assert other_binary != importlib.reload(llama_server).cached_binary()


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
