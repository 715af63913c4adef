"""Constraints on the ExLlamaV2 engine: an ``ExLlamaV2Filter`` over llguidance.

Each constrained job gets its own filter, over its own matcher
(:class:`~trioserve.engine.grammars.JobMatcher`, with the CPU engine's mask
budget): nothing is shared or reused between jobs. The filter takes ExLlamaV2 0.3.2's mask path
(exllamav2/generator/filters/base.py, ``ExLlamaV2Filter``; read at v0.3.2):

* ``can_mask_logits`` and ``use_background_worker`` are both true. Both are
  needed: ``ExLlamaV2DynamicJob.receive_sample`` (generator/dynamic.py)
  queues a filter for ``background_prepare_logit_mask`` only when every
  filter of the job says both, and otherwise queues ``background_next``,
  whose result (a token list) the sampler would then take for the mask's
  (``ExLlamaV2Sampler.sample`` asserts ``get_next(mask=True) == True``);
* ``prepare_logit_mask`` fills llguidance's int32 bitmask (32 tokens a word)
  for the next token. The generator runs it in its ``filter_pool`` threads
  right after it has launched the forward pass
  (``ExLlamaV2DynamicGenerator.iterate_gen``: "GPU workload is scheduled
  here"), so the mask is computed while the GPU works; a job's first mask is
  computed in ``receive_logits`` itself (``get_next`` with nothing pending);
* ``mask_logits`` sets the logits of the tokens the grammar forbids to -inf,
  in place, with numpy (no ``torch.compile``, and not torch's thread pool,
  which costs more to wake than the work: see
  :class:`~trioserve.engine.grammars.MaskRows`); the sampler calls it
  on the job's ``[vocab]`` row after the penalties, bans, ``token_bias`` and
  DRY, before temperature and truncation (``ExLlamaV2Sampler.sample``,
  "Evaluate filters");
* ``begin`` starts nothing (the matcher is new) and ``feed`` consumes each
  sampled token (``receive_sample``, "Feed filters", gives it as a
  ``[1, 1]`` tensor);
* ``next`` answers as 0.3.2's token-list path expects (``(pass_tokens,
  end_tokens)``, as ``ExLlamaV2SelectFilter.next``), although with the mask
  path 0.3.2 never calls it.

The filter never raises into ExLlamaV2's step: an exception there would fail
every job of the batch. A matcher error (llguidance's parser limits, a token
it refuses) or masks over the job's CPU budget
(:class:`~trioserve.engine.grammars.MaskBudget`, charged with the mask
thread's own CPU time) is kept (:attr:`GrammarMask.problem`); the mask then allows every
token, so that the sampler still draws one, and the engine fails that job
alone before its token is released. :meth:`GrammarMask.close` ends a filter
whose job is gone: a mask still queued for it computes nothing.

``exllamav2`` is imported only by :func:`filter_class` (called by the engine
once it has imported exllamav2 itself): :class:`GrammarMask` holds all the
logic and needs only torch and llguidance.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import torch

from trioserve.engine.grammars import JobMatcher

__all__ = ["GrammarMask", "filter_class"]


class GrammarMask:
    """One job's constraint as ExLlamaV2 0.3.2's filter API wants it (see the
    module docstring); :func:`filter_class` mixes it into ``ExLlamaV2Filter``.

    ``vocab_size`` is the model's vocabulary, the width of the grammar's
    tokenizer (:class:`~trioserve.engine.grammars.Grammars`); the logits
    ExLlamaV2 samples may be wider (its ``padded_vocab_size``, a multiple of
    32): ids past the vocabulary are never allowed.
    """

    def __init__(self, job: JobMatcher, vocab_size: int) -> None:
        self.job: JobMatcher | None = job
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._bits = np.zeros(self.words, dtype=np.int32)
        self._problem: str | None = None
        #: The mask allows every token (the matcher failed); nothing to apply.
        self._open = False
        self.closed = False

    # -- state, for the engine --------------------------------------------------------

    @property
    def problem(self) -> str | None:
        """Why the constraint can go no further (its job must fail), or None."""
        if self._problem is not None:
            return self._problem
        return None if self.job is None else self.job.problem()

    @property
    def complete(self) -> bool:
        """The value is complete: the grammar allows nothing but the end."""
        return self.job is not None and self._problem is None and self.job.complete

    def close(self) -> None:
        """The job is gone: forget the matcher; whatever ExLlamaV2 still asks
        of this filter does nothing."""
        self.closed = True
        self.job = None

    # -- ExLlamaV2Filter's API (exllamav2/generator/filters/base.py, v0.3.2) -----------

    def begin(self, prefix_str: str = "") -> None:
        # Called once, before the job's first sample (receive_logits, when
        # new_tokens == 0). The matcher is the job's own and new: nothing to
        # reset, and no prefix to consume (the constraint starts at the output).
        pass

    def feed(self, token: Any) -> None:
        job = self.job
        if job is None or self._problem is not None or self._open:
            # An open mask (a failed constraint) drew this token without the
            # grammar: the matcher keeps the reason the job fails for.
            return
        try:
            # A stopped matcher takes nothing more; its job ends at this token
            # (the end the grammar allowed, or the engine's "constraint").
            if not job.matcher.is_error() and not job.matcher.is_stopped():
                job.consume(int(token))
        except Exception as exc:
            self._problem = _reason(f"{type(exc).__name__}: {exc}")

    def next(self) -> tuple[set[int], set[int]]:
        # The token-list path (ExLlamaV2Sampler.sample, "elif len(filters) > 0"):
        # the allowed ids, and no "end" ids (the engine ends a complete value).
        self.prepare_logit_mask()
        if self._open:
            return set(range(self.vocab_size)), set()
        allowed = np.flatnonzero(~self._forbidden(self.vocab_size))
        return set(allowed.tolist()), set()

    def use_background_worker(self) -> bool:
        return True

    def can_mask_logits(self) -> bool:
        return True

    def prepare_logit_mask(self) -> bool:
        """Fill the bitmask for the next token. True, as the sampler asserts."""
        job = self.job
        if job is None or self.closed:
            return True
        self._open = False
        try:
            if self._problem is None:
                started = time.thread_time()
                # llguidance writes the words in place, without the GIL.
                job.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self.words * 4)
                # This thread's CPU time (a filter_pool thread's, or the
                # sampler's for a job's first mask), as the CPU engine charges.
                job.charge(time.thread_time() - started)
        except Exception as exc:
            self._problem = _reason(f"{type(exc).__name__}: {exc}")
        if self.problem is not None:
            self._open = True
        elif not self._bits.any():
            self._problem = "the constraint allows no token here"
            self._open = True
        return True

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (one job's ``[vocab]`` row, float, on the CPU) with the
        forbidden tokens at -inf, changed in place."""
        if self.closed or self._open:
            return logits
        forbidden = self._forbidden(logits.shape[-1])
        if logits.device.type == "cpu":
            # In place through numpy, on this thread only. (The sampler may run
            # in the generator's sampling_pool, outside the engine thread's
            # inference mode; numpy's write is no torch in-place op, so an
            # inference tensor would not refuse it either.)
            # A masked copy costs what the mask's runs of equal bits cost
            # the branch predictor: grammars' masks are long runs (tens of
            # microseconds for 49,152 ids), random bits the worst case
            # (about 3 ns an id).
            np.copyto(logits.numpy(), -np.inf, where=forbidden)
        else:
            with torch.inference_mode():
                where = torch.from_numpy(forbidden).to(logits.device)
                logits.masked_fill_(where, float("-inf"))
        return logits

    def _forbidden(self, width: int) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """The tokens the mask forbids, ``[width]`` bool; ids past its words too."""
        # Bit i of word j is token 32 * j + i (little-endian words and bits).
        inverted = np.invert(self._bits).view(np.uint8)
        forbidden = np.unpackbits(inverted, bitorder="little").view(np.bool_)
        if width <= forbidden.shape[0]:
            return forbidden[:width]
        return np.concatenate([forbidden, np.ones(width - forbidden.shape[0], dtype=np.bool_)])


def _reason(message: str) -> str:
    return ("the constraint failed: " + " ".join(message.split()))[:500]


@functools.cache
def filter_class() -> type[Any]:
    """``GrammarMask`` as an ``ExLlamaV2Filter`` subclass; imports exllamav2.

    Build one per job: ``filter_class()(model, tokenizer, job_matcher, vocab_size)``.
    From ``ExLlamaV2Filter`` it keeps the scheduling the generator relies on
    (``background_prepare_logit_mask``, ``get_next``, ``background_drop``);
    ``clone`` is refused, since a filter is never shared or reused.
    """
    from exllamav2.generator.filters import ExLlamaV2Filter

    class LLGuidanceFilter(GrammarMask, ExLlamaV2Filter):  # type: ignore[misc]
        def __init__(self, model: Any, tokenizer: Any, job: JobMatcher, vocab_size: int) -> None:
            # Sets model, tokenizer, sequence_str and background_result.
            ExLlamaV2Filter.__init__(self, model, tokenizer)
            GrammarMask.__init__(self, job, vocab_size)

        def clone(self, c: Any = None) -> Any:
            raise NotImplementedError("a constraint's filter belongs to one job")

    return LLGuidanceFilter
