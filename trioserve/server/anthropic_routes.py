"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST
/v1/messages/count_tokens``, through the same pipeline as every other door.

A request is parsed and bounded (400), turned into a
:class:`~trioserve.generation.GenerationRequest`, checked against the model
(400), admitted (529 ``overloaded_error`` while full, 503 while draining, 429
``rate_limit_error`` over the client's request limit), rendered, tokenized
and fitted (400 ``prompt is too long``), then followed to its end by an
:class:`~trioserve.server.exchange.Exchange` that writes what
:class:`~trioserve.anthropic.MessageReply` (sans-IO) makes of it. The job is
released in a ``finally``: a client that disconnects frees its engine slot
before the next step. The key may come as ``X-Api-Key`` (Anthropic's SDKs)
or ``Authorization: Bearer``; ``anthropic-version`` and ``anthropic-beta``
are accepted whatever they say.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence

import attrs
import trio

from trioserve import anthropic as an
from trioserve.generation import Generation, InvalidGeneration, Overloaded
from trioserve.metrics import Metrics

from . import access
from .doors import ClientIdentity, anthropic_error, from_anthropic
from .exchange import Exchange, start_request
from .http_types import (
    HTTPRequest,
    RequestHead,
    Response,
    Router,
    StreamingResponse,
    event_stream,
)
from .models import ModelError, Models
from .routes import http_errors
from .served import ServedModel

__all__ = ["AnthropicRoutes", "api_error_body"]

log = logging.getLogger("trioserve.routes")

#: Seconds between ``ping`` events while a stream waits for text.
PING_SECONDS = 10.0


def api_error_body(head: RequestHead, status: int, message: str) -> bytes | None:
    """The front door's own errors (a refused key, no route) on Anthropic's
    paths in Anthropic's shape; None (the server's shape) elsewhere."""
    if head.path == "/v1/messages" or head.path.startswith("/v1/messages/"):
        return an.error_body(status, message)
    return None


def _outcome(status: int) -> str:
    return {
        400: "invalid_request",
        429: "overloaded",
        503: "overloaded",
        an.OVERLOADED: "overloaded",
    }.get(status, "internal")


def _full_or_draining(exc: Overloaded) -> an.AnthropicError:
    """No room for the job: 529 while the server is full (Anthropic's
    "overloaded"), 503 while it shuts down, which a proxy in front (nginx's
    ``proxy_next_upstream``) passes on to another instance; Anthropic's SDKs
    retry both."""
    return an.AnthropicError(503 if exc.draining else an.OVERLOADED, exc.message, retry_after=1)


@attrs.define
class AnthropicRoutes:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, through
    the pipeline of the model each request names (``models``)."""

    models: Models
    identity: ClientIdentity
    limits: an.MessagesLimits = attrs.Factory(an.MessagesLimits)
    metrics: Metrics | None = None
    ping_seconds: float = attrs.Factory(lambda: PING_SECONDS)

    def install(self, router: Router) -> None:
        router.add("POST", "/v1/messages", http_errors(self.messages, an.AnthropicError))
        router.add(
            "POST",
            "/v1/messages/count_tokens",
            http_errors(self.count_tokens, an.AnthropicError),
        )

    async def _served(self, name: str, client: Hashable) -> ServedModel:
        try:
            return await self.models.acquire(name, client)
        except Overloaded as exc:
            raise self._overloaded(exc) from None
        except ModelError as exc:
            status = 404 if exc.status == 404 else (503 if exc.status == 503 else 400)
            raise an.AnthropicError(
                status, exc.message, retry_after=1 if status == 503 else None
            ) from None

    async def count_tokens(self, http: HTTPRequest) -> Response:
        """Counted as a generation of its client while it runs (its limit,
        and refused while draining): rendering and tokenizing share the
        tokenizer's thread with the generations' prompts."""
        client = self.identity.of(http.head)
        try:
            # Before the body is parsed: a client at its limit costs nothing more.
            self.models.admit(client)
        except Overloaded as exc:
            raise self._overloaded(exc) from None
        parsed = an.parse_count_request(http.body, self.limits)
        served = await self._served(parsed.model, client)
        try:
            count = await served.generations.count_prompt_tokens(
                from_anthropic(parsed), client=client
            )
        except InvalidGeneration as exc:
            raise anthropic_error(exc) from None
        except Overloaded as exc:
            raise self._overloaded(exc) from None
        return Response.json({"input_tokens": count})

    @staticmethod
    def _overloaded(exc: Overloaded) -> an.AnthropicError:
        """The server's shutdown (503, retry elsewhere), or the client's own
        limit (429)."""
        if exc.draining:
            return an.AnthropicError(503, exc.message, retry_after=1)
        return an.AnthropicError(429, exc.message, retry_after=1)

    async def messages(self, http: HTTPRequest) -> Response | StreamingResponse:
        arrived = trio.current_time()
        client = self.identity.of(http.head)
        model: list[ServedModel] = []

        async def open_request() -> tuple[an.MessagesRequest, list[Generation]]:
            try:
                # Before the body is parsed: a client at its limit costs nothing more.
                self.models.admit(client)
            except Overloaded as exc:
                raise self._overloaded(exc) from None
            parsed = an.parse_messages_request(http.body, self.limits)
            if parsed.skipped_tools:
                log.info(
                    "skipped Anthropic's server tools %s: this server runs only the"
                    " request's custom tools",
                    ", ".join(parsed.skipped_tools[:16]),
                )
            served = await self._served(parsed.model, client)
            model.append(served)
            return parsed, self._open(served, parsed, client)

        parsed, choices = await start_request(
            open_request,
            arrived=arrived,
            invalid=anthropic_error,
            overloaded=_full_or_draining,
            api_error=an.AnthropicError,
            refused=lambda opened, exc: self._finish(http, opened, _outcome(exc.status), arrived),
        )
        (served,) = model
        reply = an.MessageReply(parsed, served.id, choices[0])
        exchange = Exchange(
            reply,
            choices,
            finish=lambda outcome: self._finish(http, choices, outcome, arrived),
            draining=served.generations.is_draining,
            drain_message=served.cut_short,
            keepalive=reply.keepalive,
            keepalive_s=self.ping_seconds,
        )
        if not parsed.stream:
            return await exchange.whole()
        return event_stream(exchange.stream)

    def _open(
        self, served: ServedModel, parsed: an.MessagesRequest, client: Hashable
    ) -> list[Generation]:
        try:
            return served.generations.open_choices(
                from_anthropic(parsed), 1, client=client, api="anthropic"
            )
        except InvalidGeneration as exc:
            raise anthropic_error(exc) from None
        except Overloaded as exc:
            raise self._overloaded(exc) from None

    def _finish(
        self, http: HTTPRequest, choices: Sequence[Generation], outcome: str, arrived: float
    ) -> None:
        access.log_openai(
            self.metrics,
            http.head.peer,
            "messages",
            choices,
            outcome,
            duration=trio.current_time() - arrived,
            cancel_cause="shutdown" if self.models.is_draining() else "disconnect",
            api="anthropic",
        )
