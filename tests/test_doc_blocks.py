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
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio
import trio_websocket

from .helpers import running_server

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

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
    "tokenize-curl": "tests.test_doc_blocks::test_commands_against_one_server",
    "lm-eval": "tests.test_lm_eval::test_lm_eval_scores_as_the_engine_does",
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
            1
            for line in (ROOT / path).read_text(encoding="utf-8").splitlines()
            if _FENCE.match(line)
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


# -- comparing what a doc shows with what came back ----------------------------------------

#: Stands for ``...`` in a shown frame: any value.
_ELIDED = "\u2026elided"


def _sampled(request: dict[str, Any] | None) -> bool:
    """Whether the answer to ``request`` depends on chance or on the clock:
    sampled without a seed, or (seeded or not) interrupted by a stop."""
    if request is None:
        return False
    return request.get("temperature") != 0 and "seed" not in request


def normalise(frame: dict[str, Any], request: dict[str, Any] | None = None) -> dict[str, Any]:
    """``frame`` without what differs between runs: timings (their keys
    stay), the text of a sampled or interrupted answer, `info`'s status
    counts (their keys stay) and which kernels this machine runs (the key
    stays)."""
    frame = json.loads(json.dumps(frame))
    if isinstance(frame.get("model"), dict) and "kernels" in frame["model"]:
        frame["model"]["kernels"] = "KERNELS"
    if isinstance(frame.get("timing"), dict):
        frame["timing"] = sorted(frame["timing"])
    if isinstance(frame.get("status"), dict):
        frame["status"] = sorted(frame["status"])
    if frame.get("response_type") == "full" and (
        _sampled(request) or frame.get("stop_reason") == "interrupted"
    ):
        frame.pop("response", None)
        if frame.get("stop_reason") == "interrupted":
            frame["usage"].pop("generated_tokens", None)
    return frame


def matches(shown: Any, got: Any) -> bool:
    """``got`` is what ``shown`` shows: equal, with ``...`` standing for any
    value and, inside a string, for any text."""
    if shown == _ELIDED:
        return True
    if isinstance(shown, dict):
        return (
            isinstance(got, dict)
            and shown.keys() == got.keys()
            and all(matches(shown[k], got[k]) for k in shown)
        )
    if isinstance(shown, list):
        return isinstance(got, list) and len(shown) == len(got) and all(map(matches, shown, got))
    if isinstance(shown, str) and "..." in shown and isinstance(got, str):
        head, _, tail = shown.partition("...")
        return got.startswith(head) and got.endswith(tail) and len(got) >= len(shown) - 3
    return bool(shown == got) and type(shown) is type(got)


async def _receive(ws: trio_websocket.WebSocketConnection, within: float = 120) -> dict[str, Any]:
    with trio.fail_after(within):
        message = await ws.get_message()
    frame: dict[str, Any] = json.loads(message)
    return frame


# -- protocol.md: every exchange, replayed on the wire --------------------------------------


@pytest.fixture(scope="module")
def engine_256(model_dir: Path) -> Iterator[CpuEngine]:
    """The engine protocol.md's examples were made on: the embedded model,
    ``--context-length 256``, two slots (``info`` shows them)."""
    from trioserve.engine.cpu.engine import CpuEngine

    engine = CpuEngine.load(None, context_length=256, max_batch=2)
    yield engine
    engine.close()


def _exchange_params() -> list[Any]:
    return [pytest.param(block, id=block.where) for block in blocks_named("protocol-exchange")]


@pytest.mark.parametrize("block", _exchange_params())
async def test_protocol_exchange_on_the_wire(engine_256: CpuEngine, block: Block) -> None:
    """Each → frame of the block is sent as written (byte for byte, invalid
    ones too) on one new connection; the replies are the ← frames, in order.
    The `overloaded` example's server has ``--max-requests-per-connection 1``,
    as the doc says."""
    sent = [line[2:] for line in block.text.splitlines() if line.startswith("→ ")]
    shown = [json.loads(line[2:]) for line in block.text.splitlines() if line.startswith("← ")]
    assert sent and shown, block.where
    options: dict[str, Any] = {}
    if any(frame.get("error", {}).get("type") == "overloaded" for frame in shown):
        options["max_requests_per_connection"] = 1
    requests: dict[str, dict[str, Any]] = {}
    for text in sent:
        try:
            request = json.loads(text)
        except ValueError:
            continue
        if isinstance(request, dict) and isinstance(request.get("request_id"), str):
            requests[request["request_id"]] = request
    async with running_server(engine_256, **options) as listening:
        async with trio_websocket.open_websocket_url(listening.url) as ws:
            for text in sent:
                await ws.send_message(text)
            got = [await _receive(ws) for _ in shown]
    for want, have in zip(shown, got, strict=True):
        request = requests.get(str(want.get("request_id")))
        assert normalise(have, request) == normalise(want, request), (block.where, json.dumps(have))


def test_the_error_envelope_is_an_error_frame_s() -> None:
    """protocol.md's envelope has the keys of a real error frame, and the
    error object those of one with a field."""
    from trioserve import protocol as p

    envelope = json.loads(block_named("error-envelope").text)
    error = p.decode_request  # the codec's own refusal of a bad field
    try:
        error('{"action":"infer","text":"Hi","max_new_tokens":0}')
    except p.ProtocolError as refusal:
        real = json.loads(p.encode_reply(refusal.reply()))
    else:
        raise AssertionError("max_new_tokens 0 was accepted")
    assert envelope.keys() == real.keys()
    assert envelope["error"].keys() == real["error"].keys()
    assert envelope["response_type"] == real["response_type"] == "error"
    assert real["error"]["field"] == "$.max_new_tokens"


# -- quickstart.md's frames, README's fragment and serve's signature ---------------------


def _shown_frames(text: str) -> list[Any]:
    """A block of frames, one per line or continued on indented lines; a
    line ``...`` stands for any number of frames like its neighbours."""
    frames: list[Any] = []
    current = ""
    for line in text.splitlines():
        if line == "...":
            frames.append(_ELIDED)
        elif line.startswith(" ") and current:
            current += line
            continue
        if current:
            frames.insert(
                len(frames) - (line == "..."), json.loads(current.replace(":...", f':"{_ELIDED}"'))
            )
            current = ""
        if line.startswith("{"):
            current = line
    if current:
        frames.append(json.loads(current.replace(":...", f':"{_ELIDED}"')))
    return frames


async def test_quickstart_frames_on_the_wire(cpu_engine: CpuEngine) -> None:
    """The request block sent as shown gets the stream shown (``...`` lines
    stand for chunk frames); the error block is the answer to the same
    request without its id and with ``max_new_tokens`` 0."""
    request_block, stream_block, error_block = blocks_named("quickstart-frames")
    request = json.loads(request_block.text)
    shown = _shown_frames(stream_block.text)
    assert shown.count(_ELIDED) == 1
    bad = {k: v for k, v in request.items() if k != "request_id"} | {"max_new_tokens": 0}
    async with running_server(cpu_engine) as listening:
        async with trio_websocket.open_websocket_url(listening.url) as ws:
            await ws.send_message(json.dumps(request))
            got = [await _receive(ws)]
            while got[-1]["response_type"] == "chunk":
                got.append(await _receive(ws))
            await ws.send_message(json.dumps(bad))
            error = await _receive(ws)
    cut = shown.index(_ELIDED)
    head, tail = shown[:cut], shown[cut + 1 :]
    assert len(got) >= len(head) + len(tail)
    for want, have in zip(head + tail, got[: len(head)] + got[len(got) - len(tail) :], strict=True):
        assert matches(want, have), (want, have)
    assert error == json.loads(error_block.text)


async def test_the_readme_fragment_serves_and_answers(cpu_engine: CpuEngine) -> None:
    """README's three lines, as the body of an async function with
    ``nursery`` and ``engine`` defined (as in docs/examples/embed.py)."""
    import trioserve

    fragment = block_named("readme-embed").text
    source = "async def fragment():\n" + textwrap.indent(fragment, "    ") + "    return final\n"
    namespace: dict[str, Any] = {"trioserve": trioserve, "engine": cpu_engine}
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            namespace["nursery"] = nursery
            exec(compile(source, "README.md", "exec"), namespace)
            final = await namespace["fragment"]()
            nursery.cancel_scope.cancel()
    assert final.response
    assert final.stop_reason in {"eos", "num_tokens"}


def test_the_serve_signature_is_the_code_s() -> None:
    import trioserve

    shown = ast.parse(block_named("serve-signature").text.rstrip() + ": ...").body[0]
    real = ast.parse(textwrap.dedent(inspect.getsource(trioserve.serve))).body[0]
    assert isinstance(shown, ast.AsyncFunctionDef) and isinstance(real, ast.AsyncFunctionDef)
    # The code may name a type by an alias of its module (EngineLoader); the
    # doc spells it out.
    serve_module = inspect.getmodule(trioserve.serve)
    assert serve_module is not None
    module = ast.parse(inspect.getsource(serve_module))
    aliases = {
        node.targets[0].id: ast.unparse(node.value)
        for node in module.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    code = ast.unparse(real.args)
    for alias, meaning in aliases.items():
        code = re.sub(rf"\b{alias}\b", meaning, code)
    assert ast.unparse(shown.args) == code
    assert shown.returns is not None and real.returns is not None
    assert ast.unparse(shown.returns) == ast.unparse(real.returns)


def test_the_log_examples_have_the_formatters_shape() -> None:
    """deployment.md's text line is a line of the startup log the
    quickstart shows (which tests/test_docs.py checks against a real start);
    its JSON line is what the JSON formatter writes for the same record."""
    import logging

    from trioserve.logs import JsonFormatter, TextFormatter

    from .test_docs import _shape

    text_line = block_named("log-text").text.strip()
    quickstart = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    assert _shape(text_line) in {_shape(line) for line in quickstart.splitlines()}
    shown = json.loads(block_named("log-json").text)
    fields = {k: v for k, v in shown.items() if k not in {"time", "level", "logger", "message"}}
    record = logging.LogRecord(
        shown["logger"], logging.INFO, __file__, 1, shown["message"], None, None
    )
    record.fields = fields
    record.created = 1738324805.120  # 2025-01-31 12:00:05.120 UTC
    assert json.loads(JsonFormatter().format(record)) == shown
    # The text line is the same record in the text format (its time is local).
    assert TextFormatter().format(record).split(" ", 2)[2] == text_line.split(" ", 2)[2]


# -- shell commands and Python snippets against one `python -m trioserve --port 0` ----------


def _at(text: str, server: Any) -> str:
    """``text`` with the default address replaced by ``server``'s."""
    return text.replace("127.0.0.1:7862", f"{server.host}:{server.port}")


async def _run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    from .test_examples import example_env

    with trio.fail_after(180):
        result = await trio.run_process(
            argv,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            cwd=ROOT,
            env={**example_env(), "KEY": "anything"},
            **kwargs,
        )
    assert result.returncode == 0, (argv, result.stdout.decode(), result.stderr.decode())
    return result


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    def post() -> tuple[int, Any]:
        request = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    return await trio.to_thread.run_sync(post)


@pytest.mark.slow
async def test_commands_against_one_server(model_dir: Path) -> None:
    """openai.md's SDK snippet, curl commands and error; quickstart.md's
    ``--once`` command and its output; the Python clients of quickstart.md
    and protocol.md: all against one server started as the docs start it."""
    from .serverproc import open_server_process

    async with open_server_process() as server:
        # openai.md: the SDK (with the server's address) answers.
        snippet = _at(block_named("openai-python").text, server)
        result = await _run([sys.executable, "-c", snippet])
        assert "Paris" in result.stdout.decode()

        # openai.md: the curl command streams Server-Sent Events to [DONE].
        curl = _at(block_named("openai-curl").text, server)
        result = await _run(["bash", "-c", curl])
        events = [line for line in result.stdout.decode().splitlines() if line]
        assert events[-1] == "data: [DONE]"
        assert all(line.startswith("data: ") for line in events)
        first = json.loads(events[0].removeprefix("data: "))
        assert first["object"] == "chat.completion.chunk"
        assert first["choices"][0]["delta"]["role"] == "assistant"

        # openai.md: the error shown is the answer to max_tokens 100000.
        status, body = await _post(
            f"http://{server.host}:{server.port}/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100000},
        )
        assert (status, body) == (400, json.loads(block_named("openai-error").text))

        # openai.md: the tokenizer route's curl command answers what is shown.
        command, shown = blocks_named("tokenize-curl")
        result = await _run(["bash", "-c", _at(command.text, server)])
        assert json.loads(result.stdout) == json.loads(shown.text)

        # quickstart.md: the --once command prints the answer shown.
        command, output = blocks_named("client-once")
        argv = shlex.split(command.text.replace(".venv/bin/python", shlex.quote(sys.executable)))
        result = await _run([*argv, "--url", server.url])
        assert result.stdout.decode() == output.text

        # quickstart.md and protocol.md: the trioserve client snippets.
        outputs = []
        for block in blocks_named("python-client"):
            result = await _run([sys.executable, "-c", _at(block.text, server)])
            outputs.append(result.stdout.decode())
        protocol, quickstart = outputs  # in DOCS order
        assert quickstart == output.text.rstrip("\n") + "\n[eos]\n"
        count, *_, reason = protocol.splitlines()
        assert int(count) > 0
        assert reason.strip() in {"eos", "num_tokens"}
