"""Reasoning apart from the answer: the markers of a chat template's
thinking section, read from the template (and the tokenizer), the split of a
generation's text into its reasoning and its answer as it streams, and the
grammar that lets a constraint hold the answer after the thinking, not the
thinking. No I/O.

A template thinks when it handles a known pair of markers (``<think>`` ...
``</think>`` of Qwen3, QwQ and DeepSeek-R1, ``<|START_THINKING|>`` of
Command A, ``[THINK]`` of Magistral, ``<seed:think>`` of Seed-OSS,
``◁think▷`` of Kimi): it writes the end marker (to drop past reasoning from
earlier turns, or to close an empty section when thinking is off). Whether a
generation starts inside the section is read from its rendered prompt: a
generation prompt that ends with the start marker (DeepSeek-R1's, a
thinking-only Qwen3's) has opened it, one that ends with the end marker
(Qwen3's with ``enable_thinking`` false) has closed it, and otherwise the
model may open it itself as its first words.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Final, Literal

import attrs

__all__ = [
    "KNOWN_MARKERS",
    "ReasoningFormat",
    "ReasoningSplitter",
    "Section",
    "not_opening",
    "reasoning_format",
    "thinking_grammar",
]

#: The thinking markers of the model families that write them, in the order
#: they are tried.
KNOWN_MARKERS: Final = (
    ("<think>", "</think>"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("[THINK]", "[/THINK]"),
    ("<seed:think>", "</seed:think>"),
    ("◁think▷", "◁/think▷"),
)

#: Where a generation starts: inside the section (the prompt opened it),
#: after it (the prompt closed it: thinking off), or before it (the model
#: may open it).
Section = Literal["inside", "after", "before"]


@attrs.frozen
class ReasoningFormat:
    """A template's thinking markers."""

    start: str
    end: str

    def section(self, prompt: str) -> Section:
        """Where a generation of ``prompt`` (rendered) starts."""
        tail = prompt.rstrip()
        if tail.endswith(self.start):
            return "inside"
        if tail.endswith(self.end):
            return "after"
        return "before"


def reasoning_format(
    template_source: str | None, vocabulary: Iterable[str] | None = None
) -> ReasoningFormat | None:
    """The thinking markers of a chat template, or None when it has none. A
    pair counts when the template writes its end marker; with a
    ``vocabulary`` (the tokenizer's added tokens), a pair the tokenizer has
    as tokens is preferred (a template that merely mentions a marker in
    text loses to one whose model was trained on it)."""
    if not template_source:
        return None
    found = [
        ReasoningFormat(start, end)
        for start, end in KNOWN_MARKERS
        if end in template_source and start in template_source
    ]
    if not found:
        return None
    if vocabulary is not None:
        tokens = set(vocabulary)
        for fmt in found:
            if fmt.start in tokens and fmt.end in tokens:
                return fmt
    return found[0]


@attrs.define
class ReasoningSplitter:
    """Released text in, ``("reasoning" | "content", text)`` pieces out, as it
    streams. Text that may be the start of a marker is held until the next
    piece says; :meth:`finish` gives what is held. Whitespace between the
    end marker and the answer is dropped, as is whitespace before the start
    marker and before the first words of the thinking."""

    fmt: ReasoningFormat
    #: Where the generation starts.
    start: Section = "before"
    #: Where the text is now: a section's place, or in the answer.
    where: str = attrs.field(init=False)
    _held: str = attrs.field(init=False, default="")
    #: Whether any reasoning has been given yet.
    _thought: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self.where = self.start

    def feed(self, text: str) -> list[tuple[Literal["reasoning", "content"], str]]:
        out: list[tuple[Literal["reasoning", "content"], str]] = []
        text = self._held + text
        self._held = ""
        while text:
            if self.where == "before":
                stripped = text.lstrip()
                if stripped.startswith(self.fmt.start):
                    self.where = "inside"
                    text = stripped[len(self.fmt.start) :].lstrip("\n")
                    continue
                if self.fmt.start.startswith(stripped):
                    self._held = text  # whitespace, or the start of the marker
                    return out
                self.where = "content"
                continue
            if self.where == "inside":
                if not self._thought:
                    # The thinking's first words, not the newlines before them.
                    text = text.lstrip()
                    if not text:
                        return out
                index = text.find(self.fmt.end)
                if index >= 0:
                    if index:
                        self._thought = True
                        out.append(("reasoning", text[:index]))
                    self.where = "after"
                    text = text[index + len(self.fmt.end) :]
                    continue
                keep = _partial_suffix(text, self.fmt.end)
                if keep:
                    self._held = text[-keep:]
                    text = text[:-keep]
                if text:
                    self._thought = True
                    out.append(("reasoning", text))
                return out
            if self.where == "after":
                stripped = text.lstrip()
                if not stripped:
                    return out
                self.where = "content"
                text = stripped
                continue
            out.append(("content", text))
            return out
        return out

    def split(self, text: str, *, final: bool = False) -> tuple[str, str]:
        """The reasoning and the answer in ``text`` (and, ``final``, in what
        is held)."""
        pieces = self.feed(text) + (self.finish() if final else [])
        thought = "".join(piece for kind, piece in pieces if kind == "reasoning")
        return thought, "".join(piece for kind, piece in pieces if kind == "content")

    def finish(self) -> list[tuple[Literal["reasoning", "content"], str]]:
        """What is held, at the end: reasoning inside the section, else text."""
        held, self._held = self._held, ""
        if not held:
            return []
        if self.where == "inside":
            return [("reasoning", held)]
        if self.where == "before" and not held.strip():
            return []
        return [("content", held)]


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _regex_literal(text: str) -> str:
    """``text`` as a Lark regex matching it literally."""
    return re.escape(text).replace("/", "\\/")


def not_opening(fmt: ReasoningFormat) -> str:
    """A lexeme's ``& ~/.../`` operand: no text that opens the section
    (after whitespace, as :class:`ReasoningSplitter` reads it). An answer
    where the model may open the section must not: the splitter would take
    it for thinking, held neither to the budget nor to the answer's format."""
    return f" & ~/\\s*{_regex_literal(fmt.start)}(.|\\n)*/"


def thinking_grammar(
    answer_grammar: str,
    fmt: ReasoningFormat,
    where: Section,
    *,
    budget: int | None = None,
    special: bool = False,
) -> str:
    """A Lark grammar (llguidance's) whose ``start`` is the thinking section
    and then ``answer_grammar``'s start (renamed): the answer's constraint
    holds after the thinking, not in it. ``where``: the generation starts
    inside the section (the prompt opened it) or before it (the model may
    open it, or answer straight away). ``budget``: at most that many tokens
    of thinking, then the end marker is forced. ``special``: the markers are
    special tokens of the tokenizer, named as tokens."""
    lines = []
    renamed = False
    # Split on newlines only: str.splitlines also breaks at U+2028, U+0085
    # and the like, which JSON and Lark literals hold as they are.
    for line in answer_grammar.split("\n"):
        if line.startswith("start:"):
            line = "answer_start:" + line[len("start:") :]
            renamed = True
        lines.append(line)
    if not renamed:
        raise ValueError("the answer's grammar has no start rule")

    def marker(text: str) -> str:
        return text if special else _lit(text)

    attrs_ = "" if budget is None else f"[max_tokens={budget}]"
    if special:
        # A special token is never text: no text of the thought can be it.
        lines.append("THOUGHT: /(.|\\n)*/")
        lines.append(f"thought{attrs_}: THOUGHT")
        lines.append(f"think: thought {marker(fmt.end)} SPACE")
    elif budget is None:
        # The shortest text that ends with the end marker (a lazy lexeme, as
        # llguidance's docs write a thinking section of text markers): a
        # greedy thought would take the marker's first characters for more
        # thinking, and the model could never close the section itself.
        lines.append(f"thought[lazy]: /(.|\\n)*{_regex_literal(fmt.end)}/")
        lines.append("think: thought SPACE")
    else:
        # llguidance bounds only a greedy lexeme by max_tokens (a lazy one
        # runs on): so with text markers and a budget, the thinking runs to
        # the budget, where the end marker is forced (the model cannot close
        # it sooner, its first characters being taken for thinking).
        lines.append(f"THOUGHT: /(.|\\n)*/ & ~/(.|\\n)*{_regex_literal(fmt.end)}(.|\\n)*/")
        lines.append(f"thought{attrs_}: THOUGHT")
        lines.append(f"think: thought {marker(fmt.end)} SPACE")
    lines.append("SPACE: /[ \\t\\n]*/")
    if where == "inside":
        lines.append("start: think answer_start")
    else:
        lines.append(f"start: {marker(fmt.start)} think answer_start | answer_start")
    return "\n".join(lines)
