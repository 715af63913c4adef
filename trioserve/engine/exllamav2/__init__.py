"""The ExLlamaV2 engine: trioserve's Engine protocol over ExLlamaV2's dynamic
generator, on NVIDIA GPUs.

- :mod:`.engine`: :class:`ExLlamaV2Engine` and :func:`probe_exllamav2`;
- :mod:`.jobs`: a :class:`~trioserve.engine.base.GenerationSpec` as an
  ExLlamaV2 job, and the generator's results as typed updates;
- :mod:`.plan`: the load plan (pure: options in, what to build out);
- :mod:`.filter`: constraints as an ExLlamaV2 filter over llguidance;
- :mod:`.build`: building ExLlamaV2's extension without a stale lock.

Importing this package imports neither torch nor ExLlamaV2: the engine's names
are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import ExLlamaV2Engine, probe_exllamav2

__all__ = ["ExLlamaV2Engine", "probe_exllamav2"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".engine", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
