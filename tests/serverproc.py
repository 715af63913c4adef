"""``python -m trioserve`` in a subprocess, as an operator runs it.

The fuzzer, the soak and the hostile-client benchmark drive the server the way
it is deployed: the real command line, the real model, its own process (so that
its memory can be read from outside and a crash is a dead process, not an
exception in the test), stopped with SIGINT as a service manager stops it.
Everything it logs is kept, so that a run can report the errors it logged.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

__all__ = ["ServerProcess", "open_server_process"]

ROOT = Path(__file__).resolve().parents[1]
#: The start of a log line in the text format (``2026-11-30 21:44:10,269 ``).
_LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
_LISTENING = re.compile(r"listening on (ws://\[?([^\]/]+?)\]?:(\d+)/)")


@attrs.define(eq=False)
class ServerProcess:
    """A running server subprocess."""

    process: trio.Process
    url: str
    host: str
    port: int
    #: Every line the server wrote to stderr (its log) and stdout, so far.
    log: list[str] = attrs.Factory(list)
    stdout: list[str] = attrs.Factory(list)
    #: The exit status once it has exited (None while it runs).
    returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def rss_bytes(self) -> int:
        """The server's resident set size (VmRSS)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for process {self.pid}")

    def error_lines(self) -> list[str]:
        """Log lines at ERROR or above, and traceback headers."""
        return [
            line
            for line in self.log
            if " ERROR " in line
            or " CRITICAL " in line
            or line.startswith("Traceback")
            or "ERROR:" in line
        ]

    def error_reports(self, context: int = 40) -> list[str]:
        """Each ERROR (or worse) log line with the lines that follow it (its
        traceback), up to the next ordinary log line or ``context`` lines."""
        reports: list[list[str]] = []
        for line in self.log:
            starts = " ERROR " in line or " CRITICAL " in line or "ERROR:" in line
            if starts:
                reports.append([line])
            elif reports and len(reports[-1]) < context and not _LOG_LINE.match(line):
                reports[-1].append(line)
        return ["\n".join(report) for report in reports]


async def _pump(stream: trio.abc.ReceiveStream, lines: list[str], echo: bool) -> None:
    buffer = b""
    async for data in stream:
        buffer += data
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            line = raw.decode("utf-8", "replace")
            lines.append(line)
            if echo:
                print(f"  [server] {line}", file=sys.stderr, flush=True)
    if buffer:
        lines.append(buffer.decode("utf-8", "replace"))


@asynccontextmanager
async def open_server_process(
    args: Sequence[str] = (),
    *,
    ready_within: float = 600.0,
    echo_log: bool = False,
    env: dict[str, str] | None = None,
) -> AsyncIterator[ServerProcess]:
    """Start ``python -m trioserve --port 0 ARGS`` and yield once it listens.

    On the way out it is sent SIGINT (the graceful shutdown) and waited for;
    a server that has not exited 60 s later is killed. ``returncode`` says how
    it ended. Raises RuntimeError when it exits before it listens.
    """
    command = [sys.executable, "-m", "trioserve", "--port", "0", *args]
    process = await trio.lowlevel.open_process(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None and process.stderr is not None
    stdout: list[str] = []
    log: list[str] = []
    started: list[ServerProcess] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_pump, process.stdout, stdout, False)
        nursery.start_soon(_pump, process.stderr, log, echo_log)
        try:
            match = None
            with trio.move_on_after(ready_within):
                while match is None:
                    if process.poll() is not None:
                        break
                    for line in stdout:
                        match = _LISTENING.search(line)
                        if match:
                            break
                    await trio.sleep(0.05)
            if match is None:
                raise RuntimeError(
                    f"the server did not start listening (exit status {process.poll()}): "
                    + " | ".join(log[-10:])
                )
            server = ServerProcess(
                process=process,
                url=match.group(1),
                host=match.group(2),
                port=int(match.group(3)),
                log=log,
                stdout=stdout,
            )
            started.append(server)
            yield server
        finally:
            with trio.CancelScope(shield=True):
                if process.poll() is None:
                    process.send_signal(signal.SIGINT)
                with trio.move_on_after(60):
                    await process.wait()
                if process.poll() is None:
                    process.kill()
                    await process.wait()
                for server in started:
                    server.returncode = process.returncode
                nursery.cancel_scope.deadline = trio.current_time() + 5
