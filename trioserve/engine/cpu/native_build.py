"""Finding, building and loading trioserve's native CPU kernels (kernels.c
and the files beside it; each instruction-set path is one C file, compiled
for its instructions by target pragmas, so the flags name none): the checks
before anything is built (``TRIOSERVE_NATIVE``, x86-64 or ARM64 Linux, the
CPU's flags), where the library comes from, the checks that it is the one
that was built, and the checks after loading (cpuid, one OpenMP runtime).
:mod:`trioserve.engine.cpu.native` probes what this loads and calls it.

Where the library comes from, in order:

1. **The installed extension**: ``pip install`` builds it once, beside this
   file (setup.py calls :func:`build_installed`), with the same compiler
   choice and flags as below. It is used when the record written beside it
   at that build names the same sources and flags as the files here, and
   the library's sha256 is the one recorded (an editable install whose
   kernels.c changed since is stale: the cache takes over).
2. **trioserve's cache** (``$TRIOSERVE_CACHE``, else
   ``$XDG_CACHE_HOME/trioserve``, else ``~/.cache/trioserve``): under
   ``native/<key>/``, built there on first use by the machine's compiler
   (``$CC``, else ``cc``; about 7 seconds of one core). The key names the sources, the
   flags, the Python ABI and the compiler (its resolved path and the first
   line of its ``--version``), so that two hosts or two compilers sharing a
   cache never share a library. A restart without any compiler still finds
   the last build: ``native/<base>.json``, keyed by the sources, flags and
   ABI alone, names the directory it went into.

Trust: a library is loaded only when its sha256 is the one recorded beside it
when it was built (``<library>.json``, written before the build's directory
appears under its name); one that is not (changed since, or never recorded)
is refused with the reason and left where it is, not rebuilt over: removing
its directory has it rebuilt. ``native/`` and everything under it are created
with mode 0700; a directory there that another user owns, or that its group
or everyone may write, is refused. A refusal, like a missing compiler, leaves
the engine on torch's operators, with a warning saying what is lost and how
to get it back.

The library links the OpenMP runtime torch has already loaded (the same
``libgomp.so.1``), so its threads are torch's threads: the kernels run with
torch's thread count and do not compete with a second pool.

This module imports nothing outside the standard library at import time:
setup.py loads it by path to build the installed extension before trioserve's
dependencies are installed.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "FREE_THREADED",
    "INSTALLED",
    "LOST",
    "SOURCE",
    "SOURCES",
    "SUFFIX",
    "TO_GET_THEM",
    "Unavailable",
    "build_installed",
    "cache_dir",
    "load",
    "sources_digest",
]

logger = logging.getLogger("trioserve.engine.cpu.native")

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "kernels.c"
#: Every file the kernels are built from (kernels.c and the headers beside it
#: that it includes), sorted by name: what every digest of "the sources" hashes.
SOURCES = tuple(sorted([*HERE.glob("kernels*.c"), *HERE.glob("kernels*.h")], key=lambda p: p.name))
_MODULE = "_trioserve_cpu"
#: Whether this CPython is a free-threaded build (it has no stable ABI).
FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
#: The file name's ABI tag: the kernels use CPython's limited API (3.11's
#: stable ABI), so one library serves every Python version from 3.11 on, and
#: setuptools names the installed extension the same way (``py_limited_api``);
#: a free-threaded CPython's own (``.cpython-313t-x86_64-linux-gnu.so``).
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0] if FREE_THREADED else ".abi3.so"
#: The extension built at install time, beside this file.
INSTALLED = HERE / (_MODULE + SUFFIX)
_FLAGS = (
    "-O3",
    "-shared",
    "-fPIC",
    "-fopenmp",
    # The arithmetic as written: no multiply and add fused behind our back,
    # so that the numbers do not depend on the compiler's choices.
    "-ffp-contract=off",
    # Every loop's head on a 64-byte line: without it the kernels' speed
    # hung on where the linker happened to put them (the 8-bit projection's
    # loop, unchanged, ran 20 % slower at one row after an unrelated
    # function in the same file grew).
    "-falign-loops=64",
)
#: CPU flags (as /proc/cpuinfo spells them) the least of the paths needs
#: (AVX2's); the module picks the best path this CPU runs by cpuid.
_CPU_FLAGS = ("avx2", "fma", "f16c")
#: What ``uname -m`` says where the kernels have paths: x86-64 (AVX-512,
#: AVX2 with and without AVX-VNNI) and ARM64 (NEON, with and without the dot-product instructions).
MACHINES = ("x86_64", "amd64", "aarch64", "arm64")
_BUILD_TIMEOUT_S = 120.0

#: What a machine without the kernels loses (said at install and at startup).
LOST = "the CPU engine runs on torch's operators instead, about 1.5-2x slower"
#: How to get them where a compiler or Python's headers are what is missing.
TO_GET_THEM = (
    "install a C compiler and Python's headers (e.g. `apt-get install gcc python3-dev`), "
    "then reinstall trioserve, or restart it: it builds them on first use"
)


def cache_dir() -> Path:
    """Where built kernels are kept: ``native/`` in trioserve's cache
    (:func:`trioserve.engine.models.cache_root`: ``$TRIOSERVE_CACHE``, else
    ``$XDG_CACHE_HOME/trioserve``, else ``~/.cache/trioserve``)."""
    from trioserve.engine.models import cache_root

    return cache_root() / "native"


class Unavailable(Exception):
    """Why the kernels cannot be used here. ``remedy``, where set, says how
    to get them: the reason is then one a user can fix (no compiler, a
    refused cache), and startup warns rather than informs."""

    def __init__(self, reason: str, *, remedy: str | None = None) -> None:
        super().__init__(reason)
        self.remedy = remedy


#: What ``TRIOSERVE_NATIVE`` may say besides a path's name: off, or the best
#: path this CPU runs.
_OFF = ("0", "off", "false", "no")
_AUTO = ("", "1", "on", "true", "yes", "auto")


def load() -> ModuleType:
    """The kernels' module: the installed extension, else the cache's build
    (built now where there is none), running the path ``TRIOSERVE_NATIVE``
    names (``avx512``, ``avx2-vnni``, ``avx2``) or else the best this CPU runs; raises
    :class:`Unavailable` where it cannot be. Logs which library it loads."""
    wanted = os.environ.get("TRIOSERVE_NATIVE", "auto").strip().lower()
    if wanted in _OFF:
        raise Unavailable("TRIOSERVE_NATIVE is off")
    if sys.platform != "linux" or _machine() not in MACHINES:
        raise Unavailable(
            f"built for x86-64 and ARM64 Linux only (this is {sys.platform}/{_machine()})"
        )
    missing = _missing_cpu_flags() if _machine() in ("x86_64", "amd64") else []
    if missing:
        raise Unavailable(f"this CPU lacks {', '.join(missing)}")
    path = _installed() or _cached()
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
        raise Unavailable("this CPU runs none of the kernels' paths (x86-64: AVX2, FMA and F16C)")
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
        raise Unavailable(f"no C compiler ({cc!r} not found)", remedy=TO_GET_THEM)
    return found


# --- what a build is made of, and its record ---------------------------------------


def sources_digest(sources: tuple[Path, ...] = SOURCES) -> str:
    """sha256 of the sources, each by its name and its bytes, in
    :data:`SOURCES`' order (a header renamed or added changes it)."""
    h = hashlib.sha256()
    for path in sources:
        data = path.read_bytes()
        h.update(f"{path.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _base() -> dict[str, Any]:
    """What the library's code depends on, the compiler aside: the sources,
    the flags and the Python ABI. Every record holds these."""
    return {"sources": sources_digest(), "flags": list(_FLAGS), "abi": SUFFIX}


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _base_key(base: dict[str, Any]) -> str:
    """The name of the index entry for ``base`` (no compiler in it)."""
    return _digest(base["sources"], " ".join(base["flags"]), base["abi"])


def _cache_key(base: dict[str, Any], compiler: str) -> str:
    """The name of the cache directory for ``base`` built by ``compiler``."""
    return _digest(_base_key(base), compiler)


def compiler_identity(cc: str) -> str:
    """The compiler as the cache key names it: its resolved path and the
    first line of its ``--version`` (``/usr/bin/x86_64-linux-gnu-gcc-12: cc
    (Debian 12.2.0-14) 12.2.0``), so that an upgrade, or another host's
    compiler on a shared cache, is another key."""
    try:
        done = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30.0, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"cannot run {cc!r} --version: {exc}") from exc
    first = (done.stdout.strip() or done.stderr.strip() or "no version").splitlines()[0]
    return f"{os.path.realpath(cc)}: {first.strip()}"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record_path(library: Path) -> Path:
    """Where ``library``'s record is: beside it, named after it (so that two
    Pythons' builds in one source tree keep one record each)."""
    return library.with_name(library.name + ".json")


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Write ``value`` to ``path`` atomically: a reader sees the old file or
    the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _untrusted(library: Path, base: dict[str, Any]) -> str | None:
    """Why ``library`` must not be loaded for ``base``, or ``None``: it and
    its record must exist, the record must name ``base``'s sources, flags
    and ABI, and the library's sha256 must be the one recorded."""
    if not library.is_file():
        return f"no library at {str(library)!r}"
    try:
        record = json.loads(_record_path(library).read_text())
        if not isinstance(record, dict):
            raise ValueError("not an object")
    except (OSError, ValueError) as exc:
        return f"no record of its build ({_record_path(library).name}: {exc})"
    changed = [name for name in ("sources", "flags", "abi") if record.get(name) != base[name]]
    if changed:
        return f"built from other {', '.join(changed)} than these"
    actual = _sha256(library)
    if actual != record.get("sha256"):
        return (
            f"its sha256 is {actual[:16]}…, not the {str(record.get('sha256'))[:16]}… "
            "recorded when it was built: it changed since"
        )
    return None


def _compile(cc: str, compiler: str, output: Path) -> dict[str, Any]:
    """Compile the kernels with ``cc`` (whose :func:`compiler_identity` is
    ``compiler``) and :data:`_FLAGS` into ``output``; the record of the build
    (:func:`_base`, the compiler and the library's sha256)."""
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise Unavailable(f"no Python headers (Python.h not in {include!r})", remedy=TO_GET_THEM)
    units = [str(p) for p in SOURCES if p.suffix == ".c"]
    command = [cc, *_FLAGS, f"-I{include}", *units, "-o", str(output)]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False
        )
    except OSError as exc:
        raise Unavailable(f"cannot run {cc!r}: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(f"building {SOURCE.name} took over {_BUILD_TIMEOUT_S:.0f} s") from exc
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise Unavailable(
            f"building {SOURCE.name} failed: {' / '.join(tail)}",
            remedy="fix what the compiler reports, or name another compiler in $CC",
        )
    return {**_base(), "compiler": compiler, "sha256": _sha256(output)}


# --- the installed extension --------------------------------------------------------


def build_installed(target: Path) -> Path:
    """Build the installed extension into ``target`` (setup.py's build_ext
    calls this, with ``$CC`` else ``cc`` as at run time), then its record
    beside it; returns the record's path. Raises :class:`Unavailable`."""
    cc = _compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        record = _compile(cc, compiler_identity(cc), built)
        os.replace(built, target)
    _write_json(_record_path(target), record)
    return _record_path(target)


def _installed() -> Path | None:
    """The installed extension where it was built from these sources with
    these flags and is unchanged since; else ``None``, saying why at INFO."""
    if not INSTALLED.is_file():
        return None
    why = _untrusted(INSTALLED, _base())
    if why is not None:
        logger.info("the installed native CPU kernels are not used (%s): using the cache", why)
        return None
    logger.info("native CPU kernels: the installed extension %s", INSTALLED)
    return INSTALLED


# --- the cache ----------------------------------------------------------------------


def _private_dir(path: Path) -> None:
    """Create ``path`` with mode 0700 unless it exists, then refuse it unless
    it is a directory this user owns that neither its group nor everyone may
    write: a library loaded from a directory others can write is code they
    chose."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.stat()
    except OSError as exc:
        raise Unavailable(f"cannot create {str(path)!r}: {exc}") from exc
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        problem = "it is not a directory"
    elif st.st_uid != os.geteuid():
        problem = f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"its group or everyone may write it (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem is not None:
        raise Unavailable(
            f"refused the kernels' cache directory {str(path)!r}: {problem}",
            remedy=f"remove {str(path)!r} (trioserve recreates it with mode 0700)",
        )


def _cached() -> Path:
    """The cache's library for this compiler, built now where there is
    none, or, without a compiler, the last one built from these sources;
    raises :class:`Unavailable` (a refusal says why and how to recover)."""
    root = cache_dir()
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Unavailable(f"cannot create {str(root.parent)!r}: {exc}") from exc
    _private_dir(root)
    base = _base()
    index = root / f"{_base_key(base)}.json"
    try:
        cc = _compiler()
    except Unavailable:
        # No compiler: the library that the last build from these sources,
        # flags and ABI made, whichever compiler made it.
        found = _indexed(root, index, base)
        if found is None:
            raise
        return found
    compiler = compiler_identity(cc)
    where = root / _cache_key(base, compiler)
    library = where / (_MODULE + SUFFIX)
    if where.exists():
        _checked(where, library, base)
        logger.info("native CPU kernels: built into the cache at %s (by %s)", library, compiler)
    else:
        _build_into(cc, compiler, root, where, library)
    _remember(index, {"dir": where.name, "compiler": compiler})
    return library


def _remember(index: Path, entry: dict[str, str]) -> None:
    """Point ``index`` at this build, for a restart without a compiler
    (which loads it only after the same checks). Not fatal where it fails:
    only such a restart needs it."""
    try:
        if json.loads(index.read_text()) == entry:
            return
    except (OSError, ValueError):
        pass
    try:
        _write_json(index, entry)
    except OSError as exc:
        logger.info(
            "cannot write %s (a restart without a compiler will not find this build): %s",
            index,
            exc,
        )


def _indexed(root: Path, index: Path, base: dict[str, Any]) -> Path | None:
    """The library ``index`` names, checked, or ``None`` where there is no index."""
    try:
        entry = json.loads(index.read_text())
        name = str(entry["dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    where = root / name
    if where.parent != root or not where.is_dir():
        return None
    library = where / (_MODULE + SUFFIX)
    _checked(where, library, base)
    logger.info(
        "native CPU kernels: built into the cache at %s (by %s; no compiler now)",
        library,
        entry.get("compiler", "?"),
    )
    return library


def _checked(where: Path, library: Path, base: dict[str, Any]) -> None:
    """Refuse ``library`` unless its directory is private and it is the
    library recorded there for ``base``."""
    _private_dir(where)
    why = _untrusted(library, base)
    if why is not None:
        raise Unavailable(
            f"refused {str(library)!r}: {why}",
            remedy=f"remove {str(where)!r} to have it rebuilt",
        )


def _build_into(cc: str, compiler: str, root: Path, where: Path, library: Path) -> None:
    """Build into a private temporary directory, record the build there,
    then rename the directory to ``where``: the library and its record
    appear together or not at all. Where a concurrent start got there first,
    its build is checked and used instead."""
    try:
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))  # mode 0700
    except OSError as exc:
        raise Unavailable(f"cannot build into {str(root)!r}: {exc}") from exc
    try:
        record = _compile(cc, compiler, tmp / library.name)
        _write_json(_record_path(tmp / library.name), record)
        try:
            os.rename(tmp, where)
        except OSError:
            if not where.is_dir():
                raise
            _checked(where, library, record)  # the other start's build
            logger.info("native CPU kernels: built into the cache at %s", library)
            return
    except OSError as exc:
        raise Unavailable(f"cannot build into {str(root)!r}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built the native CPU kernels into %s", library)
