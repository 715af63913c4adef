"""The ExLlamaV2 engine: trioserve's Engine protocol over ExLlamaV2's dynamic generator.

ExLlamaV2 (0.3.2, ``turboderp-org/exllamav2``) runs EXL2, GPTQ and FP16/BF16
safetensors models on NVIDIA GPUs. Its :class:`ExLlamaV2DynamicGenerator` does
continuous batching over a paged KV cache, prefix reuse, sampling, stop
tokens and token healing; this module translates:

* each :class:`~trioserve.engine.base.GenerationSpec` becomes one
  ``ExLlamaV2DynamicJob`` with a fresh ``ExLlamaV2Sampler.Settings``
  (:func:`sampler_fields`, :func:`stop_conditions`), after the checks ExLlamaV2
  does not make (:func:`refusal`);
* the untyped result dicts of ``generator.iterate()`` become typed updates at
  once (:func:`updates_from_result`). The text comes from the sampled tokens,
  decoded and cut at stop strings by the CPU engine's own rules
  (:class:`~trioserve.engine.text.TextStream`), not from ExLlamaV2's text:
  the same tokens give the same text on both engines.

The generator is not thread-safe and its asyncio wrapper blocks the event
loop, so neither is used from trio: ``enqueue``, ``cancel`` and ``iterate`` are
called only from :meth:`ExLlamaV2Engine.step`.

Threads: every call that touches the GPU (:meth:`ExLlamaV2Engine.load`,
:meth:`~ExLlamaV2Engine.warm_up`, :meth:`~ExLlamaV2Engine.step`,
:meth:`~ExLlamaV2Engine.close`) may run on any thread, but on one at a time,
and the server runs them all on its one engine thread. Nothing here assumes
which thread that is, or that it is the thread that loaded the model:

* torch's current CUDA device and stream are per thread; ExLlamaV2 sets both
  for the calling thread at every forward pass and load
  (``set_device_streams`` in exllamav2/device.py, called by
  ``ExLlamaV2.forward_chunk`` and the ``load*`` methods), so the thread that
  loaded the model need not be the one that steps it;
* ExLlamaV2's CUDA graphs (quantized attention and MLP layers, decode
  shapes without cuBLAS) are captured the first times a layer runs a shape,
  in ``cudaStreamCaptureModeThreadLocal`` (exllamav2_ext/cuda/graph.cu), on
  the calling thread's stream: CUDA work on other threads does not break a
  capture, but replaying a graph from another thread than the one that
  captured it is a path ExLlamaV2's own loops never take; hence one engine
  thread (``EXLLAMA_NO_GRAPHS=1`` turns graphs off should one misbehave);
* ``torch.inference_mode`` and the grad mode are per thread: :meth:`step`
  and :meth:`warm_up` enter inference mode themselves;
* ExLlamaV2 samples in its own thread pool (``max_sampling_threads``); those
  threads are the generator's and end with :meth:`close`;
* ``encode`` and ``decode`` use trioserve's tokenizer, not ExLlamaV2's or
  torch, and are safe from any thread at any time.

``exllamav2`` is imported only by :func:`probe_exllamav2` and
:meth:`ExLlamaV2Engine.load`, never when this module is imported: on a machine
without CUDA the import fails (its C++/CUDA extension cannot be built), and
where it works it compiles that extension on first use, which takes minutes.
Everything above the two is pure and tested on a CPU.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal, TypeAlias

import attrs

from trioserve.engine.base import (
    EngineInfo,
    Failed,
    Finished,
    FinishReason,
    GenerationSpec,
    SamplingSettings,
    TextUpdate,
    Update,
)
from trioserve.engine.samplers import (
    DRY_MAX_NGRAM,
    bias_row,
    sequence_breaker_ids,
    xtc_protected_ids,
)
from trioserve.engine.sampling import settings_problem
from trioserve.engine.text import TextStream
from trioserve.engine.tokenizer import Tokenizer
from trioserve.errors import ConfigError, EngineError, ModelError

__all__ = [
    "BUILD_LOCK_WAIT",
    "CACHE_TYPES",
    "MAX_ATTENTION_SIZE",
    "PAGE_SIZE",
    "CacheType",
    "ExLlamaV2Engine",
    "JobState",
    "LoadPlan",
    "configure_attention",
    "plan_load",
    "probe_exllamav2",
    "refusal",
    "sampled_token",
    "sampler_fields",
    "stop_conditions",
    "unpaged_chunk_size",
    "updates_from_result",
    "wait_for_build_lock",
]

log = logging.getLogger("trioserve.engine")

#: The dynamic generator's page size in tokens (``PAGED_PAGE_SIZE`` in
#: exllamav2/generator/dynamic.py). The cache, and in paged mode the prefill
#: chunk, must be multiples of it.
PAGE_SIZE: Final = 256

CacheType: TypeAlias = Literal["fp16", "q4", "q6", "q8"]
#: Cache element types, each an ExLlamaV2 cache class. The FP8 cache
#: (``ExLlamaV2Cache_8bit``) is left out: the dynamic generator rejects it.
CACHE_TYPES: Final[tuple[CacheType, ...]] = ("fp16", "q4", "q6", "q8")

# The first ExLlamaV2 release with every call this module makes (eos_reason in
# the result dicts, ExLlamaV2Cache_Q6/_Q8, load_tp with expect_cache_base).
_MIN_VERSION: Final = (0, 3, 2)


# -- probing -------------------------------------------------------------------------


def probe_exllamav2(*, lock_wait: float | None = None) -> tuple[bool, str]:
    """Whether the ExLlamaV2 engine can run here, and why (or why not).

    True only when torch sees a CUDA device and ``import exllamav2`` works. The
    import is not even tried without CUDA: it would try to build the C++/CUDA
    extension and fail (an OSError on CPU-only torch). Whatever the import
    raises is caught and reported, since a broken optional backend must not
    stop the server from starting on the CPU engine.

    Nor is it tried while torch's build lock of the extension stays in place
    for ``lock_wait`` seconds (default :data:`BUILD_LOCK_WAIT`): torch's JIT
    build (``torch.utils.cpp_extension``, ``FileBaton.wait``) waits on that
    file with no timeout, and a build killed half-way leaves it behind, so
    the import would hang the server's start for ever. The probe says so
    (and logs a warning), and ``--engine auto`` falls back to the CPU engine.
    A lock that goes within the wait (another process finishing its build) is
    waited for. What it cannot see: a lock another process takes after the
    wait and then abandons while this import waits on it.

    ExLlamaV2's model module calls ``torch.set_num_threads(1)`` when imported;
    the thread count is put back, because the CPU engine and tokenization in
    the same process need the cores.
    """
    try:
        import torch
    except Exception as exc:
        return False, f"torch cannot be imported ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA device"
    if "exllamav2.generator" not in sys.modules:
        lock = _build_lock()
        if lock is not None:
            held = wait_for_build_lock(lock, BUILD_LOCK_WAIT if lock_wait is None else lock_wait)
            if held is not None:
                log.warning("exllamav2 is not imported: %s", held)
                return False, held
    threads = torch.get_num_threads()
    try:
        import exllamav2

        # The dynamic generator's module loads more of the extension.
        import exllamav2.generator
    except Exception as exc:
        return False, f"exllamav2 cannot be imported ({type(exc).__name__}: {exc})"
    finally:
        torch.set_num_threads(threads)
    version = str(getattr(exllamav2, "__version__", "unknown"))
    if _version_tuple(version) < _MIN_VERSION:
        wanted = ".".join(map(str, _MIN_VERSION))
        return False, f"exllamav2 {version} is too old: trioserve needs >= {wanted}"
    return True, f"exllamav2 {version} on {torch.cuda.get_device_name(0)}"


#: Seconds :func:`probe_exllamav2` waits for torch's build lock of ExLlamaV2's
#: extension to go before it gives up on ExLlamaV2 (a build in another process
#: may be finishing; a killed build's lock never goes).
BUILD_LOCK_WAIT: Final = 30.0


def _build_lock() -> Path | None:
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


def _version_tuple(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for part in version.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


# -- load options --------------------------------------------------------------------


@attrs.frozen
class LoadPlan:
    """The validated numbers an engine is built with."""

    cache_type: CacheType
    #: Tokens the cache holds for all jobs together; a multiple of PAGE_SIZE.
    cache_tokens: int
    #: Tokens one job may hold (prompt plus generated).
    context_length: int
    #: Prompt tokens prefilled per job and step: a multiple of PAGE_SIZE in
    #: paged mode; unpaged, bounded by the matmul attention's size
    #: (:func:`unpaged_chunk_size`).
    max_chunk_size: int
    #: Jobs running at once: 1 without paged attention.
    max_batch: int
    paged: bool
    gpu_split: tuple[float, ...] | None
    tensor_parallel: bool


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


#: ExLlamaV2's default ``config.max_attention_size`` (exllamav2/config.py):
#: the attention-weight elements per head that its own ``model.forward``
#: keeps each chunk's ``(past + chunk) x chunk`` under when attention is not
#: flash-attn's or xformers'.
MAX_ATTENTION_SIZE: Final = 2048**2


def unpaged_chunk_size(context_length: int, max_attention_size: int = MAX_ATTENTION_SIZE) -> int:
    """The largest prefill chunk whose matmul attention stays within
    ``max_attention_size`` weights per head at any position of the context.

    Unpaged, attention runs as ``softmax(q @ k.T + mask) @ v`` in torch
    (``ExLlamaV2Attention._attn_torch``, matmul branch: see
    :func:`configure_attention`): a chunk of C tokens at the end of a
    context of T makes ``C x T x heads`` float16 weights, twice over at the
    mask's addition and the softmax. The dynamic generator calls
    ``forward_chunk``, which unlike ``model.forward`` does not shrink a chunk
    for that, so the chunk is sized here: ``C x T <= max_attention_size``, the
    bound ExLlamaV2's ``model.forward`` keeps, and no more than the
    ``max_input_len ** 2`` per head its ``load_autosplit`` measured with a
    real forward pass when it placed the model. That is
    ``max_attention_size x heads x 2`` bytes per copy (72 MiB for
    SmolLM2-135M's 9 heads, 256 MiB for Llama-3-8B's 32), and C is 512 at
    T = 8192, 2048 up to T = 2048.

    A multiple of PAGE_SIZE when it is at least that; smaller only for
    contexts past 16384 tokens (unpaged, the generator asks nothing of the
    chunk but ``<= max_input_len``, dynamic.py).
    """
    chunk = max(1, max_attention_size // max(1, context_length))
    return chunk - chunk % PAGE_SIZE if chunk >= PAGE_SIZE else chunk


def configure_attention(config: Any, *, flash_attn_paged: bool) -> bool:
    """Choose the generator's mode for the ``ExLlamaV2Config`` ``config`` and
    set its attention switches; returns whether the generator is paged.

    Call it after ``config.arch_compat_overrides()`` and before the model is
    built and loaded. ``flash_attn_paged`` is ``exllamav2.attn``'s
    ``has_flash_attn_with_paged`` (flash-attn >= 2.5.7 imported).

    Paged (batched) when flash-attn >= 2.5.7 is importable and the
    architecture allows flash-attn: the generator's paged attention is
    flash-attn's, always causal. Otherwise unpaged, and ``config.no_sdpa`` is
    set: unpaged attention without flash-attn or xformers is
    ``ExLlamaV2Attention._attn_torch``, whose SDPA branch in ExLlamaV2 0.3.2
    (exllamav2/attn.py, line 889 at tag v0.3.2, unchanged on master) reads
    ``if self.layer_idx in attn_params.block_diag_layers or causal:
    attn_mask_lr = attn_params.get_block_diag_mask(...)``. For a text model
    ``cu_seqlens`` is None, so that mask is None, and
    ``F.scaled_dot_product_attention`` runs unmasked (``is_causal`` False):
    every prefill chunk of more than one token attends to its future tokens,
    and the keys and values of every later layer go wrong in the cache
    (decoding one token at a time is unaffected). The matmul branch, which
    ``no_sdpa`` selects, adds ``Params.get_attn_mask``, the causal mask. Set
    before loading, so that ``load_autosplit``'s trial forward pass measures
    the matmul branch's memory. Harmless where flash-attn (< 2.5.7) or
    xformers is there: ExLlamaV2 takes those first for causal attention.
    """
    paged = bool(flash_attn_paged) and not config.no_flash_attn
    if not paged:
        config.no_sdpa = True
    return paged


def plan_load(
    model_context: int,
    *,
    paged: bool,
    cache_type: str = "fp16",
    cache_size: int | None = None,
    max_batch: int = 32,
    context_length: int | None = None,
    gpu_split: Sequence[float] | None = None,
    tensor_parallel: bool = False,
    max_chunk_size: int = 2048,
    flash_attn: bool | None = None,
    max_attention_size: int = MAX_ATTENTION_SIZE,
) -> LoadPlan:
    """Check the engine options against the model's context length
    ``model_context`` (its config.json) and settle the derived numbers.

    The dynamic generator asserts rather than explains (dynamic.py checks the
    cache size and chunk size with ``assert``), so every option it would
    reject is rejected here first, with a message that says what is allowed.

    ``flash_attn`` says whether ExLlamaV2 can use flash-attn at all (any
    version it accepts; default: as ``paged``). Unpaged, the prefill chunk is
    also bounded by the matmul attention's size (:func:`unpaged_chunk_size`,
    with the config's ``max_attention_size``).

    Raises:
        ConfigError: an option is out of range or options conflict.
    """
    if cache_type not in CACHE_TYPES:
        raise ConfigError(f"cache_type must be one of {', '.join(CACHE_TYPES)}, not {cache_type!r}")
    if max_batch < 1:
        raise ConfigError(f"max_batch must be at least 1, not {max_batch!r}")
    if model_context < PAGE_SIZE:
        raise ConfigError(
            f"the model's context length must be at least {PAGE_SIZE} for ExLlamaV2's "
            f"dynamic generator, not {model_context!r}"
        )
    if context_length is None:
        context = model_context
    elif not PAGE_SIZE <= context_length <= model_context:
        # Longer than the model's own length would run RoPE past what it was
        # trained on; ExLlamaV2 sizes its tables to config.max_seq_len.
        raise ConfigError(
            f"context_length must be between {PAGE_SIZE} and the model's {model_context}, "
            f"not {context_length!r}"
        )
    else:
        context = context_length
    min_cache = _round_up(context, PAGE_SIZE)
    if cache_size is None:
        cache_tokens = min_cache
    elif cache_size % PAGE_SIZE != 0 or cache_size < min_cache:
        raise ConfigError(
            f"cache_size must be a multiple of {PAGE_SIZE} and at least the context length "
            f"rounded up ({min_cache}), not {cache_size!r}"
        )
    else:
        cache_tokens = cache_size
    if max_chunk_size < PAGE_SIZE or max_chunk_size % PAGE_SIZE != 0:
        raise ConfigError(
            f"max_chunk_size must be a positive multiple of {PAGE_SIZE}, not {max_chunk_size!r}"
        )
    # The model's forward pass takes at most config.max_input_len (2048, capped
    # at max_seq_len) tokens; the chunk must fit in it and stay page-aligned.
    chunk = min(max_chunk_size, (min(2048, context) // PAGE_SIZE) * PAGE_SIZE)
    if not paged:
        chunk = min(chunk, unpaged_chunk_size(context, max_attention_size))
    # The generator's batch times max_q_size (8) must fit in max_input_len
    # (dynamic.py, ExLlamaV2DynamicGenerator.__init__).
    batch_limit = min(2048, context) // 8
    if paged and max_batch > batch_limit:
        raise ConfigError(
            f"max_batch must be at most {batch_limit} for a context length of {context}, "
            f"not {max_batch!r}"
        )
    if tensor_parallel and not (paged if flash_attn is None else flash_attn):
        # Without flash-attn, ExLlamaV2's tensor-parallel attention
        # (attn.py, forward_tp_old) asserts that torch SDPA is allowed and
        # then runs _attn_torch's SDPA branch, which at 0.3.2 prefills
        # without a causal mask (see configure_attention); no_sdpa, the cure
        # elsewhere, fails that assertion.
        raise ConfigError(
            "tensor_parallel needs flash-attn here: without it ExLlamaV2 0.3.2's "
            "tensor-parallel attention prefills without a causal mask"
        )
    split: tuple[float, ...] | None = None
    if gpu_split is not None:
        split = tuple(float(x) for x in gpu_split)
        if not split or any(not math.isfinite(x) or x <= 0 for x in split):
            raise ConfigError(f"gpu_split must be positive GiB per GPU, not {list(gpu_split)!r}")
    return LoadPlan(
        cache_type=cache_type,  # narrowed by the check against CACHE_TYPES
        cache_tokens=cache_tokens,
        context_length=context,
        max_chunk_size=chunk,
        max_batch=max_batch if paged else 1,
        paged=paged,
        gpu_split=split,
        tensor_parallel=tensor_parallel,
    )


# -- per-job translation -------------------------------------------------------------


def sampler_fields(
    settings: SamplingSettings, tokenizer: Tokenizer, vocab_size: int
) -> dict[str, Any]:
    """The ``ExLlamaV2Sampler.Settings`` attributes for ``settings``.

    Every field the sampler reads is set, also those the protocol cannot
    change, so that a later ExLlamaV2 release that changes a default does not
    change what trioserve computes. Greedy (temperature 0) is asked for
    explicitly as top_k 1 at temperature 1: the C++ sampler would also treat
    a temperature below 0.01 as greedy, but only as a side rule.

    Each trioserve field maps onto the attribute of the same name, but two:
    ``logit_bias`` becomes ``token_bias``, a float32 row of the vocabulary
    padded to a multiple of 32 as ``Settings.disallow_tokens`` makes it (the
    banned ids are added to it afterwards, as -inf, by that method), and the
    strings of ``dry_sequence_breakers`` become the token ids the CPU engine
    uses (:func:`~trioserve.engine.samplers.sequence_breaker_ids`). XTC's
    protected ids are given explicitly too, computed as the CPU engine
    computes them from ``tokenizer`` (trioserve's, over the model's
    tokenizer.json). The seed is set elsewhere: it belongs to the job.
    """
    greedy = settings.greedy
    token_bias = None
    if settings.logit_bias:
        token_bias = bias_row(settings.logit_bias, vocab_size + -vocab_size % 32)
    return {
        "token_repetition_penalty": settings.rep_pen,
        # -1: the penalties look at the whole context, prompt included, as the
        # seed server did.
        "token_repetition_range": -1,
        "token_repetition_decay": 0,
        "token_frequency_penalty": settings.freq_pen,
        "token_presence_penalty": settings.pres_pen,
        "temperature": 1.0 if greedy else settings.temperature,
        "top_k": 1 if greedy else settings.top_k,
        "top_p": settings.top_p,
        "top_a": settings.top_a,
        "min_p": settings.min_p,
        "typical": settings.typical,
        "skew": settings.skew,
        "tfs": 0.0,
        "smoothing_factor": settings.smoothing_factor,
        "min_temp": settings.min_temp,
        "max_temp": settings.max_temp,
        "temp_exponent": settings.temp_exponent,
        "temperature_last": settings.temperature_last,
        "mirostat": settings.mirostat,
        "mirostat_tau": settings.mirostat_tau,
        "mirostat_eta": settings.mirostat_eta,
        # None: the job's first draw starts mu at 2 * tau (sampling.cpp).
        "mirostat_mu": None,
        "token_bias": token_bias,
        "dry_multiplier": settings.dry_multiplier,
        "dry_base": settings.dry_base,
        "dry_allowed_length": settings.dry_allowed_length,
        "dry_range": settings.dry_range,
        "dry_sequence_breakers": set(
            sequence_breaker_ids(tokenizer, settings.dry_sequence_breakers)
        ),
        "dry_max_ngram": DRY_MAX_NGRAM,
        "xtc_probability": settings.xtc_probability,
        "xtc_threshold": settings.xtc_threshold,
        "xtc_ignore_tokens": xtc_protected_ids(tokenizer),
        "cfg_scale": None,
    }


def stop_conditions(spec: GenerationSpec, eos_token_ids: frozenset[int]) -> list[int | str]:
    """The job's ``stop_conditions``: every EOS id of the model, the request's
    stop ids, then its stop strings.

    ExLlamaV2's job adds no EOS id itself (dynamic.py, ExLlamaV2DynamicJob
    takes only what it is given), and its config keeps just the first of a
    list of EOS ids, which is why Llama 3 instruct models never stop there
    (exllamav2 issue #803); the engine passes them all.
    """
    ids: list[int | str] = sorted(spec.stop_token_ids | eos_token_ids)
    return ids + list(dict.fromkeys(spec.stop_strings))


def refusal(
    spec: GenerationSpec,
    *,
    context_length: int,
    vocab_size: int,
    page_size: int,
    max_pages: int,
) -> str | None:
    """Why ``spec`` cannot be run, or None when it can.

    ExLlamaV2 checks only that a job fits in the cache pages (with an
    ``assert`` at enqueue, dynamic.py ``prepare_for_queue``); nothing checks a
    job against the model's context length, past which RoPE tables run out.
    """
    n = len(spec.prompt_ids)
    if n == 0:
        return "the prompt is empty: it must have at least one token"
    if spec.max_new_tokens < 1:
        return f"max_new_tokens must be at least 1, not {spec.max_new_tokens!r}"
    if n + spec.max_new_tokens > context_length:
        return (
            f"the prompt ({n} tokens) plus max_new_tokens ({spec.max_new_tokens}) exceeds "
            f"the context length ({context_length})"
        )
    # The job reserves pages for its whole length up front (prepare_for_queue:
    # len(sequence_ids) + max_new_tokens, plus one when healing dropped a token).
    pages = -(-(n + spec.max_new_tokens) // page_size)
    if pages > max_pages:
        return (
            f"the job needs {pages * page_size} cache tokens but the cache holds "
            f"{max_pages * page_size}; use a larger cache_size"
        )
    bad = sorted(i for i in spec.banned_ids if not 0 <= i < vocab_size)
    if bad:
        return f"banned ids must be between 0 and {vocab_size - 1}, not {bad!r}"
    bad_stop = sorted(i for i in spec.stop_token_ids if i < 0)
    if bad_stop:
        return f"stop token ids must not be negative, not {bad_stop!r}"
    if any(s == "" for s in spec.stop_strings):
        return "stop strings must not be empty"
    if any(not 0 <= i < vocab_size for i in spec.prompt_ids):
        return f"prompt ids must be between 0 and {vocab_size - 1}"
    # The sampler's own guard, as the CPU engine has it: a bad value fails
    # this job here, never a step of ExLlamaV2's batch.
    problem = settings_problem(spec.sampling)
    if problem is not None:
        return problem
    bad = [i for i, _ in spec.sampling.logit_bias if i >= vocab_size]
    if bad:
        return f"logit_bias ids must be between 0 and {vocab_size - 1}, not {bad[0]!r}"
    return None


#: Decodes token ids to text, writing special tokens as their text.
Decode: TypeAlias = Callable[[Sequence[int]], str]


@attrs.define(eq=False)
class JobState:
    """What the engine remembers about one running job between steps."""

    job_id: int
    #: Prompt tokens prefilled (token healing takes the last one off).
    prompt_tokens: int
    #: Token healing is active: the first sampled token replaces the prompt's
    #: last one, and ExLlamaV2 does not count it (``new_tokens`` starts at -1).
    healing: bool
    #: The job's text, decoded from its tokens by the CPU engine's rules.
    stream: TextStream
    #: Tokens sampled so far, the healed token included.
    sampled: int = 0

    @classmethod
    def for_spec(cls, spec: GenerationSpec, decode: Decode) -> JobState:
        # ExLlamaV2DynamicJob heals only when the input has more than one token.
        healing = spec.token_healing and len(spec.prompt_ids) > 1
        prompt = spec.prompt_ids[:-1] if healing else spec.prompt_ids
        return cls(
            job_id=spec.job_id,
            prompt_tokens=len(prompt),
            healing=healing,
            stream=TextStream(
                decode,
                spec.stop_strings,
                context_ids=prompt,
                # The healed token re-generates the removed token's text,
                # which is not emitted again.
                skip_prefix=decode(spec.prompt_ids[-1:]) if healing else "",
            ),
        )

    @property
    def generated(self) -> int:
        return self.sampled - (1 if self.healing else 0)


def sampled_token(job: Any) -> int:
    """The token an ``ExLlamaV2DynamicJob`` sampled last.

    ``receive_sample`` appends every sampled token, a stop token too, to each
    of the job's sequences before it decides anything (dynamic.py); the result
    dicts carry token ids only when they release text.
    """
    return int(job.sequences[0].sequence_ids.torch()[0, -1])


def updates_from_result(result: Mapping[str, Any], state: JobState, token: int) -> Update | None:
    """The typed update for one of ``generator.iterate()``'s result dicts.

    ``token`` is the token the job sampled in that step (:func:`sampled_token`).
    Returns None for the ``started`` and ``prefill`` stages, which the
    protocol does not report.

    ExLlamaV2 decides when a job ends at a stop token and at
    ``max_new_tokens`` (its ``eos_reason``); what text is released, what is
    held, and where a stop string cuts it, the engine decides itself from the
    tokens, with the CPU engine's :class:`~trioserve.engine.text.TextStream`
    and rules (``CpuEngine._emit``), so that the same tokens give the same
    text, ``stop_string`` and reason on both engines. ExLlamaV2's own text
    (``text``, ``held``, ``held_text``) is not used, because it departs from
    them in ways that depend on the tokens and even on ``PYTHONHASHSEED``
    (exllamav2/generator/dynamic.py, ``receive_sample``, at 0.3.2):

    * it tests stop strings one by one in the order of a ``set``, cuts at the
      first that occurs anywhere and names the first in that order that the
      rest starts with: with ``(" P", "aris!")`` and the tokens ``" Paris"``,
      ``"!"`` it may release ``" P"`` and name ``"aris!"``; and a string
      matching in part, tested first, holds a whole match of another;
    * it tests the length limit before it repairs held UTF-8, so a flush at
      ``max_new_tokens`` can hold the pieces of a character that the last
      token completed (``"日本���"`` for ``"日本語"``);
    * it writes each token's piece on its own (one U+FFFD per byte-level
      piece) and releases the pieces unrepaired once five U+FFFD are held,
      which invalid bytes followed by a split character reach;
    * at a stop token it keeps the held text (and the stop token's piece) in
      ``held`` instead of releasing it.

    A job that the rules end while ExLlamaV2 would go on (a stop string it
    held, or one it did not see) ends with a :class:`Finished` for a result
    whose ``eos`` is false: the caller cancels it in ExLlamaV2.
    """
    if result.get("stage") != "streaming":
        return None
    state.sampled += 1
    stream = state.stream
    reason = result.get("eos_reason") if result.get("eos", False) else None
    if reason == "stop_token":
        # The stop token's own text is never emitted; held text was not a
        # stop string after all, so it is released.
        stop_token = int(result.get("eos_triggering_token_id", token))
        return _finished(state, result, stream.flush(), "stop_token", stop_token=stop_token)
    if reason not in (None, "max_new_tokens", "stop_string"):
        # "end_filter" needs a grammar filter, which trioserve never sets.
        return Failed(job_id=state.job_id, message=f"exllamav2 ended the job for {reason!r}")
    piece = stream.push([token])
    if piece.stop_string is not None:
        return _finished(state, result, piece.text, "stop_string", stop_string=piece.stop_string)
    if reason is None:
        return TextUpdate(
            job_id=state.job_id,
            text=piece.text,
            held=stream.held,
            generated_tokens=state.generated,
        )
    # At the limit, or at a stop string ExLlamaV2 matched in its own text but
    # not found in the decoded one (a string with U+FFFD in it): everything
    # held is released, unless it completes a stop string after all.
    text = piece.text + stream.flush()
    if stream.stop_string is not None:
        return _finished(state, result, text, "stop_string", stop_string=stream.stop_string)
    if reason == "stop_string":
        theirs = str(result.get("eos_triggering_string", ""))
        return _finished(state, result, text, "stop_string", stop_string=theirs)
    return _finished(state, result, text, "max_new_tokens")


def _finished(
    state: JobState,
    result: Mapping[str, Any],
    text: str,
    reason: FinishReason,
    *,
    stop_string: str | None = None,
    stop_token: int | None = None,
) -> Finished:
    return Finished(
        job_id=state.job_id,
        text=text,
        reason=reason,
        stop_string=stop_string,
        stop_token=stop_token,
        prompt_tokens=state.prompt_tokens,
        # ExLlamaV2's own count (new_tokens); it agrees with state.generated.
        generated_tokens=int(result.get("new_tokens", state.generated)),
        # Whole 256-token pages shared with other jobs (paged mode) plus the
        # tokens of a partly matching page copied from the cache, or in
        # unpaged mode the prefix shared with the previous job (dynamic.py,
        # ExLlamaV2DynamicJob.prefill and emit).
        cached_tokens=int(result.get("cached_tokens", 0)),
    )


def _load_failure(exc: BaseException, model_dir: Path, plan: LoadPlan) -> str | None:
    """The ModelError message for an error ExLlamaV2 raised while placing the
    model, or None for one that is not the model's fault (re-raised as is)."""
    import torch

    where = f"the model {str(model_dir)!r} with a {plan.cache_tokens}-token {plan.cache_type} cache"
    # load_autosplit raises a plain RuntimeError("Insufficient VRAM for model
    # and cache") once the last GPU is full (model.py, load_autosplit_gen);
    # load and load_tp let torch's OutOfMemoryError through.
    if isinstance(exc, torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "Insufficient VRAM" in str(exc)
    ):
        return f"{where} does not fit on the GPUs: {exc}"
    if isinstance(exc, AssertionError | ValueError | KeyError | OSError):
        return f"exllamav2 cannot load {where}: {type(exc).__name__}: {exc}"
    return None


def _cached_tokens(job: Any) -> int:
    """Prompt tokens of ``job`` served from the cache, as ExLlamaV2 counts them
    in its final result (dynamic.py, ``emit``), for a job it did not end."""
    pages = int(getattr(job, "cached_pages", 0))
    tokens = int(getattr(job, "cached_tokens", 0))
    page_size = int(getattr(job.generator, "page_size", PAGE_SIZE))
    return (pages * page_size + tokens) // max(1, len(getattr(job, "sequences", ())))


def _free(model: Any) -> None:
    """Unload what ExLlamaV2 placed of ``model`` and give the memory back."""
    import gc

    import torch

    try:
        model.unload()
    except Exception:
        # A model that failed half-way may not unload cleanly; the original
        # error is the one to report.
        log.warning("exllamav2 could not unload a model that failed to load", exc_info=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the engine ----------------------------------------------------------------------


@attrs.define(eq=False)
class _Running:
    job: Any  # ExLlamaV2DynamicJob
    state: JobState


@attrs.define(eq=False)
class ExLlamaV2Engine:
    """An Engine over one ``ExLlamaV2DynamicGenerator``; see the module docstring.

    Build it with :meth:`load`. Not thread-safe beyond what the Engine
    protocol promises: :meth:`load`, :meth:`warm_up`, :meth:`step` and
    :meth:`close` from one thread at a time (the server's engine thread),
    :meth:`encode` and :meth:`decode` from any.
    """

    _info: EngineInfo
    _plan: LoadPlan
    _tokenizer: Tokenizer
    # ExLlamaV2 objects (untyped): model, cache, ExLlamaV2Tokenizer, generator,
    # and the classes a job needs.
    _model: Any
    _cache: Any
    _xtokenizer: Any
    _generator: Any
    _job_class: Any
    _settings_class: Any
    _jobs: dict[int, _Running] = attrs.Factory(dict)
    _closed: bool = False

    @classmethod
    def load(
        cls,
        model_dir: Path,
        *,
        cache_type: str = "fp16",
        cache_size: int | None = None,
        max_batch: int = 32,
        context_length: int | None = None,
        gpu_split: Sequence[float] | None = None,
        tensor_parallel: bool = False,
        max_chunk_size: int = 2048,
    ) -> ExLlamaV2Engine:
        """Load the model directory ``model_dir`` (EXL2, GPTQ, or FP16/BF16/FP32
        safetensors with ``config.json`` and ``tokenizer.json``) onto the GPUs.

        Placement: ``tensor_parallel`` splits every layer over all GPUs
        (``load_tp`` with the TP cache), ``gpu_split`` (GiB per GPU) places
        whole layers by that split (``load``), and otherwise layers and cache
        fill the GPUs in turn (``load_autosplit``).

        Blocking (seconds to minutes: the first import of exllamav2 compiles
        its extension); run it in a worker thread from async code.

        Raises:
            EngineError: exllamav2 cannot be used here (no CUDA, import fails).
            ModelError: the directory is not a model ExLlamaV2 can load.
            ConfigError: an option is invalid (see :func:`plan_load`).
        """
        usable, reason = probe_exllamav2()
        if not usable:
            raise EngineError(f"the exllamav2 engine cannot run: {reason}")
        from exllamav2 import (
            ExLlamaV2,
            ExLlamaV2Cache,
            ExLlamaV2Cache_Q4,
            ExLlamaV2Cache_Q6,
            ExLlamaV2Cache_Q8,
            ExLlamaV2Cache_TP,
            ExLlamaV2Config,
            ExLlamaV2Tokenizer,
        )
        from exllamav2.attn import has_flash_attn, has_flash_attn_with_paged
        from exllamav2.generator import (
            ExLlamaV2DynamicGenerator,
            ExLlamaV2DynamicJob,
            ExLlamaV2Sampler,
        )

        model_dir = Path(model_dir)
        try:
            config = ExLlamaV2Config(str(model_dir))
        except (AssertionError, ValueError, KeyError, OSError, TypeError) as exc:
            raise ModelError(f"exllamav2 cannot read the model {str(model_dir)!r}: {exc}") from exc
        # Architectures with softcapping or sliding windows need some attention
        # backends off. quiet=True keeps ExLlamaV2 from printing why (it would
        # write to stdout, config.py); what it switched off is logged below.
        backends = (config.no_flash_attn, config.no_xformers, config.no_sdpa)
        config.arch_compat_overrides(quiet=True)
        if (config.no_flash_attn, config.no_xformers, config.no_sdpa) != backends:
            log.info(
                "exllamav2 turned attention backends off for %s: flash-attn %s, xformers %s, "
                "sdpa %s",
                config.architecture,
                "off" if config.no_flash_attn else "allowed",
                "off" if config.no_xformers else "allowed",
                "off" if config.no_sdpa else "allowed",
            )
        # Before the model is built: the attention switches decide what
        # load_autosplit's trial forward pass measures.
        paged = configure_attention(config, flash_attn_paged=bool(has_flash_attn_with_paged))
        plan = plan_load(
            int(config.max_seq_len),
            paged=paged,
            flash_attn=bool(has_flash_attn) and not config.no_flash_attn,
            max_attention_size=int(config.max_attention_size),
            cache_type=cache_type,
            cache_size=cache_size,
            max_batch=max_batch,
            context_length=context_length,
            gpu_split=gpu_split,
            tensor_parallel=tensor_parallel,
            max_chunk_size=max_chunk_size,
        )
        if tensor_parallel and not config.arch.lm.supports_tp:
            raise ConfigError(
                f"tensor_parallel is not supported by ExLlamaV2 for {config.architecture!r}"
            )
        config.max_seq_len = plan.context_length
        config.max_input_len = min(int(config.max_input_len), plan.context_length)
        tokenizer = Tokenizer.from_dir(model_dir)

        cache_class = {
            "fp16": ExLlamaV2Cache,
            "q4": ExLlamaV2Cache_Q4,
            "q6": ExLlamaV2Cache_Q6,
            "q8": ExLlamaV2Cache_Q8,
        }[plan.cache_type]
        started = time.monotonic()
        model = ExLlamaV2(config)
        cache: Any = None
        failure: str | None = None
        try:
            if plan.tensor_parallel:
                model.load_tp(
                    gpu_split=list(plan.gpu_split) if plan.gpu_split else None,
                    expect_cache_tokens=plan.cache_tokens,
                    expect_cache_base=cache_class,
                )
                cache = ExLlamaV2Cache_TP(model, base=cache_class, max_seq_len=plan.cache_tokens)
            elif plan.gpu_split is not None:
                model.load(gpu_split=list(plan.gpu_split))
                cache = cache_class(model, max_seq_len=plan.cache_tokens)
            else:
                cache = cache_class(model, max_seq_len=plan.cache_tokens, lazy=True)
                model.load_autosplit(cache)
            xtokenizer = ExLlamaV2Tokenizer(config)
            generator = ExLlamaV2DynamicGenerator(
                model=model,
                cache=cache,
                tokenizer=xtokenizer,
                max_batch_size=plan.max_batch,
                max_chunk_size=plan.max_chunk_size,
                paged=plan.paged,
            )
        except BaseException as exc:
            failure = _load_failure(exc, model_dir, plan)
            if failure is None:
                _free(model)
                raise
            # As text: a record holding the exception would keep its
            # frames, and with them the GPU memory, alive.
            log.debug("".join(traceback.format_exception(exc)))
        if failure is not None:
            # Raised here, outside the except block, so that no traceback
            # keeps the half-built cache's and the layers' tensors alive.
            cache = None
            _free(model)
            raise ModelError(failure)
        # These tables are built lazily on first use, possibly from the
        # generator's sampling threads at once; build them here instead.
        xtokenizer.get_id_to_piece_list(True)
        xtokenizer.get_id_to_piece_list(False)
        xtokenizer.get_prefix_id_to_ids_dict()

        eos = set(tokenizer.eos_token_ids)
        if config.eos_token_id is not None:
            eos.add(int(config.eos_token_id))
        generation_config = getattr(config, "generation_config", None) or {}
        eos.update(int(i) for i in generation_config.get("eos_token_id") or ())
        bos = tokenizer.bos_token_id
        if bos is None and config.bos_token_id is not None:
            bos = int(config.bos_token_id)
        info = EngineInfo(
            engine="exllamav2",
            model_name=model_dir.name,
            context_length=plan.context_length,
            vocab_size=int(config.vocab_size),
            bos_token_id=bos,
            eos_token_ids=frozenset(eos),
            max_batch=plan.max_batch,
            batching=plan.paged,
            max_token_chars=tokenizer.max_token_bytes,
            model_dir=str(model_dir),
        )
        engine = cls(
            info=info,
            plan=plan,
            tokenizer=tokenizer,
            model=model,
            cache=cache,
            xtokenizer=xtokenizer,
            generator=generator,
            job_class=ExLlamaV2DynamicJob,
            settings_class=ExLlamaV2Sampler.Settings,
        )
        log.info(
            "exllamav2 loaded %s in %.1f s: context %d, %s cache of %d tokens, %s, "
            "max batch %d, placement %s",
            model_dir,
            time.monotonic() - started,
            plan.context_length,
            plan.cache_type,
            plan.cache_tokens,
            "paged attention"
            if plan.paged
            else (
                "no paged attention (flash-attn >= 2.5.7 missing): one job at a time, "
                f"torch matmul attention, prefill chunks of {plan.max_chunk_size} tokens"
            ),
            plan.max_batch,
            "tensor parallel"
            if plan.tensor_parallel
            else ("gpu split " + repr(plan.gpu_split) if plan.gpu_split else "autosplit"),
        )
        return engine

    # -- Engine protocol -----------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def plan(self) -> LoadPlan:
        """The options the engine was built with, after validation."""
        return self._plan

    def encode(self, text: str) -> list[int]:
        # trioserve's own tokenizer over the same tokenizer.json: the CPU and
        # ExLlamaV2 engines count and trim prompts identically.
        return self._tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        # Not ExLlamaV2Tokenizer.decode: with decode_special_tokens=True it
        # still drops the pad id (tokenizer.py, decode_), which for many models
        # is the EOS id, and the protocol writes every special token as text.
        return self._tokenizer.decode(ids)

    def warm_up(self) -> None:
        """Run one short generation, so that the first request does not pay for
        cuBLAS's start, kernel selection and CUDA graph capture.

        Call it on the thread that will step the engine (see the module
        docstring), before the first :meth:`step`, with no job running. It
        empties the prefix cache (``ExLlamaV2DynamicGenerator.warmup``
        resets the page table afterwards).
        """
        if self._closed:
            raise EngineError("the exllamav2 engine is closed")
        if self._jobs:
            raise EngineError("warm_up needs an idle engine: jobs are running")
        import torch

        started = time.monotonic()
        with torch.inference_mode():
            self._generator.warmup()
        log.info("exllamav2 warmed up in %.2f s", time.monotonic() - started)

    def step(self, submit: Sequence[GenerationSpec], cancel: Sequence[int]) -> list[Update]:
        if self._closed:
            raise EngineError("the exllamav2 engine is closed")
        import torch

        updates: list[Update] = []
        generator = self._generator
        for job_id in cancel:
            running = self._jobs.pop(job_id, None)
            if running is not None:
                # Pending or active, the generator forgets it and frees its
                # pages; it reports nothing (dynamic.py, cancel).
                generator.cancel(running.job)
        for spec in submit:
            failure = self._enqueue(spec)
            if failure is not None:
                updates.append(failure)
        if not generator.num_remaining_jobs():
            return updates
        try:
            with torch.inference_mode():
                results = generator.iterate()
        except Exception as exc:
            # A failed forward pass leaves every job's cache pages in an
            # unknown state: drop them all and let the caller fail them.
            self._jobs.clear()
            generator.clear_queue()
            raise EngineError(f"exllamav2 failed during a step: {exc}") from exc
        for result in results:
            running = self._jobs.get(result.get("identifier", -1))
            if running is None:
                continue
            update = updates_from_result(result, running.state, sampled_token(running.job))
            if update is None:
                continue
            if not isinstance(update, TextUpdate):
                del self._jobs[running.state.job_id]
                if not result.get("eos", False):
                    # Ended by the rules (a stop string ExLlamaV2 held or
                    # did not see); ExLlamaV2 would go on generating for it.
                    generator.cancel(running.job)
                    if isinstance(update, Finished):
                        update = attrs.evolve(update, cached_tokens=_cached_tokens(running.job))
            updates.append(update)
        return updates

    def _enqueue(self, spec: GenerationSpec) -> Failed | None:
        if spec.job_id in self._jobs:
            return Failed(job_id=spec.job_id, message=f"job id {spec.job_id!r} is already running")
        generator = self._generator
        reason = refusal(
            spec,
            context_length=self._info.context_length,
            vocab_size=self._info.vocab_size,
            page_size=int(generator.page_size),
            max_pages=int(generator.max_pages),
        )
        if reason is not None:
            return Failed(job_id=spec.job_id, message=reason)
        import torch

        settings = self._settings_class()
        for name, value in sampler_fields(
            spec.sampling, self._tokenizer, self._info.vocab_size
        ).items():
            setattr(settings, name, value)
        if spec.banned_ids:
            settings.disallow_tokens(self._xtokenizer, sorted(spec.banned_ids))
        try:
            job = self._job_class(
                input_ids=torch.tensor([spec.prompt_ids], dtype=torch.long),
                max_new_tokens=spec.max_new_tokens,
                gen_settings=settings,
                seed=spec.sampling.seed,
                stop_conditions=stop_conditions(spec, self._info.eos_token_ids),
                decode_special_tokens=True,
                token_healing=spec.token_healing,
                identifier=spec.job_id,
            )
            generator.enqueue(job)
        except (AssertionError, ValueError) as exc:
            return Failed(job_id=spec.job_id, message=f"exllamav2 refused the job: {exc}")
        self._jobs[spec.job_id] = _Running(
            job=job, state=JobState.for_spec(spec, self._tokenizer.decode)
        )
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.clear()
        generator = self._generator
        try:
            generator.clear_queue()
        finally:
            for pool in ("sampling_pool", "filter_pool"):
                executor = getattr(generator, pool, None)
                if executor is not None:
                    executor.shutdown(wait=True)
            self._model.unload()
            self._generator = self._cache = self._model = None
            import torch

            torch.cuda.empty_cache()
