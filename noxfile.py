"""Developer sessions: ``nox -s tests`` (default), ``lint``, ``typecheck``, ``bench``, ``gpu``.

Each session installs the project into its own virtual environment. torch is
pinned to the CPU build first (``TRIOSERVE_TORCH`` overrides the requirement),
because an unpinned ``torch`` would resolve to a multi-GB CUDA build.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"

PYPROJECT = nox.project.load_toml("pyproject.toml")
TORCH = os.environ.get("TRIOSERVE_TORCH", "torch==2.13.0")


def install_project(session: nox.Session, *groups: str) -> None:
    session.install(TORCH)
    session.install("-e", ".")
    for group in groups:
        session.install(*nox.project.dependency_groups(PYPROJECT, group))


@nox.session
def tests(session: nox.Session) -> None:
    """The default suite: protocol, engines, server; everything on the CPU."""
    install_project(session, "test")
    args = session.posargs or ["-m", "not gpu", "-p", "no:cacheprovider"]
    session.run("pytest", *args)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package, the tests and this file."""
    install_project(session, "typing", "bench")
    session.run("mypy", "trioserve", "tests", "noxfile.py")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (tests/bench/); prints Markdown tables for docs/performance.md."""
    install_project(session, "test", "bench")
    session.run("python", "tests/bench/run.py", *session.posargs)
