"""The CPU engine's options and weights plan (trioserve/engine/cpu/options.py,
weights_plan.py): every combination of the options, the device and dtype, the
directory's 4-bit file and the kernels this machine has, against the rules
written out here once more. What can run nowhere is refused by the options;
what this machine cannot run, by the plan; the kernels' probes are called
only where the decision needs them."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from trioserve.engine.cpu.options import CPU_KERNELS, PROJECTIONS, WEIGHT_MODES, CpuOptions
from trioserve.engine.cpu.weights_plan import WeightsPlan, plan_weights
from trioserve.errors import ConfigError, ModelError

pytestmark = pytest.mark.unit


class Probes:
    """The kernels this machine is said to have, counting each probe's calls."""

    def __init__(self, native: bool, q4: bool, int8: bool) -> None:
        self.has = {"native": native, "q4": q4, "int8": int8}
        self.calls = {"native": 0, "q4": 0, "int8": 0}

    def native(self, choice: str) -> bool:
        self.calls["native"] += 1
        if choice == "torch":
            return False
        if choice == "native" and not self.has["native"]:
            raise ModelError("trioserve's native kernels cannot run here: no AVX-512")
        return self.has["native"]

    def q4(self) -> bool:
        self.calls["q4"] += 1
        return self.has["q4"]

    def int8(self) -> bool:
        self.calls["int8"] += 1
        return self.has["int8"]


def plan(probes: Probes, has_q4_file: bool = True, **options: Any) -> WeightsPlan:
    return plan_weights(
        CpuOptions(**options),
        has_q4_file=has_q4_file,
        native_kernels=probes.native,
        torch_q4=probes.q4,
        torch_int8=probes.int8,
    )


def expected(
    weights: str, projection: str, kernels: str, cpu_bf16: bool, file: bool, has: dict[str, bool]
) -> WeightsPlan | str:
    """The rules, from docs/performance.md's and the options' own words."""
    if not cpu_bf16 and (weights in ("q4", "int8") or kernels == "native"):
        return "need dtype 'bfloat16' on the CPU"
    if not cpu_bf16 and projection == "int8":
        return "needs dtype 'bfloat16' on the CPU"
    if kernels == "native" and not has["native"]:
        return "cannot run here"
    native = cpu_bf16 and kernels != "torch" and has["native"]
    q4_works = native or has["q4"]
    from_file = file and (weights == "q4" or (weights == "auto" and cpu_bf16 and q4_works))
    mode = "q4" if from_file or weights == "q4" else "int8" if weights == "int8" else "float"
    if mode == "q4" and not q4_works:
        return "no working 4-bit"
    if mode == "int8" and not (native or has["int8"]):
        return "no working int8"
    int8_projection = projection == "int8" or (projection == "auto" and mode != "float")
    assert not (int8_projection and not cpu_bf16)
    kernel = "native" if native else "torch"
    return WeightsPlan(mode, from_file, kernel, int8_projection)  # type: ignore[arg-type]


CASES = list(
    itertools.product(
        WEIGHT_MODES,
        PROJECTIONS,
        CPU_KERNELS,
        [("cpu", "bfloat16"), ("cpu", "float32"), ("cuda:0", "bfloat16")],
        [True, False],
        itertools.product([True, False], repeat=3),
    )
)


def test_every_combination_follows_the_rules() -> None:
    # One test over the 1,728 cases (the rules are cheap; a test each would
    # cost the fast tier more in pytest's bookkeeping than in checking).
    for weights, projection, kernels, where, file, has in CASES:
        case = (weights, projection, kernels, where, file, has)
        probes = Probes(*has)
        device, dtype = where
        want = expected(
            weights,
            projection,
            kernels,
            where == ("cpu", "bfloat16"),
            file,
            dict(zip(("native", "q4", "int8"), has, strict=True)),
        )
        options = {"weights": weights, "vocab_projection": projection, "cpu_kernels": kernels}
        if isinstance(want, str):
            refused = ConfigError if "bfloat16" in want else ModelError
            with pytest.raises(refused, match=want):
                plan(probes, **options, device=device, dtype=dtype, has_q4_file=file)
            continue
        got = plan(probes, **options, device=device, dtype=dtype, has_q4_file=file)
        assert got == want, case
        # No probe runs for what the plan does not need: none off the CPU's
        # bfloat16, torch's kernels not beside trioserve's, each at most once.
        if where != ("cpu", "bfloat16"):
            assert probes.calls == {"native": 0, "q4": 0, "int8": 0}, case
        if got.kernel == "native":
            assert probes.calls["q4"] == probes.calls["int8"] == 0, case
        assert max(probes.calls.values()) <= 1, case


def test_the_embedded_model_on_an_avx512_and_an_avx2_machine() -> None:
    # AVX-512 VNNI/BF16: trioserve's kernels, the directory's 4-bit weights,
    # an 8-bit projection.
    assert plan(Probes(native=True, q4=True, int8=True)) == WeightsPlan("q4", True, "native", True)
    # AVX2 only: torch's 4-bit kernel, the same weights and projection.
    assert plan(Probes(native=False, q4=True, int8=True)) == WeightsPlan("q4", True, "torch", True)
    # No 4-bit kernel at all: the float weights, the bfloat16 projection.
    assert plan(Probes(native=False, q4=False, int8=False)) == WeightsPlan(
        "float", False, "torch", False
    )


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("weights", "q8", "weights must be one of"),
        ("vocab_projection", "fp8", "vocab_projection must be one of"),
        ("cpu_kernels", "cuda", "cpu_kernels must be one of"),
        ("dtype", "int4", "dtype must be one of"),
        ("max_batch", 0, "max_batch must be >= 1"),
        ("context_length", 1, "context_length must be >= 2"),
        ("threads", 0, "threads must be >= 1"),
        ("prefix_cache_mib", -1, "prefix_cache_mib must be >= 0"),
        ("prefill_share", 0.0, "prefill_share must be > 0 and <= 1"),
        ("prefill_share", float("nan"), "prefill_share must be > 0 and <= 1"),
        ("speculative", "eagle", "speculative must be one of"),
        ("draft_tokens", 0, "draft_tokens must be >= 1"),
        ("kv_cache_dtype", "fp8", "kv_cache_dtype must be one of"),
    ],
)
def test_each_bad_option_is_named_with_its_value(option: str, value: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=f"{says}.*got {value!r}"):
        CpuOptions(**{option: value})


def test_the_command_lines_options_carry_the_cpu_engines_whole() -> None:
    # Every CPU option is an EngineOptions field of the same name and default
    # (max_batch: None there, the CPU engine's default here).
    from trioserve.engine import EngineOptions

    assert EngineOptions().cpu() == CpuOptions()
    changed: dict[str, Any] = {"weights": "int8", "vocab_projection": "bfloat16"}
    assert EngineOptions(max_batch=3, **changed).cpu() == CpuOptions(max_batch=3, **changed)
