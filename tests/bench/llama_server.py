"""llama.cpp's own ``llama-server`` for the benches' side-by-side column.

The peer a CPU user would pick is ``llama-server`` (continuous batching with
``-np`` slots), not only llama-cpp-python. It is built from llama-cpp-python's
sdist (its ``vendor/llama.cpp``, so both llama.cpp columns are the same
llama.cpp), CMake target ``llama-server``, with the instruction sets named
(``LLAMA_CPP_CMAKE_ARGS``, as the noxfile's llama-cpp-python build: a native
build uses AMX and dies with SIGILL on these machines; AVX-512 is named only
where the CPU has it), and cached under
``~/.cache/trioserve-llama-server/<version>-<flags digest>/`` so that reruns
do not rebuild (about 10 minutes on 2 cores)::

    python -m tests.bench.llama_server build     # prints the binary's path
    python -m tests.bench.llama_server path      # the cached binary, or why there is none

``nox -s bench -- --llama-server`` builds it first. The bench looks for the
binary at ``TRIOSERVE_LLAMA_SERVER`` when set, else in the cache, and skips
the column with the reason when neither has one (:func:`find_binary`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "LLAMA_CPP_CMAKE_ARGS",
    "LLAMA_CPP_VERSION",
    "WIDEST_CMAKE_ARGS",
    "LlamaServer",
    "build",
    "cached_binary",
    "find_binary",
    "for_cpu",
]

#: The llama-cpp-python release whose vendored llama.cpp is built (the same
#: as the noxfile's llama-cpp-python column).
LLAMA_CPP_VERSION = "0.3.36"
#: The widest instruction sets named (the noxfile's llama-cpp-python build
#: reads :data:`LLAMA_CPP_CMAKE_ARGS` from here).
WIDEST_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
    " -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_AVX2=ON -DGGML_FMA=ON"
    " -DGGML_F16C=ON"
)


def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def for_cpu(args: str, flags: frozenset[str]) -> str:
    """``args`` with each AVX-512 option the CPU lacks turned off: a binary
    built with them dies with SIGILL on an AVX2-only machine, and the
    comparison is against llama.cpp built for the instruction sets this CPU
    has (as trioserve's kernels pick theirs)."""
    needs = {
        "-DGGML_AVX512": {"avx512f", "avx512bw", "avx512vl"},
        "-DGGML_AVX512_VNNI": {"avx512f", "avx512_vnni"},
        "-DGGML_AVX512_BF16": {"avx512f", "avx512_bf16"},
    }
    out = []
    for arg in args.split():
        name, _, value = arg.partition("=")
        if value == "ON" and name in needs and not needs[name] <= flags:
            arg = f"{name}=OFF"
        out.append(arg)
    return " ".join(out)


#: What the build names: TRIOSERVE_LLAMA_CPP_CMAKE_ARGS as given, else the
#: widest sets this CPU has (the noxfile's llama-cpp-python build does the same).
LLAMA_CPP_CMAKE_ARGS = os.environ.get("TRIOSERVE_LLAMA_CPP_CMAKE_ARGS") or for_cpu(
    WIDEST_CMAKE_ARGS, cpu_flags()
)
#: What the server build adds: no network libraries, no web UI download, a
#: static binary that runs from the cache wherever the build tree went.
_SERVER_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF"
    " -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
    " -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF"
)


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    digest = hashlib.sha256(f"{LLAMA_CPP_CMAKE_ARGS} {_SERVER_ARGS}".encode()).hexdigest()[:10]
    return Path(root) / "trioserve-llama-server" / f"{LLAMA_CPP_VERSION}-{digest}"


def cached_binary() -> Path:
    """Where :func:`build` puts the binary (it may not be there)."""
    return _cache_dir() / "llama-server"


def find_binary() -> tuple[Path | None, str]:
    """The llama-server binary to run, or None and why there is none."""
    given = os.environ.get("TRIOSERVE_LLAMA_SERVER")
    if given:
        path = Path(given)
        if path.is_file() and os.access(path, os.X_OK):
            return path, ""
        return None, f"TRIOSERVE_LLAMA_SERVER={given!r} is not an executable file"
    path = cached_binary()
    if path.is_file():
        return path, ""
    return None, (
        f"no llama-server binary at {str(path)!r}: build it with"
        " `python -m tests.bench.llama_server build` (about 10 minutes on 2 cores)"
        " or `nox -s bench -- --llama-server`, or set TRIOSERVE_LLAMA_SERVER"
    )


def build(*, jobs: int | None = None, log: Path | None = None) -> Path:
    """Download llama-cpp-python's sdist with pip, build ``llama-server`` from
    its vendored llama.cpp, and keep the binary in the cache; returns its path
    (at once when it is already there)."""
    out = cached_binary()
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    sdist_dir = out.parent.parent / "src"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{LLAMA_CPP_VERSION}"
    sdist = sdist_dir / f"{name}.tar.gz"
    if not sdist.is_file():
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        requirement = f"llama-cpp-python=={LLAMA_CPP_VERSION}"
        subprocess.run([*pip, requirement, "-d", str(sdist_dir)], check=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"{name}/vendor/llama.cpp")]
            tar.extractall(tmp, members=members, filter="data")
        source = Path(tmp) / name / "vendor" / "llama.cpp"
        build_dir = Path(tmp) / "build"
        args = [*LLAMA_CPP_CMAKE_ARGS.split(), *_SERVER_ARGS.split()]
        jobs = jobs or os.cpu_count() or 1
        with open(log or os.devnull, "w") as sink:
            for command in (
                ["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *args],
                ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)],
            ):
                print("llama-server build:", " ".join(command), file=sys.stderr, flush=True)
                subprocess.run(["nice", *command], check=True, stdout=sink, stderr=sink)
        binary = build_dir / "bin" / "llama-server"
        shutil.copy2(binary, out.with_suffix(".tmp"))
        out.with_suffix(".tmp").replace(out)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One ``llama-server`` process on a GGUF, on a loopback port."""

    def __init__(
        self, binary: Path, model: Path, *, threads: int, slots: int, context: int
    ) -> None:
        self.port = _free_port()
        self.slots = slots
        command = [str(binary), "-m", str(model), "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "-t", str(threads), "-tb", str(threads)]
        # Each slot gets context / slots positions (llama-server splits -c).
        command += ["-np", str(slots), "-c", str(context * slots), "--no-webui"]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}")
            try:
                status, _ = self._request("GET", "/health", None)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("llama-server did not become ready")

    def _request(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def status_kib(self, key: str) -> int:
        """``VmRSS`` or ``VmHWM`` of the server process, in bytes."""
        with open(f"/proc/{self.process.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {key} in /proc/{self.process.pid}/status")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["build"]:
        print(build(log=Path(args[1]) if len(args) > 1 else None))
        return 0
    if args[:1] == ["path"]:
        path, why = find_binary()
        print(path if path is not None else why)
        return 0 if path is not None else 1
    print("usage: python -m tests.bench.llama_server build [LOG] | path", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
