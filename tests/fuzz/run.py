"""The fuzzer: many hostile frames against one server, every one accounted for.

``run_fuzz`` drives a running server from several connections at once:

* JSON workers each send one fuzzed frame (tests/fuzz/frames.py) at a time,
  followed by a sentinel of their own: a ``stop`` (which interrupts the
  frame if it started an infer) with a request_id no fuzzed frame can know.
  The worker then reads until the sentinel's reply and one more terminal
  frame have arrived, in either order: that frame is the fuzzed frame's one
  answer (chunk frames of an infer may precede it). A second terminal frame is a frame answered
  twice (it shows up in the next round, or in the final check of the
  connection); no terminal frame within the timeout is a frame never
  answered. A valid infer the generator lets complete is waited for by its
  request_id instead of being stopped. A frame over the server's size limit
  must close its connection with 1009; the worker then reconnects.
* WebSocket workers open a connection, check it with an echo, send one
  malformed frame at the byte level, and read until the server closes: the
  close code must be the one RFC 6455 asks for where there is one.
* A bystander streams normal infers on its own connection the whole time
  and checks every frame it gets (tests/hostile.py).

Nothing here knows whether the server runs in this process or another: it
gets a URL. ``python -m tests.fuzz`` starts ``python -m trioserve`` itself.
"""

from __future__ import annotations

import collections
import contextlib
import json
import random
import time
from collections.abc import Callable
from typing import Any

import attrs
import trio
import trio_websocket

from tests import wire
from tests.fuzz.frames import FuzzFrame, WsCase, json_frame, ws_frame
from tests.hostile import Bystander

__all__ = ["FuzzReport", "run_fuzz"]

#: How long a frame may wait for its answer, and a malformed-frame connection
#: for its close, before the run calls it lost.
ANSWER_TIMEOUT = 120.0
#: How long a WebSocket worker waits for a close after input the RFC has no
#: answer for (a truncated frame, a length that lies): the server may rightly
#: wait for more bytes, so the worker then hangs up itself.
UNDETERMINED_WAIT = 0.5
#: Replies up to this size are received by the fuzzing clients (an echoed
#: long tag can make a large frame).
CLIENT_MAX_MESSAGE = 64 * 1024 * 1024


@attrs.define
class FuzzReport:
    seed: int
    #: Fuzzed frames sent at the JSON level and at the WebSocket level.
    json_frames: int = 0
    ws_frames: int = 0
    #: Every frame sent, sentinels included.
    frames_sent: int = 0
    seconds: float = 0.0
    families: collections.Counter[str] = attrs.Factory(collections.Counter)
    #: Answers to fuzzed JSON-level frames, by kind ("echo", "error:invalid_json",
    #: "infer:full", "closed:1009", ...), and chunk frames seen.
    replies: collections.Counter[str] = attrs.Factory(collections.Counter)
    chunks: int = 0
    #: Outcomes of malformed WebSocket frames ("rsv_bit -> 1002").
    ws_outcomes: collections.Counter[str] = attrs.Factory(collections.Counter)
    failures: list[str] = attrs.Factory(list)
    bystander_completed: int = 0
    bystander_failures: list[str] = attrs.Factory(list)

    @property
    def total_frames(self) -> int:
        return self.json_frames + self.ws_frames

    @property
    def ok(self) -> bool:
        return not self.failures and not self.bystander_failures and self.bystander_completed > 0

    def fail(self, message: str) -> None:
        if len(self.failures) < 1000:
            self.failures.append(message)

    def format(self) -> str:
        rate = self.total_frames / self.seconds if self.seconds else 0.0
        lines = [
            f"seed {self.seed}: {self.total_frames} fuzzed frames "
            f"({self.json_frames} JSON-level, {self.ws_frames} malformed WebSocket) "
            f"in {self.seconds:.1f} s, {rate:.0f} frames/s; {self.frames_sent} frames sent "
            "with the sentinels",
            "families: " + _counts(self.families),
            "answers: " + _counts(self.replies) + f"; chunk frames {self.chunks}",
            "malformed WebSocket frames: " + _counts(self.ws_outcomes),
            f"bystander: {self.bystander_completed} requests completed, "
            f"{len(self.bystander_failures)} failures",
            f"failures: {len(self.failures)}",
        ]
        lines += [f"  {failure}" for failure in self.failures[:20]]
        lines += [f"  bystander: {failure}" for failure in self.bystander_failures[:5]]
        return "\n".join(lines)


def _counts(counter: collections.Counter[str]) -> str:
    return ", ".join(f"{key} {count}" for key, count in sorted(counter.items())) or "none"


def _size(data: str | bytes) -> int:
    return len(data.encode("utf-8")) if isinstance(data, str) else len(data)


def _kind(frame: dict[str, Any]) -> str:
    if frame.get("response_type") == "error":
        error = frame.get("error")
        return f"error:{error.get('type') if isinstance(error, dict) else '?'}"
    if frame.get("action") == "infer":
        return f"infer:{frame.get('response_type')}"
    return str(frame.get("action"))


class _Quota:
    def __init__(self, total: int) -> None:
        self.left = total

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


async def _json_worker(
    index: int,
    url: str,
    quota: _Quota,
    report: FuzzReport,
    vocab_size: int,
    max_message_bytes: int,
    seed: int,
) -> None:
    rng = random.Random(f"{seed}-json-{index}")
    nonce = f"sentinel-{seed}-{index}-{rng.getrandbits(64):x}"
    serial = 0
    ws: trio_websocket.WebSocketConnection | None = None
    async with trio.open_nursery() as nursery:
        while True:
            if ws is None or ws.closed:
                ws = await trio_websocket.connect_websocket_url(
                    nursery, url, max_message_size=CLIENT_MAX_MESSAGE
                )
            if not quota.take():
                break
            serial += 1
            frame = json_frame(rng, vocab_size, f"{nonce}-f{serial}")
            report.json_frames += 1
            report.families[frame.family] += 1
            try:
                await _one_round(ws, frame, f"{nonce}-{serial}", report, max_message_bytes)
            except trio_websocket.ConnectionClosed as exc:
                code = exc.reason.code if exc.reason is not None else None
                if code == 1009 and _size(frame.data) > max_message_bytes:
                    report.replies["closed:1009"] += 1
                else:
                    report.fail(
                        f"a {frame.family} frame closed its connection with {code}: "
                        f"{_show(frame.data)}"
                    )
                ws = None
            except trio.TooSlowError:
                report.fail(f"no answer within {ANSWER_TIMEOUT} s to {_show(frame.data)}")
                await ws.aclose()
                ws = None
        if ws is not None and not ws.closed:
            # Nothing may be left over: the next reply answers the last request.
            final = f"{nonce}-last"
            await ws.send_message(json.dumps({"action": "echo", "request_id": final}))
            report.frames_sent += 1
            expected = {"action": "echo", "request_id": final}
            with trio.move_on_after(ANSWER_TIMEOUT) as timeout:
                while True:
                    message = await ws.get_message()
                    try:
                        if json.loads(message) == expected:
                            break
                    except (ValueError, RecursionError):
                        pass
                    report.fail(f"an extra frame after the last answer: {_show(message)}")
            if timeout.cancelled_caught:
                report.fail("no answer to the connection's last echo")
            await ws.aclose()
        nursery.cancel_scope.cancel()


def _show(data: str | bytes, limit: int = 160) -> str:
    text = repr(data[:limit])
    return text + (f"... ({_size(data)} bytes)" if _size(data) > limit else "")


async def _one_round(
    ws: trio_websocket.WebSocketConnection,
    frame: FuzzFrame,
    sentinel: str,
    report: FuzzReport,
    max_message_bytes: int,
) -> None:
    stop_id = f"{sentinel}-stop"
    await ws.send_message(frame.data)
    report.frames_sent += 1
    # A valid infer that may complete is waited for by its request_id, then
    # the sentinel follows (it stops nothing).
    sent_stop = False
    got_stop = False
    terminals: list[str] = []

    async def send_stop() -> None:
        nonlocal sent_stop
        await ws.send_message(json.dumps({"action": "stop", "request_id": stop_id}))
        report.frames_sent += 1
        sent_stop = True

    if frame.complete_id is None:
        await send_stop()
    with trio.fail_after(ANSWER_TIMEOUT):
        while not (got_stop and terminals):
            message = await ws.get_message()
            if not isinstance(message, str):
                report.fail(f"a binary frame from the server: {_show(message)}")
                continue
            try:
                reply = json.loads(message)
            except RecursionError:
                # A value nested deeper than this client's stack: still one
                # answer (only an echo of the frame's own value can be this deep).
                terminals.append("deep")
                report.replies["deep-reply"] += 1
                continue
            except ValueError:
                report.fail(f"the server sent a frame that is not JSON: {_show(message)}")
                continue
            if not isinstance(reply, dict):
                report.fail(f"the server sent a frame that is not an object: {_show(message)}")
                continue
            rid = reply.get("request_id")
            if rid == stop_id and reply.get("action") == "stop" and "stopped" in reply:
                if got_stop:
                    report.fail("the sentinel was answered twice")
                got_stop = True
                continue
            if reply.get("action") == "infer" and reply.get("response_type") == "chunk":
                report.chunks += 1
                if not reply.get("chunk"):
                    report.fail(f"an empty chunk frame: {_show(message)}")
                continue
            kind = _kind(reply)
            terminals.append(kind)
            report.replies[kind] += 1
            if kind == "error:internal":
                report.fail(f"an internal error for {_show(frame.data)}: {_show(message)}")
            if frame.complete_id is not None and not sent_stop:
                if rid != frame.complete_id or kind != "infer:full":
                    report.fail(f"a valid infer ended {_show(message)}")
                await send_stop()
    if len(terminals) != 1:
        report.fail(f"{len(terminals)} answers ({terminals}) to {_show(frame.data)}")


async def _ws_worker(
    index: int,
    host: str,
    port: int,
    quota: _Quota,
    report: FuzzReport,
    seed: int,
) -> None:
    rng = random.Random(f"{seed}-ws-{index}")
    while quota.take():
        case = ws_frame(rng)
        report.ws_frames += 1
        try:
            await _ws_case(host, port, case, report)
        except (OSError, trio.BrokenResourceError, ConnectionError, EOFError) as exc:
            report.fail(f"{case.kind}: the connection could not be used: {exc!r}")


async def _ws_case(host: str, port: int, case: WsCase, report: FuzzReport) -> None:
    ws = await wire.open_raw_websocket(host, port)
    try:
        await ws.send_json({"action": "echo", "request_id": "before"})
        report.frames_sent += 1
        if await ws.receive_json(ANSWER_TIMEOUT) != {"action": "echo", "request_id": "before"}:
            report.fail(f"{case.kind}: a wrong echo before the malformed frame")
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await ws.send_raw(case.data)
        report.frames_sent += 1
        wait = ANSWER_TIMEOUT if case.expected is not None else UNDETERMINED_WAIT
        outcome = "open"
        with trio.move_on_after(wait):
            _, close = await ws.read_to_close(within=wait + 1)
            outcome = "eof" if close is None else str(close.close_code)
        report.ws_outcomes[f"{case.kind} -> {outcome}"] += 1
        if case.expected is not None and (
            not outcome.isdigit() or int(outcome) not in case.expected
        ):
            report.fail(
                f"{case.kind}: expected a close with {sorted(case.expected)}, got {outcome} "
                f"({case.data[:40]!r})"
            )
        if outcome == "1011":
            report.fail(f"{case.kind}: closed with 1011 (an internal error) ({case.data[:40]!r})")
    finally:
        await ws.aclose()


async def server_facts(url: str) -> tuple[int, int]:
    """(vocab_size, max_message_bytes) from the server's ``info``."""
    async with trio_websocket.open_websocket_url(url) as ws:
        await ws.send_message(json.dumps({"action": "info"}))
        info = json.loads(await ws.get_message())
    return int(info["model"]["vocab_size"]), int(info["limits"]["max_message_bytes"])


async def run_fuzz(
    url: str,
    *,
    frames: int,
    seed: int = 0,
    connections: int = 8,
    ws_connections: int = 8,
    ws_share: float = 0.03,
    bystander_frame: Callable[[int], dict[str, Any]],
    say: Callable[[str], None] = lambda line: None,
    progress_every: float = 10.0,
) -> FuzzReport:
    """Send ``frames`` fuzzed frames (``ws_share`` of them malformed at the
    WebSocket level) to the server at ``url`` while a bystander streams."""
    report = FuzzReport(seed=seed)
    split = urllib_split(url)
    vocab_size, max_message_bytes = await server_facts(url)
    ws_total = int(frames * ws_share)
    json_quota, ws_quota = _Quota(frames - ws_total), _Quota(ws_total)
    bystander = Bystander(url, bystander_frame, within=ANSWER_TIMEOUT)
    begun = time.perf_counter()
    async with trio.open_nursery() as outer:
        outer.start_soon(bystander.run)
        with trio.fail_after(ANSWER_TIMEOUT):
            await bystander.first_chunk.wait()

        async def progress() -> None:
            while True:
                await trio.sleep(progress_every)
                elapsed = time.perf_counter() - begun
                say(
                    f"  {report.total_frames} frames in {elapsed:.0f} s "
                    f"({report.total_frames / elapsed:.0f}/s), {len(report.failures)} failures, "
                    f"bystander {bystander.completed} done"
                )

        progress_scope = trio.CancelScope()

        async def report_progress() -> None:
            with progress_scope:
                await progress()

        outer.start_soon(report_progress)
        async with trio.open_nursery() as workers:
            for index in range(connections):
                workers.start_soon(
                    _json_worker,
                    index,
                    url,
                    json_quota,
                    report,
                    vocab_size,
                    max_message_bytes,
                    seed,
                )
            for index in range(ws_connections if ws_total else 0):
                workers.start_soon(_ws_worker, index, split[0], split[1], ws_quota, report, seed)
        report.seconds = time.perf_counter() - begun
        progress_scope.cancel()
        bystander.stop()
        outer.cancel_scope.deadline = trio.current_time() + ANSWER_TIMEOUT
    report.bystander_completed = bystander.completed
    report.bystander_failures = list(bystander.failures)
    return report


def urllib_split(url: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None, url
    return parts.hostname, parts.port
