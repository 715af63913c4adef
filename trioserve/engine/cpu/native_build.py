"""Finding, building and loading trioserve's native CPU kernels (kernels.c
and the files beside it): the checks before anything is built
(``TRIOSERVE_NATIVE``, x86-64 Linux, the CPU's flags), the build, its cache,
and the checks after loading (cpuid, one OpenMP runtime).
:mod:`trioserve.engine.cpu.native` probes what this loads and calls it.

The build: the C files (:data:`SOURCES`; each instruction-set path is one
file, compiled for its instructions by target pragmas, so the flags name
none), the machine's compiler (``$CC``, else ``cc``), about three seconds.
The library lands in trioserve's cache (``$TRIOSERVE_CACHE``, else
``$XDG_CACHE_HOME/trioserve``, else ``~/.cache/trioserve``) under
``native/<digest>/``, the digest naming the sources, the flags and the Python
ABI (not the compiler: a restart loads it without one). It links the
OpenMP runtime torch has already loaded (the same ``libgomp.so.1``), so its
threads are torch's threads: the kernels run with torch's thread count and
do not compete with a second pool.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

__all__ = ["SOURCE", "SOURCES", "Unavailable", "cache_dir", "load"]

logger = logging.getLogger("trioserve.engine.cpu.native")

SOURCE = Path(__file__).with_name("kernels.c")
#: What the library is built from: the module (kernels.c) and each
#: instruction-set path (kernels_<isa>.c), then the headers they include.
SOURCES = (
    SOURCE,
    SOURCE.with_name("kernels_avx512.c"),
    SOURCE.with_name("kernels_avx2.c"),
)
HEADERS = (
    SOURCE.with_name("kernels.h"),
    SOURCE.with_name("kernels_arith.h"),
    SOURCE.with_name("kernels_vec_avx512.h"),
    SOURCE.with_name("kernels_vec_avx2.h"),
)
_MODULE = "_trioserve_cpu"
_FLAGS = (
    "-O3",
    "-shared",
    "-fPIC",
    "-fopenmp",
    # The arithmetic as written: no multiply and add fused behind our back,
    # so that the numbers do not depend on the compiler's choices.
    "-ffp-contract=off",
)
#: CPU flags (as /proc/cpuinfo spells them) the least of the paths needs
#: (AVX2's); the module picks the best path this CPU runs by cpuid.
_CPU_FLAGS = ("avx2", "fma", "f16c")
_BUILD_TIMEOUT_S = 120.0


def cache_dir() -> Path:
    """Where built kernels are kept: ``native/`` in trioserve's cache
    (:func:`trioserve.engine.models.cache_root`: ``$TRIOSERVE_CACHE``, else
    ``$XDG_CACHE_HOME/trioserve``, else ``~/.cache/trioserve``)."""
    from trioserve.engine.models import cache_root

    return cache_root() / "native"


class Unavailable(Exception):
    """Why the kernels cannot be used here."""


#: What ``TRIOSERVE_NATIVE`` may say besides a path's name: off, or the best
#: path this CPU runs.
_OFF = ("0", "off", "false", "no")
_AUTO = ("", "1", "on", "true", "yes", "auto")


def load() -> ModuleType:
    """The kernels' module, built (or found in the cache) and loaded, running
    the path ``TRIOSERVE_NATIVE`` names (``avx512``, ``avx2``) or else the best
    this CPU runs; raises :class:`Unavailable` where it cannot be."""
    wanted = os.environ.get("TRIOSERVE_NATIVE", "auto").strip().lower()
    if wanted in _OFF:
        raise Unavailable("TRIOSERVE_NATIVE is off")
    if sys.platform != "linux" or _machine() not in ("x86_64", "amd64"):
        raise Unavailable(f"built for x86-64 Linux only (this is {sys.platform}/{_machine()})")
    missing = _missing_cpu_flags()
    if missing:
        raise Unavailable(f"this CPU lacks {', '.join(missing)}")
    path = _built()
    spec = importlib.util.spec_from_file_location(
        _MODULE, path, loader=importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
    )
    if spec is None or spec.loader is None:  # pragma: no cover - a path always has a spec
        raise Unavailable(f"cannot load {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise Unavailable(f"cannot load {str(path)!r}: {exc}") from exc
    if module.isa() is None:
        raise Unavailable("this CPU runs none of the kernels' paths (cpuid: AVX2, FMA and F16C)")
    if wanted not in _AUTO:
        try:
            module.use(wanted)
        except ValueError as exc:
            runs = ", ".join(module.isas())
            raise Unavailable(f"TRIOSERVE_NATIVE={wanted}: {exc} (this CPU runs: {runs})") from exc
    runtimes = _openmp_runtimes()
    if len(runtimes) > 1:
        raise Unavailable(f"two OpenMP runtimes loaded ({', '.join(runtimes)}): not torch's pool")
    return module


def _machine() -> str:
    return os.uname().machine.lower()


def _missing_cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError as exc:
        raise Unavailable(f"cannot read /proc/cpuinfo: {exc}") from exc
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    return [f for f in _CPU_FLAGS if f not in flags]


def _openmp_runtimes() -> list[str]:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # pragma: no cover - Linux has it
        return []
    names = {ln.split()[-1] for ln in maps.splitlines() if "libgomp" in ln or "libiomp" in ln}
    return sorted({os.path.realpath(n) for n in names if n.startswith("/")})


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    found = shutil.which(cc)
    if found is None:
        raise Unavailable(f"no C compiler ({cc!r} not found)")
    return found


def _built() -> Path:
    """The kernels' shared library, built now unless the cache has it (a
    cached one loads without a compiler)."""
    include = sysconfig.get_paths()["include"]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    digest = hashlib.sha256(
        b"\0".join(
            [
                *(p.read_bytes() for p in (*SOURCES, *HEADERS)),
                " ".join(_FLAGS).encode(),
                suffix.encode(),
            ]
        )
    ).hexdigest()[:16]
    where = cache_dir() / digest
    target = where / (_MODULE + suffix)
    if target.is_file():
        return target
    cc = _compiler()
    if not (Path(include) / "Python.h").is_file():
        raise Unavailable(f"no Python headers (Python.h not in {include!r})")
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=where) as tmp:
            built = Path(tmp) / target.name
            command = [cc, *_FLAGS, f"-I{include}", *map(str, SOURCES), "-o", str(built)]
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False
            )
            if result.returncode != 0:
                tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
                raise Unavailable(f"building {SOURCE.name} failed: {' / '.join(tail)}")
            os.replace(built, target)  # atomic: a concurrent build's file is as good
    except OSError as exc:
        raise Unavailable(f"cannot build into {str(where)!r}: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(f"building {SOURCE.name} took over {_BUILD_TIMEOUT_S:.0f} s") from exc
    logger.info("built the native CPU kernels into %s", target)
    return target
