"""The CPU engine: trioserve's own Llama implementation on torch, with native
kernels where the CPU has AVX-512.

- :mod:`.engine`: :class:`CpuEngine`, the :class:`~trioserve.engine.base.Engine`
  (loading, the step, admission, the prefix cache);
- :mod:`.jobs`, :mod:`.plan`: a job's state and sampling, and each step's plan
  (pure: which prompts prefill, which jobs decode);
- :mod:`.llama`, :mod:`.attention`, :mod:`.kvcache`: the model, its attention
  and its paged KV cache;
- :mod:`.quant`, :mod:`.native` (C source: ``kernels.c``), :mod:`.mapped`: the
  4-bit and 8-bit weights, the native kernels, file-mapped tables;
- :mod:`.prefix`, :mod:`.speculative`, :mod:`.logprobs`, :mod:`.contention`:
  the prefix cache, prompt-lookup drafts, log probabilities, the busy-cores hint.

Importing this package imports no torch: ``CpuEngine`` and
``CpuEngineStatistics`` are loaded on first use, so that the pure modules
(:mod:`.plan`, :mod:`.speculative`) stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import CpuEngine, CpuEngineStatistics

__all__ = ["CpuEngine", "CpuEngineStatistics"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".engine", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
