"""The chat page at ``/``: one self-contained HTML document for a person with a
browser, a client of the server's own WebSocket protocol.

The page is made of three files shipped as package data (``trioserve/static/``:
``chat.html``, ``chat.css``, ``chat.js``), put together once into one document
with the style and the script inline, so that it works offline, from any
origin the server is reached at, with no build step and nothing fetched from
elsewhere. Its Content-Security-Policy allows exactly that style and that
script (by their sha256), connections to its own origin only (the WebSocket,
``/ready``), no frames, forms, plugins or base URL.

It is static: its ETag is its content's hash, and it is served with
``Cache-Control: no-cache`` (a browser revalidates, and gets ``304 Not
Modified`` while the server's version is the same). ``/`` answers it only to
clients that prefer HTML (:func:`~trioserve.server.accept.prefers_html`);
both answers carry ``Vary: Accept``.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from importlib import resources
from typing import Final

import attrs

from .http_types import HTTPRequest, Response

__all__ = ["ChatPage", "chat_page"]

_PARTS: Final = (("style", "chat.css"), ("script", "chat.js"))


def _sha256(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


@attrs.frozen
class ChatPage:
    """The assembled page and the headers it is served with."""

    body: bytes
    etag: str
    headers: tuple[tuple[str, str], ...]

    @classmethod
    def assemble(cls, html: str, style: str, script: str) -> ChatPage:
        """The page with ``style`` and ``script`` put in place of
        ``<style data-inline="chat.css"></style>`` and
        ``<script data-inline="chat.js"></script>``. Raises ``ValueError``
        when a placeholder is not there exactly once, or when a part could end
        its own element early."""
        inline = {"style": style, "script": script}
        hashes = {}
        for tag, name in _PARTS:
            placeholder = f'<{tag} data-inline="{name}"></{tag}>'
            if html.count(placeholder) != 1:
                raise ValueError(f"chat.html must hold {placeholder!r} exactly once")
            text = inline[tag]
            if f"</{tag}" in text.lower():
                raise ValueError(f"{name} must not contain '</{tag}'")
            html = html.replace(placeholder, f"<{tag}>{text}</{tag}>")
            hashes[tag] = _sha256(text)
        policy = "; ".join(
            [
                "default-src 'none'",
                f"script-src 'sha256-{hashes['script']}'",
                f"style-src 'sha256-{hashes['style']}'",
                # 'self' covers ws: and wss: to this page's own host and port.
                "connect-src 'self'",
                "img-src data:",
                "base-uri 'none'",
                "form-action 'none'",
                "frame-ancestors 'none'",
            ]
        )
        body = html.encode("utf-8")
        etag = f'"{hashlib.sha256(body).hexdigest()[:32]}"'
        headers = (
            ("Content-Security-Policy", policy),
            ("Cache-Control", "no-cache"),
            ("ETag", etag),
            ("Vary", "Accept"),
            ("X-Content-Type-Options", "nosniff"),
            ("X-Frame-Options", "DENY"),
            ("Referrer-Policy", "no-referrer"),
        )
        return cls(body, etag, headers)

    def respond(self, request: HTTPRequest) -> Response:
        """The page, or ``304 Not Modified`` when ``If-None-Match`` names it."""
        if _matches(request.header("if-none-match"), self.etag):
            return Response(304, b"", None, self.headers)
        return Response(200, self.body, "text/html; charset=utf-8", self.headers)


def _matches(if_none_match: str | None, etag: str) -> bool:
    if if_none_match is None:
        return False
    # Weak comparison (RFC 9110, section 13.1.2), as for any GET; bounded.
    tags = [t.strip().removeprefix("W/") for t in if_none_match[:4096].split(",")[:64]]
    return "*" in tags or etag in tags


@functools.cache
def chat_page() -> ChatPage:
    """The page, read from the package's ``static`` folder once."""
    folder = resources.files("trioserve.static")
    return ChatPage.assemble(
        folder.joinpath("chat.html").read_text(encoding="utf-8"),
        folder.joinpath("chat.css").read_text(encoding="utf-8"),
        folder.joinpath("chat.js").read_text(encoding="utf-8"),
    )
