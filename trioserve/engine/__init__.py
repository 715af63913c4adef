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
from .base import (
    CPU_KERNELS,
    KV_CACHE_DTYPES,
    PROJECTIONS,
    WEIGHT_MODES,
    Engine,
    EngineInfo,
    GenerationSpec,
)
from .cpu.speculative import DEFAULT_DRAFT_TOKENS, SPECULATIVE_MODES, SpeculativeMode

__all__ = [
    "CPU_KERNELS",
    "ENGINE_NAMES",
    "KV_CACHE_DTYPES",
    "SPECULATIVE_MODES",
    "VOCAB_PROJECTIONS",
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
    """How to build an engine; the command line maps onto this one to one."""

    engine: EngineName = "auto"
    #: A Hugging Face model directory; None serves the embedded SmolLM2.
    model: Path | None = None
    #: CPU engine: torch dtype name and device.
    dtype: str = "bfloat16"
    device: str = "cpu"
    #: Lowers the model's context length (None keeps the model's).
    context_length: int | None = None
    #: Jobs generated together; None picks the backend's default.
    max_batch: int | None = None
    #: Never download the embedded model; fail with instructions instead.
    offline: bool = False
    #: CPU engine: torch threads (None keeps torch's default).
    threads: int | None = None
    #: CPU engine: what the linear layers run on: ``auto`` (the model's own
    #: 4-bit weights where it has them and the kernel is exact enough, else
    #: bfloat16), ``float`` (the dtype), ``q4`` or ``int8``.
    weights: str = "auto"
    #: CPU engine: what the vocabulary projection runs on: ``auto`` (8 bits
    #: per weight when the linear layers are quantized, else bfloat16),
    #: ``bfloat16`` or ``int8``.
    vocab_projection: str = "auto"
    #: CPU engine: the kernel 4-bit layers run on: ``auto`` (trioserve's own,
    #: 8-bit activations and integer dot products, where it builds and passes
    #: its probe; else torch's), ``native`` (trioserve's, or an error saying
    #: why not) or ``torch``.
    cpu_kernels: str = "auto"
    #: CPU engine: memory for the prefix cache of finished prompts, in MiB
    #: (0 turns it off).
    prefix_cache_mib: int = 128
    #: CPU engine: while jobs decode, the share of the engine's time that
    #: prompts' prefill may take (0 < share <= 1).
    prefill_share: float = 0.5
    #: CPU engine: speculative decoding, ``off`` or ``ngram`` (drafts looked
    #: up in the job's own context; the output is the same either way; off by
    #: default: with two threads it cost a story 15 %, docs/performance.md),
    #: and the drafts fed per job and step, at most.
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
        if self.context_length is not None and self.context_length < 2:
            raise ConfigError(f"context length must be >= 2, got {self.context_length!r}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError(f"max batch must be >= 1, got {self.max_batch!r}")
        if self.weights not in WEIGHT_MODES:
            raise ConfigError(f"weights must be one of {WEIGHT_MODES}, got {self.weights!r}")
        if self.vocab_projection not in VOCAB_PROJECTIONS:
            raise ConfigError(
                f"vocab projection must be one of {VOCAB_PROJECTIONS},"
                f" got {self.vocab_projection!r}"
            )
        if self.cpu_kernels not in CPU_KERNELS:
            raise ConfigError(f"q4 kernel must be one of {CPU_KERNELS}, got {self.cpu_kernels!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv cache dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if not 0.0 < self.prefill_share <= 1.0:
            raise ConfigError(f"prefill share must be > 0 and <= 1, got {self.prefill_share!r}")
        if self.speculative not in SPECULATIVE_MODES:
            raise ConfigError(
                f"speculative must be one of {SPECULATIVE_MODES}, got {self.speculative!r}"
            )
        if self.draft_tokens < 1:
            raise ConfigError(f"draft tokens must be >= 1, got {self.draft_tokens!r}")
        if self.prefix_cache_mib < 0:
            raise ConfigError(f"prefix cache must be >= 0 MiB, got {self.prefix_cache_mib!r}")
        if self.cache_size is not None and (self.cache_size <= 0 or self.cache_size % 256):
            raise ConfigError(
                f"cache size must be a positive multiple of 256, got {self.cache_size!r}"
            )

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

        return CpuEngine.load(
            options.model,
            dtype=options.dtype,
            device=options.device,
            context_length=options.context_length,
            max_batch=options.max_batch or 8,
            offline=options.offline,
            threads=options.threads,
            weights=options.weights,
            prefix_cache_bytes=options.prefix_cache_mib * 2**20,
            prefill_share=options.prefill_share,
            projection=options.vocab_projection,
            speculative=options.speculative,
            draft_tokens=options.draft_tokens,
            kv_cache_dtype=options.kv_cache_dtype,
            cpu_kernels=options.cpu_kernels,
        )
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
