"""Every sampler setting the ranges accept can be sampled, in any batch; what
they refuse is refused by the sampler's own guard; and a row that fails
anyway fails alone."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trioserve.engine.sampling import (
    SamplingError,
    _rows_apart,
    make_generator,
    sample,
    settings_problem,
)
from trioserve.vocabulary.sampling import Range, SamplingSettings, setting_ranges

RANGES = setting_ranges()


def values_in(allowed: Range) -> st.SearchStrategy[Any]:
    edges = [allowed.lo, allowed.hi]
    if allowed.integer:
        return st.sampled_from([int(e) for e in edges]) | st.integers(
            int(allowed.lo), int(allowed.hi)
        )
    tiny = [v for v in (1e-300, 5e-324, 1e-45) if allowed.lo <= v <= allowed.hi]
    return st.sampled_from(edges + tiny) | st.floats(
        allowed.lo, allowed.hi, allow_nan=False, allow_infinity=False
    )


accepted_settings = st.builds(
    SamplingSettings,
    **{name: values_in(allowed) for name, allowed in RANGES.items() if name != "seed"},
)


@given(st.lists(accepted_settings, min_size=1, max_size=4), st.integers(0, 2**32))
def test_every_accepted_setting_samples_a_token(batch: list[SamplingSettings], seed: int) -> None:
    for s in batch:
        assert settings_problem(s) is None
    torch.manual_seed(seed % 1000)
    vocab = 50
    logits = torch.randn(len(batch), vocab) * 8
    counts = torch.randint(0, 4, (len(batch), vocab))
    ids = sample(
        logits, batch, [make_generator(seed + i) for i in range(len(batch))], counts=counts
    )
    assert ids.shape == (len(batch),)
    assert all(0 <= i < vocab for i in ids.tolist())


#: The values issue 8 found passing validation and failing a whole step.
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 2**63),
        ("top_k", 2**31),
        ("top_k", 10**30),
        ("temperature", 1e30),
        ("temperature", 1e308),
        ("rep_pen", 1e-300),
        ("rep_pen", 1e30),
        ("pres_pen", -1e308),
        ("freq_pen", 1e30),
        ("skew", 1e308),
        ("top_a", 1e308),
        ("seed", 2**64),
        ("temperature", math.inf),
    ],
)
def test_values_beyond_the_ranges_fail_their_row_only(field: str, value: Any) -> None:
    bad = SamplingSettings(**{field: value})
    problem = settings_problem(bad)
    assert problem is not None and problem.startswith(f"{field} must be ")
    good = SamplingSettings(temperature=0.7)
    logits = torch.randn(3, 20)
    with pytest.raises(SamplingError) as caught:
        sample(logits, [good, bad, good], [make_generator(i) for i in range(3)])
    assert caught.value.rows == (1,)
    assert caught.value.ids is not None
    ids = caught.value.ids.tolist()
    assert ids[1] == -1 and 0 <= ids[0] < 20 and 0 <= ids[2] < 20


def test_a_tiny_temperature_is_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0 - 1e-6]])
    for temperature in (5e-324, 1e-300, 1e-45):
        s = SamplingSettings(temperature=temperature, top_k=0, top_p=1.0)
        assert sample(logits, [s], [make_generator(0)]).tolist() == [1]


def test_a_failure_in_a_batch_is_pinned_on_its_row() -> None:
    # Work that fails whenever row 5 is in it: the batch is redone row by row
    # and only row 5 gets a reason; every row keeps its one uniform.
    done: dict[int, float] = {}

    def work(part: torch.Tensor, rows: list[int], uniforms: list[float]) -> None:
        assert part.shape[0] == len(rows) == len(uniforms)
        if 5 in rows:
            raise RuntimeError("overflow when unpacking long")
        done.update(zip(rows, uniforms, strict=True))

    reasons: dict[int, str] = {}
    _rows_apart(torch.zeros(3, 4), [2, 5, 7], [0.1, 0.2, 0.3], work, reasons)
    assert done == {2: 0.1, 7: 0.3}
    assert list(reasons) == [5]
    assert reasons[5] == "RuntimeError: overflow when unpacking long"


def test_a_lone_row_that_fails_gets_a_reason_too() -> None:
    def work(part: torch.Tensor, rows: list[int], uniforms: list[float]) -> None:
        raise ValueError("bug")

    reasons: dict[int, str] = {}
    _rows_apart(torch.zeros(1, 4), [3], [0.5], work, reasons)
    assert reasons == {3: "ValueError: bug"}


def test_ranges_describe_themselves() -> None:
    assert RANGES["top_k"].describe() == "an integer from 0 to 2^31-1"
    assert RANGES["seed"].describe() == "an integer from -2^63 to 2^64-1"
    assert RANGES["rep_pen"].describe() == "a number in [0.01, 100]"
    assert not RANGES["top_k"].contains(True)
    assert not RANGES["top_k"].contains(1.0)
    assert RANGES["top_p"].contains(1)
    assert not RANGES["top_p"].contains(10**400)
