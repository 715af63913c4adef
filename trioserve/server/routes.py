"""The HTTP routes of a server: health, readiness, metrics, the info page, and
the OpenAI-compatible API.

:class:`OpsRoutes` and :class:`OpenAIRoutes` add their handlers to a
:class:`~trioserve.server.http_types.Router`. The OpenAI routes run each
request through the same pipeline as a WebSocket ``infer``
(:class:`~trioserve.generation.Generations`): the request is parsed and bounded
(400), turned into a :class:`~trioserve.generation.GenerationRequest`, checked
against the model (400), admitted (503 while draining or full, 429 over the
client's request limit), rendered, tokenized and fitted (400
``context_length_exceeded``), then followed to its end, its reply made by
:class:`~trioserve.openai.Reply` (sans-IO) and written here. The job is released in
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

from trioserve import anthropic as an
from trioserve import openai as oa
from trioserve._version import __version__
from trioserve.generation import Generation, InvalidGeneration, Overloaded
from trioserve.metrics import Metrics

from . import access
from .accept import prefers_html
from .doors import ClientIdentity, from_openai, openai_error
from .exchange import Exchange, start_request
from .http_types import (
    Handler,
    HTTPError,
    HTTPRequest,
    Response,
    Router,
    StreamingResponse,
    event_stream,
)
from .models import ModelError, Models, ModelSlot
from .page import chat_page
from .served import ServedModel

__all__ = [
    "OpenAIRoutes",
    "OpsRoutes",
    "Readiness",
    "http_errors",
    "model_error",
    "not_admitted",
]

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
                "openai": "/v1 (models, completions, chat/completions: docs/openai.md;"
                " responses: docs/responses.md)",
                "anthropic": "/v1/messages, /v1/messages/count_tokens (docs/anthropic.md)",
                "tokenizer": "/tokenize, /detokenize, /tokenizer_info (vLLM's: docs/openai.md)",
                "sglang": "/model_info, /server_info (for SGLang's Model Gateway:"
                " docs/scale-out.md)",
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


def http_errors(
    handler: Handler, kind: type[oa.OpenAIError] | type[an.AnthropicError] = oa.OpenAIError
) -> Handler:
    """``handler`` with its API's errors (``kind``: OpenAI's by default)
    turned into the HTTP layer's, their body in the API's own shape: the
    front door knows no API, only :class:`HTTPError`."""

    async def wrapped(request: HTTPRequest) -> Response | StreamingResponse:
        try:
            return await handler(request)
        except kind as exc:
            raise HTTPError(
                exc.status, exc.message, headers=exc.headers(), body=exc.body()
            ) from None

    return wrapped


#: An OpenAI request of either generation route.
Request = oa.CompletionRequest | oa.ChatCompletionRequest


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


def not_admitted(exc: Overloaded) -> oa.OpenAIError:
    """A request the pipeline would not take: the server's shutdown (503),
    or the client's own limit (429: a rate limit, not the server's fullness)."""
    if exc.draining:
        return _overloaded(exc)
    return oa.OpenAIError(429, exc.message, code="rate_limit_exceeded", retry_after=1)


def model_error(exc: ModelError) -> oa.OpenAIError:
    """A model that cannot serve a request, in OpenAI's terms (naming ``model``)."""
    retry = 1 if exc.status == 503 else None
    return oa.OpenAIError(exc.status, exc.message, param="model", code=exc.code, retry_after=retry)


@attrs.define
class OpenAIRoutes:
    """``GET /v1/models``, ``GET /v1/models/{model}``, ``POST
    /v1/completions`` and ``POST /v1/chat/completions``, through the
    pipeline of the model each request names (``models``)."""

    models: Models
    identity: ClientIdentity
    limits: oa.OpenAILimits = attrs.Factory(oa.OpenAILimits)
    metrics: Metrics | None = None
    #: What ``/v1/models`` reports as the model's ``limits`` (the WebSocket
    #: ``info`` reply's, from the same declarations).
    model_limits: Mapping[str, int] = attrs.Factory(dict)
    #: When the server started (the ``created`` of the model objects).
    created: int = attrs.Factory(lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        """The default model's name (the one model's, with ``--model``)."""
        served = self.models.default_served()
        return served.id if served is not None else self.models.default_id

    def install(self, router: Router) -> None:
        router.add("GET", "/v1/models", http_errors(self.list_models))
        router.add("GET", "/v1/models/{model}", http_errors(self.model))
        router.add("POST", "/v1/completions", http_errors(self.completions))
        router.add("POST", "/v1/chat/completions", http_errors(self.chat_completions))
        # SGLang's: its Model Gateway reads the model's name from them when a
        # worker registers (else it serves the worker as model "unknown").
        router.add("GET", "/model_info", http_errors(self.model_info))
        router.add("GET", "/server_info", http_errors(self.model_info))

    async def list_models(self, request: HTTPRequest) -> Response:
        return Response(
            200,
            oa.models_response(
                [(slot.id, self._model(slot)) for slot in self._listed()], self.created
            ),
        )

    async def model(self, request: HTTPRequest) -> Response:
        name = request.params["model"]
        try:
            slot = self.models.slot(name)
        except ModelError as exc:
            raise model_error(exc) from None
        if not self.models.several and name != self.model_name:
            raise oa.OpenAIError(
                404,
                f"the model {name[:200]!r} does not exist",
                param="model",
                code="model_not_found",
            )
        return Response.json(oa.model_object(slot.id, self.created, **self._model(slot)))

    async def model_info(self, request: HTTPRequest) -> Response:
        # The name only: SGLang's model_path and tokenizer_path are the paths
        # it loaded, which the gateway would try to fetch a tokenizer from
        # (from huggingface.co, for a bare name); without them it does not.
        served = self.models.default_served()
        return Response.json(
            {
                "served_model_name": self.model_name,
                "is_generation": True,
                "context_length": served.info.context_length if served is not None else None,
                "version": __version__,
            }
        )

    def _listed(self) -> list[ModelSlot]:
        return list(self.models.slots.values())

    def _model(self, slot: ModelSlot) -> dict[str, Any]:
        served = slot.served
        limits = dict(self.model_limits)
        if served is not None and limits:
            limits["max_new_tokens"] = served.max_new_tokens
        described: dict[str, Any] = {
            "context_length": served.info.context_length if served is not None else None,
            "limits": limits or None,
            "kernels": served.info.kernels if served is not None else None,
        }
        if self.models.several:
            described["status"] = slot.describe()["status"]
        return described

    async def completions(self, request: HTTPRequest) -> Response | StreamingResponse:
        return await self._serve(request, "completions")

    async def chat_completions(self, request: HTTPRequest) -> Response | StreamingResponse:
        return await self._serve(request, "chat_completions")

    async def _serve(
        self, http: HTTPRequest, action: Literal["completions", "chat_completions"]
    ) -> Response | StreamingResponse:
        arrived = trio.current_time()
        client = self.identity.of(http.head)
        model: list[ServedModel] = []

        async def open_request() -> tuple[Request, list[Generation]]:
            parsed: Request
            if action == "completions":
                parsed = oa.parse_completion_request(http.body, self.limits)
            else:
                parsed = oa.parse_chat_request(http.body, self.limits)
            try:
                served = await self.models.acquire(parsed.model, client)
            except Overloaded as exc:
                raise not_admitted(exc) from None
            except ModelError as exc:
                raise model_error(exc) from None
            model.append(served)
            return parsed, self._open(served, parsed, client)

        parsed, choices = await start_request(
            open_request,
            arrived=arrived,
            invalid=openai_error,
            overloaded=_overloaded,
            api_error=oa.OpenAIError,
            refused=lambda opened, exc: self._finish(
                http, action, opened, _outcome(exc.status), arrived
            ),
        )
        (served,) = model
        reply = oa.Reply(parsed, served.id, choices)
        exchange = Exchange(
            reply,
            choices,
            finish=lambda outcome: self._finish(http, action, choices, outcome, arrived),
            draining=served.generations.is_draining,
            drain_message=served.cut_short,
        )
        if not parsed.stream:
            return await exchange.whole()
        return event_stream(exchange.stream)

    def _open(
        self,
        served: ServedModel,
        parsed: oa.CompletionRequest | oa.ChatCompletionRequest,
        client: Hashable,
    ) -> list[Generation]:
        try:
            return served.generations.open_choices(
                from_openai(parsed), parsed.n, client=client, api="openai"
            )
        except InvalidGeneration as exc:
            raise openai_error(exc) from None
        except Overloaded as exc:
            raise not_admitted(exc) from None

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
            cancel_cause="shutdown" if self.models.is_draining() else "disconnect",
        )
