"""The HTTP layer's value types: limits, the access policy, request heads,
requests and responses, the router, and the observer of a front door.

Pure data and small pure functions: no sockets, no API. :mod:`.front_door`
serves them; routes (:mod:`.routes`) build and return them.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol, TypeAlias
from urllib.parse import parse_qs, unquote

import attrs
import trio_websocket

from trioserve.errors import TrioserveError

from .accept import prefers_html
from .origin import same_origin

__all__ = [
    "AccessPolicy",
    "BodyWriter",
    "ClientGone",
    "ErrorBody",
    "FrontDoorStatistics",
    "HTTPError",
    "HTTPLimits",
    "HTTPRequest",
    "Handler",
    "KiB",
    "MiB",
    "Network",
    "NoObserver",
    "Observer",
    "Reject",
    "RequestHead",
    "Response",
    "Router",
    "StreamingResponse",
    "WebSocketHandler",
    "client_address",
    "error_body",
    "event_stream",
    "parse_networks",
]

KiB: Final = 1024
MiB: Final = 1024 * KiB
_LOOPBACK_ORIGIN: Final = re.compile(r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?$")

Headers: TypeAlias = tuple[tuple[bytes, bytes], ...]


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> bytes:
    """The server's JSON error: ``{"error": {"message", "type", "param",
    "code"}}``, the shape OpenAI's SDKs read their exceptions from, so that a
    413 or a 404 from this layer reads like any other error to them."""
    if status >= 500:
        kind = "server_error"
    elif status == 429:
        kind = "rate_limit_error"
    else:
        kind = "invalid_request_error"
    payload = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


# --------------------------------------------------------------------------
# Configuration


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class HTTPLimits:
    """The bounds of one connection. Defaults suit a server on a LAN or
    behind a reverse proxy; each is a knob in the server's config."""

    #: Request line and headers together (h11's default); larger: 431.
    max_head_bytes: int = attrs.field(default=16 * KiB, validator=_positive)
    #: A request body; larger: 413 (before reading it when Content-Length says so).
    max_body_bytes: int = attrs.field(default=8 * MiB, validator=_positive)
    #: From accepting a connection, or from the first byte of a later request,
    #: until its head is complete; slower: 408 and close (slowloris).
    head_timeout: float = attrs.field(default=10.0, validator=_positive)
    #: How long a kept-alive connection may wait for its next request.
    idle_timeout: float = attrs.field(default=30.0, validator=_positive)
    #: From the head until the whole body has arrived; slower: 408 and close.
    body_timeout: float = attrs.field(default=60.0, validator=_positive)
    #: How long one write may wait on a client that does not read; then the
    #: connection is closed (and a streamed generation cancelled).
    send_timeout: float = attrs.field(default=30.0, validator=_positive)
    #: Requests served on one connection before it is closed (the client
    #: reconnects); bounds what one connection can hold on to.
    max_requests_per_connection: int = attrs.field(default=1000, validator=_positive)
    #: Open connections of both protocols; more are answered 503. None: no cap.
    max_connections: int | None = None
    #: For the WebSocket handshake once handed to trio-websocket, and for its
    #: closing handshake.
    websocket_handshake_timeout: float = attrs.field(default=10.0, validator=_positive)
    #: How long a closing connection keeps reading (and discarding) what the
    #: client still sends, so that an error response is not lost to a reset.
    linger: float = attrs.field(default=1.0, validator=_positive)


@attrs.frozen
class Reject:
    """A refusal, answered as a plain HTTP error response. ``reason`` is the
    metrics label (``origin``, ``auth``, ``draining``, ``capacity``, ``invalid``)."""

    status: int
    message: str
    reason: str = "invalid"
    headers: tuple[tuple[str, str], ...] = ()
    code: str | None = None


@attrs.frozen(kw_only=True)
class AccessPolicy:
    """Who may use the server: the API key, and the origins browsers may
    connect from. Both doors (HTTP and WebSocket) apply the same policy."""

    #: When set, every request outside ``public_paths`` must carry
    #: ``Authorization: Bearer <key>``; WebSocket handshakes may send it as
    #: ``?api_key=<key>`` instead (browsers cannot set headers on them).
    api_key: str | None = None
    #: Origins a browser may connect from besides the loopback ones
    #: (``http``/``https`` on localhost, 127.0.0.1 or [::1], any port);
    #: ``"*"`` allows every origin. ``null`` is never allowed.
    allowed_origins: tuple[str, ...] = ()
    #: Whether the loopback origins are allowed (``--allowed-origin none``).
    allow_loopback_origins: bool = True
    #: Paths served without the key (health checks of load balancers).
    public_paths: frozenset[str] = frozenset({"/health", "/ready"})
    #: Paths whose HTML page (a GET or HEAD that prefers ``text/html``) is
    #: served without the key: the chat page holds no secret, and asks the
    #: person for the key itself. Their JSON still needs it.
    public_pages: frozenset[str] = frozenset({"/"})

    def __attrs_post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("api key must not be empty")

    def origin_allowed(self, origin: str) -> bool:
        """protocol.md section 6: loopback origins (unless turned off), the
        configured ones, or any with ``*``; ``null`` never."""
        origin = origin.strip().rstrip("/").lower()
        if origin == "null":
            return False
        if "*" in self.allowed_origins:
            return True
        if self.allow_loopback_origins and _LOOPBACK_ORIGIN.match(origin) is not None:
            return True
        return origin in {a.rstrip("/").lower() for a in self.allowed_origins}

    def same_origin(self, head: RequestHead, origin: str) -> bool:
        """Whether ``origin`` is the server's own as ``head``'s one ``Host``
        names it (the chat page it served, wherever it is reached from).
        A host name counts only when a key is required: without one, DNS
        rebinding would let any site pass (:mod:`.origin` explains)."""
        hosts = [value for key, value in head.headers if key == b"host"]
        if len(hosts) != 1:
            return False
        host = hosts[0].decode("latin-1")
        return same_origin(origin, host, names=self.api_key is not None)

    def check_origin(self, head: RequestHead) -> Reject | None:
        origin = head.header("origin")
        if origin is None or self.origin_allowed(origin) or self.same_origin(head, origin):
            return None
        return Reject(
            403, f"origin {origin[:200]!r} is not allowed", "origin", code="origin_not_allowed"
        )

    def public_page(self, head: RequestHead) -> bool:
        """Whether ``head`` asks for a page of ``public_pages``: a plain GET or
        HEAD that prefers HTML. Never an upgrade: a WebSocket handshake that
        claims to prefer HTML still needs the key."""
        return (
            head.method in ("GET", "HEAD")
            and head.path in self.public_pages
            and head.header("upgrade") is None
            and prefers_html(head.header("accept"))
        )

    def authorized(self, head: RequestHead, *, allow_query: bool = False) -> bool:
        if self.api_key is None or head.path in self.public_paths:
            return True
        if self.public_page(head):
            return True
        expected = self.api_key.encode()
        scheme, _, token = head.header_bytes(b"authorization").partition(b" ")
        # compare_digest: the time taken must not tell how much of a guess was right.
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), expected):
            return True
        # Anthropic's SDKs and Claude Code send the key as X-Api-Key.
        anthropic_key = head.header("x-api-key")
        if anthropic_key is not None and hmac.compare_digest(
            anthropic_key.strip().encode("latin-1"), expected
        ):
            return True
        if allow_query:
            for key in parse_qs(head.query).get("api_key", []):
                if hmac.compare_digest(key.encode(), expected):
                    return True
        return False

    def check_key(self, head: RequestHead, *, allow_query: bool = False) -> Reject | None:
        if self.authorized(head, allow_query=allow_query):
            return None
        return Reject(
            401,
            "missing or wrong api key: send it as 'Authorization: Bearer <key>' (or 'X-Api-Key')",
            "auth",
            headers=(("WWW-Authenticate", 'Bearer realm="trioserve"'),),
            code="invalid_api_key",
        )


# --------------------------------------------------------------------------
# Requests and responses


@attrs.frozen
class RequestHead:
    """A request line and its headers. Header names are lowercase bytes."""

    method: str
    target: str
    path: str
    query: str
    headers: Headers
    http_version: str
    #: ``host:port`` of the client, for logs.
    peer: str

    def header_bytes(self, name: bytes, default: bytes = b"") -> bytes:
        for key, value in self.headers:
            if key == name:
                return value
        return default

    def header(self, name: str) -> str | None:
        """The first value of a header (latin-1, as HTTP defines), or None."""
        raw = name.lower().encode("ascii")
        for key, value in self.headers:
            if key == raw:
                return value.decode("latin-1")
        return None

    def header_tokens(self, name: bytes) -> list[bytes]:
        """The comma-separated tokens of every value of a header, lowercased."""
        tokens: list[bytes] = []
        for key, value in self.headers:
            if key == name:
                tokens.extend(t.strip().lower() for t in value.split(b",") if t.strip())
        return tokens

    def bearer_key(self) -> str | None:
        """The token of ``Authorization: Bearer <token>``, if any."""
        scheme, _, token = self.header_bytes(b"authorization").partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        return token.strip().decode("latin-1")

    def api_key(self) -> str | None:
        """The key the client sent: ``Authorization: Bearer``, else
        ``X-Api-Key`` (Anthropic's header), if any."""
        key = self.bearer_key()
        if key is None:
            key = self.header("x-api-key")
        return None if key is None else key.strip()

    def query_param(self, name: str) -> str | None:
        """The first value of a query parameter, URL-decoded, if any."""
        values = parse_qs(self.query).get(name)
        return values[0] if values else None

    @property
    def peer_host(self) -> str:
        """The peer's address without its port (``[::1]:5000`` -> ``::1``)."""
        host, _, port = self.peer.rpartition(":")
        if not host or not port.isdigit():
            return self.peer
        return host[1:-1] if host.startswith("[") and host.endswith("]") else host


#: At most this many addresses of ``X-Forwarded-For`` are looked at, from
#: the right (the nearest proxies first).
MAX_FORWARDED_HOPS: Final = 32

Network: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(
    cidrs: Iterable[str],
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """CIDRs (``10.0.0.0/8``, ``::1``) as networks; raises ``ValueError``."""
    return tuple(ipaddress.ip_network(c.strip(), strict=False) for c in cidrs)


def _in_networks(address: str, networks: Iterable[Network]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip.version == n.version and ip in n for n in networks)


def client_address(head: RequestHead, trusted_proxies: Sequence[Network]) -> str:
    """The client's address: the peer's, or, when the peer is a trusted proxy,
    the nearest untrusted address of ``X-Forwarded-For`` (read from the right,
    so that a client cannot choose its address by sending the header itself:
    only what a trusted proxy appended counts). An untrusted peer's header is
    ignored."""
    networks = trusted_proxies
    address = head.peer_host
    if not networks or not _in_networks(address, networks):
        return address
    forwarded: list[str] = []
    for key, value in head.headers:
        if key == b"x-forwarded-for":
            forwarded.extend(value.decode("latin-1").split(","))
    for hop in reversed(forwarded[-MAX_FORWARDED_HOPS:]):
        hop = hop.strip()
        if hop.startswith("[") and "]" in hop:  # [v6]:port
            hop = hop[1 : hop.index("]")]
        elif hop.count(":") == 1:  # v4:port
            hop = hop.partition(":")[0]
        try:
            ipaddress.ip_address(hop)
        except ValueError:
            return address  # a hop that is no address: trust nothing beyond it
        if not _in_networks(hop, networks):
            return hop
        address = hop
    return address


@attrs.frozen
class HTTPRequest:
    """A whole request, as handlers see it: the head, the body (already read
    and bounded), and the route that matched it."""

    head: RequestHead
    body: bytes
    #: The matched route's pattern (``/v1/models/{model}``): a metrics label.
    route: str
    params: Mapping[str, str] = attrs.field(factory=dict)

    @property
    def method(self) -> str:
        return self.head.method

    @property
    def path(self) -> str:
        return self.head.path

    def header(self, name: str) -> str | None:
        return self.head.header(name)


@attrs.frozen
class Response:
    """A whole response, sent with Content-Length."""

    status: int
    body: bytes = b""
    content_type: str | None = "application/json"
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(cls, obj: Any, status: int = 200, headers: Iterable[tuple[str, str]] = ()) -> Response:
        body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
        return cls(status, body, "application/json", tuple(headers))

    @classmethod
    def error(
        cls,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Iterable[tuple[str, str]] = (),
    ) -> Response:
        """An error in OpenAI's error shape, which every route uses."""
        return cls(
            status,
            error_body(status, message, param=param, code=code),
            "application/json",
            tuple(headers),
        )


class ClientGone(TrioserveError):
    """The client went away (or stopped reading) while its response was sent."""


class BodyWriter(Protocol):
    """What a :class:`StreamingResponse` writes its body with."""

    async def send(self, data: bytes) -> None:
        """Send ``data`` as the next piece of the body. Raises
        :class:`ClientGone` when the client is gone or stops reading."""
        ...


@attrs.frozen
class StreamingResponse:
    """A response whose body is written as it is produced (chunked transfer
    encoding). ``write`` is always called with a :class:`BodyWriter` (for a
    HEAD request too, which discards the body), so that it can release what
    the handler opened; the status line and headers go out with its first
    ``send``. When it returns, the body ends. Should it raise before its first
    ``send``, the client gets a 500 instead; after, the connection closes.

    Cancellation: ``write`` runs in a cancel scope that is cancelled when the
    client disconnects or the connection's writes time out; it must release
    what it holds (an engine job) in ``finally``.
    """

    status: int
    content_type: str
    write: Callable[[BodyWriter], Awaitable[None]]
    headers: tuple[tuple[str, str], ...] = ()


def event_stream(
    write: Callable[[BodyWriter], Awaitable[None]], headers: Iterable[tuple[str, str]] = ()
) -> StreamingResponse:
    """A Server-Sent Events response: ``text/event-stream``, never cached, and
    not buffered by nginx-style proxies (``X-Accel-Buffering: no``)."""
    return StreamingResponse(
        200,
        "text/event-stream; charset=utf-8",
        write,
        (("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no"), *headers),
    )


#: The body of an error the front door answers itself (a refused key, no
#: route, a 500) in the shape of the API ``head``'s path belongs to; None:
#: the server's own shape.
ErrorBody: TypeAlias = Callable[[RequestHead, int, str], bytes | None]


class HTTPError(TrioserveError):
    """Raised by a handler to answer with an error response: the server's
    error shape (:func:`error_body`), or ``body`` when a route's API has
    rendered its own."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = tuple(headers)
        self.body = body

    def response(self) -> Response:
        if self.body is not None:
            return Response(self.status, self.body, "application/json", self.headers)
        return Response.error(
            self.status, self.message, code=self.code, param=self.param, headers=self.headers
        )


Handler: TypeAlias = Callable[[HTTPRequest], Awaitable[Response | StreamingResponse]]
WebSocketHandler: TypeAlias = Callable[
    [trio_websocket.WebSocketConnection, RequestHead], Awaitable[None]
]


@attrs.frozen
class _Route:
    method: str
    pattern: str
    parts: tuple[str, ...]
    handler: Handler


class Router:
    """A table of routes: a method and a path pattern, exact segments or one
    ``{name}`` per segment (``/v1/models/{model}``), each with its handler."""

    def __init__(self) -> None:
        self._routes: list[_Route] = []

    def add(self, method: str, pattern: str, handler: Handler) -> None:
        if not pattern.startswith("/"):
            raise ValueError(f"a route pattern must start with '/', got {pattern!r}")
        self._routes.append(_Route(method.upper(), pattern, tuple(pattern.split("/")[1:]), handler))

    def match(self, method: str, path: str) -> tuple[_Route, dict[str, str]] | list[str]:
        """The route and its parameters, or the methods the path allows
        (empty: no route has this path)."""
        parts = path.split("/")[1:] if path.startswith("/") else None
        allowed: list[str] = []
        for route in self._routes:
            params = _match_parts(route.parts, parts)
            if params is None:
                continue
            if route.method == method or (method == "HEAD" and route.method == "GET"):
                return route, params
            allowed.append(route.method)
        if "GET" in allowed and "HEAD" not in allowed:
            allowed.append("HEAD")
        return allowed

    def methods(self, path: str) -> list[str]:
        found = self.match("", path)
        return found if isinstance(found, list) else []


def _match_parts(pattern: tuple[str, ...], parts: list[str] | None) -> dict[str, str] | None:
    if parts is None or len(pattern) != len(parts):
        return None
    params: dict[str, str] = {}
    for want, got in zip(pattern, parts, strict=True):
        if want.startswith("{") and want.endswith("}"):
            if not got:
                return None
            params[want[1:-1]] = unquote(got)
        elif want != got:
            return None
    return params


# --------------------------------------------------------------------------
# Observation


class Observer(Protocol):
    """What the front door reports (``trioserve.metrics.Metrics`` is one)."""

    def connection_opened(self, protocol: str) -> None: ...
    def connection_closed(self, protocol: str) -> None: ...
    def handshake_rejected(self, reason: str) -> None: ...
    def http_response(self, route: str, status: int) -> None: ...


class NoObserver:
    """An :class:`Observer` that records nothing."""

    def connection_opened(self, protocol: str) -> None:
        pass

    def connection_closed(self, protocol: str) -> None:
        pass

    def handshake_rejected(self, reason: str) -> None:
        pass

    def http_response(self, route: str, status: int) -> None:
        pass


@attrs.frozen
class FrontDoorStatistics:
    http_connections: int
    websocket_connections: int
    #: HTTP requests answered since start (WebSocket handshakes excluded).
    requests: int
    #: Connections ended by a protocol error, a timeout or an exception.
    errors: int
