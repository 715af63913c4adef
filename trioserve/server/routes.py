"""The HTTP routes of a server: health, readiness, metrics, the info page, and
the OpenAI-compatible API.

:class:`OpsRoutes` and :class:`OpenAIRoutes` add their handlers to a
:class:`~trioserve.server.http_types.Router`. The OpenAI routes run each
request through the same pipeline as a WebSocket ``infer``
(:class:`~trioserve.generation.Generations`): the request is parsed and bounded
(400), turned into a :class:`~trioserve.generation.GenerationRequest`, checked
against the model (400), admitted (503 while draining or full, 429 over the
client's request limit), rendered, tokenized and fitted (400
``context_length_exceeded``), then followed to its end. The job is released in
a ``finally``: when the client disconnects, the front door cancels the
handler's scope, and the engine slot is freed before the next step, as on the
WebSocket side. API errors become :class:`HTTPError` here: the front door
knows no API.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Literal

import attrs
import trio

from trioserve import openai as oa
from trioserve._version import __version__
from trioserve.engine.base import Finished, TokenLogprob
from trioserve.generation import (
    Generation,
    Generations,
    InvalidGeneration,
    Overloaded,
    follow_choices,
    start_choices,
)
from trioserve.generation.tools import (
    CallArguments,
    CallStart,
    Content,
    ToolCallReader,
    ToolEvent,
    ToolFormat,
)
from trioserve.metrics import Metrics

from . import access
from .accept import prefers_html
from .doors import ClientIdentity, from_openai, openai_error
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
from .page import chat_page

__all__ = ["OpenAIRoutes", "OpsRoutes", "Readiness", "http_errors"]

log = logging.getLogger("trioserve.routes")

#: Readiness of the server: only ``ready`` answers 200 on ``/ready``.
Readiness = Literal["ready", "starting", "draining"]


# --------------------------------------------------------------------------
# Health, readiness, metrics, the info page


@attrs.define
class OpsRoutes:
    """``GET /health``, ``/ready``, ``/metrics`` and ``/`` (the chat page for
    a browser, :mod:`.page`; JSON for anyone else).

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
        # A browser gets the chat page; every other client the JSON below.
        if prefers_html(request.header("accept")):
            return chat_page().respond(request)
        return Response.json(
            {
                "name": "trioserve",
                "version": __version__,
                **self.info(),
                "websocket": "/ (the ExLlamaV2 WebSocket protocol: docs/protocol.md)",
                "openai": "/v1 (models, completions, chat/completions: docs/openai.md)",
                "tokenizer": "/tokenize, /detokenize, /tokenizer_info (vLLM's: docs/openai.md)",
                "health": "/health",
                "ready": "/ready",
                "metrics": "/metrics" if self.metrics is not None else None,
                "docs": "the docs/ folder of trioserve: quickstart.md, deployment.md",
            },
            headers=[("Vary", "Accept")],
        )

    async def scrape(self, request: HTTPRequest) -> Response:
        assert self.metrics is not None
        body, content_type = self.metrics.render(request.header("accept"))
        return Response(200, body, content_type)


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


def _overloaded(exc: Overloaded) -> oa.OpenAIError:
    return oa.OpenAIError(503, exc.message, code="overloaded", retry_after=1)


_SHUTTING_DOWN = "the server is shutting down"


@attrs.define
class OpenAIRoutes:
    """``GET /v1/models``, ``GET /v1/models/{model}``, ``POST
    /v1/completions`` and ``POST /v1/chat/completions``, through
    ``generations``."""

    generations: Generations
    identity: ClientIdentity
    limits: oa.OpenAILimits = attrs.Factory(oa.OpenAILimits)
    metrics: Metrics | None = None
    #: What ``/v1/models`` reports as the model's ``limits`` (the WebSocket
    #: ``info`` reply's, from the same declarations).
    model_limits: Mapping[str, int] = attrs.Factory(dict)
    #: When the model was loaded (the ``created`` of the model object).
    created: int = attrs.Factory(lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.generations.info.model_name

    def install(self, router: Router) -> None:
        router.add("GET", "/v1/models", http_errors(self.models))
        router.add("GET", "/v1/models/{model}", http_errors(self.model))
        router.add("POST", "/v1/completions", http_errors(self.completions))
        router.add("POST", "/v1/chat/completions", http_errors(self.chat_completions))

    async def models(self, request: HTTPRequest) -> Response:
        return Response(200, oa.models_response(self.model_name, self.created, **self._model()))

    async def model(self, request: HTTPRequest) -> Response:
        name = request.params["model"]
        if name != self.model_name:
            raise oa.OpenAIError(
                404,
                f"the model {name[:200]!r} does not exist",
                param="model",
                code="model_not_found",
            )
        return Response.json(oa.model_object(name, self.created, **self._model()))

    def _model(self) -> dict[str, Any]:
        return {
            "context_length": self.generations.info.context_length,
            "limits": self.model_limits or None,
        }

    async def completions(self, request: HTTPRequest) -> Response | StreamingResponse:
        return await self._serve(request, "completions")

    async def chat_completions(self, request: HTTPRequest) -> Response | StreamingResponse:
        return await self._serve(request, "chat_completions")

    async def _serve(
        self, http: HTTPRequest, action: Literal["completions", "chat_completions"]
    ) -> Response | StreamingResponse:
        arrived = trio.current_time()
        client = self.identity.of(http.head)
        choices: list[Generation] = []
        try:
            parsed: oa.CompletionRequest | oa.ChatCompletionRequest
            if action == "completions":
                parsed = oa.parse_completion_request(http.body, self.limits)
            else:
                parsed = oa.parse_chat_request(http.body, self.limits)
            choices = self._open(parsed, client)
            for choice in choices:
                choice.received = arrived
            try:
                await start_choices(choices)
            except InvalidGeneration as exc:
                raise openai_error(exc) from None
            except Overloaded as exc:
                raise _overloaded(exc) from None
        except oa.OpenAIError as exc:
            for choice in choices:
                choice.close()
            self._finish(http, action, choices, _outcome(exc.status), arrived)
            raise
        except BaseException:
            for choice in choices:
                choice.close()
            raise
        reply = _Reply(self, http, action, parsed, choices)
        if not parsed.stream:
            return await reply.whole()
        return event_stream(reply.stream)

    def _open(
        self, parsed: oa.CompletionRequest | oa.ChatCompletionRequest, client: Hashable
    ) -> list[Generation]:
        try:
            return self.generations.open_choices(
                from_openai(parsed), parsed.n, client=client, api="openai"
            )
        except InvalidGeneration as exc:
            raise openai_error(exc) from None
        except Overloaded as exc:
            if exc.draining:
                raise _overloaded(exc) from None
            # The client's own limit: a rate limit, not the server's fullness.
            raise oa.OpenAIError(
                429, exc.message, code="rate_limit_exceeded", retry_after=1
            ) from None

    def _finish(
        self,
        http: HTTPRequest,
        action: str,
        choices: Sequence[Generation],
        outcome: str,
        arrived: float,
    ) -> None:
        """Count and log one request's end."""
        access.log_openai(
            self.metrics,
            http.head.peer,
            action,
            choices,
            outcome,
            duration=trio.current_time() - arrived,
            cancel_cause="shutdown" if self.generations.is_draining() else "disconnect",
        )


@attrs.define(eq=False)
class _Choice:
    """One choice of a streamed reply: what of it has been sent."""

    index: int
    generation: Generation
    calls: _CallEvents
    #: The legacy completions ``logprobs`` objects, their offsets counted on.
    legacy: oa.LegacyLogprobs = attrs.Factory(oa.LegacyLogprobs)
    sent: int = 0
    entries: int = 0
    ended: bool = False


@attrs.define(eq=False)
class _Reply:
    """The answer to one started OpenAI request (its ``n`` choices), whole or
    streamed."""

    routes: OpenAIRoutes
    http: HTTPRequest
    action: str
    request: oa.CompletionRequest | oa.ChatCompletionRequest
    choices: list[Generation]
    id: str = ""
    created: int = attrs.Factory(lambda: int(time.time()))
    done: bool = False

    def __attrs_post_init__(self) -> None:
        self.id = oa.new_id("chatcmpl" if self.chat else "cmpl")

    @property
    def chat(self) -> bool:
        return isinstance(self.request, oa.ChatCompletionRequest)

    @property
    def first(self) -> Generation:
        return self.choices[0]

    @property
    def echo(self) -> str:
        request = self.request
        if isinstance(request, oa.CompletionRequest) and request.echo:
            # Token ids are echoed as their text (lm-evaluation-harness sends ids).
            return request.prompt if isinstance(request.prompt, str) else self.first.util_text
        return ""

    def _usage(self) -> oa.TokenUsage:
        # The prompt is counted once: the choices share it.
        first = self.first
        generated = sum(choice.generated_tokens for choice in self.choices)
        return oa.TokenUsage(first.prompt_tokens, generated, first.cached_tokens)

    def _end(self, outcome: str) -> None:
        if not self.done:
            self.done = True
            self.routes._finish(self.http, self.action, self.choices, outcome, self.first.received)

    def _failure(self) -> oa.OpenAIError:
        """The error of a request whose choices did not all finish."""
        failed = [c for c in self.choices if c.outcome == "failed"]
        if failed and not self.routes.generations.is_draining():
            self._end("internal")
            log.error("generation failed: %s", failed[0].failure)
            return oa.OpenAIError(500, failed[0].failure or "the engine failed", code="internal")
        # Interrupted under us: only the shutdown does that.
        self._end("interrupted")
        return oa.OpenAIError(503, _SHUTTING_DOWN, code="overloaded", retry_after=1)

    def _outcome(self) -> str:
        finished = self.first.finished
        assert finished is not None
        return "num_tokens" if finished.reason == "max_new_tokens" else "eos"

    def _logprobs(
        self, entries: Sequence[TokenLogprob], legacy: oa.LegacyLogprobs
    ) -> dict[str, Any] | None:
        """The ``logprobs`` object of these entries, when the request asked."""
        if self.request.logprobs.top is None:
            return None
        if self.chat:
            return oa.chat_logprobs(entries)
        return legacy.of(entries)

    async def whole(self) -> Response:
        try:
            await follow_choices(self.choices)
        finally:
            self._release()
        if any(choice.finished is None for choice in self.choices):
            raise self._failure()
        self._end(self._outcome())
        name = self.routes.model_name
        if self.chat:
            body = oa.chat_completion_response(
                id=self.id,
                created=self.created,
                model=name,
                choices=[self._chat_choice(i, c) for i, c in enumerate(self.choices)],
                usage=self._usage(),
            )
        else:
            body = oa.completion_response(
                id=self.id,
                created=self.created,
                model=name,
                choices=[self._completion_choice(i, c) for i, c in enumerate(self.choices)],
                usage=self._usage(),
            )
        return Response(200, body)

    def _chat_choice(self, index: int, generation: Generation) -> oa.ChatChoice:
        finished = generation.finished
        assert finished is not None
        reason = oa.finish_reason(finished)
        content, calls = generation.response, []
        if generation.tool_format is not None:
            reader = ToolCallReader(generation.tool_format)
            events = reader.feed(content) + reader.finish()
            content = "".join(e.text for e in events if isinstance(e, Content))
            calls = reader.calls
            if calls and reason == "stop":
                reason = "tool_calls"
        return oa.ChatChoice(
            index=index,
            content=content,
            finish_reason=reason,
            tool_calls=calls,
            logprobs=self._logprobs(generation.logprobs, oa.LegacyLogprobs()),
        )

    def _completion_choice(self, index: int, generation: Generation) -> oa.CompletionChoice:
        finished = generation.finished
        assert finished is not None
        entries = [*generation.prompt_logprobs, *generation.logprobs, *_stop_entry(finished)]
        return oa.CompletionChoice(
            index=index,
            text=self.echo + generation.response,
            finish_reason=oa.finish_reason(finished),
            logprobs=self._logprobs(entries, oa.LegacyLogprobs()),
        )

    async def stream(self, out: BodyWriter) -> None:
        """Send the choices as Server-Sent Events. Text released while a
        write waits on the client is sent as one event with the next write
        (never lost, never reordered): a slow reader gets fewer, larger
        events, and the generation never waits on the socket."""
        request = self.request
        name = self.routes.model_name
        stream: oa.ChatCompletionStream | oa.CompletionStream
        if isinstance(request, oa.ChatCompletionRequest):
            stream = oa.ChatCompletionStream(self.id, self.created, name, request.include_usage)
        else:
            stream = oa.CompletionStream(self.id, self.created, name, request.include_usage)
        choices = [
            _Choice(index, generation, _CallEvents(stream, generation.tool_format, index))
            for index, generation in enumerate(self.choices)
        ]
        # Set: the first choice may have released text before the stream began.
        wake = trio.Event()
        wake.set()

        def released(_text: str) -> None:
            wake.set()

        for choice in choices:
            choice.generation.on_text = released
        try:
            async with trio.open_nursery() as nursery:

                async def follow() -> None:
                    try:
                        await follow_choices(self.choices)
                    finally:
                        wake.set()

                nursery.start_soon(follow)
                opening = b""
                for choice in choices:
                    if isinstance(stream, oa.ChatCompletionStream):
                        opening += stream.start(index=choice.index)
                    if self.echo:
                        opening += stream.text(self.echo, index=choice.index)
                await out.send(opening)
                while True:
                    await wake.wait()
                    wake = trio.Event()
                    data = b""
                    for choice in choices:
                        if not choice.ended:
                            data += self._progress(choice, stream)
                    if any(c.ended and c.generation.finished is None for c in choices):
                        await out.send(data + stream.error(self._failure()))
                        return
                    if all(choice.ended for choice in choices):
                        self._end(self._outcome())
                        await out.send(data + stream.end(self._usage()))
                        return
                    if data:
                        await out.send(data)
        finally:
            self._release()

    def _progress(
        self, choice: _Choice, stream: oa.ChatCompletionStream | oa.CompletionStream
    ) -> bytes:
        """The events of what one choice released since the last call, and
        its last chunk when it has ended."""
        generation = choice.generation
        ended = generation.outcome is not None
        text = generation.response[choice.sent :]
        choice.sent += len(text)
        calls = choice.calls
        if not ended:
            if not text:
                return b""
            # With a tool-call reader the text is split into content and
            # calls: the entries then go with the last chunk.
            new = generation.logprobs[choice.entries :]
            logprobs = None if calls.reader is not None else self._logprobs(new, choice.legacy)
            choice.entries += 0 if logprobs is None else len(new)
            return calls.text(text, logprobs)
        choice.ended = True
        events = calls.text(text) + calls.finish()
        if generation.finished is None:
            return events
        reason = oa.finish_reason(generation.finished)
        if calls.made and reason == "stop":
            reason = "tool_calls"
        rest = generation.logprobs[choice.entries :]
        if not self.chat:
            rest = [*rest, *_stop_entry(generation.finished)]
        logprobs = self._logprobs(rest, choice.legacy)
        return events + stream.finish_choice(reason, "", logprobs, index=choice.index)

    def _release(self) -> None:
        """The jobs' end, in a ``finally``: a choice that has no outcome yet
        is being abandoned by its client."""
        abandoned = False
        for generation in self.choices:
            if generation.outcome is None:
                abandoned = True
                generation.interrupt()
            generation.close()
        if abandoned and not self.done:
            self._end("interrupted")


def _stop_entry(finished: Finished) -> tuple[TokenLogprob, ...]:
    """The stop token's entry of a completion that ended on one: listed last
    in the legacy ``logprobs``, as OpenAI lists ``<|endoftext|>`` (its text is
    not in ``text``). lm-evaluation-harness scores ``prompt + 1 token`` and
    drops the last entry: without it, the prompt's last token would go."""
    return () if finished.stop_logprob is None else (finished.stop_logprob,)


@attrs.define
class _CallEvents:
    """A choice's released text as events: content as it is, or, when the
    request lets the model call tools, content and tool calls apart (no call
    marker reaches the content; a call's arguments stream in pieces)."""

    stream: oa.ChatCompletionStream | oa.CompletionStream
    fmt: ToolFormat | None
    #: The choice's index.
    index: int = 0
    reader: ToolCallReader | None = None
    made: bool = False

    def __attrs_post_init__(self) -> None:
        if self.fmt is not None and isinstance(self.stream, oa.ChatCompletionStream):
            self.reader = ToolCallReader(self.fmt)

    def text(self, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        if self.reader is None:
            return self.stream.text(text, logprobs, index=self.index) if text else b""
        return self._events(self.reader.feed(text)) if text else b""

    def finish(self) -> bytes:
        return b"" if self.reader is None else self._events(self.reader.finish())

    def _events(self, events: list[ToolEvent]) -> bytes:
        stream = self.stream
        assert isinstance(stream, oa.ChatCompletionStream)
        out = b""
        for event in events:
            if isinstance(event, Content):
                if event.text:
                    out += stream.text(event.text, index=self.index)
            elif isinstance(event, CallStart):
                self.made = True
                out += stream.tool_call(event.index, id=event.id, name=event.name, index=self.index)
            elif isinstance(event, CallArguments):
                out += stream.tool_call(event.index, arguments=event.text, index=self.index)
        return out
