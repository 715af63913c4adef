"""trioserve's native CPU kernels (trioserve/engine/cpu/native.py, kernels.c):
what each computes against a float64 reference of its formula, that a row's
result never depends on the other rows it is computed with, the build, its
cache and its fallbacks, and the real model on them (perplexity, and greedy
text equal to the model functions' own: the engine's exactness tests in
test_cpu_engine.py, test_kvcache.py and test_speculative.py run on these
kernels wherever they load, as the default chooses them)."""

from __future__ import annotations

import importlib
import importlib.machinery
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.direct import mean_nll
from trioserve.engine.cpu import int8_layout, llama, native, native_build
from trioserve.engine.cpu.options import CpuOptions
from trioserve.engine.cpu.quant import QuantizedWeight, dequantize, linear, q4_weight, quantize_q4
from trioserve.errors import ConfigError

needs_native = pytest.mark.skipif(
    native.kernel() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)
ROOT = Path(__file__).resolve().parents[1]


def _q4_case(seed: int, n: int, k: int, rows: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4
    m = -8 * d + torch.randn(n, k // 32, generator=g) * 0.01
    x = (torch.randn(rows, k, generator=g) * torch.rand(1, k, generator=g) * 8).bfloat16()
    return q, d, m, x


@needs_native
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(1, 70),
    groups=st.integers(1, 53),
    rows=st.integers(1, 19),
)
def test_q4_matmul_computes_its_formula_and_rows_do_not_depend_on_each_other(
    seed: int, n: int, groups: int, rows: int
) -> None:
    k = 32 * groups  # wide blocks of 16 groups, narrow ones of 4, a short last one
    q, d, m, x = _q4_case(seed, n, k, rows)
    data, scales = native.pack(q, d, m)
    out = native.q4_mm(x, data, scales, n)
    ref, rounding = native.reference(x, data, scales)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # The output's bfloat16 rounding (half a step: at most 2^-8 of a value)
    # and float32's sums.
    assert bool(((out.double() - ref).abs() <= ref.abs() * 2**-8 + rounding).all())
    # And the 15-bit activations against the exact product: within 2^-7 of
    # the sum of the terms' magnitudes.
    w = native.unpack(data, k).double().view(n, -1, 32) * scales[0].double()[..., None]
    w = (w + scales[1].double()[..., None]).view(n, k)
    exact = x.double() @ w.T
    assert bool(((out.double() - exact).abs() <= (x.double().abs() @ w.abs().T) * 2**-7).all())
    for r in range(rows):
        assert torch.equal(native.q4_mm(x[r : r + 1], data, scales, n), out[r : r + 1])
    assert torch.equal(native.q4_mm(x[rows // 2 :], data, scales, n), out[rows // 2 :])


@needs_native
def test_the_activations_are_written_in_15_bits_ties_to_even() -> None:
    # A ramp whose products with 127 / max land exactly on .5: ties go to even;
    # all-zero groups contribute nothing (no division by zero).
    k = 96
    x = torch.zeros(2, k)
    x[0, :32] = torch.arange(32) - 16.0
    x[1, 32:64] = torch.linspace(-3, 3, 32)
    x8, r8, dx = native.quantize_rows(x.bfloat16())
    assert bool((x8.abs() <= 127).all()) and bool((r8.abs() <= 64).all())
    approx = dx[..., None] * (x8 + r8 / 128)
    err = (approx - x.bfloat16().double().view(2, 3, 32)).abs()
    assert bool((err <= dx[..., None] / 256 + 1e-12).all())
    q = torch.zeros(k, k, dtype=torch.uint8)
    q[torch.arange(k), torch.arange(k)] = 1  # output j reads input j
    data, scales = native.pack(q, torch.ones(k, 3), torch.zeros(k, 3))
    out = native.q4_mm(x.bfloat16(), data, scales, k).double()
    ref, _ = native.reference(x.bfloat16(), data, scales)
    assert torch.allclose(out, ref, rtol=2**-8, atol=0)
    assert bool((out[0, 32:] == 0).all()) and bool((out[1, :32] == 0).all())
    # Against the exact product: 15 bits, then bfloat16's rounding of the output.
    assert torch.allclose(out, x.bfloat16().double(), rtol=2**-8, atol=float(dx.max()) / 256)


@needs_native
def test_pack_and_unpack_round_trip_and_dequantize_reads_the_native_layout() -> None:
    w = torch.randn(48, 32 * 21)
    q, d, m = quantize_q4(w)
    data, _ = native.pack(q, d, m)
    assert data.shape == (48, 32 * 21 // 2)
    assert torch.equal(native.unpack(data, 32 * 21), q)
    weight = q4_weight(q, d, m, lambda t: t, "native")
    assert isinstance(weight, QuantizedWeight) and weight.native
    expected = (q.view(48, 21, 32).float() * d.half().float()[..., None]) + m.half().float()[
        ..., None
    ]
    assert torch.equal(dequantize(weight, torch.float32), expected.view(48, -1))


@needs_native
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(1, 300),
    k16=st.integers(1, 80),
    rows=st.integers(1, 11),
    spread=st.floats(0.0, 8.0),
)
def test_int8_matmul_computes_its_formula_and_rows_do_not_depend_on_each_other(
    seed: int, n: int, k16: int, rows: int, spread: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    k = 16 * k16  # up to 1,280: past one integer chunk of 512 inputs
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    q[0] = 127  # the largest sums the integers hold
    scale = (torch.rand(n, generator=g) * 0.01 + 1e-4).bfloat16()
    # Magnitudes over up to 8 octaves: the 16 bits are against the row's largest.
    x = torch.randn(rows, k, generator=g) * 2.0 ** (torch.rand(rows, k, generator=g) * spread)
    x = x.bfloat16()
    x[0] = x[0].abs().max()  # every input at the largest magnitude
    packed = int8_layout.pack_int8(q)
    assert torch.equal(int8_layout.unpack_int8(packed, n), q)
    out = native.int8_mm(x, packed, scale, torch.float32)
    ref = x.double() @ (q.double() * scale.double()[:, None]).T
    bound = x.double().abs().amax(1, keepdim=True) * int8_layout.input_error(k)
    bound = bound * (q.double().abs().sum(1) * scale.double())
    assert bool(((out.double() - ref).abs() <= bound).all())
    assert torch.equal(native.int8_mm(x, packed, scale), out.bfloat16())
    for r in range(rows):
        alone = native.int8_mm(x[r : r + 1], packed, scale, torch.float32)
        assert torch.equal(alone, out[r : r + 1])


@needs_native
def test_int8_matmul_gives_nan_for_a_row_that_is_not_finite_and_leaves_the_others() -> None:
    g = torch.Generator().manual_seed(5)
    q = int8_layout.pack_int8(torch.randint(-127, 128, (40, 64), generator=g, dtype=torch.int8))
    scale = torch.full((40,), 0.01).bfloat16()
    x = torch.randn(4, 64, generator=g).bfloat16()
    clean = native.int8_mm(x, q, scale, torch.float32)
    x[1, 7], x[2, 60] = float("inf"), float("nan")
    out = native.int8_mm(x, q, scale, torch.float32)
    assert bool(out[1:3].isnan().all())
    assert torch.equal(out[0], clean[0]) and torch.equal(out[3], clean[3])


@needs_native
def test_int8_matmul_takes_rows_too_small_for_a_reciprocal_and_rows_of_zeros() -> None:
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-127, 128, (24, 96), generator=g, dtype=torch.int8)
    scale = torch.full((24,), 0.5).bfloat16()
    x = torch.zeros(3, 96)
    x[0] = torch.randn(96, generator=g) * 1e-38  # 32767 / its largest overflows float32
    x[0, ::3] = 0
    x[2] = torch.randn(96, generator=g)
    x = x.bfloat16()
    out = native.int8_mm(x, int8_layout.pack_int8(q), scale, torch.float32)
    ref = x.double() @ (q.double() * 0.5).T
    bound = x.double().abs().amax(1, keepdim=True) * int8_layout.input_error(96)
    assert bool(((out.double() - ref).abs() <= bound * q.double().abs().sum(1) * 0.5).all())
    assert bool((out[1] == 0).all()) and bool((out[0] != 0).any())


@needs_native
def test_int8_matmul_is_finite_wherever_its_result_is() -> None:
    q = torch.zeros(16, 32, dtype=torch.int8)
    q[0, 0] = 127
    x = torch.zeros(1, 32)
    x[0, 0] = 1e30
    x, scale = x.bfloat16(), torch.full((16,), 1e4).bfloat16()
    out = native.int8_mm(x, int8_layout.pack_int8(q), scale, torch.float32)
    exact = float(x[0, 0]) * 127 * float(scale[0])  # about 1.3e36, 32767 times it is not finite
    assert math.isfinite(float(out[0, 0]))
    assert abs(float(out[0, 0]) - exact) <= exact * int8_layout.input_error(32)


@needs_native
def test_the_8bit_layout_packs_16_outputs_a_block_and_pads_the_last() -> None:
    q = torch.arange(-60, 60, dtype=torch.int8).view(20, 6)  # 20 outputs of 6 inputs
    packed = int8_layout.pack_int8(q)
    assert packed.shape == (2, 3, 32)
    # Block 0, inputs (2, 3): output j's q[2] and q[3] at bytes 2j and 2j + 1.
    assert packed[0, 1].tolist() == [int(v) for j in range(16) for v in q[j, 2:4]]
    assert packed[1, 0, 8:].tolist() == [0] * 24  # outputs 20 to 31: zero rows
    assert torch.equal(int8_layout.row_sums(packed, 20), q.abs().sum(1))


@needs_native
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), d16=st.integers(1, 64), rows=st.integers(1, 40))
def test_add_rms_norm_adds_in_place_and_normalises_each_row_alone(
    seed: int, d16: int, rows: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    d = 16 * d16
    x = torch.randn(rows, d, generator=g) * 10
    y = torch.randn(rows, d, generator=g).bfloat16()
    w = torch.rand(d, generator=g) + 0.1
    summed = x + y.float()
    xs = x.clone()
    out = native.add_rms_norm(xs, y, w, 1e-5)
    assert torch.equal(xs, summed)  # float32 adds, the same as torch's
    s = summed.double()
    ref = s * (s.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * w.double()
    assert bool(((out.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all())
    assert torch.equal(native.add_rms_norm(summed.clone(), None, w, 1e-5), out)
    for r in range(rows):
        assert torch.equal(
            native.add_rms_norm(summed[r : r + 1].clone(), None, w, 1e-5), out[r : r + 1]
        )


@needs_native
def test_the_kernels_refuse_shapes_they_cannot_run() -> None:
    module = native.kernel()
    assert module is not None
    x = torch.zeros(1, 48, dtype=torch.bfloat16)
    out = torch.zeros(1, 4, dtype=torch.bfloat16)
    p = x.data_ptr()
    with pytest.raises(ValueError, match="multiple of 32"):
        module.q4_mm(p, p, p, p, out.data_ptr(), 1, 4, 48, 1)  # K = 48
    with pytest.raises(ValueError, match="multiple of 16"):
        module.int8_mm(p, p, p, out.data_ptr(), 1, 4, 40, 0, 1)
    with pytest.raises(ValueError):
        module.add_rms_norm(p, None, p, out.data_ptr(), 0, 16, 1e-5, 1)  # no rows
    with pytest.raises(ValueError, match="required buffer"):
        module.q4_mm(0, p, p, p, out.data_ptr(), 1, 4, 64, 1)  # a NULL input
    with pytest.raises(ValueError, match="threads"):
        module.q4_mm(p, p, p, p, out.data_ptr(), 1, 4, 64, 2**40)
    with pytest.raises(ValueError, match="threads"):
        module.silu_mul(p, out.data_ptr(), 1, 16, 2**40)
    with pytest.raises(TypeError):
        module.q4_mm(1, 2, 3)


@needs_native
def test_the_wrappers_check_what_they_pass_to_c() -> None:
    q, d, m = quantize_q4(torch.randn(32, 64))
    data, scales = native.pack(q, d, m)
    with pytest.raises(ValueError, match="data"):
        native.q4_mm(torch.zeros(2, 96).bfloat16(), data, scales, 32)  # K 96 against 64
    with pytest.raises(ValueError, match="data"):
        native.q4_mm(torch.zeros(2, 64).bfloat16(), data, scales, 31)
    with pytest.raises(ValueError, match="x"):
        native.add_rms_norm(torch.zeros(2, 32).bfloat16(), None, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="y"):
        native.add_rms_norm(torch.zeros(2, 32), torch.zeros(1, 32), torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="scale"):
        native.int8_mm(torch.zeros(1, 32), torch.zeros(1, 16, 32, dtype=torch.int8), torch.ones(4))
    with pytest.raises(ValueError, match="pack_int8"):  # [N, K] as it was before packing
        native.int8_mm(
            torch.zeros(1, 32), torch.zeros(4, 32, dtype=torch.int8), torch.ones(4).bfloat16()
        )
    cache = torch.zeros(2, 2, 16, 32, dtype=torch.bfloat16)
    rope = (torch.zeros(16, 32), torch.zeros(16, 32))
    qkv = torch.zeros(2, 3 * 32, dtype=torch.bfloat16)
    for slots, positions, why in (
        (torch.tensor([0, 0]), torch.tensor([3, 3]), "same"),  # two rows at one place
        (torch.tensor([0]), torch.tensor([3]), "slots"),  # fewer than the rows
        (torch.tensor([0, 1]), torch.tensor([3, 4], dtype=torch.int32), "int64"),
    ):
        with pytest.raises(ValueError, match=why):
            native.attention(qkv, rope, cache, slots, positions, 1, 1)
    assert not cache.any()
    # A non-contiguous input is copied (and kept alive) before C reads it.
    wide = torch.randn(3 * 32, 2).bfloat16().t()
    out = native.attention(wide, rope, cache, torch.tensor([0, 1]), torch.tensor([0, 0]), 1, 1)
    assert out.shape == (2, 32)


def test_linear_runs_the_kernel_a_weight_was_made_for() -> None:
    w = torch.randn(64, 256)
    q, d, m = quantize_q4(w)
    x = torch.randn(3, 256).bfloat16()
    torch_weight = q4_weight(q, d, m, lambda t: t, "torch")
    assert isinstance(torch_weight, QuantizedWeight) and not torch_weight.native
    exact = x.double() @ dequantize(torch_weight, torch.float32).double().T
    for weight in [torch_weight] + (
        [q4_weight(q, d, m, lambda t: t, "native")] if native.kernel() else []
    ):
        out = linear(x, weight).double()
        # Both within a few 8-bit activation steps of the exact product.
        assert float((out - exact).abs().max()) <= 0.02 * float(exact.abs().max())


# --- the build, its cache, its fallbacks ------------------------------------------


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        # TRIOSERVE_NATIVE only where a test sets it (``nox -s isa`` sets it
        # for the whole run; these tests look at the other reasons).
        env={
            **{k: v for k, v in os.environ.items() if k != "TRIOSERVE_NATIVE"},
            "PYTHONPATH": str(ROOT),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


#: Loads the kernels in a fresh process and says whether they loaded, and
#: why not. What an install built beside the source (an editable install's
#: extension) is not looked at unless ``INSTALLED`` names it: these tests are
#: about the cache.
_REPORT = (
    "import logging, os, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
    "from pathlib import Path\n"
    "from trioserve.engine.cpu import native, native_build\n"
    "native_build.INSTALLED = Path(os.environ.get('INSTALLED', '/nonexistent/none.so'))\n"
    "print('LOADED', native.kernel() is not None, native.unavailable_reason())\n"
)


@needs_native
def test_the_build_is_cached_and_a_restart_does_not_compile(tmp_path: Path) -> None:
    env = {"TRIOSERVE_CACHE": str(tmp_path)}
    first = _python(_REPORT, env)
    assert "LOADED True None" in first.stdout, first.stdout + first.stderr
    assert "built the native CPU kernels" in first.stdout
    (library,) = tmp_path.glob("native/*/_trioserve_cpu*.so")
    stamp = library.stat().st_mtime_ns
    # No compiler on the second run: it must load the cached library.
    second = _python(_REPORT, {**env, "CC": "/nonexistent/cc", "PATH": "/nonexistent"})
    assert "LOADED True None" in second.stdout, second.stdout + second.stderr
    assert "built the native" not in second.stdout
    assert library.stat().st_mtime_ns == stamp


@needs_native
def test_a_library_in_the_cache_that_is_not_the_one_built_is_not_loaded(tmp_path: Path) -> None:
    env = {"TRIOSERVE_CACHE": str(tmp_path)}
    assert "LOADED True None" in _python(_REPORT, env).stdout
    (library,) = tmp_path.glob("native/*/_trioserve_cpu*.so")
    # Another library in its place: a real extension module, just not this one
    # (or, where this Python has _json built in, another file).
    other = Path(getattr(importlib.import_module("_json"), "__file__", None) or os.__file__)
    library.write_bytes(other.read_bytes())
    result = _python(_REPORT, env)
    assert "LOADED False refused" in result.stdout, result.stdout + result.stderr
    assert "recorded when it was built: it changed since" in result.stdout
    # A warning with the way back (and no rebuild over it).
    assert "WARNING:trioserve.engine.cpu.native:native CPU kernels not used: refused" in (
        result.stdout
    )
    assert f"To get them: remove {str(library.parent)!r} to have it rebuilt" in result.stdout
    assert library.read_bytes() == other.read_bytes()
    shutil.rmtree(library.parent)
    assert "LOADED True None" in _python(_REPORT, env).stdout


@needs_native
def test_the_installed_extension_is_loaded_when_built_from_these_sources(tmp_path: Path) -> None:
    installed = tmp_path / "site" / f"_trioserve_cpu{native_build.SUFFIX}"
    native_build.build_installed(installed)
    env = {"TRIOSERVE_CACHE": str(tmp_path / "cache"), "INSTALLED": str(installed)}
    result = _python(_REPORT, env)
    assert "LOADED True None" in result.stdout, result.stdout + result.stderr
    assert f"native CPU kernels: the installed extension {installed}" in result.stdout
    assert not (tmp_path / "cache" / "native").exists()


def _other_pythons() -> list[str]:
    """CPython interpreters of other minor versions than this one (3.11 and
    later) on this machine: pyenv's, or on the PATH."""
    import glob

    found: dict[str, str] = {}
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[1-9]*/bin/python3")))
    candidates += [p for v in range(11, 20) if (p := shutil.which(f"python3.{v}"))]
    for path in candidates:
        version = subprocess.run(
            [path, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        if version and version != here and version not in found:
            found[version] = path
    return sorted(found.values())


@needs_native
def test_the_library_is_the_stable_abis_and_loads_under_other_pythons() -> None:
    """kernels.c uses CPython's limited API (3.11's stable ABI): the library
    this Python loads also loads and runs under every other CPython from
    3.11 on, its errors included."""
    others = _other_pythons()
    if not others:
        pytest.skip("no other CPython (3.11 or later) on this machine")
    # The library this process runs (installed, or the cache's build).
    library = Path(native_build.load().__file__ or "")
    assert library.name.endswith(native_build.SUFFIX), library
    code = (
        "import importlib.machinery, importlib.util, sys\n"
        f"path = {str(library)!r}\n"
        "loader = importlib.machinery.ExtensionFileLoader('_trioserve_cpu', path)\n"
        "spec = importlib.util.spec_from_file_location('_trioserve_cpu', path, loader=loader)\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print('RAN', module.isa(), module.isas(), module.max_group_heads())\n"
        "print('ARGS', len(module.forward_args()), module.layer_fields()[0])\n"
        "try:\n"
        "    module.use('no-such-path')\n"
        "except ValueError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    here = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    for python in others:
        there = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
        assert there.returncode == 0, (python, there.stderr)
        assert there.stdout == here.stdout, python
    assert "REFUSED no kernel path named 'no-such-path'" in here.stdout


def test_without_a_compiler_the_engine_falls_back_to_torch_and_says_why(tmp_path: Path) -> None:
    code = _REPORT + (
        "import torch\n"
        "from trioserve.engine.cpu import quant\n"
        "print('AUTO', quant.use_native('auto'))\n"
        "try:\n"
        "    quant.use_native('native')\n"
        "except Exception as exc:\n"
        "    print('NATIVE', type(exc).__name__, exc)\n"
    )
    result = _python(code, {"TRIOSERVE_CACHE": str(tmp_path), "CC": "/nonexistent/cc"})
    assert "LOADED False" in result.stdout, result.stdout + result.stderr
    assert "AUTO False" in result.stdout
    assert "NATIVE ModelError trioserve's native kernels cannot run here:" in result.stdout
    # Why, in the log and the error: no compiler (or, elsewhere, no AVX2).
    assert "no C compiler" in result.stdout or "lacks" in result.stdout
    if "no C compiler" in result.stdout:
        # A warning, with what is lost and how to get them.
        assert "WARNING:trioserve.engine.cpu.native:native CPU kernels not used" in result.stdout
        assert "1.5-2x slower. To get them: install a C compiler" in result.stdout
    assert not list(tmp_path.glob("native/*/_trioserve_cpu*"))


def test_trioserve_native_0_turns_them_off() -> None:
    result = _python(_REPORT, {"TRIOSERVE_NATIVE": "0"})
    assert "LOADED False TRIOSERVE_NATIVE is off" in result.stdout, result.stdout + result.stderr


def test_a_broken_compiler_is_a_reason_not_a_crash(tmp_path: Path) -> None:
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'cc: fatal error: out of coffee' >&2\nexit 1\n")
    fake.chmod(0o755)
    result = _python(_REPORT, {"TRIOSERVE_CACHE": str(tmp_path / "cache"), "CC": str(fake)})
    if "lacks" in result.stdout:
        pytest.skip("this CPU lacks AVX2, FMA or F16C: the compiler is never run")
    assert "LOADED False" in result.stdout, result.stdout + result.stderr
    assert "out of coffee" in result.stdout


def test_native_kernels_asked_for_off_the_cpus_bfloat16_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cpu_kernels 'native' need dtype 'bfloat16' on the CPU"):
        CpuOptions(dtype="float32", cpu_kernels="native")
    with pytest.raises(ConfigError, match="got dtype 'bfloat16' on device 'cuda'"):
        CpuOptions(device="cuda", cpu_kernels="native")


# --- the real model on them -------------------------------------------------------


@needs_native
def test_perplexity_on_the_native_kernels_is_within_half_a_percent_of_bfloat16s(
    model_dir: Path,
) -> None:
    """15-bit activations: the same quality as the weights in bfloat16 on
    torch's operators (measured: docs/performance.md, "trioserve's native
    kernels"; 0.03 % apart on the AVX2 EPYC, torch's own 4-bit kernel 0.26 %)."""
    from tests.test_cpu_engine import PERPLEXITY_TEXT
    from trioserve.engine.tokenizer import Tokenizer

    config = llama.LlamaConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    text = PERPLEXITY_TEXT + " " + (ROOT / "README.md").read_text()[:2500]
    ids = [1, *tokenizer.encode(text)][:700]
    results = {}
    for kernels, mode in (("native", "auto"), ("torch", "float")):
        options = CpuOptions(cpu_kernels=kernels, weights=mode)
        weights = llama.LlamaWeights.load(model_dir, config, options)
        assert weights.native_norm == (kernels == "native")
        results[f"{kernels} {mode}"] = math.exp(mean_nll(model_dir, weights, ids))
    assert 1.0 < results["torch float"] < 200.0
    assert abs(results["native auto"] / results["torch float"] - 1) <= 0.005, results


# --- attention ---------------------------------------------------------------------


def _attention_reference(
    qkv: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 causal attention after rope (rotated in float32 and rounded to
    bfloat16, as the model path does), and the cache after the rows' writes."""
    rows, e = qkv.shape[0], cache.shape[-1]
    x = qkv.view(rows, heads + 2 * kv_heads, e).float()
    cos, sin = (t[positions][:, None] for t in rope)
    swapped = x.view(rows, heads + 2 * kv_heads, 2, e // 2).flip(2).view(x.shape)
    rotated = (x * cos + swapped * sin).bfloat16()
    cache = cache.clone()
    for r in range(rows):
        s, p = int(slots[r]), int(positions[r])
        cache[s, :kv_heads, p] = rotated[r, heads : heads + kv_heads]
        cache[s, kv_heads:, p] = qkv.view(rows, -1, e)[r, heads + kv_heads :]
    out = torch.empty(rows, heads, e, dtype=torch.float64)
    group = heads // kv_heads
    for r in range(rows):
        s, p = int(slots[r]), int(positions[r])
        for h in range(heads):
            k = cache[s, h // group, : p + 1].double()
            v = cache[s, kv_heads + h // group, : p + 1].double()
            weights = torch.softmax(k @ rotated[r, h].double() / math.sqrt(e), dim=0)
            out[r, h] = weights @ v
    return out.view(rows, heads * e), cache


@needs_native
@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    heads_per_kv=st.sampled_from([1, 3, 4]),
    kv_heads=st.integers(1, 3),
    e32=st.integers(1, 3),
    rows=st.integers(1, 9),
)
def test_attention_is_causal_attention_after_rope_and_rows_do_not_depend_on_each_other(
    seed: int, heads_per_kv: int, kv_heads: int, e32: int, rows: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    heads, e, slots_n, length = heads_per_kv * kv_heads, 32 * e32, 3, 80
    rope = (torch.randn(length, e, generator=g), torch.randn(length, e, generator=g))
    cache = torch.randn(slots_n, 2 * kv_heads, length, e, generator=g).bfloat16()
    # Rows of one slot at consecutive positions see each other's writes, as a
    # prefill chunk's or a job's draft rows do; others anywhere.
    slots = torch.randint(0, slots_n, (rows,), generator=g)
    positions = torch.randint(0, length - rows, (rows,), generator=g)
    for s in range(slots_n):
        mine = (slots == s).nonzero().flatten()
        if len(mine):
            positions[mine] = positions[mine[0]] + torch.arange(len(mine))
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * e, generator=g) * 2).bfloat16()
    ref, ref_cache = _attention_reference(qkv, rope, cache, slots, positions, heads, kv_heads)
    mine = cache.clone()
    out = native.attention(qkv, rope, mine, slots, positions, heads, kv_heads)
    assert torch.equal(mine, ref_cache)  # the keys (rotated) and values written
    assert float((out.double() - ref).abs().max()) <= 2**-7 * float(ref.abs().max()) + 1e-3
    # Each row alone, once the pass's writes are in place, gives the same bits.
    for r in range(rows):
        alone = native.attention(
            qkv[r : r + 1],
            rope,
            ref_cache.clone(),
            slots[r : r + 1],
            positions[r : r + 1],
            heads,
            kv_heads,
        )
        assert torch.equal(alone, out[r : r + 1])


@needs_native
def test_attention_refuses_rows_outside_the_cache() -> None:
    cache = torch.zeros(2, 2, 16, 32, dtype=torch.bfloat16)
    rope = (torch.zeros(16, 32), torch.zeros(16, 32))
    qkv = torch.zeros(1, 3 * 32, dtype=torch.bfloat16)
    for slot, position in ((2, 0), (0, 16), (-1, 0), (0, -1)):
        with pytest.raises(ValueError, match="outside the cache"):
            native.attention(qkv, rope, cache, torch.tensor([slot]), torch.tensor([position]), 1, 1)
    assert not cache.any()  # nothing written


@needs_native
def test_silu_mul_is_torchs_in_bfloat16() -> None:
    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(7, 2 * 96, generator=g) * 4).bfloat16()
    out = native.silu_mul(gate_up)
    want = torch.nn.functional.silu(gate_up[:, :96]) * gate_up[:, 96:]
    # Within a bfloat16 step of torch's (its exp and ours round differently).
    assert torch.allclose(out.float(), want.float(), rtol=2**-7, atol=1e-6)
    assert torch.equal(native.silu_mul(gate_up[2:3]), out[2:3])


# --- the layer stack in one call ---------------------------------------------------


class _Renamed:
    """The real kernels, with ``forward_layers`` taking its arguments in
    another order (reversed) or under other names."""

    def __init__(self, module: Any, names: tuple[str, ...]) -> None:
        self._module, self._names = module, names
        self.calls: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def forward_args(self) -> tuple[str, ...]:
        return self._names

    def forward_layers(self, *args: Any) -> None:
        self.calls.append(dict(zip(self._names, args, strict=True)))


@needs_native
def test_kernels_taking_other_forward_arguments_fail_their_probe() -> None:
    """Built from other sources (a stale cache, a changed kernels.h): the
    names disagree and the kernels are not used, instead of being called
    with an argument in another's place."""
    real = native._module()
    names = tuple("rope_len" if n == "rope_length" else n for n in real.forward_args())
    failed = native._probe(cast("ModuleType", _Renamed(real, names)))
    assert failed is not None and "forward_layers takes" in failed and "rope_len" in failed
    doubled = (*real.forward_args()[:-1], "eps")
    assert native._probe(cast("ModuleType", _Renamed(real, doubled))) is not None
    assert native._probe(real) is None


@needs_native
def test_forward_layers_passes_each_argument_under_the_kernels_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = native._module()
    proxy = _Renamed(real, tuple(reversed(real.forward_args())))
    monkeypatch.setattr(native, "_module", lambda: proxy)
    e, length, layers = 64, 40, 3
    x = torch.zeros(2, 576)
    native.forward_layers(
        x,
        torch.zeros(layers, len(real.layer_fields()), dtype=torch.int64),
        torch.zeros(layers, dtype=torch.int64),
        (torch.zeros(length, e), torch.zeros(length, e)),
        torch.tensor([1, 0]),
        torch.tensor([5, 5]),
        heads=9,
        kv_heads=3,
        intermediate=1536,
        cache_shape=(4, length),
        eps=1e-5,
    )
    (call,) = proxy.calls
    assert call["x"] == x.data_ptr()
    assert (call["R"], call["D"], call["H"], call["K"], call["E"], call["F"]) == (
        2,
        576,
        9,
        3,
        e,
        1536,
    )
    assert (call["n_layers"], call["T"], call["S"], call["rope_length"]) == (
        layers,
        length,
        4,
        length,
    )
    assert call["eps"] == 1e-5 and call["scale"] == 1 / math.sqrt(e)


@needs_native
def test_the_layer_stack_in_one_call_is_the_per_operator_path_bit_for_bit(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import attrs

    calls: list[int] = []
    real = native.forward_layers

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(native, "forward_layers", counted)

    from trioserve.engine.tokenizer import Tokenizer

    config = llama.LlamaConfig.from_dir(model_dir)
    stack = llama.LlamaWeights.load(model_dir, config, CpuOptions())
    assert stack.layer_table is not None and stack.layer_table.shape == (config.n_layers, 14)
    # Its columns are in the order kernels.h declares them, by name.
    fields = list(native._module().layer_fields())
    last = stack.layers[-1]
    assert isinstance(last.w_down, QuantizedWeight) and isinstance(last.wqkv, QuantizedWeight)
    assert int(stack.layer_table[-1, fields.index("mlp_norm")]) == last.mlp_norm.data_ptr()
    assert int(stack.layer_table[-1, fields.index("down_m")]) == last.w_down.scales[1].data_ptr()
    assert int(stack.layer_table[-1, fields.index("qkv")]) == last.wqkv.data.data_ptr()
    per_op = attrs.evolve(stack, layer_table=None)
    ids = Tokenizer.from_dir(model_dir).encode(
        "Three slots, two prompts of twelve tokens each, and then one decode step for both: "
    )
    rope = llama.rope_tables(config, 128, torch.device("cpu"))
    results = []
    for weights in (stack, per_op):
        cache = llama.KVCache(
            config.n_layers, config.n_kv_heads, config.head_dim, torch.bfloat16, torch.device("cpu")
        )
        cache.fit(3, 128)
        with torch.inference_mode():
            # A prefill of two prompts (slots 2 and 0), then one decode row each.
            tokens = torch.tensor([ids[:12], ids[3:15]])
            positions = torch.arange(12).repeat(2, 1)
            slots = torch.tensor([2, 0])
            first = llama.forward(
                weights, config, cache, rope, tokens, positions, slots, every_position=True
            )
            second = llama.forward(
                weights,
                config,
                cache,
                rope,
                torch.tensor([[5], [7]]),
                torch.tensor([[12], [12]]),
                slots,
            )
        results.append((first, second, cache.kv))
    assert len(calls) == 2  # the stack ran both passes of the first, none of the second
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


# --- the instruction-set paths -------------------------------------------------


def _every_kernel(module: Any, seed: int) -> list[torch.Tensor]:
    """Every kernel's outputs on shapes that take each of its branches (wide
    and narrow 4-bit blocks, a short last block, ragged row counts, grouped and
    ungrouped heads, silu at its extremes), from one seed."""
    g = torch.Generator().manual_seed(seed)
    outs: list[torch.Tensor] = []
    for n, k in ((80, 576), (16, 96), (33, 608), (7, 4256)):
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        d = torch.rand(n, k // 32, generator=g) * 0.02 + 0.001
        data, scales = native.pack(q, d, -8 * d + torch.randn(n, k // 32, generator=g) * 0.01)
        for rows in (1, 5, 13):
            x = (torch.randn(rows, k, generator=g) * 3).bfloat16()
            outs.append(native._call(module, x, data, scales, n))
    # 8 rows (one AVX2 pass) of SmolLM2's gate_up: enough outputs that two
    # fused multiply-adds taken in the other order change some of them after
    # the rounding to bfloat16 (the shapes above alone did not show it).
    q = torch.randint(0, 16, (3072, 576), generator=g, dtype=torch.uint8)
    d = torch.rand(3072, 18, generator=g) * 0.02 + 0.001
    data, scales = native.pack(q, d, -8 * d + torch.randn(3072, 18, generator=g) * 0.01)
    outs.append(
        native._call(module, torch.randn(8, 576, generator=g).bfloat16(), data, scales, 3072)
    )
    for n, k, rows in ((100, 576, 7), (37, 1040, 9)):
        q8 = int8_layout.pack_int8(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8))
        scale = (torch.rand(n, generator=g) * 0.01).bfloat16()
        x = torch.randn(rows, k, generator=g).bfloat16()
        outs.append(native._int8(module, x, q8, scale, torch.float32))
        outs.append(native._int8(module, x, q8, scale))
    x = torch.randn(19, 576, generator=g) * 5
    y = torch.randn(19, 576, generator=g).bfloat16()
    w = torch.rand(576, generator=g)
    outs += [native._norm(module, x, y, w, 1e-5), x, native._norm(module, x.clone(), None, w, 1e-5)]
    gate_up = (torch.randn(9, 2 * 1536, generator=g) * 6).bfloat16()
    gate_up[0, :6] = torch.tensor([100.0, -100.0, 88.0, -88.0, 1e30, float("nan")])
    outs.append(native._silu(module, gate_up))
    for heads, kv_heads, e in ((9, 3, 64), (8, 1, 128), (4, 4, 96)):
        # Magnitudes spread over a few octaves, so that the order of a sum's
        # terms changes its rounding (equal magnitudes often sum exactly).
        def spread(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g))

        rope = (torch.randn(300, e, generator=g), torch.randn(300, e, generator=g))
        cache = spread(3, 2 * kv_heads, 300, e).bfloat16()
        qkv = spread(6, (heads + 2 * kv_heads) * e).bfloat16()
        slots, positions = torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([0, 17, 5, 290, 63, 64])
        outs += [native._attend(module, qkv, rope, cache, slots, positions, heads, kv_heads), cache]
    return [t.view(torch.int16) if t.dtype == torch.bfloat16 else t for t in outs]


@needs_native
def test_every_path_this_cpu_runs_gives_the_same_bits() -> None:
    """The AVX2 path computes the AVX-512 path's operations in the same order,
    lane for lane (kernels_vec_avx2.h): on a CPU that runs both, every kernel's
    output is the same bits on each (NaN included), and each passes the probe."""
    module = native.kernel()
    assert module is not None
    paths = module.isas()
    if len(paths) < 2:
        pytest.skip(f"this CPU runs one path ({paths[0]}): nothing to compare it with")
    chosen = module.isa()
    try:
        module.use(paths[0])
        want = _every_kernel(module, 41)
        for other in paths[1:]:
            module.use(other)
            assert native._probe(module) is None, other
            got = _every_kernel(module, 41)
            pairs = enumerate(zip(want, got, strict=True))
            differ = [i for i, (a, b) in pairs if not torch.equal(a, b)]
            assert not differ, f"{other} differs from {paths[0]} at outputs {differ}"
    finally:
        module.use(chosen)


@needs_native
def test_the_module_runs_the_best_path_and_says_which() -> None:
    module = native.kernel()
    assert module is not None
    # The best this CPU runs, unless TRIOSERVE_NATIVE names one (nox -s isa).
    named = os.environ.get("TRIOSERVE_NATIVE", "")
    chosen = named if named in module.isas() else module.isas()[0]
    assert native.path() == module.isa() == chosen
    assert native.max_group_heads() == module.max_group_heads() >= 8
    with pytest.raises(ValueError, match="no kernel path named 'sse2'"):
        module.use("sse2")
    assert native.path() == chosen  # a refused switch changes nothing


_PATH_REPORT = _REPORT + "print('PATH', native.path())\n"


@needs_native
def test_trioserve_native_names_a_path_or_is_refused_with_what_runs(tmp_path: Path) -> None:
    module = native.kernel()
    assert module is not None
    env = {"TRIOSERVE_CACHE": str(tmp_path)}
    for name in module.isas():
        result = _python(_PATH_REPORT, {**env, "TRIOSERVE_NATIVE": name})
        assert f"PATH {name}" in result.stdout, result.stdout + result.stderr
    result = _python(_PATH_REPORT, {**env, "TRIOSERVE_NATIVE": "avx9000"})
    assert "PATH None" in result.stdout, result.stdout + result.stderr
    assert "TRIOSERVE_NATIVE=avx9000: no kernel path named 'avx9000'" in result.stdout
    assert f"(this CPU runs: {', '.join(module.isas())})" in result.stdout


def test_a_model_over_the_kernels_group_limit_says_so_and_runs_torchs_attention(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from types import SimpleNamespace

    from trioserve.engine.cpu import attention

    limit = native.max_group_heads()
    if limit == 0:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    weights = SimpleNamespace(native_norm=True)
    cache = SimpleNamespace(quantized=False, dtype=torch.bfloat16)
    within = SimpleNamespace(head_dim=64, n_heads=limit, n_kv_heads=1)
    over = SimpleNamespace(head_dim=64, n_heads=2 * limit, n_kv_heads=1)
    assert attention.native_attention_for(weights, within, cache)  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="trioserve.engine.cpu.attention"):
        assert not attention.native_attention_for(weights, over, cache)  # type: ignore[arg-type]
    assert f"{2 * limit} query heads per KV head, the kernel at most {limit}" in caplog.text
