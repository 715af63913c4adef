"""Build (or find) ExLlamaV2's C++/CUDA extension, with the whole log and nothing left locked.

``import exllamav2`` compiles ``exllamav2_ext`` on first use through
``torch.utils.cpp_extension.load`` (ninja + nvcc), silently unless the build
fails. This script does that import on purpose, so that the build is a step
of its own, and:

* forces the build to be verbose (``load`` is wrapped before exllamav2 imports
  it), so every compiler command and message reaches stdout, not only a
  failure's tail;
* removes the build directory's ``lock`` left by an earlier build that was
  killed (torch waits on that file forever, so every later import would
  hang); a build interrupted with SIGINT (``timeout -s INT``) releases it
  itself, through ``load``'s ``finally``;
* prints each compile's seconds from ninja's log, the slowest first;
* with ``--copy-to DIR``, copies the built module there as ``exllamav2_ext.so``:
  a directory on ``PYTHONPATH`` holding it makes ``import exllamav2_ext``
  succeed, and exllamav2 then skips its build (the device check's fallback).

Exit status: 0 when ``import exllamav2.generator`` works, 1 when it does not.
It needs a CUDA build of torch and nvcc, not a GPU. ``--env`` prints the
environment the build needs (:func:`build_environment`), to be set for the
build and for every later import. Usage::

    python tests/gpu/build_exllamav2.py --env [--link-dir DIR]
    env $(python tests/gpu/build_exllamav2.py --env) python tests/gpu/build_exllamav2.py
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

EXTENSION = "exllamav2_ext"


def _build_dir() -> Path | None:
    """Where torch builds the extension, or None when torch says nothing."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(EXTENSION, False))


def _ninja_times(build_dir: Path) -> list[tuple[float, str]]:
    """(seconds, output) of each step in ninja's log, the slowest first."""
    log = build_dir / ".ninja_log"
    if not log.exists():
        return []
    times: dict[str, float] = {}
    for line in log.read_text().splitlines():
        fields = line.split("\t")
        # "# ninja log v5" header, then start_ms, end_ms, mtime, output, hash.
        if len(fields) >= 4 and fields[0].isdigit() and fields[1].isdigit():
            times[fields[3]] = (int(fields[1]) - int(fields[0])) / 1000
    return sorted(((s, out) for out, s in times.items()), reverse=True)


#: Headers torch's CUDA headers include that a bare toolkit may lack.
_LIBRARY_HEADERS = ("cublas_v2.h", "cusparse.h", "cusolverDn.h", "curand.h")


def _torch_cuda_lib_dir(home: str) -> str:
    """The directory torch's extension link searches for ``-lcudart``:
    ``$CUDA_HOME/lib64``, or ``lib`` when only that exists
    (``torch.utils.cpp_extension._prepare_ldflags``)."""
    lib64, lib = os.path.join(home, "lib64"), os.path.join(home, "lib")
    return lib if not os.path.exists(lib64) and os.path.exists(lib) else lib64


def find_cudart(home: str) -> str | None:
    """A CUDA runtime library to link against, versioned names too: the
    toolkit's own first, then the nvidia-* packages' (torch's)."""
    import glob
    import site

    import torch

    dirs = [os.path.join(home, "lib64"), os.path.join(home, "lib")]
    dirs += sorted(glob.glob(os.path.join(home, "targets", "*", "lib")))
    for packages in site.getsitepackages():
        dirs += sorted(glob.glob(os.path.join(packages, "nvidia", "**", "lib"), recursive=True))
    major = (torch.version.cuda or "").split(".")[0]
    found = [f for d in dirs for f in sorted(glob.glob(os.path.join(d, "libcudart.so*")))]
    # The runtime torch was built for (libcudart.so.13 for CUDA 13) first.
    found.sort(key=lambda f: not (major and f.endswith(f".so.{major}")))
    return found[0] if found else None


def build_environment(link_dir: Path | None = None) -> dict[str, str]:
    """``CUDA_HOME``, ``CPLUS_INCLUDE_PATH`` and ``LIBRARY_PATH`` for building
    the extension here.

    torch takes ``CUDA_HOME`` from the environment, else two directories above
    ``nvcc``, which is wrong when ``nvcc`` is a wrapper script (this project's
    development machine has one in /usr/local/bin): the first directory with
    both ``bin/nvcc`` and ``include/cuda_runtime.h`` wins. Library headers
    the toolkit lacks come from the nvidia-* packages torch installs, through
    ``CPLUS_INCLUDE_PATH``, which gcc searches after every ``-isystem``
    directory, so the toolkit's own headers always come first (``CPATH``
    would put the packages' ``cuda_runtime.h`` before the toolkit's).

    The same environment must be set wherever exllamav2 is imported later:
    torch compares the build's commands, in which ``CUDA_HOME`` appears, and
    compiles again when they differ. So must the same ``ninja`` be first on
    ``PATH``: the pip-installed one of a virtual environment (1.13, log v7)
    and an older system one (1.11) cannot read each other's log, and either
    then compiles everything again.

    The link takes ``-lcudart`` from ``$CUDA_HOME/lib64`` (or ``lib``), which
    needs an unversioned ``libcudart.so`` there. A toolkit from pip's CUDA
    packages may have none (no ``lib64``, only ``libcudart.so.13``), and the
    link then fails after every compile finished. In that case, with
    ``link_dir``, a ``libcudart.so`` link to the runtime :func:`find_cudart`
    finds is made in ``link_dir``, and ``LIBRARY_PATH`` (which gcc searches
    after every ``-L``) names it; ``LIBCUDART`` says which file it is.
    ``LIBRARY_PATH`` is not part of the build's commands, so setting it does
    not make torch compile again.
    """
    import glob
    import site

    from torch.utils.cpp_extension import CUDA_HOME

    candidates = [os.environ.get("CUDA_HOME"), CUDA_HOME, "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    home = next(
        (
            c
            for c in candidates
            if c
            and os.path.isfile(os.path.join(c, "bin", "nvcc"))
            and os.path.isfile(os.path.join(c, "include", "cuda_runtime.h"))
        ),
        None,
    )
    env: dict[str, str] = {}
    if home is None:
        return env
    env["CUDA_HOME"] = home
    missing = [h for h in _LIBRARY_HEADERS if not os.path.isfile(os.path.join(home, "include", h))]
    dirs = sorted(
        {
            os.path.dirname(found)
            for packages in site.getsitepackages()
            for header in missing
            for found in glob.glob(os.path.join(packages, "nvidia", "**", header), recursive=True)
        }
    )
    if dirs:
        env["CPLUS_INCLUDE_PATH"] = ":".join(
            [*dirs, *filter(None, [os.environ.get("CPLUS_INCLUDE_PATH")])]
        )
    if not os.path.isfile(os.path.join(_torch_cuda_lib_dir(home), "libcudart.so")):
        cudart = find_cudart(home)
        env["LIBCUDART"] = cudart or ""
        if cudart is None:
            print(
                f"build_exllamav2: no libcudart under {home} or the nvidia packages: "
                "the extension's link will fail",
                file=sys.stderr,
            )
        elif link_dir is not None:
            link_dir.mkdir(parents=True, exist_ok=True)
            link = link_dir / "libcudart.so"
            link.unlink(missing_ok=True)
            link.symlink_to(cudart)
            env["LIBRARY_PATH"] = ":".join(
                [str(link_dir), *filter(None, [os.environ.get("LIBRARY_PATH")])]
            )
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--copy-to", type=Path, default=None, help="copy the built module here")
    parser.add_argument(
        "--env",
        action="store_true",
        help="print the build environment (KEY=VALUE lines) and build nothing",
    )
    parser.add_argument(
        "--link-dir",
        type=Path,
        default=None,
        help="with --env: where to link a libcudart.so when CUDA_HOME has none",
    )
    args = parser.parse_args(argv)
    if args.env:
        for key, value in build_environment(args.link_dir).items():
            print(f"{key}={value}")
        return 0

    import torch
    import torch.utils.cpp_extension as cpp_extension

    print(
        f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"CUDA_HOME {cpp_extension.CUDA_HOME}, TORCH_CUDA_ARCH_LIST "
        f"{os.environ.get('TORCH_CUDA_ARCH_LIST')!r}, MAX_JOBS {os.environ.get('MAX_JOBS')!r}",
        flush=True,
    )
    build_dir = _build_dir()
    print(f"build directory: {build_dir}", flush=True)
    if build_dir is not None:
        lock = build_dir / "lock"
        if lock.exists():
            # Only a build that was killed leaves it: nothing else builds here now.
            print(f"removing a stale lock left by a killed build: {lock}", flush=True)
            lock.unlink()

    original = cpp_extension.load

    @functools.wraps(original)
    def verbose_load(*load_args: Any, **load_kwargs: Any) -> Any:
        load_kwargs["verbose"] = True
        return original(*load_args, **load_kwargs)

    # exllamav2/ext.py does `from torch.utils.cpp_extension import load` when
    # imported, so it takes this one.
    cpp_extension.load = verbose_load
    started = time.monotonic()
    try:
        import exllamav2
        import exllamav2.generator  # the generator loads more of the extension
        from exllamav2.ext import exllamav2_ext as ext
    except BaseException:
        print(f"IMPORT FAILED after {time.monotonic() - started:.1f} s:", flush=True)
        traceback.print_exc(file=sys.stdout)
        return 1
    finally:
        cpp_extension.load = original
        if build_dir is not None:
            times = _ninja_times(build_dir)
            if times:
                print(f"ninja: {len(times)} steps, {sum(s for s, _ in times):.0f} s of work:")
                for seconds, output in times:
                    print(f"  {seconds:7.1f} s  {output}")
    elapsed = time.monotonic() - started
    where = getattr(ext, "__file__", "?")
    print(f"import exllamav2 {exllamav2.__version__} OK in {elapsed:.1f} s; module {where}")
    if args.copy_to is not None:
        args.copy_to.mkdir(parents=True, exist_ok=True)
        target = args.copy_to / f"{EXTENSION}.so"
        shutil.copyfile(where, target)
        print(f"copied to {target} ({target.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
