"""Errors in OpenAI's shape: :class:`OpenAIError` knows its status, its
body (``{"error": {"message", "type", "param", "code"}}``, which the SDKs read
into their exceptions) and its headers."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Final

from trioserve.errors import TrioserveError

__all__ = ["OpenAIError", "error_body", "invalid"]


#: OpenAI's ``error.type`` for each status this API answers with.
_ERROR_TYPES: Final[Mapping[int, str]] = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    411: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> bytes:
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param",
    "code"}}``. The SDKs read ``message`` into their exceptions."""
    payload = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code,
        }
    }
    try:
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate the client sent (in a field's name, echoed back):
        # escaped, so that the error still reaches the client.
        return json.dumps(payload, separators=(",", ":")).encode("ascii")


class OpenAIError(TrioserveError):
    """A request this API answers with an error: its status, and everything
    for OpenAI's error body. ``retry_after`` (seconds) goes into a
    ``Retry-After`` header for 429 and 503."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> bytes:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def headers(self) -> list[tuple[str, str]]:
        if self.retry_after is None:
            return []
        return [("Retry-After", str(self.retry_after))]

    def __repr__(self) -> str:
        return (
            f"OpenAIError({self.status!r}, {self.message!r}, "
            f"param={self.param!r}, code={self.code!r})"
        )


def invalid(message: str, param: str | None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)
