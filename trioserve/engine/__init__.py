"""Engines: the Engine protocol, its backends, and a loader by name.

Backends are imported lazily: ``cpu`` pulls in torch, ``exllamav2`` pulls in
ExLlamaV2 (which needs CUDA), and neither is needed to use the other.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import attrs

from ..errors import ConfigError, EngineError
from ..vocabulary.results import Failed, Finished, FinishReason, TextUpdate, Update
from ..vocabulary.sampling import SamplingSettings
from .base import Engine, EngineInfo, GenerationSpec
from .cpu.options import CPU_KERNELS, KV_CACHE_DTYPES, PROJECTIONS, WEIGHT_MODES, CpuOptions
from .cpu.speculative import DEFAULT_DRAFT_TOKENS, SPECULATIVE_MODES, SpeculativeMode

__all__ = [
    "CPU_KERNELS",
    "ENGINE_NAMES",
    "KV_CACHE_DTYPES",
    "SPECULATIVE_MODES",
    "VOCAB_PROJECTIONS",
    "WEIGHT_MODES",
    "CpuOptions",
    "Engine",
    "EngineInfo",
    "EngineOptions",
    "Failed",
    "FinishReason",
    "Finished",
    "GenerationSpec",
    "SamplingSettings",
    "TextUpdate",
    "Update",
    "load_engine",
]

log = logging.getLogger("trioserve.engine")

EngineName = Literal["auto", "cpu", "exllamav2"]
ENGINE_NAMES: tuple[EngineName, ...] = ("auto", "cpu", "exllamav2")
CACHE_TYPES = ("fp16", "q4", "q6", "q8")
#: What the CPU engine's vocabulary projection may run on.
VOCAB_PROJECTIONS = PROJECTIONS


@attrs.frozen(kw_only=True)
class EngineOptions:
    """How to build an engine; the command line maps onto this one to one.

    The CPU engine's options are :class:`~trioserve.engine.cpu.options.CpuOptions`'
    fields, under the same names and with the same defaults, and are checked
    there (:meth:`cpu`); the rest are the choice of engine and ExLlamaV2's.
    """

    engine: EngineName = "auto"
    #: A Hugging Face model directory; None serves the embedded SmolLM2.
    model: Path | None = None
    #: A folder of models served by name, loaded on demand (instead of ``model``).
    models_dir: Path | None = None
    #: A TOML file of per-model options for ``models_dir``'s models.
    models_preset: Path | None = None
    #: Lowers the model's context length (None keeps the model's).
    context_length: int | None = None
    #: Jobs generated together; None picks the backend's default.
    max_batch: int | None = None
    #: Never download the embedded model; fail with instructions instead.
    offline: bool = False
    # The CPU engine's (CpuOptions documents each).
    dtype: str = "bfloat16"
    device: str = "cpu"
    threads: int | None = None
    weights: str = "auto"
    vocab_projection: str = "auto"
    cpu_kernels: str = "auto"
    prefix_cache_mib: int = 128
    prefill_share: float = 0.5
    speculative: SpeculativeMode = "off"
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    #: The KV cache's elements: ``auto`` the model's (the CPU engine's dtype;
    #: ExLlamaV2: as ``cache_type``), ``int8`` 8 bits (the CPU engine: one
    #: bfloat16 scale per head and position; ExLlamaV2: its Q8 cache where
    #: ``cache_type`` is fp16, see :attr:`exllamav2_cache_type`).
    kv_cache_dtype: str = "auto"
    #: ExLlamaV2 engine: cache type and size (tokens, a multiple of 256),
    #: GPU split in GB per device (None = autosplit), tensor parallel.
    cache_type: str = "fp16"
    cache_size: int | None = None
    gpu_split: tuple[float, ...] | None = None
    tensor_parallel: bool = False

    def __attrs_post_init__(self) -> None:
        if self.engine not in ENGINE_NAMES:
            raise ConfigError(f"engine must be one of {ENGINE_NAMES}, got {self.engine!r}")
        if self.cache_type not in CACHE_TYPES:
            raise ConfigError(f"cache type must be one of {CACHE_TYPES}, got {self.cache_type!r}")
        if self.cache_size is not None and (self.cache_size <= 0 or self.cache_size % 256):
            raise ConfigError(
                f"cache size must be a positive multiple of 256, got {self.cache_size!r}"
            )
        # context_length, max_batch and the CPU engine's options: their
        # checks are declared once, in CpuOptions.
        self.cpu()

    def cpu(self) -> CpuOptions:
        """The CPU engine's options (``max_batch`` None: its default).

        Raises:
            ConfigError: one of them is invalid, alone or with the others.
        """
        names = [f.name for f in attrs.fields(CpuOptions) if f.name != "max_batch"]
        given = {name: getattr(self, name) for name in names}
        if self.max_batch is not None:
            given["max_batch"] = self.max_batch
        return CpuOptions(**given)

    @property
    def exllamav2_cache_type(self) -> str:
        """ExLlamaV2's cache type: ``cache_type``, except that ``kv_cache_dtype``
        int8 makes its default, fp16, ``q8`` (``ExLlamaV2Cache_Q8``); a
        quantized ``cache_type`` is ExLlamaV2's own choice and stays."""
        if self.kv_cache_dtype == "int8" and self.cache_type == "fp16":
            return "q8"
        return self.cache_type


def choose_engine(name: EngineName) -> tuple[Literal["cpu", "exllamav2"], str]:
    """Resolve ``auto``: ExLlamaV2 when it imports and CUDA is present, else CPU.

    Returns the backend and the reason, for the log.
    """
    if name == "cpu":
        return "cpu", "asked for"
    if name == "exllamav2":
        return "exllamav2", "asked for"
    from .exllamav2.engine import probe_exllamav2

    usable, reason = probe_exllamav2()
    if usable:
        return "exllamav2", reason
    return "cpu", f"exllamav2 is not usable: {reason}"


def load_engine(options: EngineOptions) -> Engine:
    """Build the engine that ``options`` describe (blocking: loads a model).

    Raises :class:`~trioserve.errors.ModelError` when the model cannot be had,
    :class:`~trioserve.errors.EngineError` when the backend cannot run.
    """
    backend, reason = choose_engine(options.engine)
    log.info("engine: %s (%s)", backend, reason)
    if backend == "cpu":
        from .cpu.engine import CpuEngine

        return CpuEngine.load(options.model, options.cpu())
    from .exllamav2.engine import ExLlamaV2Engine, probe_exllamav2

    if options.engine == "exllamav2":
        usable, why = probe_exllamav2()
        if not usable:
            raise EngineError(f"the exllamav2 engine cannot run here: {why}")
    model = options.model
    if model is None:
        from .models import default_model_dir

        model = default_model_dir(offline=options.offline)
    return ExLlamaV2Engine.load(
        model,
        cache_type=options.exllamav2_cache_type,
        cache_size=options.cache_size,
        max_batch=options.max_batch or 32,
        context_length=options.context_length,
        gpu_split=options.gpu_split,
        tensor_parallel=options.tensor_parallel,
    )
