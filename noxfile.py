"""Developer sessions: ``nox -s tests`` (default), ``lint``, ``typecheck``, ``bench``, ``gpu``.

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
    """mypy --strict over the package, the tests, the doc examples and this file."""
    install_project(session, "typing", "bench")
    session.run("mypy", "trioserve", "tests", "noxfile.py", "docs/examples")


#: llama-cpp-python for the engine bench's llama.cpp column (opt-in: it is
#: an sdist that compiles llama.cpp, about 8 minutes on 2 cores).
LLAMA_CPP = "llama-cpp-python==0.3.36"
#: Its default native build uses every instruction the build machine has,
#: AMX included, and dies with SIGILL where the kernel does not allow AMX:
#: name the instruction sets instead. Override with TRIOSERVE_LLAMA_CPP_CMAKE_ARGS.
LLAMA_CPP_CMAKE_ARGS = os.environ.get(
    "TRIOSERVE_LLAMA_CPP_CMAKE_ARGS",
    "-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
    " -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_AVX2=ON -DGGML_FMA=ON"
    " -DGGML_F16C=ON",
)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (tests/bench/); prints Markdown tables for docs/performance.md.

    ``nox -s bench -- --llama-cpp [args]`` first builds and installs
    llama-cpp-python (without its dependencies' unpinned extras, so no torch
    is pulled) for the engine bench's side-by-side llama.cpp column.
    """
    install_project(session, "test", "bench")
    args = list(session.posargs)
    if "--llama-cpp" in args:
        args.remove("--llama-cpp")
        session.install("numpy", "typing-extensions", "diskcache", "jinja2")
        session.install(
            "--no-deps", LLAMA_CPP, env={"CMAKE_ARGS": LLAMA_CPP_CMAKE_ARGS, "FORCE_CMAKE": "1"}
        )
    session.run("python", "tests/bench/run.py", *args)


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
