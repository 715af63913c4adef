"""Constraints on the ExLlamaV2 engine: an ``ExLlamaV2Filter`` over llguidance.

Each constrained job gets its own filter, over its own matcher
(:meth:`~trioserve.engine.grammars.CompiledGrammar.matcher`): nothing is
shared or reused between jobs. The filter takes ExLlamaV2 0.3.2's mask path
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
  in place, with plain tensor ops (no ``torch.compile``); the sampler calls it
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
it refuses) is kept (:attr:`GrammarMask.problem`); the mask then allows every
token, so that the sampler still draws one, and the engine fails that job
alone before its token is released. :meth:`GrammarMask.close` ends a filter
whose job is gone: a mask still queued for it computes nothing.

``exllamav2`` is imported only by :func:`filter_class` (called by the engine
once it has imported exllamav2 itself): :class:`GrammarMask` holds all the
logic and needs only torch and llguidance.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import llguidance
import torch

__all__ = ["GrammarMask", "filter_class"]


class GrammarMask:
    """One job's constraint as ExLlamaV2 0.3.2's filter API wants it (see the
    module docstring); :func:`filter_class` mixes it into ``ExLlamaV2Filter``.

    ``vocab_size`` is the model's vocabulary, the width of the grammar's
    tokenizer (:class:`~trioserve.engine.grammars.Grammars`); the logits
    ExLlamaV2 samples may be wider (its ``padded_vocab_size``, a multiple of
    32): ids past the vocabulary are never allowed.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher: llguidance.LLMatcher | None = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._bits = torch.zeros(self.words, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)
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
        matcher = self.matcher
        if matcher is not None and matcher.is_error():
            return _reason(matcher.get_error())
        return None

    @property
    def complete(self) -> bool:
        """The value is complete: the grammar allows nothing but the end."""
        matcher = self.matcher
        return (
            matcher is not None
            and self._problem is None
            and matcher.is_stopped()
            and not matcher.is_error()
        )

    def close(self) -> None:
        """The job is gone: forget the matcher; whatever ExLlamaV2 still asks
        of this filter does nothing."""
        self.closed = True
        self.matcher = None

    # -- ExLlamaV2Filter's API (exllamav2/generator/filters/base.py, v0.3.2) -----------

    def begin(self, prefix_str: str = "") -> None:
        # Called once, before the job's first sample (receive_logits, when
        # new_tokens == 0). The matcher is the job's own and new: nothing to
        # reset, and no prefix to consume (the constraint starts at the output).
        pass

    def feed(self, token: Any) -> None:
        matcher = self.matcher
        if matcher is None or self._problem is not None:
            return
        try:
            # A stopped matcher takes nothing more; its job ends at this token
            # (the end the grammar allowed, or the engine's "constraint").
            if not matcher.is_error() and not matcher.is_stopped():
                matcher.consume_token(int(token))
        except Exception as exc:
            self._problem = _reason(f"{type(exc).__name__}: {exc}")

    def next(self) -> tuple[set[int], set[int]]:
        # The token-list path (ExLlamaV2Sampler.sample, "elif len(filters) > 0"):
        # the allowed ids, and no "end" ids (the engine ends a complete value).
        self.prepare_logit_mask()
        if self._open:
            return set(range(self.vocab_size)), set()
        allowed = self._allowed(self.words * 32)[: self.vocab_size]
        return set(torch.nonzero(allowed).flatten().tolist()), set()

    def use_background_worker(self) -> bool:
        return True

    def can_mask_logits(self) -> bool:
        return True

    def prepare_logit_mask(self) -> bool:
        """Fill the bitmask for the next token. True, as the sampler asserts."""
        matcher = self.matcher
        if matcher is None or self.closed:
            return True
        self._open = False
        try:
            if self._problem is None:
                # llguidance writes the words in place, without the GIL.
                matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self.words * 4)
        except Exception as exc:
            self._problem = _reason(f"{type(exc).__name__}: {exc}")
        if self.problem is not None:
            self._open = True
        elif not bool(self._bits.any()):
            self._problem = "the constraint allows no token here"
            self._open = True
        return True

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (one job's ``[vocab]`` row, float, on the CPU) with the
        forbidden tokens at -inf, changed in place."""
        if self.closed or self._open:
            return logits
        # The sampler may run in the generator's sampling_pool, outside the
        # engine thread's inference mode (thread-local); the logits are a view
        # of its pinned buffer (not an inference tensor), but should a
        # release hand an inference tensor, an in-place change outside
        # inference mode would raise.
        with torch.inference_mode():
            allowed = self._allowed(logits.shape[-1])
            logits.masked_fill_(~allowed, -math.inf)
        return logits

    def _allowed(self, width: int) -> torch.Tensor:
        """The bitmask as ``[width]`` bool; ids past its words are forbidden."""
        expanded = ((self._bits.unsqueeze(-1) >> self._shifts) & 1).reshape(-1).bool()
        if width <= expanded.shape[0]:
            return expanded[:width]
        tail = torch.zeros(width - expanded.shape[0], dtype=torch.bool)
        return torch.cat([expanded, tail])


def _reason(message: str) -> str:
    return ("the constraint failed: " + " ".join(message.split()))[:500]


@functools.cache
def filter_class() -> type[Any]:
    """``GrammarMask`` as an ``ExLlamaV2Filter`` subclass; imports exllamav2.

    Build one per job: ``filter_class()(model, tokenizer, matcher, vocab_size)``.
    From ``ExLlamaV2Filter`` it keeps the scheduling the generator relies on
    (``background_prepare_logit_mask``, ``get_next``, ``background_drop``);
    ``clone`` is refused, since a filter is never shared or reused.
    """
    from exllamav2.generator.filters import ExLlamaV2Filter

    class LLGuidanceFilter(GrammarMask, ExLlamaV2Filter):  # type: ignore[misc]
        def __init__(
            self, model: Any, tokenizer: Any, matcher: llguidance.LLMatcher, vocab_size: int
        ) -> None:
            # Sets model, tokenizer, sequence_str and background_result.
            ExLlamaV2Filter.__init__(self, model, tokenizer)
            GrammarMask.__init__(self, matcher, vocab_size)

        def clone(self, c: Any = None) -> Any:
            raise NotImplementedError("a constraint's filter belongs to one job")

    return LLGuidanceFilter
