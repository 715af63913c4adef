"""The CPU engine's weights plan (trioserve/engine/cpu/weights_plan.py):
every combination of the options, the device and dtype, the directory's
4-bit file and the kernels this machine has, against the rules written out
here once more; the kernels' probes are called only where the decision needs
them."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from trioserve.engine.base import CPU_KERNELS, PROJECTIONS, WEIGHT_MODES
from trioserve.engine.cpu.weights_plan import WeightsPlan, plan_weights
from trioserve.errors import ModelError

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


def plan(probes: Probes, **options: Any) -> WeightsPlan:
    values: dict[str, Any] = {
        "weights": "auto",
        "projection": "auto",
        "cpu_kernels": "auto",
        "device": "cpu",
        "dtype": "bfloat16",
        "has_q4_file": True,
        **options,
    }
    return plan_weights(
        **values, native_kernels=probes.native, torch_q4=probes.q4, torch_int8=probes.int8
    )


def expected(
    weights: str, projection: str, kernels: str, cpu_bf16: bool, file: bool, has: dict[str, bool]
) -> WeightsPlan | str:
    """The rules, from docs/performance.md's and the options' own words."""
    if not cpu_bf16 and (weights in ("q4", "int8") or kernels == "native"):
        return "bfloat16 only"
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
    if int8_projection and not cpu_bf16:
        return "8-bit vocabulary projection"
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
        options = {"weights": weights, "projection": projection, "cpu_kernels": kernels}
        if isinstance(want, str):
            with pytest.raises(ModelError, match=want):
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
    ("option", "value"), [("weights", "q8"), ("projection", "fp8"), ("cpu_kernels", "cuda")]
)
def test_unknown_options_are_named(option: str, value: str) -> None:
    with pytest.raises(ModelError, match=f"must be one of .* got {value!r}"):
        plan(Probes(True, True, True), **{option: value})
