"""Developer sessions: ``nox -s tests`` (default), ``lint``, ``typecheck``, ``bench``,
``fuzz``, ``soak``, ``scale-out``, ``gpu``.

Each session installs the project into its own virtual environment. torch is
pinned to the CPU build first (``TRIOSERVE_TORCH`` overrides the requirement),
because an unpinned ``torch`` would resolve to a multi-GB CUDA build. ``gpu``
is the exception: it runs in the environment that has the machine's CUDA torch.
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
    args = session.posargs or ["-m", "not gpu and not scaleout", "-p", "no:cacheprovider"]
    session.run("pytest", *args)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package, the tests, the doc examples and this file."""
    install_project(session, "typing", "bench")
    session.run("mypy", "trioserve", "tests", "noxfile.py", "docs/examples")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (tests/bench/); prints Markdown tables for docs/performance.md and
    docs/reliability.md (the hostile-client bench: ``nox -s bench -- --only hostile``)."""
    install_project(session, "test", "bench")
    session.run("python", "tests/bench/run.py", *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """100,000 fuzzed frames against ``python -m trioserve`` on the embedded model
    (tests/fuzz/, docs/reliability.md); arguments go to ``python -m tests.fuzz``
    (``--frames``, ``--seed``, ``--url`` for a server already running)."""
    install_project(session, "test")
    session.run("python", "-m", "tests.fuzz", *session.posargs)


@nox.session(default=False)
def soak(session: nox.Session) -> None:
    """Mixed requests from several clients for ``--minutes`` (default 10) against
    ``python -m trioserve``: every request answered exactly once, the server's
    memory after warm-up vs at the end (tests/soak.py, docs/reliability.md)."""
    install_project(session, "test", "bench")
    session.run("python", "-m", "tests.soak", *session.posargs)


@nox.session(name="scale-out", default=False)
def scale_out(session: nox.Session) -> None:
    """Two ``python -m trioserve`` instances behind nginx with deploy/nginx/ as shipped,
    on loopback (tests/deploy/, docs/scale-out.md): connections spread, stop reaches
    its instance, a drained instance loses no request, OpenAI routes balanced, TLS.
    Installs Debian's nginx with apt when it is missing (as root; skipped, saying
    why, otherwise). Arguments go to pytest."""
    install_project(session, "test")
    session.run(
        "pytest",
        "-m",
        "scaleout",
        "-p",
        "no:cacheprovider",
        "-rA",
        "tests/deploy",
        *session.posargs,
    )


# Checks the machine's torch before anything is installed: the project and
# exllamav2 declare torch, and pip would satisfy a missing one with an
# unpinned (and possibly CPU-only) build.
_CUDA_TORCH_CHECK = """
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu session: no torch in this environment; install the CUDA build your driver "
             "needs, or set TRIOSERVE_TORCH to its requirement (see docs/gpu.md)")
if not torch.cuda.is_available():
    sys.exit(f"gpu session: torch {torch.__version__} sees no CUDA device")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
"""


@nox.session(venv_backend="none", default=False)
def gpu(session: nox.Session) -> None:
    """GPU checks: ``pytest -m gpu``, then tests/gpu/bench_gpu.py (docs/gpu.md).

    Runs in the Python on PATH (activate the environment that has your CUDA
    torch first), because a fresh virtual environment would not see that
    torch, and must never get the CPU build the other sessions pin.
    ``TRIOSERVE_TORCH``, when set, is a torch requirement installed first.
    The project goes in with ``--no-deps`` and its dependencies without torch,
    so the torch found here is the one that runs. Arguments after ``--`` go to
    pytest; set ``TORCH_CUDA_ARCH_LIST`` and ``MAX_JOBS`` to speed up
    ExLlamaV2's first-import compile.
    """
    pip = ("python", "-m", "pip", "install")
    requirement = os.environ.get("TRIOSERVE_TORCH")
    if requirement:
        session.run(*pip, requirement)
    session.run("python", "-c", _CUDA_TORCH_CHECK)
    project = PYPROJECT["project"]
    dependencies = [
        dependency
        for dependency in [*project["dependencies"], *project["optional-dependencies"]["exllamav2"]]
        if not dependency.startswith("torch")
    ]
    session.run(*pip, *dependencies, *nox.project.dependency_groups(PYPROJECT, "test"))
    session.run(*pip, "--no-deps", "-e", ".")
    args = session.posargs or ["-p", "no:cacheprovider", "-rs"]
    session.run("python", "-m", "pytest", "-m", "gpu", *args)
    # bench-results/ is git-ignored: numbers belong in docs, not in commits.
    os.makedirs("bench-results", exist_ok=True)
    session.run("python", "tests/gpu/bench_gpu.py", "--out", "bench-results/gpu.json")
