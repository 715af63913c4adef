"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, through the same pipeline as every other door.

A request is admitted (503 while draining, 429 over the client's request
limit) before its body is read, parsed and bounded (400), continued from
its ``previous_response_id`` (404 when that is unknown, expired or
another client's), turned into a
:class:`~trioserve.generation.GenerationRequest`, checked against the
model (400), rendered, tokenized and fitted (400
``context_length_exceeded``), then followed to its end by an
:class:`~trioserve.server.exchange.Exchange` that writes what
:class:`~trioserve.responses.ResponseReply` (sans-IO) makes of it. A
response that ends (completed or incomplete) with ``store`` is kept in the
bounded :class:`~trioserve.responses.ResponseStore`, seen only by the
client that made it (its API key, or its address without keys). The job is
released in a ``finally``: a client that disconnects frees its engine slot
before the next step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Hashable, Sequence

import attrs
import trio

from trioserve import openai as oa
from trioserve import responses as rs
from trioserve.generation import Generation, InvalidGeneration, Overloaded
from trioserve.metrics import Metrics

from . import access
from .doors import ClientIdentity, from_responses, responses_error
from .exchange import Exchange, start_request
from .http_types import HTTPRequest, Response, Router, StreamingResponse, event_stream
from .models import ModelError, Models
from .routes import _outcome, _overloaded, http_errors, model_error, not_admitted
from .served import ServedModel

__all__ = ["ResponsesRoutes"]

log = logging.getLogger("trioserve.routes")


def _not_found(id: str, param: str | None = None) -> oa.OpenAIError:
    what = "Previous response" if param else "Response"
    return oa.OpenAIError(
        404,
        f"{what} with id {id[:300]!r} not found (unknown, expired, deleted, or made by"
        " another client)",
        param=param,
        code="previous_response_not_found" if param else "not_found",
    )


@attrs.define
class ResponsesRoutes:
    """``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``."""

    models: Models
    identity: ClientIdentity
    store: rs.ResponseStore = attrs.Factory(rs.ResponseStore)
    limits: rs.ResponsesLimits = attrs.Factory(rs.ResponsesLimits)
    metrics: Metrics | None = None

    def install(self, router: Router) -> None:
        router.add("POST", "/v1/responses", http_errors(self.create))
        router.add("GET", "/v1/responses/{id}", http_errors(self.retrieve))
        router.add("DELETE", "/v1/responses/{id}", http_errors(self.delete))

    async def retrieve(self, http: HTTPRequest) -> Response:
        if http.head.query_param("stream") not in (None, "false"):
            raise oa.OpenAIError(
                400,
                "stream: a stored response is returned whole here; its events are not replayed",
                param="stream",
                code="unsupported_parameter",
            )
        id = http.params["id"]
        stored = self.store.get(id, self.identity.of(http.head))
        if stored is None:
            raise _not_found(id)
        return Response(200, stored.body)

    async def delete(self, http: HTTPRequest) -> Response:
        id = http.params["id"]
        if not self.store.delete(id, self.identity.of(http.head)):
            raise _not_found(id)
        return Response.json({"id": id, "object": "response", "deleted": True})

    def _parse(self, http: HTTPRequest, client: Hashable) -> rs.ResponsesRequest:
        obj = rs.parse_responses_body(http.body)
        previous = rs.previous_id(obj, self.limits)
        history: rs.Turns = ()
        if previous is not None:
            stored = self.store.get(previous, client)
            if stored is None:
                raise _not_found(previous, "previous_response_id")
            history = stored.turns
        parsed = rs.parse_responses_request(obj, history, self.limits)
        if parsed.skipped_tools:
            log.info(
                "skipped tools %s: this server runs only the request's function tools",
                ", ".join(parsed.skipped_tools[:16]),
            )
        return parsed

    async def create(self, http: HTTPRequest) -> Response | StreamingResponse:
        arrived = trio.current_time()
        client = self.identity.of(http.head)
        model: list[ServedModel] = []

        async def open_request() -> tuple[rs.ResponsesRequest, list[Generation]]:
            try:
                # Before the body is parsed: a client at its limit costs nothing more.
                self.models.admit(client)
            except Overloaded as exc:
                raise not_admitted(exc) from None
            parsed = self._parse(http, client)
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
            invalid=responses_error,
            overloaded=_overloaded,
            api_error=oa.OpenAIError,
            refused=lambda opened, exc: self._log(http, opened, _outcome(exc.status), arrived),
        )
        (served,) = model
        reply = rs.ResponseReply(parsed, served.id, choices[0])

        def finish(outcome: str) -> None:
            if parsed.store and reply.finished:
                body = json.dumps(reply.response(), ensure_ascii=False).encode()
                if not self.store.put(reply.id, client, body, reply.history()):
                    log.warning("response %s not stored: larger than the store", reply.id)
            self._log(http, choices, outcome, arrived)

        exchange = Exchange(
            reply,
            choices,
            finish=finish,
            draining=served.generations.is_draining,
            drain_message=served.cut_short,
        )
        if not parsed.stream:
            return await exchange.whole()
        return event_stream(exchange.stream)

    def _open(
        self, served: ServedModel, parsed: rs.ResponsesRequest, client: Hashable
    ) -> list[Generation]:
        try:
            return served.generations.open_choices(
                from_responses(parsed), 1, client=client, api="openai"
            )
        except InvalidGeneration as exc:
            raise responses_error(exc) from None
        except Overloaded as exc:
            raise not_admitted(exc) from None

    def _log(
        self, http: HTTPRequest, choices: Sequence[Generation], outcome: str, arrived: float
    ) -> None:
        access.log_openai(
            self.metrics,
            http.head.peer,
            "responses",
            choices,
            outcome,
            duration=trio.current_time() - arrived,
            cancel_cause="shutdown" if self.models.is_draining() else "disconnect",
        )
