"""Shared test helpers: a scripted engine, a server runner and a raw client.

The scripted engine is for unit tests of the server and scheduler only: it is
deterministic and fast, and can be made slow or failing on demand. Every
feature is also tested against the real embedded model (tests marked with the
``model`` fixture).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import attrs
import trio
import trio_websocket

from trioserve.engine.base import EngineInfo, GenerationSpec
from trioserve.engine.text import TextStream
from trioserve.server import Listening, Server, ServerConfig, serve
from trioserve.vocabulary.results import Failed, Finished, TextUpdate, Update

BOS = 256
EOS = 257
SPECIALS = {BOS: "<|bos|>", EOS: "<|eos|>"}
SPECIAL_IDS = {text: token for token, text in SPECIALS.items()}

#: What the scripted engine answers by default: ASCII, a multi-byte
#: character that spans several byte tokens, CJK and an emoji.
DEFAULT_SCRIPT = "Hello, world! Ünïcode 日本語 works 🙂 and so on. "


def scripted_reply(prompt: str) -> str:
    """The scripted engine's answer to ``prompt``.

    ``say:<text>`` answers exactly ``<text>`` followed by EOS; anything else
    answers :data:`DEFAULT_SCRIPT` repeated forever (so max_new_tokens ends it).
    """
    marker = prompt.rfind("say:")
    if marker >= 0:
        return prompt[marker + 4 :]
    return DEFAULT_SCRIPT * 10_000


@attrs.define(eq=False)
class _ScriptedJob:
    spec: GenerationSpec
    reply: bytes
    stream: TextStream
    generated: int = 0


class ScriptedEngine:
    """A deterministic byte-level engine implementing the Engine protocol.

    Token ids 0..255 are bytes, 256 is BOS and 257 EOS. Each step generates
    one token for every running job (at most ``max_batch``; more wait in
    arrival order). ``step_delay`` makes every step sleep (a slow model);
    ``fail_when`` makes a job fail when its prompt contains the given text;
    ``crash_when`` makes the whole step raise when a running job's prompt
    contains it. ``pausing`` makes it a pausing engine (``EngineInfo.pausing``):
    a paused job keeps its progress and resumes where it stopped.
    """

    def __init__(
        self,
        *,
        context_length: int = 16384,
        max_batch: int = 4,
        step_delay: float = 0.0,
        fail_when: str = "FAIL",
        crash_when: str = "CRASH",
        model_dir: str | None = None,
        pausing: bool = False,
    ) -> None:
        self._info = EngineInfo(
            engine="scripted",
            model_name="scripted-bytes",
            context_length=context_length,
            vocab_size=258,
            bos_token_id=BOS,
            eos_token_ids=frozenset({EOS}),
            max_batch=max_batch,
            # A token is one byte: it covers at most one character.
            max_token_chars=1,
            # Where the server looks for a chat template.
            model_dir=model_dir,
            pausing=pausing,
        )
        self.step_delay = step_delay
        self.fail_when = fail_when
        self.crash_when = crash_when
        self._waiting: list[_ScriptedJob] = []
        self._running: dict[int, _ScriptedJob] = {}
        self.paused: dict[int, _ScriptedJob] = {}
        #: Every pause and resume, in order: ("pause" | "resume", job_id).
        self.pause_log: list[tuple[str, int]] = []
        self.steps = 0
        self.closed = False
        self._in_step = threading.Lock()

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def running_jobs(self) -> int:
        return len(self._running)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        while pos < len(text):
            special = next((s for s in SPECIAL_IDS if text.startswith(s, pos)), None)
            if special is not None:
                ids.append(SPECIAL_IDS[special])
                pos += len(special)
                continue
            ids.extend(text[pos].encode("utf-8"))
            pos += 1
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        for token in ids:
            out.extend(SPECIALS[token].encode() if token in SPECIALS else bytes([token]))
        return out.decode("utf-8", errors="replace")

    def step(
        self, submit: Sequence[GenerationSpec], cancel: Sequence[int], pause: Sequence[int] = ()
    ) -> list[Update]:
        # The engine is not thread-safe: a second concurrent caller is a bug.
        if not self._in_step.acquire(blocking=False):
            raise AssertionError("step() called concurrently")
        if pause and not self._info.pausing:
            raise AssertionError("pause sent to an engine that does not pause")
        try:
            return self._step(submit, cancel, pause)
        finally:
            self._in_step.release()

    def _step(
        self, submit: Sequence[GenerationSpec], cancel: Sequence[int], pause: Sequence[int] = ()
    ) -> list[Update]:
        updates: list[Update] = []
        for job_id in cancel:
            self.paused.pop(job_id, None)
        for job_id in pause:
            job = self._running.pop(job_id, None)
            if job is None:
                job = next((j for j in self._waiting if j.spec.job_id == job_id), None)
                if job is not None:
                    self._waiting.remove(job)
            if job is not None:
                self.paused[job_id] = job
                self.pause_log.append(("pause", job_id))
        for spec in submit:
            resumed = self.paused.pop(spec.job_id, None)
            if resumed is not None:
                self.pause_log.append(("resume", spec.job_id))
                self._waiting.append(resumed)
                continue
            if len(spec.prompt_ids) + spec.max_new_tokens > self._info.context_length:
                updates.append(Failed(spec.job_id, "prompt plus max_new_tokens exceed the context"))
                continue
            prompt = self.decode(spec.prompt_ids)
            if self.fail_when in prompt:
                updates.append(Failed(spec.job_id, "scripted failure"))
                continue
            reply = scripted_reply(prompt).encode("utf-8")
            stream = TextStream(self.decode, spec.stop_strings)
            self._waiting.append(_ScriptedJob(spec, reply, stream))
        for job_id in cancel:
            self._running.pop(job_id, None)
            self._waiting = [j for j in self._waiting if j.spec.job_id != job_id]
        while self._waiting and len(self._running) < self._info.max_batch:
            job = self._waiting.pop(0)
            self._running[job.spec.job_id] = job
        if not self._running:
            return updates
        if any(self.crash_when in self.decode(j.spec.prompt_ids) for j in self._running.values()):
            raise RuntimeError("scripted engine crash")
        if self.step_delay:
            time.sleep(self.step_delay)
        self.steps += 1
        for job_id, job in list(self._running.items()):
            updates.append(self._advance(job))
            if not isinstance(updates[-1], TextUpdate):
                del self._running[job_id]
        return updates

    def _advance(self, job: _ScriptedJob) -> Update:
        spec = job.spec
        token = job.reply[job.generated] if job.generated < len(job.reply) else EOS
        job.generated += 1
        if token in spec.stop_token_ids:
            return self._finished(job, job.stream.flush(), "stop_token", stop_token=token)
        piece = job.stream.push([token])
        if piece.stop_string is not None:
            return self._finished(job, piece.text, "stop_string", stop_string=piece.stop_string)
        if job.generated >= spec.max_new_tokens:
            return self._finished(job, piece.text + job.stream.flush(), "max_new_tokens")
        return TextUpdate(spec.job_id, piece.text, job.stream.held, job.generated)

    def _finished(
        self,
        job: _ScriptedJob,
        text: str,
        reason: Any,
        *,
        stop_string: str | None = None,
        stop_token: int | None = None,
    ) -> Finished:
        return Finished(
            job_id=job.spec.job_id,
            text=text,
            reason=reason,
            stop_string=stop_string,
            stop_token=stop_token,
            prompt_tokens=len(job.spec.prompt_ids),
            generated_tokens=job.generated,
        )

    def close(self) -> None:
        self.closed = True


@asynccontextmanager
async def running_server(
    engine: Any, config: ServerConfig | None = None, **options: Any
) -> AsyncIterator[Listening]:
    """Serve ``engine`` on a free loopback port for the duration of the block."""
    config = config or ServerConfig(host="127.0.0.1", port=0, **options)
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(serve, engine, config)
        yield listening
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def serving(engine: Any, **options: Any) -> AsyncIterator[tuple[Server, Listening]]:
    """Like :func:`running_server`, also yielding the Server for its statistics."""
    server = Server(engine, ServerConfig(host="127.0.0.1", port=0, **options))
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(server.run)
        yield server, listening
        nursery.cancel_scope.cancel()


class RawClient:
    """A bare WebSocket client that sends and receives JSON frames verbatim."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self.ws = ws

    async def send(self, frame: Any) -> None:
        """Send ``frame``: str and bytes as they are, anything else as JSON."""
        if not isinstance(frame, str | bytes):
            frame = json.dumps(frame)
        await self.ws.send_message(frame)

    async def recv(self, within: float = 30.0) -> dict[str, Any]:
        with trio.fail_after(within):
            message = await self.ws.get_message()
        assert isinstance(message, str), "the server sends text frames only"
        frame = json.loads(message)
        assert isinstance(frame, dict)
        return frame

    async def recv_until_final(
        self, request_id: Any = None, within: float = 60.0
    ) -> list[dict[str, Any]]:
        """Frames up to and including the terminal frame of one infer."""
        frames: list[dict[str, Any]] = []
        while True:
            frame = await self.recv(within)
            if request_id is not None and frame.get("request_id") != request_id:
                raise AssertionError(f"unexpected frame {frame!r}")
            frames.append(frame)
            if frame.get("response_type") in ("full", "error"):
                return frames

    async def until(
        self, action: str, within: float = 60.0
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The next frame of ``action`` that is not an infer frame, and the
        frames received before it."""
        skipped: list[dict[str, Any]] = []
        while True:
            frame = await self.recv(within)
            if frame.get("action") == action and "response_type" not in frame:
                return frame, skipped
            skipped.append(frame)

    async def request(self, frame: Any) -> dict[str, Any]:
        await self.send(frame)
        return await self.recv()


@asynccontextmanager
async def raw_client(url: str, **options: Any) -> AsyncIterator[RawClient]:
    async with trio_websocket.open_websocket_url(url, **options) as ws:
        yield RawClient(ws)


async def wait_until(predicate: Callable[[], bool], within: float = 10.0) -> None:
    """Poll ``predicate`` until it holds. For state changed by the engine's
    worker thread, which has no trio event to wait on."""
    with trio.fail_after(within):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.005)


def chunks_of(frames: Sequence[dict[str, Any]]) -> list[str]:
    return [f["chunk"] for f in frames if f.get("response_type") == "chunk"]


@contextmanager
def server_in_thread(
    engine_factory: Callable[[], Any], **options: Any
) -> Iterator[tuple[Listening, trio.lowlevel.TrioToken, ServerHandle]]:
    """Run a server in its own trio loop in a thread (for synchronous drivers
    such as Hypothesis state machines). Yields the address, the loop's token
    (for ``trio.from_thread.run``) and a handle to stop it."""
    ready = threading.Event()
    handle = ServerHandle()

    async def main() -> None:
        engine = engine_factory()
        handle.engine = engine

        async def serve_in_scope(task_status: trio.TaskStatus[Listening]) -> None:
            # Its own scope: cancelling it is the server's graceful shutdown
            # (a drain), while the test's clients in the nursery go on.
            with handle.serve_scope:
                await serve(
                    engine,
                    ServerConfig(host="127.0.0.1", port=0, **options),
                    task_status=task_status,
                )

        async with trio.open_nursery() as nursery:
            handle.listening = await nursery.start(serve_in_scope)
            handle.token = trio.lowlevel.current_trio_token()
            handle.cancel_scope = nursery.cancel_scope
            handle.nursery = nursery
            # The loop outlives a drained server: the test's clients run on.
            nursery.start_soon(trio.sleep_forever)
            ready.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the server thread did not start")
    try:
        assert handle.listening is not None and handle.token is not None
        yield handle.listening, handle.token, handle
    finally:
        assert handle.token is not None and handle.cancel_scope is not None
        scope = handle.cancel_scope
        trio.from_thread.run_sync(scope.cancel, trio_token=handle.token)
        thread.join(30)


@attrs.define
class ServerHandle:
    listening: Listening | None = None
    token: trio.lowlevel.TrioToken | None = None
    cancel_scope: trio.CancelScope | None = None
    #: A nursery in the server's loop for tasks of the test (clients).
    nursery: trio.Nursery | None = None
    engine: Any = None
    #: Cancelled to shut the server down gracefully (it drains).
    serve_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
