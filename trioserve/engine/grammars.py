"""Constrained decoding with llguidance: compiling a request's
:class:`~trioserve.vocabulary.constraint.Constraint` for a model's tokenizer, and
the per-step token masks.

:class:`Grammars` (one per loaded model) compiles a constraint -- in a worker
thread, never on the event loop or the engine thread -- into a
:class:`CompiledGrammar`, cached by content. An engine gives each constrained
job its own matcher (:meth:`CompiledGrammar.matcher`, a copy of the compiled
one: nothing is shared between jobs), asks it for the allowed tokens before
each sample (:class:`MaskRows` fills one preallocated bitmask for the
constrained rows of a step) and feeds it each sampled token.

Bounds, so that no request can freeze the server or grow it without limit:

* before compiling, the request's own size
  (:data:`~trioserve.vocabulary.constraint.CONSTRAINT_LIMITS`: schema bytes,
  regex and grammar characters, choices), checked by the doors;
* while compiling and at every step, llguidance's parser limits
  (:data:`PARSER_LIMITS`): grammar size, lexer states (memory), and the
  "fuel" a lexer or parser may burn per step (time). A matcher that runs
  out fails its own job with llguidance's reason; the other jobs go on.

Why llguidance (docs/structured-output.md has the figures): one abi3 wheel
with no dependencies and no torch, JSON schema with ``$ref``, ``anyOf`` and
formats, regex, Lark and GBNF, and a mask in tens of microseconds on a
49,152-token vocabulary without precomputing anything per schema.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs
import llguidance
import numpy as np
import torch

from trioserve.vocabulary.constraint import Constraint, ConstraintError, grammar_syntax

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = [
    "MASK_BUDGET",
    "PARSER_LIMITS",
    "CompiledGrammar",
    "Grammars",
    "JobMatcher",
    "MaskBudget",
    "MaskRows",
    "grammar_of",
]

#: llguidance's parser limits, tighter than its defaults where a hostile
#: grammar could otherwise hold the engine thread or memory: per step at most
#: about 4 ms of lexer work and 1 ms of parser work (its documented speeds:
#: ~14 k fuel and ~20 k items per ms), and at most 20,000 lexer states
#: (1-2 kB each: 40 MB at worst per grammar, against 500 MB by default).
PARSER_LIMITS: Final[Mapping[str, int]] = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 50_000,
    "step_max_items": 20_000,
    "max_lexer_states": 20_000,
    "max_grammar_size": 200_000,
}

#: JSON schemas compile to compact JSON with the usual separators (as Python's
#: ``json.dumps`` writes it): free whitespace would let a small model pad an
#: object with newlines until ``max_tokens`` runs out. A schema's own
#: ``x-guidance`` options override these.
_JSON_DEFAULTS: Final[JsonCompileOptions] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def grammar_of(constraint: Constraint) -> str:
    """llguidance's grammar for this constraint (raises ValueError for a
    grammar whose GBNF cannot be converted, or a choice list that is not one)."""
    if constraint.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(
            constraint.text, defaults=_JSON_DEFAULTS
        )
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.text)
    if constraint.kind == "choice":
        choices = json.loads(constraint.text)
        # A Lark alternative of string literals, each written as JSON.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices)
        )
    if grammar_syntax(constraint.text) == "gbnf":
        return llguidance.grammar_from("gbnf", constraint.text)
    return llguidance.LLMatcher.grammar_from_lark(constraint.text)


def _limits() -> llguidance.LLParserLimits:
    limits = PARSER_LIMITS
    return llguidance.LLParserLimits(
        max_items_in_row=limits["max_items_in_row"],
        initial_lexer_fuel=limits["initial_lexer_fuel"],
        step_lexer_fuel=limits["step_lexer_fuel"],
        step_max_items=limits["step_max_items"],
        max_lexer_states=limits["max_lexer_states"],
        max_grammar_size=limits["max_grammar_size"],
        verbose_errors=False,
    )


def _one_line(message: str, limit: int = 500) -> str:
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@attrs.frozen
class MaskBudget:
    """How much CPU time a job's masks may take: at most ``window *
    seconds_per_token`` over its last ``window`` steps.

    A usual grammar's mask costs tens of microseconds; a step that meets a
    lexer state never seen before walks the whole token trie once (about
    10 ms for 49,152 ids on this project's CPUs), which a usual grammar does
    a few times per answer. A hostile one (a regex whose automaton explodes)
    does it at every step, and the step of every other job waits for it: so a
    job over the budget fails, alone, with the figure. The engine thread's
    own CPU time is measured (not wall time), so a busy machine does not
    fail a job for others' work.
    """

    window: int = 32
    seconds_per_token: float = 0.004

    @property
    def seconds(self) -> float:
        return self.window * self.seconds_per_token


MASK_BUDGET: Final = MaskBudget()


@attrs.frozen(eq=False)
class CompiledGrammar:
    """A constraint compiled for one model's tokenizer. The matcher it
    holds is never advanced: each job gets its own copy."""

    constraint: Constraint
    _template: llguidance.LLMatcher = attrs.field(repr=False)
    #: Seconds the compilation took (grammar, lexer and the first mask).
    compile_seconds: float
    #: What the cache charges for it: the constraint's and the grammar's text.
    nbytes: int
    #: What its jobs' masks may cost.
    budget: MaskBudget = MASK_BUDGET

    def matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the output (a copy: cheap)."""
        return self._template.deep_copy()


class Grammars:
    """Compiles constraints for one model and caches them by content.

    ``tokenizer_json`` is the model's ``tokenizer.json`` text; ``vocab_size``
    the width of its logits (which may exceed the tokenizer's ids);
    ``eos_ids`` the ids that end a job, which a complete value allows.
    Thread-safe: compile from worker threads (it holds the GIL only briefly;
    llguidance builds grammars without it). The tokenizer's token trie is
    built on first use (about a quarter of a second for 49,152 ids).
    """

    def __init__(
        self,
        tokenizer_json: str,
        *,
        vocab_size: int,
        eos_ids: Iterable[int],
        cache_bytes: int = 16 * 2**20,
        budget: MaskBudget = MASK_BUDGET,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.budget = budget
        self.vocab_size = vocab_size
        self.eos_ids = sorted(set(eos_ids))
        self.cache_bytes = cache_bytes
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[Constraint, CompiledGrammar] = (
            collections.OrderedDict()
        )
        self._cached_bytes = 0

    @classmethod
    def for_model(
        cls, model_dir: Path, *, vocab_size: int, eos_ids: Iterable[int], **kwargs: Any
    ) -> Grammars:
        """For the Hugging Face directory ``model_dir`` (its ``tokenizer.json``)."""
        text = (Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8")
        return cls(text, vocab_size=vocab_size, eos_ids=eos_ids, **kwargs)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_ids
                )
            return self._tokenizer

    def cached(self, constraint: Constraint) -> CompiledGrammar | None:
        """The compiled grammar when the cache holds it (cheap: for the event
        loop, to skip the worker thread)."""
        with self._lock:
            found = self._cache.get(constraint)
            if found is not None:
                self._cache.move_to_end(constraint)
            return found

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """``constraint`` compiled (or from the cache). Blocking. Raises
        :class:`ConstraintError` with llguidance's reason."""
        found = self.cached(constraint)
        if found is not None:
            return found
        tokenizer = self.tokenizer
        started = time.perf_counter()
        try:
            grammar = grammar_of(constraint)
        except (ValueError, TypeError) as exc:
            raise ConstraintError(_one_line(str(exc))) from None
        try:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=_limits())
        except (ValueError, TypeError) as exc:  # text Rust cannot take (a lone surrogate)
            raise ConstraintError(_one_line(str(exc))) from None
        if matcher.is_error():
            raise ConstraintError(_one_line(matcher.get_error()))
        # The first mask builds the lexer's first states, and shows a grammar
        # that allows no token at all, before any job is queued.
        probe = matcher.deep_copy()
        MaskRows(self.vocab_size, 1).fill([probe])
        if probe.is_error():
            reason = probe.get_error()
            if reason.startswith("NoExtension"):
                reason = "no text satisfies it (not even an empty one)"
            raise ConstraintError(_one_line(reason))
        compiled = CompiledGrammar(
            constraint,
            matcher,
            compile_seconds=time.perf_counter() - started,
            nbytes=constraint.nbytes + len(grammar),
            budget=self.budget,
        )
        self._keep(compiled)
        return compiled

    def _keep(self, compiled: CompiledGrammar) -> None:
        if compiled.nbytes > self.cache_bytes:
            return
        with self._lock:
            key = compiled.constraint
            if key in self._cache:
                return
            self._cache[key] = compiled
            self._cached_bytes += compiled.nbytes
            while self._cached_bytes > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.nbytes

    @property
    def cache_statistics(self) -> tuple[int, int]:
        """Grammars cached and the bytes charged for them."""
        with self._lock:
            return len(self._cache), self._cached_bytes


@attrs.define(eq=False)
class JobMatcher:
    """One job's matcher and what its masks cost."""

    matcher: llguidance.LLMatcher
    budget: MaskBudget = MASK_BUDGET
    #: Mask CPU seconds of the job so far, and of its last ``budget.window`` steps.
    seconds: float = 0.0
    recent: collections.deque[float] = attrs.field(init=False)
    steps: int = 0

    def __attrs_post_init__(self) -> None:
        self.recent = collections.deque(maxlen=self.budget.window)

    @classmethod
    def start(cls, compiled: CompiledGrammar) -> JobMatcher:
        return cls(compiled.matcher(), compiled.budget)

    def charge(self, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1
        self.recent.append(seconds)

    def problem(self) -> str | None:
        """Why the job cannot go on (the matcher failed, or its masks are
        over the budget), or None."""
        if self.matcher.is_error():
            return f"the constraint failed: {_one_line(self.matcher.get_error(), 400)}"
        spent = sum(self.recent)
        if spent > self.budget.seconds:
            return (
                f"the constraint is too costly to enforce: its masks took {spent * 1000:.0f} ms"
                f" of CPU time over its last {len(self.recent)} tokens (the limit is"
                f" {self.budget.seconds * 1000:.0f} ms over {self.budget.window}); simplify it"
            )
        return None

    def consume(self, token: int) -> None:
        """Advance past the sampled ``token`` (an error state shows in :meth:`problem`)."""
        self.matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """The value is complete: nothing but the end may follow."""
        return self.matcher.is_stopped() and not self.matcher.is_error()


class MaskRows:
    """One preallocated bitmask for a step's constrained rows (32 tokens per
    int32 word, as llguidance writes it), and its expansion to the
    sampler's ``[rows, vocab]`` bool mask.

    The expansion runs in numpy, on one thread: torch would split a tensor
    of this size over its thread pool, and waking the pool costs more than
    the work (tens of milliseconds on a busy two-core machine, against tens
    of microseconds)."""

    def __init__(self, vocab_size: int, rows: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._bits = np.zeros((max(1, rows), self.words), dtype=np.int32)

    def fill(self, matchers: Sequence[llguidance.LLMatcher | JobMatcher]) -> torch.Tensor:
        """The allowed tokens of each matcher: ``[len(matchers), vocab]``
        bool. A matcher in error allows nothing (check ``is_error()``); a
        :class:`JobMatcher` is charged its mask's CPU time."""
        if len(matchers) > self._bits.shape[0]:
            self._bits = np.zeros((len(matchers), self.words), dtype=np.int32)
        bits = self._bits[: len(matchers)]
        row_bytes = self.words * 4
        for row, matcher in enumerate(matchers):
            target = bits[row].ctypes.data
            started = time.thread_time()
            # llguidance writes the row in place, without the GIL.
            if isinstance(matcher, JobMatcher):
                matcher.matcher.unsafe_compute_mask_ptr(target, row_bytes)
                matcher.charge(time.thread_time() - started)
            else:
                matcher.unsafe_compute_mask_ptr(target, row_bytes)
        # Bit i of word j is token 32 * j + i (little-endian words and bits).
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(unpacked[:, : self.vocab_size].view(np.bool_))
