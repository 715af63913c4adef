"""The layers of docs/design.md, checked on the code: every import (those
under TYPE_CHECKING and inside functions too) points down or stays in its own
folder, no module imports itself back through others, each engine backend
keeps to its folder (neither imports the other; what both use is in engine/
itself), and no module is over the size the house style allows."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "trioserve"

#: The module trioserve/engine/__init__.py as a layer of its own.
ENGINE_LOADER = "trioserve.engine (loader)"

#: Higher may import lower; a layer may import itself; two layers of one rank
#: may not import each other. The ranks follow from docs/design.md's rules:
#: the vocabulary is the floor (no torch, no trio); the wire formats stand on
#: it alone, protocol/ beside the engines (neither knows the other) and
#: openai/ and anthropic/ below generation/ (they never see the trio
#: scheduler), neither importing the other; responses/ (OpenAI's Responses
#: API) on openai/ (its errors and field rules), still below generation/;
#: server/ routes and moves bytes above them all.
RANKS = {
    "trioserve": 7,  # the public __init__ re-exports every layer
    "trioserve.__main__": 8,
    "trioserve.cli": 7,
    "trioserve.server": 6,
    "trioserve.client": 5,
    "trioserve.generation": 4,
    "trioserve.openai": 3,
    "trioserve.anthropic": 3,
    "trioserve.responses": 3.5,
    "trioserve.protocol": 2,
    "trioserve.metrics": 2,
    "trioserve.chat_template": 2,
    # The engine package's own __init__ is the loader (EngineOptions,
    # load_engine): above both backends, which it picks by name.
    ENGINE_LOADER: 4,
    # The models folder and its presets: the loader's options per model.
    "trioserve.engine.catalog": 4.5,
    # The backends: the same rank, so neither may import the other.
    "trioserve.engine.cpu": 3,
    "trioserve.engine.exllamav2": 3,
    # What both backends share: the Engine protocol, constraints, samplers, text.
    "trioserve.engine": 2,
    "trioserve.vocabulary": 1,
    "trioserve.logs": 0,
    "trioserve._version": 0,
    "trioserve.errors": 0,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(name: str) -> str:
    if name == "trioserve.engine":
        return ENGINE_LOADER
    parts = name.split(".")
    for size in (3, 2, 1):
        candidate = ".".join(parts[:size])
        if candidate in RANKS:
            return candidate
    raise AssertionError(f"{name} is in no layer of RANKS")


def imports(path: Path) -> set[str]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("trioserve")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.startswith("trioserve"):
                # "from trioserve import protocol": the names may be modules.
                for alias in node.names:
                    candidate = f"{target}.{alias.name}"
                    where = PACKAGE.parent / Path(*candidate.split("."))
                    if where.exists() or where.with_suffix(".py").exists():
                        found.add(candidate)
                    else:
                        found.add(target)
    return found


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


#: What each wire format may import besides itself: the vocabulary, the
#: errors, and (for openai/) the WebSocket protocol's public names.
WIRE_FLOOR = {
    "trioserve.protocol": {"trioserve.vocabulary", "trioserve.errors"},
    "trioserve.openai": {"trioserve.vocabulary", "trioserve.errors", "trioserve.protocol"},
    "trioserve.anthropic": {"trioserve.vocabulary", "trioserve.errors", "trioserve.protocol"},
    "trioserve.responses": {
        "trioserve.vocabulary",
        "trioserve.errors",
        "trioserve.protocol",
        "trioserve.openai",
    },
}


@pytest.mark.parametrize("name", sorted(n for n in MODULES if layer(n) in WIRE_FLOOR))
def test_the_wire_formats_stand_on_the_vocabulary(name: str) -> None:
    own = layer(name)
    for target in imports(MODULES[name]):
        other = layer(target)
        if other == own:
            continue
        assert other in WIRE_FLOOR[own], f"{name} imports {target}"
        # A wire format's private modules are its own: openai/ reads the
        # protocol through the names it exports.
        assert not any(part.startswith("_") for part in target.split(".")[2:]), (
            f"{name} imports {target}, a private module of {other}"
        )


def test_the_vocabulary_needs_neither_torch_nor_trio() -> None:
    for name, path in MODULES.items():
        if layer(name) != "trioserve.vocabulary":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            found = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            for module in found:
                top = module.split(".")[0]
                assert top not in {"torch", "trio", "trio_websocket"}, f"{name}: {module}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name: str) -> None:
    own = layer(name)
    for target in imports(MODULES[name]):
        if target == "trioserve" and own != "trioserve":
            raise AssertionError(f"{name} imports the public package {target}")
        other = layer(target)
        assert other == own or RANKS[other] < RANKS[own], f"{name} ({own}) imports {target}"


def test_no_import_cycle() -> None:
    graph = {
        name: {t for t in imports(path) if t in MODULES and t != name}
        for name, path in MODULES.items()
    }
    # A package's __init__ re-exporting its modules is not a cycle of the code.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join([*trail, node, nxt]))
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [])


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_and_classes_stay_small(name: str) -> None:
    """At most 700 lines a module and 400 a class (docs/design.md): past
    that, a file holds two things, and is split where they part."""
    source = MODULES[name].read_text(encoding="utf-8")
    assert source.count("\n") <= 700, f"{name}: {source.count(chr(10))} lines"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            assert size <= 400, f"{name}.{node.name}: {size} lines"


#: What only a wire format's own code writes: OpenAI's and Anthropic's reply
#: fields and their streams' framing.
REPLY_WORDS = (
    "tool_calls",
    "finish_reason",
    '"data: ',
    "[DONE]",
    "chat.completion",
    "end_turn",
    "content_block",
    "message_start",
)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if layer(n) == "trioserve.server"))
def test_the_server_holds_no_reply_logic(name: str) -> None:
    """server/ routes and moves bytes: what turns a generation into an
    API's reply lives with the API's wire format (openai/replies.py)."""
    source = MODULES[name].read_text(encoding="utf-8")
    for word in REPLY_WORDS:
        assert word not in source, f"{name} writes {word!r}"
