"""The deployment tests run only when asked for by their marker: ``nox -s scale-out``
(``pytest -m scaleout tests/deploy``) installs nginx and starts three servers, ``nox -s
gateway`` (``pytest -m gateway tests/deploy``) installs nginx and SGLang's gateway and
starts five, so a plain ``pytest -m "not gpu"`` skips them rather than spend minutes on
them."""

from __future__ import annotations

import pytest

#: Each opt-in marker and the session that runs its tests.
OPT_IN = {
    "scaleout": "scale-out test: run it with 'nox -s scale-out' (pytest -m scaleout tests/deploy)",
    "gateway": "gateway test: run it with 'nox -s gateway' (pytest -m gateway tests/deploy)",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    asked = config.option.markexpr or ""
    for marker, reason in OPT_IN.items():
        if marker in asked:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)
