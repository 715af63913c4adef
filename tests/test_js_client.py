"""A Node client in the manner of the public ExLlamaV2Api JavaScript class
(tests/js/exllamav2_api.mjs) against the real model over a real socket.

That client yields the final frame to its consumer like a chunk frame, and
consumers write ``text += m.chunk``: without ``"chunk": ""`` on the final
frame the text ended in ``"undefined"`` and ``process.stdout.write(m.chunk)``
threw (issue 9). It uses Node's own WebSocket (undici's), a client no one
here wrote, so no package is installed: Node 22 has it built in, Node 20.10+
behind ``--experimental-websocket``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

from .helpers import running_server

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

SCRIPT = Path(__file__).resolve().parent / "js" / "exllamav2_api.mjs"
PARIS = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def node_command() -> list[str] | None:
    """node with the standard WebSocket, with the flag it needs, or None."""
    node = shutil.which("node")
    if node is None:
        return None
    for flags in ([], ["--experimental-websocket"]):
        probe = subprocess.run(
            [node, *flags, "-p", "typeof WebSocket"],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        if probe.stdout.strip() == "function":
            return [node, *flags]
    return None


async def test_exllamav2api_style_client(cpu_engine: CpuEngine) -> None:
    node = node_command()
    if node is None:
        pytest.skip("needs node with the standard WebSocket API (node 22, or 20.10+ with a flag)")
    async with running_server(cpu_engine) as listening:
        with trio.fail_after(300):
            result = await trio.run_process(
                [*node, str(SCRIPT), listening.url],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    assert result.returncode == 0, result.stderr.decode()
    seen = json.loads(result.stdout)

    assert seen["echo"] == {"action": "echo", "request_id": 1}
    assert seen["count"]["num_tokens"] == len(cpu_engine.encode(PARIS))

    # The consumer's text is the answer, with nothing appended by the final
    # frame ("...Paris.undefined" before).
    for name in ("streamed", "plain", "compact"):
        run = seen[name]
        final = run["frames"][-1]
        assert final["response_type"] == "full"
        assert final["chunk"] == ""
        assert "Paris" in final["response"]
    for name in ("streamed", "compact"):
        assert seen[name]["text"] == seen[name]["frames"][-1]["response"]
    # Without streaming the one frame is the final one: its empty chunk adds
    # nothing (the answer is in `response`, as from the seed).
    assert len(seen["plain"]["frames"]) == 1
    assert seen["plain"]["text"] == ""
    # Every chunk frame carries the prompt used, as the seed's do, unless
    # the client asked for compact chunks.
    streamed = seen["streamed"]["frames"]
    assert len(streamed) > 2
    assert all(f["util_text"] == PARIS for f in streamed)
    compact = seen["compact"]["frames"]
    assert all("util_text" not in f for f in compact[:-1])
    assert compact[-1]["util_text"] == PARIS
    # Everything yielded was written with process.stderr.write(m.chunk).
    written = sum(len(seen[n]["text"]) for n in ("streamed", "plain", "compact"))
    assert len(result.stderr.decode()) == written

    # An error frame ends the generator; it names the field and suggests one.
    (error,) = seen["bad"]["frames"]
    assert error["response_type"] == "error"
    assert error["error"]["field"] == "$.temprature"
    assert "did you mean 'temperature'?" in error["error"]["message"]
