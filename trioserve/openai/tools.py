"""The tools of a chat request: ``tools``, ``tool_choice``,
``parallel_tool_calls``, and the legacy ``functions`` / ``function_call``,
read into one :class:`~trioserve.vocabulary.tools.ToolUse`.

Bounds before any work: at most 128 tools (OpenAI's own limit), names of 1 to
64 characters of letters, digits, ``_`` and ``-``, each only once, a
description of at most 4,096 characters, and each tool's ``parameters`` a JSON
schema within the same ``max_schema_bytes`` as structured output.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from trioserve.vocabulary.rules import BadValue
from trioserve.vocabulary.tools import Tool, ToolUse

from .fields import _rule
from .params import BadParam, is_text, show

__all__ = ["MAX_TOOLS", "TOOL_PARAMS", "read_tools"]

MAX_TOOLS: Final = 128
_MAX_DESCRIPTION: Final = 4096
_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")

#: Every body field that carries tools.
TOOL_PARAMS: Final = frozenset(
    {"tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"}
)


def read_tools(fields: Mapping[str, Any]) -> ToolUse | None:
    """The tools of a body's tool fields, or None when it has none (or an
    empty list). Raises :class:`BadParam` naming the field."""
    tools_key = "tools"
    listed = fields.get("tools")
    if fields.get("functions") not in (None, []):
        if listed not in (None, []):
            raise BadParam("functions", "give tools or functions, not both")
        tools_key, listed = "functions", fields["functions"]
    choice_key = "tool_choice"
    choice = fields.get("tool_choice")
    if fields.get("function_call") is not None:
        if choice is not None:
            raise BadParam("function_call", "give tool_choice or function_call, not both")
        choice_key, choice = "function_call", fields["function_call"]
    parallel = fields.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadParam(
            "parallel_tool_calls",
            f"parallel_tool_calls must be true or false, got {show(parallel)}",
        )
    tools = _tools(tools_key, listed)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise BadParam(choice_key, f"{choice_key} names a tool, but the request has no tools")
        return None
    mode, named = _choice(choice_key, choice, tools)
    return ToolUse(
        tools=tools,
        choice=mode,
        named=named,
        parallel=True if parallel is None else parallel,
    )


def _tools(key: str, listed: Any) -> tuple[Tool, ...]:
    if listed is None:
        return ()
    if not isinstance(listed, list):
        raise BadParam(key, f"{key} must be a list of tools, got {show(listed)}")
    if len(listed) > MAX_TOOLS:
        raise BadParam(key, f"{key} may hold at most {MAX_TOOLS} tools, got {len(listed)}")
    tools: list[Tool] = []
    names: set[str] = set()
    for index, item in enumerate(listed):
        where = f"{key}[{index}]"
        if not isinstance(item, dict):
            raise BadParam(where, f"{where} must be an object, got {show(item)}")
        if key == "tools":
            for field in item:
                if field not in ("type", "function"):
                    raise BadParam(f"{where}.{field}", f"unknown field {show(field)} in {where}")
            if item.get("type") != "function":
                raise BadParam(
                    f"{where}.type",
                    f"{where}.type must be 'function', got {show(item.get('type'))}",
                    "unsupported_parameter",
                )
            function, where = item.get("function"), f"{where}.function"
            if not isinstance(function, dict):
                raise BadParam(where, f"{where} must be an object, got {show(function)}")
        else:
            function = item
        tool = _tool(function, where)
        if tool.name in names:
            raise BadParam(f"{where}.name", f"{where}.name {show(tool.name)} is given twice")
        names.add(tool.name)
        tools.append(tool)
    return tuple(tools)


def _tool(function: dict[str, Any], where: str) -> Tool:
    for field in function:
        if field not in ("name", "description", "parameters", "strict"):
            raise BadParam(f"{where}.{field}", f"unknown field {show(field)} in {where}")
    name = function.get("name")
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise BadParam(
            f"{where}.name",
            f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {show(name)}",
        )
    description = function.get("description")
    if description is not None and (
        not is_text(description) or len(description) > _MAX_DESCRIPTION
    ):
        raise BadParam(
            f"{where}.description",
            f"{where}.description must be a string of at most {_MAX_DESCRIPTION} characters",
        )
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadParam(
            f"{where}.strict", f"{where}.strict must be true or false, got {show(strict)}"
        )
    parameters = function.get("parameters")
    if parameters is not None:
        try:
            parameters = _rule("json_schema").read(parameters)
        except BadValue as exc:
            raise BadParam(f"{where}.parameters", f"{where}.parameters {exc}") from None
    return Tool(
        name=name, description=description, parameters=parameters or None, strict=bool(strict)
    )


def _choice(key: str, choice: Any, tools: tuple[Tool, ...]) -> tuple[Any, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict):
        # tool_choice {"type": "function", "function": {"name": ...}};
        # function_call {"name": ...}.
        inner = choice.get("function") if key == "tool_choice" else choice
        name = inner.get("name") if isinstance(inner, dict) else None
        if key == "tool_choice" and choice.get("type") != "function":
            raise BadParam(f"{key}.type", f"{key}.type must be 'function'")
        if not isinstance(name, str):
            raise BadParam(key, f"{key} must name a function, got {show(choice)}")
        if name not in {t.name for t in tools}:
            raise BadParam(key, f"{key} names {show(name)}, which is not one of the tools")
        return "required", name
    raise BadParam(
        key,
        f"{key} must be 'none', 'auto', 'required' or a named function, got {show(choice)}",
    )
