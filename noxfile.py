"""Developer sessions: ``nox -s tests`` (default), ``unit``, ``isa``, ``lint``, ``typecheck``,
``bench``, ``fuzz``, ``soak``, ``scale-out``, ``gateway``, ``clients``, ``gpu``.

Each session installs the project into its own virtual environment (reused by
later runs), torch first: ``torch==2.13.0``, the version the project is tested
with (``TRIOSERVE_TORCH`` overrides the requirement). Which build that is
depends on where pip looks: from PyPI alone, on Linux x86-64, it is the CUDA
build (about 2.7 GB with NVIDIA's libraries); with
``PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu`` in the
environment (pip reads it, and nox passes it on) it is the CPU-only build
``2.13.0+cpu`` (about 190 MB), as README.md explains. The session prints which
one it got. torch is installed once: the project's own ``torch>=2.4`` is then
already satisfied. ``gpu`` is the exception: it runs in the environment that
has the machine's CUDA torch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import nox
from nox.command import CommandFailed
from packaging.requirements import Requirement

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
# A supported Python that is not installed skips its session (with a line
# that says so) instead of failing the run, CI's included.
nox.options.error_on_missing_interpreters = False

PYPROJECT = nox.project.load_toml("pyproject.toml")
TORCH = os.environ.get("TRIOSERVE_TORCH", "torch==2.13.0")
#: The Pythons the package supports (pyproject's requires-python).
PYTHONS = ["3.11", "3.12"]


def _pyenv_pythons() -> None:
    """Where pyenv manages the interpreters and PYENV_VERSION is unset, let
    nox find each installed CPython of :data:`PYTHONS` (pyenv's shims run only
    the selected versions: ``python3.12`` fails while the global one is 3.11).
    The global version stays first, so ``python3`` is unchanged."""
    if "PYENV_VERSION" in os.environ or shutil.which("pyenv") is None:
        return
    pyenv = ["pyenv", "versions", "--bare"], ["pyenv", "version-name"]
    installed, selected = (
        subprocess.run(command, capture_output=True, text=True, check=False).stdout
        for command in pyenv
    )
    newest: dict[str, tuple[int, str]] = {}
    for version in installed.split():
        match = re.fullmatch(r"(3\.\d+)\.(\d+)", version)
        if match and match[1] in PYTHONS:
            newest[match[1]] = max(newest.get(match[1], (-1, "")), (int(match[2]), version))
    chosen = [v for v in selected.strip().split(":") if v]
    chosen += [v for _, v in newest.values() if v not in chosen]
    if chosen:
        os.environ["PYENV_VERSION"] = ":".join(chosen)


_pyenv_pythons()


# Says which torch build a session got, so that a 2.7 GB surprise is visible.
_WHICH_TORCH = (
    "import torch; cuda = torch.version.cuda; "
    "print(f'torch {torch.__version__}: ' + (f'CUDA {cuda} build' if cuda else 'CPU-only build'))"
)


def install_project(session: nox.Session, *groups: str) -> None:
    session.install(TORCH)
    session.install("-e", ".")
    for group in groups:
        session.install(*nox.project.dependency_groups(PYPROJECT, group))
    session.run("python", "-c", _WHICH_TORCH, silent=False)


#: Claude Code as tests/test_claude_code.py runs it (npm).
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
CODEX = "@openai/codex@0.169.0"


@nox.session
def tests(session: nox.Session) -> None:
    """The default suite: protocol, engines, server; everything on the CPU."""
    install_project(session, "test")
    session.run("pytest", *pytest_args(session.posargs))


#: The line that puts a test module in the fast tier (tests/test_tiers.py).
UNIT_MARK = re.compile(r"^pytestmark = pytest\.mark\.unit$", re.MULTILINE)


@nox.session(python=PYTHONS)
def unit(session: nox.Session) -> None:
    """The fast tier, on each supported Python, without torch: the test
    modules marked ``unit`` (the codecs and their rules, the plans, the HTTP
    front door, the server and scheduler on a scripted engine), in well under
    a minute. torch and the model are not installed: a unit test that needs
    either fails here."""
    requirements = PYPROJECT["project"]["dependencies"]
    session.install(
        *(r for r in requirements if Requirement(r).name != "torch"),
        *nox.project.dependency_groups(PYPROJECT, "test"),
    )
    session.install("--no-deps", "-e", ".")
    modules = sorted(
        str(path)
        for path in Path("tests").glob("test_*.py")
        if UNIT_MARK.search(path.read_text(encoding="utf-8"))
    )
    session.run("pytest", "-m", "unit", "-p", "no:cacheprovider", *modules, *session.posargs)


#: What the default session leaves out: GPU tests (their own session), the
#: nginx scale-out tests (``nox -s scale-out``) and the gateway's (``nox -s gateway``).
BASE_MARKERS = "not gpu and not scaleout and not gateway"


def pytest_args(posargs: list[str]) -> list[str]:
    """The default session's pytest arguments (skips say why through
    pyproject's ``-rs``). A ``-m`` given after ``--`` narrows the default
    marker expression instead of replacing it: ``nox -s tests -- -m "not
    slow"`` is the fast lane."""
    args = list(posargs)
    markers = BASE_MARKERS
    if "-m" in args:
        index = args.index("-m")
        markers = f"({BASE_MARKERS}) and ({args[index + 1]})"
        del args[index : index + 2]
    return ["-m", markers, "-p", "no:cacheprovider", *args]


#: Instruction sets a CPU may give torch, below the machine's own, and what
#: forces each: torch's kernels (ATEN_CPU_CAPABILITY), oneDNN's (whose
#: bfloat16 attention fails under AVX2 torch unless it is capped too), MKL's
#: and trioserve's (its kernels' AVX2 path, as an AVX2-only CPU runs them;
#: ``avx2-torch`` as such a CPU without a C compiler runs: torch's alone).
_AVX2_TORCH = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "DNNL_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
ISA_ENVIRONMENTS = {
    "avx2": {**_AVX2_TORCH, "TRIOSERVE_NATIVE": "avx2"},
    "avx2-torch": {**_AVX2_TORCH, "TRIOSERVE_NATIVE": "0"},
    "default": {
        "ATEN_CPU_CAPABILITY": "default",
        "DNNL_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "TRIOSERVE_NATIVE": "0",
    },
}

#: What ``isa`` runs without vector instructions: the 4-bit layers and the
#: model functions on small random models, the sampler, the mapped table
#: (about half a minute). Without vector kernels torch runs the real model
#: tens of times slower: past 15 minutes for the 8-bit KV cache's tests alone.
ISA_DEFAULT_TESTS = [
    "tests/test_llama.py",
    "tests/test_sampling.py",
    "tests/test_mapped.py",
]


@nox.session
def isa(session: nox.Session) -> None:
    """The suite as a CPU with fewer instruction sets than this machine's runs
    it: torch's dispatch forced down to AVX2 with trioserve's kernels on their
    AVX2 path, then the same with trioserve's kernels off (both the whole
    default suite), then torch's forced to no vector instructions (the
    numeric tests that need no real model, :data:`ISA_DEFAULT_TESTS`). So an
    AVX-512 machine checks what an AVX2-only one would see.
    ``nox -s isa -- avx2 [pytest args]`` runs one."""
    install_project(session, "test")
    args = list(session.posargs)
    names = [args.pop(0)] if args and args[0] in ISA_ENVIRONMENTS else list(ISA_ENVIRONMENTS)
    for name in names:
        env = ISA_ENVIRONMENTS[name]
        session.run(
            "python", "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())", env=env
        )
        tests = ISA_DEFAULT_TESTS if name == "default" else []
        session.run("pytest", *pytest_args([*tests, *args]), env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package, the tests, the doc examples, the deployment
    scripts and this file."""
    install_project(session, "typing", "bench")
    session.run("mypy", "trioserve", "tests", "noxfile.py", "docs/examples")
    # One at a time: a script without .py is module __main__ to mypy.
    for script in ("deploy/gateway/run-replicas", "deploy/gateway/launch-gateway"):
        session.run("mypy", script)


#: llama-cpp-python for the engine bench's llama.cpp column (opt-in: it is
#: an sdist that compiles llama.cpp, about 8 minutes on 2 cores).
LLAMA_CPP = "llama-cpp-python==0.3.36"


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (tests/bench/); prints Markdown tables for docs/performance.md and
    docs/reliability.md (the hostile-client bench: ``nox -s bench -- --only hostile``).

    ``nox -s bench -- --llama-cpp [args]`` first builds and installs
    llama-cpp-python (without its dependencies' unpinned extras, so no torch
    is pulled) for the engine bench's side-by-side llama.cpp column.
    ``--llama-server`` first builds llama.cpp's ``llama-server`` from the same
    release's sdist, with the same instruction sets, into
    ``~/.cache/trioserve-llama-server/`` (once; about 10 minutes on 2 cores)
    for the comparison of the two servers (tests/bench/server_vs_llama.py).
    ``--only gateway`` (nginx's least_conn against SGLang's Model Gateway, opt-in)
    first installs the project's ``gateway`` extra (sglang-router).
    """
    install_project(session, "test", "bench")
    args = list(session.posargs)
    if "gateway" in args:
        # --only gateway: three replicas behind nginx against SGLang's gateway.
        session.install("-e", ".[gateway]")
    if "--llama-server" in args:
        args.remove("--llama-server")
        session.run("python", "-m", "tests.bench.llama_server", "build")
    if "--llama-cpp" in args:
        args.remove("--llama-cpp")
        # The instruction sets the llama-server build names (one source,
        # tests/bench/llama_server.py): a native build uses AMX and dies with
        # SIGILL where the kernel does not allow it, and AVX-512 is named only
        # where the CPU has it. TRIOSERVE_LLAMA_CPP_CMAKE_ARGS overrides both.
        cmake_args = session.run(
            "python",
            "-c",
            "from tests.bench.llama_server import LLAMA_CPP_CMAKE_ARGS as a; print(a)",
            silent=True,
        )
        session.install("numpy", "typing-extensions", "diskcache", "jinja2")
        session.install(
            "--no-deps",
            LLAMA_CPP,
            env={"CMAKE_ARGS": str(cmake_args).strip(), "FORCE_CMAKE": "1"},
        )
    session.run("python", "tests/bench/run.py", *args)


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


@nox.session(default=False)
def gateway(session: nox.Session) -> None:
    """Three ``python -m trioserve`` replicas behind SGLang's Model Gateway
    (sglang-router, cache_aware) and nginx, as deploy/gateway/ ships them, on loopback
    (tests/deploy/test_gateway.py, docs/scale-out.md): the OpenAI doors through the
    gateway, a shared prefix kept on one replica, the key, the WebSocket and
    /v1/messages through nginx, a replica drained while clients stream. Installs the
    project's ``gateway`` extra (sglang-router, a wheel with a Rust binary) and Debian's
    nginx with apt when it is missing (as root); skips, saying why, where either cannot
    be installed. Arguments go to pytest."""
    install_project(session, "test")
    try:
        session.install("-e", ".[gateway]")
    except CommandFailed:
        session.skip(
            "sglang-router cannot be installed here (pip install -e '.[gateway]' failed: "
            "a platform without its wheel, or no index): the gateway tests need it"
        )
    session.run(
        "pytest",
        "-m",
        "gateway",
        "-p",
        "no:cacheprovider",
        "-rA",
        "tests/deploy/test_gateway.py",
        *session.posargs,
    )


@nox.session(default=False)
def arm64(session: nox.Session) -> None:
    """The native kernels' ARM64 paths (NEON, and NEON with the dot-product
    instructions), cross-compiled with Debian's ``gcc-aarch64-linux-gnu`` and run
    under ``qemu-aarch64 -cpu max``: they must write the bytes this machine's x86-64
    paths write (tests/test_native_paths.py, which ``tests`` also runs and skips
    without the tools). Here a missing tool fails the session, naming the packages
    (``apt-get install gcc-aarch64-linux-gnu qemu-user``). About 10 seconds of
    test time."""
    install_project(session, "test")
    session.run(
        "pytest",
        "-p",
        "no:cacheprovider",
        "-rA",
        "tests/test_native_paths.py",
        *session.posargs,
        env={"TRIOSERVE_REQUIRE_ARM64": "1"},
    )


@nox.session(default=False)
def clients(session: nox.Session) -> None:
    """Client programs run unchanged against ``python -m trioserve`` that are too
    heavy for the test group: lm-evaluation-harness on two local tasks, every
    loglikelihood checked against the engine (tests/test_lm_eval.py, docs/openai.md),
    Claude Code against the Messages door (tests/test_claude_code.py) and Codex CLI against
    the Responses door (tests/test_codex.py), where npm is there. Installs the ``clients``
    group (lm-eval[api]: about 45 packages, 620 MB), Claude Code and Codex CLI.
    Arguments go to pytest."""
    install_project(session, "clients")
    env = {}
    npm = shutil.which("npm")
    if npm is not None:
        # Claude Code, pinned, into nox's cache (235 MB; no network needed to run it).
        prefix = Path(session.cache_dir).resolve() / "claude-code"
        session.run(
            npm,
            "install",
            "--prefix",
            str(prefix),
            "--no-audit",
            "--no-fund",
            CLAUDE_CODE,
            external=True,
        )
        env["TRIOSERVE_CLAUDE_CODE"] = str(prefix / "node_modules" / ".bin" / "claude")
        # Codex CLI, pinned, beside it (a native binary, 80 MB).
        prefix = Path(session.cache_dir).resolve() / "codex"
        session.run(
            npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", CODEX, external=True
        )
        env["TRIOSERVE_CODEX"] = str(prefix / "node_modules" / ".bin" / "codex")
    session.run(
        "pytest",
        "-p",
        "no:cacheprovider",
        "-rA",
        "tests/test_lm_eval.py",
        "tests/test_claude_code.py",
        "tests/test_codex.py",
        *session.posargs,
        env=env,
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


# The exl2-cpu session's versions: the torch of the project's GPU machines
# (2.11.0, CUDA 13.0; PyPI's Linux build of it is the CUDA 13.0 one) and the
# ExLlamaV2 release the adapter was checked against.
EXL2_CPU_TORCH = "torch==2.11.0"
EXL2_CPU_EXLLAMAV2 = "exllamav2==0.3.2"


def _exl2_build_env(session: nox.Session) -> dict[str, str]:
    """Environment for building ExLlamaV2's extension once and finding it again.

    TORCH_EXTENSIONS_DIR is a cache outside the virtual environment, named by
    what the build depends on, so a recreated environment (or another
    checkout) reuses it; ninja rebuilds only what changed. MAX_JOBS=2 because
    this machine has two cores shared by several people; TORCH_CUDA_ARCH_LIST
    names the H200's sm_90, so the same build is the GPU check's fallback
    (tests/gpu/README.md).
    """
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0")
    versions = f"{EXL2_CPU_EXLLAMAV2}_{EXL2_CPU_TORCH}".replace("==", "-")
    tag = f"{versions}_py312_sm{arch.replace('.', '').replace(';', '-')}"
    env = {
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", os.path.join(cache, "trioserve-exl2-cpu", tag)
        ),
        "MAX_JOBS": os.environ.get("MAX_JOBS", "2"),
        "TORCH_CUDA_ARCH_LIST": arch,
    }
    # CUDA_HOME, the library headers a bare toolkit lacks and a linkable
    # libcudart where CUDA_HOME has none, as the GPU check finds them too
    # (tests/gpu/build_exllamav2.py, build_environment).
    link_dir = os.path.join(env["TORCH_EXTENSIONS_DIR"], "cudart")
    lines = session.run(
        "python", "tests/gpu/build_exllamav2.py", "--env", "--link-dir", link_dir, silent=True
    )
    for line in str(lines or "").splitlines():
        key, sep, value = line.partition("=")
        if sep and key in ("CUDA_HOME", "CPLUS_INCLUDE_PATH", "LIBRARY_PATH"):
            env[key] = value
    return env


@nox.session(name="exl2-cpu", python="3.12", default=False)
def exl2_cpu(session: nox.Session) -> None:
    """The ExLlamaV2 adapter against ExLlamaV2's real job code, on the CPU (opt-in).

    Installs torch 2.11.0 with CUDA 13.0 (a download of several GB, in this
    session's own environment only) and exllamav2 0.3.2, builds ExLlamaV2's
    extension with the machine's nvcc (no GPU needed; 48 compile steps, over
    an hour on two busy cores the first time, then cached), and runs
    tests/test_exllamav2.py and tests/test_exllamav2_filter.py with the
    tests that need exllamav2 required to run: the ones that drive
    ``ExLlamaV2DynamicJob.receive_sample``, the constraint filter inside
    0.3.2's job and sampler code, and
    the engine's attention set-up against a real ``ExLlamaV2Config`` and
    ExLlamaV2's own ``_attn_torch``. CPython 3.12 (the GPU machines' Python,
    so that the build doubles as the GPU check's prebuilt extension); with
    pyenv: ``PYENV_VERSION=3.11.7:3.12.1``.
    """
    session.install(EXL2_CPU_TORCH)
    session.install(
        "-e",
        ".[exllamav2]",
        EXL2_CPU_EXLLAMAV2,
        *nox.project.dependency_groups(PYPROJECT, "test"),
    )
    env = _exl2_build_env(session)
    session.log("build environment: %s", env)
    session.run("python", "tests/gpu/build_exllamav2.py", env=env)
    args = session.posargs or [
        "-p",
        "no:cacheprovider",
        "-rs",
        "tests/test_exllamav2.py",
        "tests/test_exllamav2_filter.py",
    ]
    session.run(
        "python", "-m", "pytest", "-m", "not gpu", *args, env={**env, "TRIOSERVE_EXL2_CPU": "1"}
    )
