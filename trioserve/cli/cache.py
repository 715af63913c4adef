"""``python -m trioserve cache list|clean``: what trioserve's cache holds, and
removing it.

The cache (``$TRIOSERVE_CACHE``, else ``$XDG_CACHE_HOME/trioserve``, else
``~/.cache/trioserve``) holds converted models (the embedded one, and each
``--model file.gguf``, keyed by the file's content) and, until its conversion
is done, the embedded model's downloaded wheel. Nothing in it is needed that
the next start cannot make again: ``clean`` removes it all, and that start
downloads (unless ``--offline``) and converts again.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence

from ..engine.models import cache_entries, cache_root

__all__ = ["cache_main", "mib"]


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def cache_main(argv: Sequence[str], prog: str) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{prog} cache",
        description="Show or empty trioserve's cache of converted models "
        f"({cache_root()}; TRIOSERVE_CACHE moves it).",
    )
    parser.add_argument(
        "command",
        choices=["list", "clean"],
        help="list: each converted model and download, with its size; "
        "clean: remove them all, and the built native kernels (the next start converts and "
        "builds again)",
    )
    args = parser.parse_args(argv)
    root = cache_root()
    entries = cache_entries(root)
    total = sum(entry.size for entry in entries)
    if args.command == "list":
        print(f"{root}: {mib(total)} in {len(entries)} entries")
        for entry in entries:
            print(f"  {mib(entry.size):>12}  {entry.kind:<8}  {entry.path.relative_to(root)}")
        return 0
    for folder in (root / "models", root / "downloads", root / "native"):
        shutil.rmtree(folder, ignore_errors=True)
    left = cache_entries(root)
    if left:
        print(f"{prog}: error: could not remove {left[0].path}", file=sys.stderr)
        return 1
    print(f"{root}: removed {len(entries)} entries, {mib(total)}")
    return 0
