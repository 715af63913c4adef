"""The scale-out test runs only when asked for by its marker (``nox -s scale-out``,
``pytest -m scaleout tests/deploy``): it installs nginx and starts three servers, so a
plain ``pytest -m "not gpu"`` skips it rather than spend minutes on it."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "scaleout" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(
        reason="scale-out test: run it with 'nox -s scale-out' (pytest -m scaleout tests/deploy)"
    )
    for item in items:
        if item.get_closest_marker("scaleout") is not None:
            item.add_marker(skip)
