"""Freed heap memory handed back to the system."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util

__all__ = ["give_back_freed_memory"]


def give_back_freed_memory() -> None:
    """Return the heap the process freed to the OS (glibc's ``malloc_trim``);
    elsewhere than glibc this does nothing.

    glibc keeps freed memory for later: loading a model frees hundreds of MB
    of temporaries (reading, quantizing and packing the weights), and an
    unloaded model frees all it held, yet the process's RSS would stay
    (measured: 470 and 613 MiB resident after two identical loads). No
    ``gc.collect()`` here: a full collection holds the GIL for tens of
    milliseconds, stalling the models that serve meanwhile.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(ctypes.c_size_t(0))
