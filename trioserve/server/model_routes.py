"""The models router's API, in llama-server's shapes (router mode), on a
server of several models (``--models-dir``):

* ``GET /models``: ``{"data": [{"id", "path", "format", "aliases", "status":
  {"value", "reason"?, "load_seconds"?}, ...}]}``;
* ``POST /models/load {"model": ID}`` and ``POST /models/unload {"model": ID}``:
  ``{"success": true, "model": ID, "status": ...}`` at once; the load or
  the drain goes on, and ``GET /models/sse`` (or ``GET /models``) shows it;
* ``GET /models/sse``: Server-Sent Events, one ``data: {"id", "status"}``
  per status change, after one event per model as it stands.

Loading and unloading need the API key like every route, and where the
server has an admin key (``--admin-key``), that key in ``X-Admin-Key`` too
(TabbyAPI's header). A body is bounded by the front door; its ``model``
must be a string naming a model of the folder (by id or alias).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any

import attrs
import trio

from trioserve import openai as oa
from trioserve.engine.catalog import valid_model_id

from .http_types import BodyWriter, HTTPError, HTTPRequest, Response, Router, event_stream
from .models import ModelError, Models, ModelSlot

__all__ = ["ModelRoutes"]

#: Seconds between SSE comments that keep an idle event stream open through proxies.
KEEPALIVE_SECONDS = 15.0


#: llama-server's error types, by status.
_TYPES = {
    400: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    503: "unavailable_error",
}


def _error(status: int, message: str, code: str) -> HTTPError:
    """An error in llama-server's shape (``code`` is the status there; ours
    goes in ``reason``)."""
    kind = _TYPES.get(status, "server_error")
    error = {"code": status, "type": kind, "message": message, "reason": code}
    return HTTPError(status, message, body=json.dumps({"error": error}).encode())


@attrs.define
class ModelRoutes:
    """``/models``, ``/models/load``, ``/models/unload``, ``/models/sse``."""

    models: Models
    admin_key: str | None = attrs.field(default=None, repr=False)

    def install(self, router: Router) -> None:
        router.add("GET", "/models", self.list_models)
        router.add("POST", "/models/load", self.load)
        router.add("POST", "/models/unload", self.unload)
        router.add("GET", "/models/sse", self.events)

    async def list_models(self, request: HTTPRequest) -> Response:
        return Response.json(
            {"object": "list", "data": [s.describe() for s in self.models.slots.values()]}
        )

    async def load(self, request: HTTPRequest) -> Response:
        return self._change(request, self.models.load)

    async def unload(self, request: HTTPRequest) -> Response:
        return self._change(request, self.models.unload)

    def _change(self, request: HTTPRequest, change: Callable[[str], ModelSlot]) -> Response:
        """Load or unload the body's model (once the admin key is checked)."""
        name = self._admitted(request)
        try:
            slot = change(name)
        except ModelError as exc:
            raise _error(exc.status, exc.message, exc.code) from None
        return Response.json({"success": True, "model": slot.id, **slot.describe()})

    async def events(self, request: HTTPRequest) -> Any:
        receive = self.models.watch()
        current = [
            {"id": s.id, "status": s.describe()["status"]} for s in self.models.slots.values()
        ]

        async def write(body: BodyWriter) -> None:
            with receive:
                for event in current:
                    await body.send(_event(event))
                while True:
                    with trio.move_on_after(KEEPALIVE_SECONDS) as waited:
                        try:
                            event = await receive.receive()
                        except trio.EndOfChannel:
                            return
                    if waited.cancelled_caught:
                        await body.send(b": keepalive\n\n")
                    else:
                        await body.send(_event(event))

        return event_stream(write)

    def _admitted(self, request: HTTPRequest) -> str:
        """The body's model, once the admin key (where set) is checked."""
        if self.admin_key is not None:
            given = request.header("x-admin-key") or ""
            if not hmac.compare_digest(given.encode("latin-1"), self.admin_key.encode()):
                raise _error(
                    403,
                    "loading and unloading models needs the admin key (X-Admin-Key)",
                    "forbidden",
                )
        try:
            body = json.loads(request.body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise _error(
                400, 'the body must be JSON: {"model": "<id>"}', "invalid_request"
            ) from None
        name = body.get("model") if isinstance(body, dict) else None
        if not valid_model_id(name):
            raise _error(
                400,
                'the body must be {"model": "<id>"} naming a model of GET /models',
                "invalid_request",
            )
        assert isinstance(name, str)
        return name


def _event(event: dict[str, Any]) -> bytes:
    return oa.sse_event(event)
