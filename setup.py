"""Builds trioserve's native CPU kernels at install time, as an optional
extension (pyproject.toml holds everything else about the package).

``pip install .`` and ``pip install -e .`` compile kernels.c once, with the
compiler and the flags that a build on first use would take
(:func:`trioserve.engine.cpu.native_build.build_installed`: ``$CC``, else
``cc``), into ``trioserve/engine/cpu/_trioserve_cpu<ABI tag>.so`` and a record
beside it (``<that file>.json``: the sources' sha256, the flags, the compiler,
the library's sha256), by which trioserve knows at run time whether the
extension was built from the sources it has.

A machine without a compiler or without Python's headers still installs: the
build is skipped with a warning saying what that loses and how to get it back
(trioserve then builds the kernels on first use where a compiler turns up,
and otherwise runs on torch's operators). Off x86-64 and ARM64 Linux nothing
is built.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
PACKAGE = Path("trioserve", "engine", "cpu")
#: A free-threaded CPython (no stable ABI: the kernels are built for it alone).
FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def _native_build() -> ModuleType:
    """trioserve/engine/cpu/native_build.py, loaded by its path: importing
    trioserve would need its dependencies, which an isolated build does not
    have (the module itself imports only the standard library)."""
    path = HERE / PACKAGE / "native_build.py"
    spec = importlib.util.spec_from_file_location("_trioserve_native_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _warn(reason: str, native: ModuleType) -> None:
    """Say, loudly, that the kernels were not built, what is lost and how to
    get them: on the build's stderr, and on the terminal where there is one.
    pip shows a successful build's output only with ``-v`` (a build backend
    has no other channel to the user), so the terminal is where an
    interactive ``pip install`` shows it; trioserve's startup log says it
    again either way."""
    rule = "=" * 78
    text = (
        f"\n{rule}\n"
        f"WARNING: trioserve's native CPU kernels were not built: {reason}.\n"
        f"trioserve installs and runs without them, but {native.LOST}.\n"
        f"To get them: {native.TO_GET_THEM}.\n"
        f"{rule}\n"
    )
    print(text, file=sys.stderr, flush=True)
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(text)
    except OSError:
        pass  # no terminal (CI, a container build): the build log has it


class BuildKernels(build_ext):
    """Builds the kernels with native_build's own build (the same compiler,
    flags and record as the cache's), never failing the install."""

    def build_extension(self, ext: Extension) -> None:
        native = _native_build()
        if sys.platform != "linux" or platform.machine().lower() not in native.MACHINES:
            print(
                "trioserve: the native CPU kernels are for x86-64 and ARM64 Linux only; none built",
                file=sys.stderr,
            )
            return
        target = Path(self.get_ext_fullpath(ext.name))
        # What an earlier build left in the build directory (which pip keeps
        # in the source tree) must not ship as this build's.
        target.unlink(missing_ok=True)
        Path(f"{target}.json").unlink(missing_ok=True)
        try:
            record = native.build_installed(target)
        except native.Unavailable as exc:
            _warn(str(exc), native)
        except Exception as exc:  # a failed build must not fail the install
            _warn(f"{type(exc).__name__}: {exc}", native)
        else:
            print(f"trioserve: built the native CPU kernels ({record})", file=sys.stderr)

    def copy_extensions_to_source(self) -> None:
        """An editable install: the record goes into the source tree with
        the library it describes."""
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace, built = self._get_inplace_equivalent(build_py, ext)
            if os.path.exists(built + ".json"):
                self.copy_file(built + ".json", inplace + ".json", level=self.verbose)


setup(
    ext_modules=[
        Extension(
            "trioserve.engine.cpu._trioserve_cpu",
            # kernels.c and one file per instruction-set path, built together.
            sources=sorted(str(p.relative_to(HERE)) for p in (HERE / PACKAGE).glob("kernels*.c")),
            depends=sorted(str(p.relative_to(HERE)) for p in (HERE / PACKAGE).glob("kernels*.h")),
            optional=True,
            # CPython's stable ABI (kernels.c sets Py_LIMITED_API): one
            # library for every Python version from 3.11 on. A free-threaded
            # CPython has none: there the library is its own.
            py_limited_api=not FREE_THREADED,
        )
    ],
    cmdclass={"build_ext": BuildKernels},
    # A wheel built here installs on any CPython from 3.11 on.
    options={} if FREE_THREADED else {"bdist_wheel": {"py_limited_api": "cp311"}},
)
