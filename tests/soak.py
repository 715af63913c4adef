"""The soak: mixed requests from several clients for minutes, each answered once.

``python -m tests.soak`` (``nox -s soak``) starts ``python -m trioserve`` on the
embedded model and runs ``--clients`` clients for ``--minutes``. Each client
keeps a few requests in flight on one connection, drawn from a mix: echo,
info, estimate_token, lefttrim_token, infers (streamed or not, 1 to 24
tokens, some with stop strings or a seed), infers it stops midway with a
targeted ``stop``, requests with a bad field, and, now and then, a hang-up
with requests in flight (then it reconnects). Every request carries a unique
request_id, and a reader on each connection checks, for every frame, that it
belongs to a request in flight; that chunk frames come only to streamed
infers, before their terminal frame; that each request gets exactly one
terminal frame; that a stop's reply comes after the final frame of the infer
it stopped; and that nothing is left unanswered at the end.

The server's RSS is sampled every few seconds: the report gives it after the
warm-up (``--warmup-minutes``) and at the end, and the highest sample. A
growing RSS under a steady load is a leak. The run fails (exit status 1) on
any protocol failure, a server that died or logged an error, or a run that
served nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import attrs  # noqa: E402
import trio  # noqa: E402
import trio_websocket  # noqa: E402

from tests.serverproc import ServerProcess, open_server_process  # noqa: E402

MiB = 1024 * 1024
PROMPTS = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nGive me three tips for staying healthy.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "The quick brown fox jumps over the lazy",
)
#: How long a request may wait for its answer before the soak calls it lost.
ANSWER_TIMEOUT = 300.0


@attrs.define
class Pending:
    kind: str
    stream: bool = False
    sent: float = 0.0
    chunks: int = 0
    #: For a stop: the request_id of the infer it targets.
    target: str | None = None


@attrs.define
class SoakReport:
    sent: collections.Counter[str] = attrs.Factory(collections.Counter)
    answered: collections.Counter[str] = attrs.Factory(collections.Counter)
    chunks: int = 0
    hangups: int = 0
    #: Requests in flight when their client hung up (not expected to be answered).
    abandoned: int = 0
    failures: list[str] = attrs.Factory(list)
    rss_samples: list[tuple[float, int]] = attrs.Factory(list)

    def fail(self, message: str) -> None:
        if len(self.failures) < 200:
            self.failures.append(message)


class SoakClient:
    def __init__(self, index: int, url: str, report: SoakReport, seed: int) -> None:
        self.index = index
        self.url = url
        self.report = report
        self.rng = random.Random(f"{seed}-{index}")
        self.serial = 0
        self.pending: dict[str, Pending] = {}
        #: Terminal frames seen, by request_id (to catch a second one).
        self.done: set[str] = set()

    def new_id(self) -> str:
        self.serial += 1
        return f"c{self.index}-{self.serial}"

    def request(self) -> tuple[str, dict[str, Any], Pending]:
        rid = self.new_id()
        roll = self.rng.random()
        rng = self.rng
        if roll < 0.15:
            return rid, {"action": "echo"}, Pending("echo")
        if roll < 0.2:
            return rid, {"action": "info"}, Pending("info")
        if roll < 0.3:
            return rid, {"action": "estimate_token", "text": rng.choice(PROMPTS)}, Pending("est")
        if roll < 0.38:
            frame = {
                "action": "lefttrim_token",
                "text": rng.choice(PROMPTS),
                "trimmed_length": rng.randint(0, 10),
            }
            return rid, frame, Pending("trim")
        if roll < 0.45:
            bads: list[dict[str, Any]] = [
                {"top_k": -1},
                {"temprature": 1},
                {"max_new_tokens": 0},
                {"stream": "yes"},
            ]
            bad = rng.choice(bads)
            frame = {"action": "infer", "text": "hi", "max_new_tokens": 4, **bad}
            return rid, frame, Pending("bad")
        stream = rng.random() < 0.6
        frame = {
            "action": "infer",
            "text": rng.choice(PROMPTS),
            "max_new_tokens": rng.randint(1, 24),
            "stream": stream,
            "temperature": rng.choice([0, 0.7]),
        }
        if rng.random() < 0.2:
            frame["stop_conditions"] = [".", "\n"]
        if rng.random() < 0.2:
            frame["seed"] = rng.randint(0, 1000)
        if rng.random() < 0.1:
            frame["stream_full"] = True
        return rid, frame, Pending("infer", stream=stream)

    async def run(self, until: float) -> None:
        while time.perf_counter() < until:
            try:
                await self._connection(until)
            except (trio_websocket.ConnectionClosed, trio_websocket.HandshakeError, OSError) as exc:
                self.report.fail(f"client {self.index}: connection lost: {exc!r}")
                self.report.abandoned += len(self.pending)
                self.pending.clear()
                await trio.sleep(1.0)

    async def _connection(self, until: float) -> None:
        async with trio_websocket.open_websocket_url(self.url) as ws:
            async with trio.open_nursery() as nursery:
                hang_up = trio.Event()
                nursery.start_soon(self._reader, ws, nursery.cancel_scope)
                while time.perf_counter() < until:
                    if len(self.pending) >= 4:
                        await trio.sleep(0.01)
                        continue
                    if self.rng.random() < 0.003 and self.pending:
                        hang_up.set()
                        break
                    await self._send_one(ws)
                    await trio.sleep(self.rng.uniform(0, 0.05))
                if hang_up.is_set():
                    # Abrupt: the requests in flight are abandoned, not answered.
                    self.report.hangups += 1
                    self.report.abandoned += len(self.pending)
                    self.pending.clear()
                    nursery.cancel_scope.cancel()
                    await ws.aclose()
                    return
                # The end: wait for every answer.
                with trio.move_on_after(ANSWER_TIMEOUT):
                    while self.pending:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                for rid, pending in self.pending.items():
                    self.report.fail(f"{rid} ({pending.kind}) never answered")
                self.pending.clear()
                nursery.cancel_scope.cancel()

    async def _send_one(self, ws: trio_websocket.WebSocketConnection) -> None:
        streaming = [rid for rid, p in self.pending.items() if p.kind == "infer" and p.chunks > 0]
        if streaming and self.rng.random() < 0.3:
            target = self.rng.choice(streaming)
            rid = self.new_id()
            pending = Pending("stop", target=target)
            frame: dict[str, Any] = {"action": "stop", "target": target}
        else:
            rid, frame, pending = self.request()
        pending.sent = time.perf_counter()
        self.pending[rid] = pending
        self.report.sent[pending.kind] += 1
        await ws.send_message(json.dumps({**frame, "request_id": rid}))

    async def _reader(
        self, ws: trio_websocket.WebSocketConnection, scope: trio.CancelScope
    ) -> None:
        while True:
            message = await ws.get_message()
            if not isinstance(message, str):
                self.report.fail(f"client {self.index}: a binary frame: {message[:100]!r}")
                continue
            frame = json.loads(message)
            rid = frame.get("request_id")
            pending = self.pending.get(rid) if isinstance(rid, str) else None
            if pending is None:
                what = "a second answer" if rid in self.done else "a frame for no request"
                self.report.fail(f"client {self.index}: {what}: {message[:200]}")
                continue
            if frame.get("response_type") == "chunk":
                if pending.kind != "infer" or not pending.stream:
                    self.report.fail(f"a chunk frame for {pending.kind} {rid}")
                pending.chunks += 1
                self.report.chunks += 1
                continue
            del self.pending[rid]
            self.done.add(rid)
            self._check(rid, pending, frame)

    def _check(self, rid: str, pending: Pending, frame: dict[str, Any]) -> None:
        kind = pending.kind
        error = (
            frame.get("error", {}).get("type") if frame.get("response_type") == "error" else None
        )
        self.report.answered[kind if error is None else f"{kind}:{error}"] += 1
        if kind == "bad":
            if error != "invalid_request":
                self.report.fail(f"{rid}: a bad request answered {frame}")
            return
        if error is not None and not (kind == "infer" and error == "overloaded"):
            self.report.fail(f"{rid} ({kind}) failed: {frame}")
            return
        if kind == "stop":
            assert pending.target is not None
            if frame.get("stopped") == 1 and pending.target in self.pending:
                self.report.fail(f"{rid}: the stop replied before its infer's final frame")
        if kind == "infer" and error is None and frame.get("response_type") != "full":
            self.report.fail(f"{rid}: an infer ended with {frame}")


async def soak(args: argparse.Namespace) -> tuple[SoakReport, ServerProcess]:
    report = SoakReport()
    server_args = ["--context-length", str(args.context_length), *args.server_arg]
    async with open_server_process(server_args) as server:
        print(f"soak: server pid {server.pid} at {server.url}", file=sys.stderr, flush=True)
        begun = time.perf_counter()
        until = begun + args.minutes * 60

        async def sample() -> None:
            while True:
                if server.alive:
                    report.rss_samples.append((time.perf_counter() - begun, server.rss_bytes()))
                await trio.sleep(5.0)

        async def progress() -> None:
            while True:
                await trio.sleep(30.0)
                done = sum(report.answered.values())
                rss = report.rss_samples[-1][1] / MiB if report.rss_samples else 0
                print(
                    f"  {time.perf_counter() - begun:.0f} s: {done} answered, "
                    f"{len(report.failures)} failures, rss {rss:.0f} MiB",
                    file=sys.stderr,
                    flush=True,
                )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            nursery.start_soon(progress)
            async with trio.open_nursery() as clients:
                for index in range(args.clients):
                    client = SoakClient(index, server.url, report, args.seed)
                    clients.start_soon(client.run, until)
            report.rss_samples.append((time.perf_counter() - begun, server.rss_bytes()))
            nursery.cancel_scope.cancel()
        alive = server.alive
    if not alive:
        report.fail("the server died during the soak")
    return report, server


def format_report(report: SoakReport, server: ServerProcess, args: argparse.Namespace) -> str:
    warm = [rss for t, rss in report.rss_samples if t >= args.warmup_minutes * 60]
    after_warmup = warm[0] if warm else 0
    end = report.rss_samples[-1][1] if report.rss_samples else 0
    peak = max((rss for _, rss in report.rss_samples), default=0)
    answered = sum(report.answered.values())
    lines = [
        f"soak: {args.clients} clients for {args.minutes} min, seed {args.seed}",
        f"requests sent: {sum(report.sent.values())} "
        + "("
        + ", ".join(f"{k} {v}" for k, v in sorted(report.sent.items()))
        + ")",
        f"answered exactly once: {answered} "
        + "("
        + ", ".join(f"{k} {v}" for k, v in sorted(report.answered.items()))
        + f"); chunk frames {report.chunks}",
        f"hang-ups with requests in flight: {report.hangups} "
        f"({report.abandoned} requests abandoned)",
        f"server RSS: {after_warmup / MiB:.0f} MiB after the {args.warmup_minutes} min warm-up, "
        f"{end / MiB:.0f} MiB at the end ({(end - after_warmup) / MiB:+.0f} MiB), "
        f"peak {peak / MiB:.0f} MiB",
        f"server: exit status {server.returncode} after SIGINT, "
        f"{len(server.error_lines())} error lines in its log",
        f"failures: {len(report.failures)}",
        *(f"  {failure}" for failure in report.failures[:20]),
        *(f"  server: {line}" for line in server.error_lines()[:10]),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-minutes", type=float, default=1.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument("--server-arg", action="append", default=[])
    args = parser.parse_args(argv)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average at start: {load}")
    report, server = trio.run(soak, args)
    print(format_report(report, server, args))
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    ok = (
        not report.failures
        and not server.error_lines()
        and server.returncode == 0
        and sum(report.answered.values()) > 0
    )
    print("RESULT: " + ("pass" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
