"""The HTTP routes of a server: health, readiness, metrics, the info page, and
the OpenAI-compatible API over the scheduler.

:class:`OpsRoutes` and :class:`OpenAIRoutes` add their handlers to a
:class:`~trioserve.http.Router`. The OpenAI routes need four things of the
server, named by :class:`GenerationBackend`: the model's limits, its chat
template, tokenizing off the event loop, and starting a job whose updates can
be read and which can be cancelled. :class:`SchedulerBackend` provides them
over a :class:`~trioserve.scheduler.Scheduler`.

A request's life (both routes, streamed or not): parse and bound the body
(400), render the chat template (400 when the model has none or it refuses
the messages), tokenize, check against the context (400), start the job
(503 when the queue is full or the server drains), then read its updates
until it finishes. The job is cancelled in a ``finally``: when the client
disconnects, the front door cancels the handler's scope, and the engine slot
is freed before the next step, as on the WebSocket side.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterable, Callable, Mapping
from typing import Any, Final, Literal, Protocol

import attrs
import trio

from trioserve import openai as oa
from trioserve._version import __version__
from trioserve.chat_template import ChatTemplate, ChatTemplateError, NoChatTemplate
from trioserve.engine.base import Engine, Failed, Finished, GenerationSpec, TextUpdate, Update
from trioserve.generation.generation import Tokenizing
from trioserve.generation.scheduler import Job, QueueFull, Scheduler, SchedulerClosed
from trioserve.metrics import Metrics

from .http_types import (
    BodyWriter,
    Handler,
    HTTPError,
    HTTPRequest,
    Response,
    Router,
    StreamingResponse,
    event_stream,
)

__all__ = [
    "Generation",
    "GenerationBackend",
    "OpenAIRoutes",
    "OpsRoutes",
    "Readiness",
    "SchedulerBackend",
]

log = logging.getLogger("trioserve.routes")
access_log = logging.getLogger("trioserve.access")

#: Readiness of the server: only ``ready`` answers 200 on ``/ready``.
Readiness = Literal["ready", "starting", "draining"]

#: Texts (or message lists) longer than this many characters are tokenized
#: (rendered) in a worker thread rather than on the event loop.
_THREAD_CHARS: Final = 4096


# --------------------------------------------------------------------------
# Health, readiness, metrics, the info page


@attrs.define
class OpsRoutes:
    """``GET /health``, ``/ready``, ``/metrics`` and ``/``.

    ``readiness()`` says whether the server takes work (the model is loaded
    and it is not draining); ``info()`` gives what ``/`` shows besides the
    routes (the model's name, for instance).
    """

    readiness: Callable[[], Readiness]
    metrics: Metrics | None = None
    info: Callable[[], Mapping[str, Any]] = dict

    def install(self, router: Router) -> None:
        router.add("GET", "/health", self.health)
        router.add("GET", "/ready", self.ready)
        router.add("GET", "/", self.index)
        if self.metrics is not None:
            router.add("GET", "/metrics", self.scrape)

    async def health(self, request: HTTPRequest) -> Response:
        # Live while the process answers; says nothing about the model.
        return Response.json({"status": "ok"})

    async def ready(self, request: HTTPRequest) -> Response:
        state = self.readiness()
        return Response.json({"status": state}, 200 if state == "ready" else 503)

    async def index(self, request: HTTPRequest) -> Response:
        return Response.json(
            {
                "name": "trioserve",
                "version": __version__,
                **self.info(),
                "websocket": "/ (the ExLlamaV2 WebSocket protocol: docs/protocol.md)",
                "openai": "/v1 (models, completions, chat/completions: docs/openai.md)",
                "health": "/health",
                "ready": "/ready",
                "metrics": "/metrics" if self.metrics is not None else None,
                "docs": "the docs/ folder of trioserve: quickstart.md, deployment.md",
            }
        )

    async def scrape(self, request: HTTPRequest) -> Response:
        assert self.metrics is not None
        body, content_type = self.metrics.render(request.header("accept"))
        return Response(200, body, content_type)


# --------------------------------------------------------------------------
# What the OpenAI routes need of the server


class Generation(Protocol):
    """One started job: its updates, until a Finished or Failed, and a
    synchronous, idempotent cancel (safe in ``finally``)."""

    @property
    def updates(self) -> AsyncIterable[Update]: ...

    def cancel(self) -> None: ...


class GenerationBackend(Protocol):
    @property
    def model(self) -> oa.ModelLimits: ...

    @property
    def chat_template(self) -> ChatTemplate | None: ...

    @property
    def draining(self) -> bool: ...

    async def encode(self, text: str) -> list[int]:
        """Tokenize as the WebSocket side does, off the event loop when long."""
        ...

    def new_job_id(self) -> int: ...

    def start(self, spec: GenerationSpec) -> Generation:
        """Queue ``spec``; raise :class:`~trioserve.openai_api.OpenAIError`
        (503 with Retry-After, or 429) when it cannot be taken now."""
        ...


@attrs.define(eq=False)
class _JobGeneration:
    scheduler: Scheduler
    job: Job

    @property
    def updates(self) -> AsyncIterable[Update]:
        return self.job.updates

    def cancel(self) -> None:
        self.scheduler.cancel(self.job)


@attrs.define(eq=False)
class SchedulerBackend:
    """:class:`GenerationBackend` over a scheduler and its engine."""

    scheduler: Scheduler
    engine: Engine
    model: oa.ModelLimits
    chat_template: ChatTemplate | None = None
    is_draining: Callable[[], bool] = lambda: False
    #: The server's tokenizing (long texts off the event loop, GIL released,
    #: on a limiter of its own); None: one of its own.
    tokenizing: Tokenizing | None = None

    def __attrs_post_init__(self) -> None:
        if self.tokenizing is None:
            self.tokenizing = Tokenizing(self.engine)

    @property
    def draining(self) -> bool:
        return self.is_draining()

    async def encode(self, text: str) -> list[int]:
        # Room first, so that a full server does not tokenize megabytes for nothing.
        if not self.scheduler.has_room():
            raise oa.OpenAIError(
                503,
                f"{self.scheduler.max_waiting} jobs are already waiting for the engine; "
                "retry later",
                code="overloaded",
                retry_after=1,
            )
        assert self.tokenizing is not None
        return await self.tokenizing.encode(text)

    def new_job_id(self) -> int:
        return self.scheduler.new_job_id()

    def start(self, spec: GenerationSpec) -> Generation:
        if self.draining:
            raise oa.OpenAIError(
                503, "the server is shutting down", code="overloaded", retry_after=1
            )
        try:
            job = self.scheduler.open_job(spec)
        except QueueFull as exc:
            raise oa.OpenAIError(503, str(exc), code="overloaded", retry_after=1) from None
        except SchedulerClosed:
            raise oa.OpenAIError(
                503, "the server is shutting down", code="overloaded", retry_after=1
            ) from None
        return _JobGeneration(self.scheduler, job)


# --------------------------------------------------------------------------
# The OpenAI routes


def http_errors(handler: Handler) -> Handler:
    """``handler`` with its API errors turned into the HTTP layer's: the
    front door knows no API, only :class:`HTTPError` (with OpenAI's body)."""

    async def wrapped(request: HTTPRequest) -> Response | StreamingResponse:
        try:
            return await handler(request)
        except oa.OpenAIError as exc:
            raise HTTPError(
                exc.status, exc.message, headers=exc.headers(), body=exc.body()
            ) from None

    return wrapped


def _outcome(status: int) -> str:
    """The metrics outcome of an error status."""
    return {
        400: "invalid_request",
        404: "not_found",
        413: "too_large",
        429: "overloaded",
        503: "overloaded",
    }.get(status, "internal")


@attrs.define(eq=False)
class _Tracker:
    """Timing and token counts of one generation request, for its usage and
    the metrics."""

    metrics: Metrics | None
    action: str
    #: The client, for the access log.
    peer: str = ""
    arrived: float = attrs.Factory(trio.current_time)
    first_at: float | None = None
    cached_tokens: int = 0
    last: float | None = None
    generated: int = 0
    prompt_tokens: int = 0
    done: bool = False

    def update(self, generated: int) -> None:
        now = trio.current_time()
        new = generated - self.generated
        if new > 0 and self.first_at is None:
            self.first_at = now
        if new > 0 and self.metrics is not None:
            if self.last is None:
                self.metrics.first_token(now - self.arrived, api="openai")
                if new > 1:
                    self.metrics.tokens(0.0, new - 1)
            else:
                self.metrics.tokens(now - self.last, new)
        if new > 0:
            self.last = now
        self.generated = max(self.generated, generated)

    def finish(self, outcome: str) -> None:
        if self.done:
            return
        self.done = True
        now = trio.current_time()
        if self.metrics is not None:
            self.metrics.request_finished(
                api="openai",
                action=self.action,
                outcome=outcome,
                prompt_tokens=self.prompt_tokens,
                generated_tokens=self.generated,
                cached_tokens=self.cached_tokens,
                duration=now - self.arrived,
            )
        ttft = None if self.first_at is None else round(self.first_at - self.arrived, 4)
        rate = None
        if self.first_at is not None and self.last is not None and self.generated > 1:
            span = self.last - self.first_at
            rate = round((self.generated - 1) / span, 1) if span > 0 else None
        access_log.info(
            "%s done",
            self.action,
            extra={
                "fields": {
                    "peer": self.peer,
                    "api": "openai",
                    "action": self.action,
                    "outcome": outcome,
                    "prompt_tokens": self.prompt_tokens,
                    "generated_tokens": self.generated,
                    "cached_tokens": self.cached_tokens,
                    "ttft_s": ttft,
                    "tok_s": rate,
                    "total_s": round(now - self.arrived, 4),
                }
            },
        )


@attrs.define
class OpenAIRoutes:
    """``GET /v1/models``, ``GET /v1/models/{model}``, ``POST
    /v1/completions`` and ``POST /v1/chat/completions`` over ``backend``."""

    backend: GenerationBackend
    limits: oa.OpenAILimits = attrs.Factory(oa.OpenAILimits)
    metrics: Metrics | None = None
    #: When the model was loaded (the ``created`` of the model object).
    created: int = attrs.Factory(lambda: int(time.time()))

    def install(self, router: Router) -> None:
        router.add("GET", "/v1/models", http_errors(self.models))
        router.add("GET", "/v1/models/{model}", http_errors(self.model))
        router.add("POST", "/v1/completions", http_errors(self.completions))
        router.add("POST", "/v1/chat/completions", http_errors(self.chat_completions))

    async def models(self, request: HTTPRequest) -> Response:
        return Response(200, oa.models_response(self.backend.model.name, self.created))

    async def model(self, request: HTTPRequest) -> Response:
        name = request.params["model"]
        if name != self.backend.model.name:
            raise oa.OpenAIError(
                404,
                f"the model {name[:200]!r} does not exist",
                param="model",
                code="model_not_found",
            )
        return Response.json(oa.model_object(name, self.created))

    async def completions(self, request: HTTPRequest) -> Response | StreamingResponse:
        tracker = _Tracker(self.metrics, "completions", request.head.peer)
        try:
            parsed = oa.parse_completion_request(request.body, self.limits)
            if isinstance(parsed.prompt, str):
                ids = await self.backend.encode(parsed.prompt)
            elif parsed.echo:
                raise oa.OpenAIError(
                    400, "echo needs the prompt as text, not token ids", param="echo"
                )
            else:
                ids = list(parsed.prompt)
            echo = parsed.prompt if parsed.echo and isinstance(parsed.prompt, str) else ""
            return await self._generate(parsed, ids, tracker, echo=echo)
        except oa.OpenAIError as exc:
            tracker.finish(_outcome(exc.status))
            raise

    async def chat_completions(self, request: HTTPRequest) -> Response | StreamingResponse:
        tracker = _Tracker(self.metrics, "chat_completions", request.head.peer)
        try:
            parsed = oa.parse_chat_request(request.body, self.limits)
            prompt = await self._render(parsed)
            ids = await self.backend.encode(prompt)
            return await self._generate(parsed, ids, tracker)
        except oa.OpenAIError as exc:
            tracker.finish(_outcome(exc.status))
            raise

    async def _render(self, request: oa.ChatCompletionRequest) -> str:
        template = self.backend.chat_template
        if template is None:
            raise oa.OpenAIError(
                400,
                f"the model {self.backend.model.name!r} has no chat template: use /v1/completions "
                "with a prompt in the model's format",
                param="messages",
                code="no_chat_template",
            )
        messages = request.template_messages()
        try:
            if sum(len(m.content) for m in request.messages) > _THREAD_CHARS:
                return await trio.to_thread.run_sync(template.render, messages)
            return template.render(messages)
        except NoChatTemplate as exc:  # pragma: no cover - a template is there
            raise oa.OpenAIError(400, str(exc), param="messages", code="no_chat_template") from None
        except ChatTemplateError as exc:
            raise oa.OpenAIError(
                400, str(exc), param="messages", code="chat_template_error"
            ) from None

    async def _generate(
        self,
        request: oa.CompletionRequest | oa.ChatCompletionRequest,
        ids: list[int],
        tracker: _Tracker,
        *,
        echo: str = "",
    ) -> Response | StreamingResponse:
        backend = self.backend
        spec = oa.build_spec(request, ids, backend.model, job_id=backend.new_job_id())
        tracker.prompt_tokens = len(spec.prompt_ids)
        # Started before the response begins, so that an overloaded server
        # answers with a status the SDKs retry on, not a broken stream.
        generation = backend.start(spec)
        chat = isinstance(request, oa.ChatCompletionRequest)
        kind: Literal["cmpl", "chatcmpl"] = "chatcmpl" if chat else "cmpl"
        response_id = oa.new_id(kind)
        created = int(time.time())
        name = backend.model.name
        if not request.stream:
            try:
                text, finished = await self._collect(generation, tracker)
            finally:
                self._release(generation, tracker)
            usage = oa.TokenUsage(
                finished.prompt_tokens, finished.generated_tokens, finished.cached_tokens
            )
            reason = oa.finish_reason(finished)
            if chat:
                body = oa.chat_completion_response(
                    id=response_id,
                    created=created,
                    model=name,
                    content=text,
                    finish_reason=reason,
                    usage=usage,
                )
            else:
                body = oa.completion_response(
                    id=response_id,
                    created=created,
                    model=name,
                    text=echo + text,
                    finish_reason=reason,
                    usage=usage,
                )
            return Response(200, body)

        stream: oa.ChatCompletionStream | oa.CompletionStream
        if chat:
            stream = oa.ChatCompletionStream(response_id, created, name, request.include_usage)
        else:
            stream = oa.CompletionStream(response_id, created, name, request.include_usage)

        async def write(out: BodyWriter) -> None:
            try:
                if isinstance(stream, oa.ChatCompletionStream):
                    await out.send(stream.start())
                if echo:
                    await out.send(stream.text(echo))
                async for update in generation.updates:
                    if isinstance(update, TextUpdate):
                        tracker.update(update.generated_tokens)
                        if update.text:
                            await out.send(stream.text(update.text))
                    elif isinstance(update, Finished):
                        tracker.update(update.generated_tokens)
                        usage = oa.TokenUsage(
                            update.prompt_tokens, update.generated_tokens, update.cached_tokens
                        )
                        reason = oa.finish_reason(update)
                        tracker.cached_tokens = update.cached_tokens
                        tracker.finish("num_tokens" if reason == "length" else "eos")
                        await out.send(stream.finish(reason, usage, text=update.text))
                        return
                    else:
                        error = self._failure(update, tracker)
                        await out.send(stream.error(error))
                        return
            finally:
                self._release(generation, tracker)

        return event_stream(write)

    async def _collect(self, generation: Generation, tracker: _Tracker) -> tuple[str, Finished]:
        parts: list[str] = []
        async for update in generation.updates:
            if isinstance(update, TextUpdate):
                tracker.update(update.generated_tokens)
                parts.append(update.text)
            elif isinstance(update, Finished):
                tracker.update(update.generated_tokens)
                tracker.cached_tokens = update.cached_tokens
                tracker.finish("num_tokens" if update.reason == "max_new_tokens" else "eos")
                parts.append(update.text)
                return "".join(parts), update
            else:
                raise self._failure(update, tracker)
        # The job was cancelled under us: only the shutdown does that.
        tracker.finish("interrupted")
        raise oa.OpenAIError(503, "the server is shutting down", code="overloaded", retry_after=1)

    def _failure(self, update: Failed, tracker: _Tracker) -> oa.OpenAIError:
        if self.backend.draining:
            tracker.finish("interrupted")
            if self.metrics is not None:
                self.metrics.cancelled("shutdown")
            return oa.OpenAIError(
                503, "the server is shutting down", code="overloaded", retry_after=1
            )
        tracker.finish("internal")
        log.error("generation failed: %s", update.message)
        return oa.OpenAIError(500, update.message, code="internal")

    def _release(self, generation: Generation, tracker: _Tracker) -> None:
        """The job's end, in a ``finally``: a request that has no outcome yet
        is being abandoned by its client."""
        generation.cancel()
        if not tracker.done:
            tracker.finish("interrupted")
            if self.metrics is not None:
                self.metrics.cancelled("disconnect")
