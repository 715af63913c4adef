"""The CPU engine's options, declared and checked once.

:class:`CpuOptions` is what :meth:`CpuEngine.load
<trioserve.engine.cpu.engine.CpuEngine.load>` is given, whole: its loading
(:mod:`~trioserve.engine.cpu.loading`) and the weights plan
(:mod:`~trioserve.engine.cpu.weights_plan`) read it and check nothing again.
:class:`~trioserve.engine.EngineOptions` (the command line's) carries the same
fields under the same names and builds one with
:meth:`~trioserve.engine.EngineOptions.cpu`.

Pure: no torch. What only the machine can say (is CUDA there, does a kernel
build and pass its probe) is found out at load.
"""

from __future__ import annotations

from typing import Any, Final

import attrs

from trioserve.engine.cpu.speculative import (
    DEFAULT_DRAFT_TOKENS,
    SPECULATIVE_MODES,
    SpeculativeMode,
)
from trioserve.errors import ConfigError

__all__ = [
    "CPU_KERNELS",
    "DTYPE_NAMES",
    "KV_CACHE_DTYPES",
    "PROJECTIONS",
    "WEIGHT_MODES",
    "CpuOptions",
]

#: The dtypes the CPU engine's model may run in (torch's names).
DTYPE_NAMES: Final = ("bfloat16", "float16", "float32")
#: What the linear layers may run on: ``auto`` (the model's own 4-bit weights
#: where a probe finds the kernel exact enough, else the dtype), ``float``
#: (the dtype), ``q4`` or ``int8``.
WEIGHT_MODES: Final = ("auto", "float", "q4", "int8")
#: What the KV cache may store: ``"auto"`` the model's dtype, ``"int8"`` 8 bits
#: per value with one bfloat16 scale per head and position (see
#: :mod:`trioserve.engine.cpu.kvcache`).
KV_CACHE_DTYPES: Final = ("auto", "int8")
#: Which kernel the 4-bit layers run on: ``"auto"`` trioserve's own
#: (:mod:`trioserve.engine.cpu.native`) where it builds and passes its probe,
#: else torch's; ``"native"`` trioserve's only; ``"torch"`` torch's
#: ``_weight_int4pack_mm_for_cpu`` only.
CPU_KERNELS: Final = ("auto", "native", "torch")
#: What the vocabulary projection (hidden states to logits) may run on:
#: ``"bfloat16"`` the bfloat16 lm_head; ``"int8"`` an 8-bit copy with one
#: scale per vocabulary row (half the bytes to read per step); ``"auto"`` int8
#: when the linear layers are quantized, else bfloat16. Either way the
#: candidates near each row's maximum are recomputed in float32 from the
#: bfloat16 lm_head (:func:`trioserve.engine.cpu.llama.logits`).
PROJECTIONS: Final = ("auto", "bfloat16", "int8")


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in choices:
            raise ConfigError(f"{attribute.name} must be one of {choices}, got {value!r}")

    return check


def _at_least(bound: int) -> Any:
    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and value < bound:
            raise ConfigError(f"{attribute.name} must be >= {bound}, got {value!r}")

    return check


def _share(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{attribute.name} must be > 0 and <= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class CpuOptions:
    """How to build a :class:`~trioserve.engine.cpu.engine.CpuEngine`.

    Each field is checked here, on its own and against the others; a bad
    value is a :class:`~trioserve.errors.ConfigError` naming the option as
    it is named here, in :class:`~trioserve.engine.EngineOptions` and
    (with dashes) on the command line.
    """

    #: The torch dtype the model runs in.
    dtype: str = attrs.field(default="bfloat16", validator=_one_of(DTYPE_NAMES))
    #: The torch device: ``cpu`` or ``cuda[:N]`` (where CUDA is, at load).
    device: str = "cpu"
    #: Lowers the model's context length (None keeps the model's; at load it
    #: must also be at most the model's).
    context_length: int | None = attrs.field(default=None, validator=_at_least(2))
    #: Jobs generated together.
    max_batch: int = attrs.field(default=8, validator=_at_least(1))
    #: Never download the embedded model; fail with instructions instead.
    offline: bool = False
    #: torch's thread count, set at load for the whole process (None keeps
    #: torch's default).
    threads: int | None = attrs.field(default=None, validator=_at_least(1))
    #: What the linear layers run on (:data:`WEIGHT_MODES`). Layers whose
    #: shape a quantized kernel cannot run stay bfloat16.
    weights: str = attrs.field(default="auto", validator=_one_of(WEIGHT_MODES))
    #: What the vocabulary projection runs on (:data:`PROJECTIONS`).
    vocab_projection: str = attrs.field(default="auto", validator=_one_of(PROJECTIONS))
    #: The kernel 4-bit layers run on (:data:`CPU_KERNELS`).
    cpu_kernels: str = attrs.field(default="auto", validator=_one_of(CPU_KERNELS))
    #: Memory for the prefix cache of finished prompts (the keys and values
    #: that later prompts starting with the same tokens reuse; see
    #: :mod:`trioserve.engine.cpu.prefix`), in MiB; 0 turns it off. 128 MiB
    #: holds about 5,800 positions of the embedded model (23 KiB each; about
    #: 11,000 with an 8-bit KV cache), a few long conversations.
    prefix_cache_mib: int = attrs.field(default=128, validator=_at_least(0))
    #: While jobs decode, the share of the engine's time that prompts'
    #: prefill may take (0 < share <= 1).
    prefill_share: float = attrs.field(default=0.5, validator=_share)
    #: Speculative decoding: ``off``, or ``ngram`` (drafts looked up in the
    #: job's own context; the output is the same either way).
    speculative: SpeculativeMode = attrs.field(default="off", validator=_one_of(SPECULATIVE_MODES))
    #: The drafts fed per job and step, at most (with ``ngram``).
    draft_tokens: int = attrs.field(default=DEFAULT_DRAFT_TOKENS, validator=_at_least(1))
    #: The KV cache's elements (:data:`KV_CACHE_DTYPES`).
    kv_cache_dtype: str = attrs.field(default="auto", validator=_one_of(KV_CACHE_DTYPES))

    def __attrs_post_init__(self) -> None:
        if not self.quantizable:
            where = f"got dtype {self.dtype!r} on device {self.device!r}"
            if self.weights in ("q4", "int8"):
                raise ConfigError(
                    f"weights {self.weights!r} need dtype 'bfloat16' on the CPU, {where}"
                )
            if self.cpu_kernels == "native":
                raise ConfigError(f"cpu_kernels 'native' need dtype 'bfloat16' on the CPU, {where}")
            if self.vocab_projection == "int8":
                raise ConfigError(
                    f"vocab_projection 'int8' needs dtype 'bfloat16' on the CPU, {where}"
                )

    @property
    def quantizable(self) -> bool:
        """Quantized weights and trioserve's kernels can run: bfloat16 on the CPU."""
        return self.device.partition(":")[0] == "cpu" and self.dtype == "bfloat16"

    @property
    def prefix_cache_bytes(self) -> int:
        """The prefix cache's bound in bytes."""
        return self.prefix_cache_mib * 2**20

    @property
    def drafts(self) -> int:
        """Drafts fed per job and step: ``draft_tokens``, 0 with speculation off."""
        return self.draft_tokens if self.speculative == "ngram" else 0
