"""Errors in the shape of Anthropic's Messages API:
``{"type": "error", "error": {"type": ..., "message": ...}}``, the error
type following the status as Anthropic's API and SDKs pair them (the SDKs
pick their exception class by the status; Claude Code reads the message)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Final

from trioserve.errors import TrioserveError

__all__ = ["ERROR_TYPES", "OVERLOADED", "AnthropicError", "error_body"]

#: Anthropic's status for "the server is overloaded" (its SDKs retry it).
OVERLOADED: Final = 529

#: The error ``type`` of each status, as Anthropic's API documents them.
ERROR_TYPES: Final[Mapping[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    431: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
    OVERLOADED: "overloaded_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> bytes:
    """The JSON body of an error answered with ``status``."""
    error = {"type": error_type(status), "message": message}
    body = {"type": "error", "error": error}
    try:
        return json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate the client sent, echoed back
        return json.dumps(body).encode("ascii")


class AnthropicError(TrioserveError):
    """A request this door answers with an error: its status, its message,
    and ``Retry-After`` when a retry may succeed."""

    def __init__(self, status: int, message: str, *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return error_type(self.status)

    def body(self) -> bytes:
        return error_body(self.status, self.message)

    def event(self) -> dict[str, object]:
        """The error as the data of a stream's ``error`` event."""
        return {"type": "error", "error": {"type": self.type, "message": self.message}}

    def headers(self) -> list[tuple[str, str]]:
        return [] if self.retry_after is None else [("Retry-After", str(self.retry_after))]

    def __repr__(self) -> str:
        return f"AnthropicError({self.status}, {self.message!r})"


def invalid(message: str) -> AnthropicError:
    return AnthropicError(400, message)
