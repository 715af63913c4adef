"""A generation's thinking section (a thinking chat template's, with
``Generations.reasoning``): where the generation starts in it, read from the
prompt rendered early, the splitter that keeps its reasoning apart from its
answer, and the constraint that holds the answer after the thinking, not
the thinking (:func:`~trioserve.vocabulary.reasoning.thinking_grammar`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from trioserve.vocabulary.constraint import Constraint
from trioserve.vocabulary.reasoning import (
    ReasoningFormat,
    ReasoningSplitter,
    not_opening,
    thinking_grammar,
)
from trioserve.vocabulary.request import GenerationRequest
from trioserve.vocabulary.tools import ToolFormat, answer_rule

from .request import InvalidGeneration

__all__ = ["after_thinking", "find_thinking", "kept_markers"]


async def find_thinking(
    fmt: ReasoningFormat | None,
    render: Callable[[GenerationRequest], Awaitable[str]],
    request: GenerationRequest,
) -> tuple[str | None, ReasoningSplitter | None]:
    """The prompt, rendered by ``render`` (None when nothing was rendered here), and the
    splitter of the generation's text: None when the template does not
    think, when the prompt closed the section (thinking off), or when a
    prefill continues the answer itself. A request that keeps the reasoning
    in its answer (``separate_reasoning`` false) has one too: the thinking's
    budget and the answer's format hold all the same; only the text is not
    split (:meth:`Generation._release`)."""
    if fmt is None or request.messages is None or request.prompt_ids is not None:
        return None, None
    rendered = await render(request)
    if request.assistant_prefix:
        return rendered, None
    section = fmt.section(rendered)
    if section == "after":
        return rendered, None
    return rendered, ReasoningSplitter(fmt, section)


async def after_thinking(
    constraint: Constraint | None,
    splitter: ReasoningSplitter | None,
    budget: int | None,
    encode: Callable[[str], Awaitable[list[int]]],
) -> Constraint | None:
    """The constraint that holds the answer after the thinking, not the
    thinking, and closes the thinking after ``budget`` tokens (even without
    a constraint). A grammar of the client's own cannot be set after the
    thinking: a 400 naming it."""
    if splitter is None or (constraint is None and budget is None):
        return constraint
    fmt = splitter.fmt
    # Where the model may open the section itself, a free answer must not
    # open it: the splitter would take it all for thinking (the budget and
    # the answer's format both bypassed).
    guard = not_opening(fmt) if splitter.start == "before" else ""
    if constraint is None:
        answer = f"start: ANSWER_TEXT\nANSWER_TEXT: /(.|\\n)*/{guard}"
    elif constraint.field == "tools":
        # The tools grammar's free text (auto), guarded alike.
        answer = constraint.text.replace("TEXT: /(.|\\n)*/", "TEXT: /(.|\\n)*/" + guard)
    elif constraint.kind == "regex":
        answer = (
            f"%llguidance {{}}\nstart: ANSWER_TEXT\nANSWER_TEXT: {answer_rule(constraint)}{guard}"
        )
    elif constraint.kind in ("json_schema", "choice"):
        answer = "%llguidance {}\nstart: " + answer_rule(constraint)
    else:
        raise InvalidGeneration(
            "a grammar cannot follow this model's thinking section: give a JSON schema, a"
            " regex or choices, or turn thinking off (reasoning_effort: none)",
            "constraint",
            wire_name=constraint.field,
        )
    special = all([len(await encode(marker)) == 1 for marker in (fmt.start, fmt.end)])
    grammar = thinking_grammar(answer, fmt, splitter.start, budget=budget, special=special)
    return Constraint("grammar", grammar, "constraint" if constraint is None else constraint.field)


def kept_markers(fmt: ReasoningFormat | None, tools: ToolFormat | None) -> frozenset[str]:
    """The texts a reply is parsed by (a thinking template's markers, the
    tool calls'), written even where special tokens are skipped."""
    markers: set[str] = set()
    if fmt is not None:
        markers.update((fmt.start, fmt.end))
    if tools is not None:
        markers.update((tools.trigger, tools.open, tools.begin, tools.end, tools.close))
    markers.discard("")
    return frozenset(markers)
