"""docs/design.md's map of the modules, checked against the tree: every file
and folder it names exists, and every module of the package is on the map.
Prose paths (``generation/engine_thread.py``, ``tests/test_layers.py``) are
checked too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DESIGN = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
#: Where a map line's names end and its description starts (the column of
#: the descriptions; a line indented that far only continues a description).
DESCRIPTION_COLUMN = 30


def module_map() -> list[str]:
    """The map's block, line by line."""
    marker = "<!-- not run here: a map of the modules -->\n```\n"
    start = DESIGN.index(marker) + len(marker)
    return DESIGN[start : DESIGN.index("\n```", start)].splitlines()


def mapped_paths(lines: list[str]) -> list[Path]:
    """The paths the map names. A top-level entry gives its folder
    (``trioserve/server/``) or files (``trioserve/metrics.py, logs.py``, the
    later ones beside the first); an indented entry is in the last folder
    named one level up."""
    found: list[Path] = []
    folders: dict[int, Path] = {}
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= DESCRIPTION_COLUMN:
            continue
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        parent = ROOT if indent == 0 else folders[indent - 4]
        base = parent
        for number, name in enumerate(n.strip() for n in names.split(",")):
            path = (parent / name) if number == 0 else (base / name)
            if number == 0:
                base = path if name.endswith("/") else path.parent
            found.append(path)
            if name.endswith("/"):
                folders[indent] = path
    return found


def test_every_path_on_the_map_exists() -> None:
    paths = mapped_paths(module_map())
    assert len(paths) >= 60, paths
    missing = [str(p.relative_to(ROOT)) for p in paths if not p.exists()]
    assert not missing, missing


def test_every_module_of_the_package_is_on_the_map() -> None:
    # A folder on the map stands for its modules only where the map lists
    # none of them (trioserve/client/: its two modules are in the description).
    mapped = set(mapped_paths(module_map()))
    listed_in = {path.parent for path in mapped if path.suffix}
    unmapped = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "trioserve").rglob("*.py"))
        if path not in mapped
        and path.name != "__init__.py"
        and not (path.parent in mapped and path.parent not in listed_in)
    ]
    assert not unmapped, unmapped


def test_paths_in_the_prose_exist() -> None:
    prose = DESIGN.replace("\n".join(module_map()), "")
    named = set(re.findall(r"\b((?:[a-z_]+/)+[a-z_]+\.py)\b", prose))
    assert named, "the prose names no path"
    missing = [
        p for p in named if not (ROOT / p).exists() and not (ROOT / "trioserve" / p).exists()
    ]
    assert not missing, missing


#: A reference to this project's tracker: "issue 23", "(issue 18;", "issues
#: 8 and 9", "lever 5", "defect 1". An upstream reference names its
#: repository (turboderp-org/exllamav2#803) and is not one.
TRACKER = re.compile(r"\b(?:issues? #?\d+|lever \d+|defect \d+)", re.IGNORECASE)


def test_no_tracker_numbers_for_users() -> None:
    """Users read the README, docs/ and the package; they cannot look up this
    project's tracker, so none of it cites one."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts += sorted((ROOT / "trioserve").rglob("*.py"))
    texts += sorted((ROOT / "trioserve").rglob("*.c"))
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in texts
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if TRACKER.search(line)
    ]
    assert not found, "\n".join(found)
