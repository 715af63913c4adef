"""A generation's constraint, compiled off the event loop: the request's own
(structured output) or the one its tools imply (tool calls), from the
grammar cache or in a worker thread of its own limiter, with the errors a
client can act on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from trioserve.vocabulary.constraint import Constraint, ConstraintError
from trioserve.vocabulary.tools import ToolFormat, ToolUse, schema_options, tool_grammar

if TYPE_CHECKING:
    from trioserve.engine.grammars import CompiledGrammar, Grammars

__all__ = ["compile_constraint", "tools_constraint"]


class ConstraintRefused(Exception):
    """Raised by :func:`compile_constraint`; ``field`` and ``wire_name``
    name what the client sent."""

    def __init__(self, message: str, field: str, wire_name: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.wire_name = wire_name


def tools_constraint(
    use: ToolUse, fmt: ToolFormat, *, special_trigger: bool, answer: Constraint | None = None
) -> Constraint | None:
    """The grammar that keeps the calls of ``use`` valid (and, with
    ``answer``, a reply that calls none to that format), or None when it
    allows none (``tool_choice: "none"``)."""
    grammar = tool_grammar(use, fmt, special_trigger=special_trigger, answer=answer)
    return None if grammar is None else Constraint("grammar", grammar, "tools")


async def compile_constraint(
    constraint: Constraint,
    *,
    grammars: Grammars,
    limiter: trio.CapacityLimiter,
    observer: Any,
    tools: ToolUse | None = None,
    answer: Constraint | None = None,
) -> CompiledGrammar:
    """``constraint`` compiled for the model. Raises :class:`ConstraintRefused`
    (a tools grammar that fails is traced to the tool whose parameters are to
    blame: ``tools[i].function.parameters``)."""
    compiled = grammars.cached(constraint)
    if compiled is not None:
        if observer is not None:
            observer.constraint(constraint.kind, "cached")
        return compiled
    started = trio.current_time()
    try:
        compiled = await trio.to_thread.run_sync(grammars.compile, constraint, limiter=limiter)
    except ConstraintError as exc:
        if observer is not None:
            observer.constraint(constraint.kind, "refused", trio.current_time() - started)
        if tools is not None:
            raise await _blame(tools, grammars, limiter, str(exc), answer) from None
        raise ConstraintRefused(
            f"the {constraint.kind.replace('_', ' ')} cannot be used: {exc}",
            "constraint",
            constraint.field,
        ) from None
    if observer is not None:
        observer.constraint(constraint.kind, "compiled", compiled.compile_seconds)
    return compiled


async def _blame(
    tools: ToolUse,
    grammars: Grammars,
    limiter: trio.CapacityLimiter,
    reason: str,
    answer: Constraint | None = None,
) -> ConstraintRefused:
    """The first tool whose parameters do not compile alone, the answer's
    format beside them, or the whole."""
    for index, tool in enumerate(tools.tools):
        parameters = dict(tool.parameters or {"type": "object"})
        options = {"lenient": schema_options(tool)["lenient"]}
        schema = Constraint.json_schema({**parameters, "x-guidance": options})
        try:
            await trio.to_thread.run_sync(grammars.compile, schema, limiter=limiter)
        except ConstraintError as exc:
            where = f"tools[{index}].function.parameters"
            return ConstraintRefused(
                f"{where} cannot be used as a JSON schema: {exc}", "tools", where
            )
    if answer is not None:
        try:
            await trio.to_thread.run_sync(grammars.compile, answer, limiter=limiter)
        except ConstraintError as exc:
            return ConstraintRefused(
                f"the {answer.kind.replace('_', ' ')} cannot be used: {exc}",
                "constraint",
                answer.field,
            )
    return ConstraintRefused(
        f"the {len(tools.tools)} tools cannot be constrained together: {reason}",
        "tools",
        "tools",
    )
