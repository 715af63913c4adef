"""A weight kept in a file and mapped, instead of in the heap: the bfloat16
token-embedding table of a quantized model.

With the layers and the vocabulary projection quantized, the bfloat16
embedding table (54 MiB for SmolLM2's 49,152 x 576) is read only a few rows
at a time: one per token fed, the candidates the float32 refinement of
near-ties recomputes (:func:`trioserve.engine.cpu.llama.logits`), the ids whose
log probabilities are asked for. Mapped from a file, only the pages of rows
read are resident, and they are clean pages the kernel can drop and read
again, not heap: the server's RSS after load falls by about the table's
size (docs/performance.md, "The 8-bit vocabulary projection").

The file is written once beside the model's other converted files (the
bfloat16 values exactly as loaded, so nothing computed changes) and checked
against them when mapped; where it cannot be written (a read-only model
directory) or read back equal, the table stays in memory, as before.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["file_backed"]

log = logging.getLogger(__name__)


def file_backed(path: Path, tensor: Tensor) -> Tensor:
    """``tensor`` (a contiguous CPU tensor), or the same values mapped from
    ``path`` (written there first when missing or not holding them); never
    raises for a file it cannot use."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return tensor
    for attempt in range(2):
        try:
            if attempt or not path.is_file() or path.stat().st_size != _nbytes(tensor):
                _write(path, tensor)
            mapped = _mapped(path, tensor)
        except OSError as exc:
            log.info("kept the %s table in memory: %s", path.name, exc)
            return tensor
        if mapped is not None:
            return mapped
    log.warning("%s does not hold the table's values: kept in memory", path)
    return tensor


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _write(path: Path, tensor: Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".{os.getpid()}.partial")
    with open(partial, "wb") as f:
        f.write(tensor.view(torch.uint8).reshape(-1).numpy().tobytes())
    os.replace(partial, path)  # atomic: a concurrent writer's file is the same


def _mapped(path: Path, tensor: Tensor) -> Tensor | None:
    """The file's values as a tensor over a private mapping, or None where they
    are not ``tensor``'s."""
    with open(path, "rb") as f:
        # Private and writable (copy on write): a write never reaches the
        # file; torch wants a writable buffer.
        mapping = mmap.mmap(
            f.fileno(),
            _nbytes(tensor),
            flags=mmap.MAP_PRIVATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
    mapped = torch.frombuffer(mapping, dtype=tensor.dtype, count=tensor.numel()).view(tensor.shape)
    same = torch.equal(mapped, tensor)
    # Reading it back made every page resident: let them go (a row read later
    # is read from the file again).
    with contextlib.suppress(OSError, ValueError):
        mapping.madvise(mmap.MADV_DONTNEED)
    return mapped if same else None
