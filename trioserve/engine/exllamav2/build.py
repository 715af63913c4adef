"""torch's JIT build of ExLlamaV2's extension, as the probe sees it: where its
lock file is, and a bounded wait for it to go.

``import exllamav2`` without a prebuilt ``exllamav2_ext`` compiles the
extension through ``torch.utils.cpp_extension.load``, which waits on a lock
file with no timeout; :func:`~trioserve.engine.exllamav2.engine.probe_exllamav2`
waits for it here with one. Nothing here imports ``exllamav2``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Final

__all__ = ["BUILD_LOCK_WAIT", "build_lock", "wait_for_build_lock"]

log = logging.getLogger("trioserve.engine")

#: Seconds :func:`~trioserve.engine.exllamav2.engine.probe_exllamav2` waits for
#: torch's build lock of ExLlamaV2's extension to go before it gives up on
#: ExLlamaV2 (a build in another process may be finishing; a killed build's
#: lock never goes).
BUILD_LOCK_WAIT: Final = 30.0


def build_lock() -> Path | None:
    """The lock file torch's JIT build of ``exllamav2_ext`` would wait on, or
    None when the import builds nothing (exllamav2 is not installed, or a
    prebuilt ``exllamav2_ext`` module is importable: exllamav2/ext.py then
    imports it and never calls torch's ``load``)."""
    import importlib.util

    try:
        if importlib.util.find_spec("exllamav2") is None:
            return None
        if importlib.util.find_spec("exllamav2_ext") is not None:
            return None
        # Where torch.utils.cpp_extension.load builds exllamav2/ext.py's
        # extension (``name="exllamav2_ext"``, no build_directory): the same
        # function and arguments. Private, hence the broad except: a torch
        # that moved it makes the probe import without waiting, as before.
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory("exllamav2_ext", False)) / "lock"
    except Exception:
        log.debug("could not find torch's build directory for exllamav2_ext", exc_info=True)
        return None


def wait_for_build_lock(lock: Path, wait: float, *, poll: float = 0.25) -> str | None:
    """Wait up to ``wait`` seconds for the build lock ``lock`` to go.

    Returns None when it is not there (or went), else why the import is not
    tried. Never deletes it: a build in another process may still hold it.
    """
    deadline = time.monotonic() + wait
    while lock.exists():
        if time.monotonic() >= deadline:
            return (
                f"torch's build lock {str(lock)!r} has been held for {wait:.0f} s: "
                "another process is building exllamav2's extension, or a build "
                "killed half-way left it (torch would wait on it for ever); "
                "delete it if no build is running"
            )
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
    return None
