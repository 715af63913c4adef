"""What the CPU engine loads, in which form, with which kernels: decided
before any tensor is read, from the options (their device and dtype among
them), whether the model directory has 4-bit weights, and which kernels work
here.

:func:`plan_weights` is that decision and nothing else (no torch, no
files): :meth:`LlamaWeights.load <trioserve.engine.cpu.llama.LlamaWeights.load>`
carries its :class:`WeightsPlan` out. The kernels' probes are passed in as
callables and called only where the decision needs them (a probe builds or
runs a kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import attrs

from trioserve.engine.cpu.options import CpuOptions
from trioserve.errors import ModelError

__all__ = ["WeightsPlan", "plan_weights"]

#: What the linear layers run on once the plan is made.
WeightMode = Literal["float", "q4", "int8"]


@attrs.frozen
class WeightsPlan:
    """How the model's weights are loaded and run."""

    #: The linear layers: in the run dtype, in 4-bit groups, or in 8 bits.
    mode: WeightMode
    #: The 4-bit groups come from the directory's own file (else, with
    #: ``mode`` q4, they are quantized from the float weights at load).
    q4_file: bool
    #: The kernel the quantized layers (and the norms) run on.
    kernel: Literal["native", "torch"]
    #: The vocabulary projection in 8 bits (else the bfloat16 lm_head).
    int8_projection: bool


def plan_weights(
    options: CpuOptions,
    *,
    has_q4_file: bool,
    native_kernels: Callable[[str], bool],
    torch_q4: Callable[[], bool],
    torch_int8: Callable[[], bool],
) -> WeightsPlan:
    """The plan for ``options.weights``, ``options.vocab_projection`` and
    ``options.cpu_kernels`` in ``options.dtype`` on ``options.device``
    (:class:`~trioserve.engine.cpu.options.CpuOptions`, which has already
    refused what can run nowhere: quantized weights off the CPU's bfloat16).

    ``auto`` takes the directory's 4-bit weights where it has them and a
    4-bit kernel works here, else the float weights. trioserve's kernels run
    where ``native_kernels(cpu_kernels)`` says so (it raises, with the
    reason, where ``native`` is asked for and they cannot run); torch's
    4-bit and 8-bit kernels where ``torch_q4()`` / ``torch_int8()`` find them
    working.

    Raises:
        ModelError: quantized weights asked for where no kernel here runs them.
    """
    can_quantize = options.quantizable
    native = can_quantize and native_kernels(options.cpu_kernels)
    weights = options.weights

    known: list[bool] = []

    def q4_works() -> bool:
        if not known:
            known.append(native or torch_q4())
        return known[0]

    q4_file = has_q4_file and (
        weights == "q4" or (weights == "auto" and can_quantize and q4_works())
    )
    mode: WeightMode = (
        "q4" if q4_file or weights == "q4" else "int8" if weights == "int8" else "float"
    )
    if mode == "q4" and not q4_works():
        raise ModelError("no working 4-bit CPU kernel here (neither torch's nor trioserve's)")
    if mode == "int8" and not (native or torch_int8()):
        raise ModelError("this torch build has no working int8 CPU kernel")
    projection = options.vocab_projection
    return WeightsPlan(
        mode=mode,
        q4_file=q4_file,
        kernel="native" if native else "torch",
        int8_projection=projection == "int8" or (projection == "auto" and mode != "float"),
    )
