"""One generation, from a validated request to its outcome; no sockets.

Both front ends (the WebSocket protocol and, through it, any other API) turn
a request into a :class:`GenerationRequest`, and :class:`Generation` does the
rest: checks against the model, tokenizes (after the queue has room, off the
event loop for long texts), trims to the context, submits the job and follows
its updates. The front end reads what it needs to answer from the
``Generation`` (text so far, counts, timing, the outcome) and decides how to
send it; nothing here knows a frame or a socket.

The pure part, :func:`trim_prompt` and :func:`build_spec`, is separate so it
can be tested without trio.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Literal, Protocol, TypeAlias

import attrs
import trio

from trioserve.engine.base import (
    Engine,
    EngineInfo,
    Failed,
    Finished,
    GenerationSpec,
    SamplingSettings,
    TextUpdate,
)
from trioserve.errors import TrioserveError

from .scheduler import Job, QueueFull, Scheduler, SchedulerClosed

__all__ = [
    "Generation",
    "GenerationRequest",
    "InvalidGeneration",
    "Outcome",
    "Overloaded",
    "Tokenizing",
    "build_spec",
    "tail_chars",
    "trim_prompt",
]


class InvalidGeneration(TrioserveError):
    """The request cannot run on this model (a limit or a token id); names the field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class Overloaded(TrioserveError):
    """No room for the job now (queue full, or the server is shutting down)."""


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """What to generate, whatever API asked for it."""

    #: The prompt text, and ``custom_bos`` put before it (its first token
    #: survives trimming: protocol.md 3.4).
    text: str
    custom_bos: str = ""
    max_new_tokens: int
    sampling: SamplingSettings = attrs.field(factory=SamplingSettings)
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    banned_ids: tuple[int, ...] = ()
    token_healing: bool = False
    #: Wire path of the prompt, for errors (``$.text``, or ``$.messages``
    #: when the prompt was rendered from them).
    text_field: str = "$.text"


def trim_prompt(ids: Sequence[int], keep: int, *, keep_first: bool) -> list[int]:
    """The last ``keep`` ids of ``ids``; with ``keep_first``, the first id stays
    in front (the ``customBos`` rule of protocol.md 3.4)."""
    if len(ids) <= keep:
        return list(ids)
    if keep_first:
        return [ids[0], *ids[len(ids) - (keep - 1) :]] if keep > 1 else [ids[0]]
    return list(ids[len(ids) - keep :])


def tail_chars(info: EngineInfo, keep: int) -> int | None:
    """How many characters at the end of a prompt can matter when it is
    trimmed to ``keep`` tokens, or None when the engine cannot say.

    One token covers at most ``max_token_chars`` characters, so the last
    ``keep`` tokens of a text lie within its last ``keep * max_token_chars``
    characters. A margin of 64 tokens more keeps the tokens near the cut
    (where tokenizing the tail alone may split a word differently) out of
    the kept part.
    """
    if info.max_token_chars is None:
        return None
    return (keep + 64) * max(1, info.max_token_chars)


def build_spec(
    job_id: int, request: GenerationRequest, prompt_ids: Sequence[int], info: EngineInfo
) -> GenerationSpec:
    """The engine's job for ``request`` with its final prompt ids."""
    return GenerationSpec(
        job_id=job_id,
        prompt_ids=tuple(prompt_ids),
        max_new_tokens=request.max_new_tokens,
        sampling=request.sampling,
        stop_token_ids=frozenset(info.eos_token_ids) | frozenset(request.stop_token_ids),
        stop_strings=request.stop_strings,
        banned_ids=frozenset(request.banned_ids),
        token_healing=request.token_healing,
    )


class Tokenizing:
    """Runs an engine's tokenizer for the event loop: short texts inline (a
    few microseconds), long ones in a worker thread of its own limiter, so
    that tokenizing never takes a thread the engine or anything else needs.
    The engine's tokenizer releases the GIL on long texts, so the event loop
    keeps running meanwhile."""

    def __init__(self, engine: Engine, *, inline_chars: int = 2048, threads: int = 1) -> None:
        self.engine = engine
        self.inline_chars = inline_chars
        self.limiter = trio.CapacityLimiter(threads)

    async def encode(self, text: str) -> list[int]:
        if len(text) <= self.inline_chars:
            return self.engine.encode(text)
        return await trio.to_thread.run_sync(self.engine.encode, text, limiter=self.limiter)

    async def decode(self, ids: list[int]) -> str:
        if len(ids) <= self.inline_chars // 4:
            return self.engine.decode(ids)
        return await trio.to_thread.run_sync(self.engine.decode, ids, limiter=self.limiter)


Outcome: TypeAlias = Literal["finished", "failed", "interrupted"]


class GenerationObserver(Protocol):
    """What a generation reports as it goes (``trioserve.metrics.Metrics`` is one)."""

    def first_token(self, seconds: float, *, api: str) -> None: ...

    def tokens(self, seconds: float, count: int = 1) -> None: ...


@attrs.define(eq=False)
class Generation:
    """One generation in flight: its prompt, job, text so far and timing.

    ``run`` prepares and submits the job and follows its updates to the end;
    ``on_text`` (set by the front end) is called synchronously with each
    piece of released text, so the front end decides how (and whether yet)
    to send it. When the task running ``run`` is cancelled (a stop, a
    disconnect, a shutdown), call :meth:`interrupt` from outside the
    cancelled scope: it frees the job and settles the outcome.
    """

    request: GenerationRequest
    #: trio.current_time() when the request arrived.
    received: float
    owner: Hashable | None = None
    util_text: str = ""
    prompt_tokens: int = 0
    trimmed_tokens: int = 0
    #: Prompt tokens the engine took from its prefix cache.
    cached_tokens: int = 0
    response: str = ""
    held: str = ""
    generated_tokens: int = 0
    first_token_at: float | None = None
    job: Job | None = None
    #: Set when the outcome is decided (a stop can no longer change it).
    outcome: Outcome | None = None
    finished: Finished | None = None
    failure: str | None = None
    ended_at: float | None = None
    #: Told of the first token and of the gaps between later ones (metrics),
    #: under ``api``'s name.
    observer: GenerationObserver | None = None
    api: str = "websocket"
    last_token_at: float | None = None
    #: Called with each piece of released text; the front end sets it.
    on_text: Callable[[str], None] = attrs.field(default=lambda _text: None, repr=False)
    _prompt_ids: list[int] = attrs.field(factory=list, init=False, repr=False)

    @property
    def decided(self) -> bool:
        """Whether the outcome is known, or the job has delivered its last
        update (a stop arriving now is too late to change it)."""
        return self.outcome is not None or (self.job is not None and self.job.done)

    async def run(
        self, scheduler: Scheduler, tokenizing: Tokenizing, *, max_new_tokens: int
    ) -> None:
        """Prepare, submit and follow the job until it ends.

        The request has been checked against the model already (limits and
        token ids: ``protocol.validate_against_model``, or the OpenAI core's
        own checks). Raises :class:`InvalidGeneration` (an empty prompt) or
        :class:`Overloaded` before the job is submitted; after that, the
        outcome says how it ended.
        """
        info = scheduler.engine.info
        request = self.request
        # Room first, so a full server does not tokenize megabytes for nothing.
        if not scheduler.has_room(self.owner):
            raise Overloaded(
                f"{scheduler.max_waiting} jobs are already waiting for the engine; retry later"
            )
        await self._prepare(tokenizing, info)
        spec = build_spec(scheduler.new_job_id(), request, self._prompt_ids, info)
        try:
            self.job = job = scheduler.open_job(spec, owner=self.owner)
        except QueueFull as exc:
            raise Overloaded(str(exc)) from None
        except SchedulerClosed:
            raise Overloaded("the server is shutting down and takes no new requests") from None
        async for update in job.updates:
            if self._apply(update):
                return
        # pragma: no cover - the scheduler always ends a job with an update
        self._settle("failed", failure="the job ended without a result")

    async def _prepare(self, tokenizing: Tokenizing, info: EngineInfo) -> None:
        """Tokenize and trim: protocol.md 3.4."""
        request = self.request
        keep = info.context_length - request.max_new_tokens
        prompt = request.custom_bos + request.text
        tail = tail_chars(info, keep)
        if tail is not None and len(request.text) > tail:
            # Far longer than the context: only its tail can be kept, so only
            # the tail is tokenized. trimmed_tokens then counts the tokens of
            # that tail that were dropped (a lower bound).
            head = await tokenizing.encode(request.custom_bos) if request.custom_bos else []
            ids = head[:1] + await tokenizing.encode(request.text[len(request.text) - tail :])
        else:
            ids = await tokenizing.encode(prompt)
        if not ids:
            raise InvalidGeneration(
                "the prompt (customBos + text) must encode to at least one token",
                request.text_field,
            )
        if len(ids) > keep:
            kept = trim_prompt(ids, keep, keep_first=bool(request.custom_bos))
            self.trimmed_tokens = len(ids) - len(kept)
            ids = kept
            self.util_text = await tokenizing.decode(ids)
        else:
            self.util_text = prompt
        self.prompt_tokens = len(ids)
        self._prompt_ids = ids

    def _apply(self, update: TextUpdate | Finished | Failed) -> bool:
        """Take one update; True when it was the last."""
        if isinstance(update, Failed):
            self._settle("failed", failure=update.message)
            return True
        self._count_tokens(update.generated_tokens)
        if isinstance(update, TextUpdate):
            self.held = update.held
            self._release(update.text)
            return False
        self.held = ""
        self.prompt_tokens = update.prompt_tokens
        self.cached_tokens = update.cached_tokens
        self._release(update.text)
        self.finished = update
        self._settle("finished")
        return True

    def _count_tokens(self, generated: int) -> None:
        new = generated - self.generated_tokens
        if new <= 0:
            return
        now = trio.current_time()
        observer = self.observer
        if self.first_token_at is None:
            self.first_token_at = now
            if observer is not None:
                observer.first_token(now - self.received, api=self.api)
                if new > 1:
                    observer.tokens(0.0, new - 1)
        elif observer is not None and self.last_token_at is not None:
            observer.tokens(now - self.last_token_at, new)
        self.last_token_at = now
        self.generated_tokens = generated

    def _release(self, text: str) -> None:
        if text:
            self.response += text
            self.on_text(text)

    def _settle(self, outcome: Outcome, *, failure: str | None = None) -> None:
        self.outcome = outcome
        self.failure = failure
        self.ended_at = trio.current_time()

    def interrupt(self, scheduler: Scheduler) -> None:
        """Settle a generation whose task was cancelled: synchronous, for
        ``finally`` blocks.

        A job that had already delivered its last update keeps its real
        outcome (a stop or a drain that races the end of a job must not turn
        an ``eos`` into ``interrupted``). Otherwise the job is cancelled and
        held text is flushed into the response: nothing generated is lost.
        """
        if self.outcome is not None:
            return
        job = self.job
        if job is not None and job.done:
            # Read what the task did not get to: the job's channel holds its
            # last updates and is closed, so this never waits.
            while True:
                try:
                    update = job.updates.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
                if self._apply(update):
                    return
        if job is not None:
            scheduler.cancel(job)
        if self.held:
            self._release(self.held)
            self.held = ""
        self._settle("interrupted")

    # -- figures for replies and logs ------------------------------------------------

    @property
    def queued_s(self) -> float:
        job = self.job
        end = self.ended_at if self.ended_at is not None else trio.current_time()
        if job is None:
            return end - self.received
        started = job.started_at if job.started_at is not None else end
        return started - job.queued_at

    @property
    def first_token_s(self) -> float | None:
        if self.first_token_at is None:
            return None
        return self.first_token_at - self.received

    @property
    def total_s(self) -> float:
        end = self.ended_at if self.ended_at is not None else trio.current_time()
        return end - self.received

    @property
    def tokens_per_second(self) -> float | None:
        """Decode speed after the first token, or None with fewer than two tokens."""
        if self.first_token_at is None or self.ended_at is None or self.generated_tokens < 2:
            return None
        span = self.ended_at - self.first_token_at
        return (self.generated_tokens - 1) / span if span > 0 else math.inf
