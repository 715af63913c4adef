"""Every fenced code block in README.md and docs/*.md is run by a test, or says
why it is not.

The line directly above each opening fence is one of two HTML comments (they
do not show when the Markdown is rendered):

- ``<!-- run: NAME -->``: the block is executed by the test that ``RUNNERS``
  names for NAME; that test reads the block from the document (by NAME), so
  what is run is what is shown;
- ``<!-- not run here: REASON -->``: the block cannot run in this suite (it
  installs packages, needs a GPU, is a deployment file, a diagram, an
  interactive session...), and REASON says why.

An unmarked block, an unknown NAME, a runner without its test and a runner no
block uses fail ``test_every_block_is_run_or_says_why_not`` with the file and
line.

What the runners substitute, and nothing else: the server's address
``127.0.0.1:7862`` becomes the address of the server the test started (the
same model, the same CLI, ``--port 0``); ``.venv/bin/python`` becomes the
interpreter running the tests; ``$KEY`` is set in the environment; a
command-line client that talks to the default address gets ``--url`` of that
server. Timings (``timing``, ``...`` in a frame) are compared by their keys
only; an answer that was sampled without a seed (or interrupted at a moment
that depends on the machine) by its keys and its stop reason.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio
import trio_websocket

from .helpers import running_server

if TYPE_CHECKING:
    from trioserve.engine.cpu import CpuEngine

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(\s*)(```+)(\S*)\s*$")
_MARK = re.compile(r"^\s*<!-- (?:run: (?P<run>[a-z0-9-]+)|not run here: (?P<reason>\S.*?)) -->$")


@attrs.frozen
class Block:
    path: str
    #: The line of the opening fence (1-based).
    line: int
    lang: str
    text: str
    run: str | None
    reason: str | None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_blocks() -> list[Block]:
    blocks: list[Block] = []
    for path in DOCS:
        lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            fence = _FENCE.match(lines[i])
            if fence is None:
                i += 1
                continue
            indent, ticks, lang = fence.groups()
            end = i + 1
            while end < len(lines) and lines[end].strip() != ticks:
                end += 1
            body = [line.removeprefix(indent) for line in lines[i + 1 : end]]
            mark = _MARK.match(lines[i - 1]) if i else None
            blocks.append(
                Block(
                    path=path,
                    line=i + 1,
                    lang=lang,
                    text="\n".join(body) + "\n",
                    run=mark.group("run") if mark else None,
                    reason=mark.group("reason") if mark else None,
                )
            )
            i = end + 1
    return blocks


def blocks_named(name: str) -> list[Block]:
    found = [block for block in doc_blocks() if block.run == name]
    assert found, f"no block is marked <!-- run: {name} -->"
    return found


def block_named(name: str) -> Block:
    (block,) = blocks_named(name)
    return block


#: Each ``run:`` name and the test that runs its blocks.
RUNNERS: dict[str, str] = {
    "readme-frames": "tests.test_docs::test_readme_frames_are_what_the_server_sends",
    "startup-log": "tests.test_docs::test_the_quickstart_startup_log_is_what_a_start_writes",
    "examples": "tests.test_examples::test_docs_show_the_examples_verbatim",
    "embed-output": "tests.test_examples::test_embed_serves_answers_and_shuts_down",
    "readme-embed": "tests.test_doc_blocks::test_the_readme_fragment_serves_and_answers",
    "serve-signature": "tests.test_doc_blocks::test_the_serve_signature_is_the_code_s",
    "log-text": "tests.test_doc_blocks::test_the_log_examples_have_the_formatters_shape",
    "log-json": "tests.test_doc_blocks::test_the_log_examples_have_the_formatters_shape",
    "protocol-exchange": "tests.test_doc_blocks::test_protocol_exchange_on_the_wire",
    "error-envelope": "tests.test_doc_blocks::test_the_error_envelope_is_an_error_frame_s",
    "quickstart-frames": "tests.test_doc_blocks::test_quickstart_frames_on_the_wire",
    "openai-python": "tests.test_doc_blocks::test_commands_against_one_server",
    "openai-curl": "tests.test_doc_blocks::test_commands_against_one_server",
    "openai-error": "tests.test_doc_blocks::test_commands_against_one_server",
    "client-once": "tests.test_doc_blocks::test_commands_against_one_server",
    "python-client": "tests.test_doc_blocks::test_commands_against_one_server",
}


def test_every_block_is_run_or_says_why_not() -> None:
    blocks = doc_blocks()
    assert len(blocks) > 50
    problems = [
        f"{block.where}: a ```{block.lang} block without <!-- run: NAME --> or "
        "<!-- not run here: REASON --> on the line above"
        for block in blocks
        if block.run is None and block.reason is None
    ]
    problems += [
        f"{block.where}: <!-- run: {block.run} --> names no runner in RUNNERS"
        for block in blocks
        if block.run is not None and block.run not in RUNNERS
    ]
    used = {block.run for block in blocks}
    problems += [f"RUNNERS[{name!r}]: no block uses it" for name in RUNNERS if name not in used]
    for name, node in RUNNERS.items():
        module, test = node.split("::")
        if not callable(getattr(importlib.import_module(module), test, None)):
            problems.append(f"RUNNERS[{name!r}]: {node} does not exist")
    assert not problems, "\n".join(problems)


def test_the_scanner_sees_every_fence() -> None:
    # Every ``` line is an opening or a closing fence of a block it found.
    for path in DOCS:
        fences = sum(
            1 for line in (ROOT / path).read_text(encoding="utf-8").splitlines() if _FENCE.match(line)
        )
        assert fences == 2 * sum(1 for block in doc_blocks() if block.path == path), path


def test_json_blocks_parse() -> None:
    """Every ```json block holds JSON: one value, or one per line (the frames
    of a stream). The quickstart's abridged stream (``...``) is parsed by its
    runner."""
    for block in doc_blocks():
        if block.lang != "json" or "..." in block.text:
            continue
        try:
            json.loads(block.text)
        except json.JSONDecodeError:
            for line in block.text.splitlines():
                json.loads(line)
