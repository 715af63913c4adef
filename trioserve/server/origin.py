"""The same-origin rule: a browser's ``Origin`` against the request's ``Host``.

The chat page at ``/`` (:mod:`.page`) opens a WebSocket to the server that
served it, so its origin must be accepted wherever the server is reached: on
loopback, on a LAN address, behind a TLS proxy under a public name. An
``Origin`` is *same-origin* when its host and port equal those of ``Host``.

Why this is safe: the origin check defends browsers only (any other client
can send whatever ``Origin`` it likes, or none). In a browser both headers
are the browser's own: a page on another site that opens a WebSocket to this
server sends its own origin and this server's host, which differ. The one
way a foreign page gets a matching pair is DNS rebinding: ``evil.example``
first resolves to the attacker, then to this server's address, and the
attacker's page (origin ``http://evil.example:7862``) talks to
``Host: evil.example:7862``. So a *name* counts only where rebinding gains
nothing: when the server requires an API key (the foreign page does not have
it). IP literals (a page loaded from ``http://192.0.2.7:7862/`` was served by
that address) and ``localhost`` (browsers resolve it themselves, never through
DNS) count always.

Ports: the origin's port is its explicit one or its scheme's default (80 for
``http``, 443 for ``https``). A ``Host`` without a port matches the default
port of the origin's scheme: browsers leave a default port out of both
headers, and a TLS proxy that forwards ``Host`` as the browser sent it (nginx's
``$host`` on port 443, or ``$http_host``) gives the server a host the browser's
``https`` origin matches, although the server itself speaks plain ``http``.
The scheme is not compared, since a server behind a proxy cannot know the
browser's. ``X-Forwarded-Host`` and ``X-Forwarded-Proto`` are not read: any
client may send them, and what the browser asked for is ``Host``.

Every input is bounded before it is parsed: a header longer than a host name
can be (with its port) never matches.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final

__all__ = ["parse_host", "parse_origin", "same_origin"]

#: A DNS name is at most 253 characters; with brackets, a colon and a port
#: there is no longer valid Host. ``https://`` adds 8 to an Origin.
MAX_HOST_CHARS: Final = 262
MAX_ORIGIN_CHARS: Final = MAX_HOST_CHARS + len("https://")
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
# A reg-name as browsers serialize it (lowercase, IDNs in punycode; "_" is in
# some internal names), or an IPv6 literal in brackets; then an optional port.
_HOST: Final = re.compile(r"(\[[0-9a-f:.]{2,45}\]|[a-z0-9_.-]{1,253})(?::([0-9]{1,5}))?")
_ORIGIN: Final = re.compile(r"(https?)://(.+)")


def _host_and_port(text: str) -> tuple[str, int | None] | None:
    match = _HOST.fullmatch(text)
    if match is None:
        return None
    host, port_text = match.groups()
    port = int(port_text) if port_text is not None else None
    if port is not None and not 0 < port < 65536:
        return None
    if host.startswith("["):
        try:
            address = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return None
        # One spelling per address: [0:0::1] and [::1] are the same host.
        host = f"[{address.compressed}]"
    return host, port


def parse_host(host: str) -> tuple[str, int | None] | None:
    """The host (lowercase; an IPv6 literal in brackets, compressed) and the
    explicit port of a ``Host`` header, or None when it is no valid host."""
    if len(host) > MAX_HOST_CHARS:
        return None
    return _host_and_port(host.strip().lower())


def parse_origin(origin: str) -> tuple[str, str, int] | None:
    """The scheme, host and port (explicit or the scheme's default) of an
    ``http`` or ``https`` origin, or None (``null``, other schemes, a path,
    anything malformed)."""
    if len(origin) > MAX_ORIGIN_CHARS:
        return None
    match = _ORIGIN.fullmatch(origin.strip().lower())
    if match is None:
        return None
    scheme, rest = match.groups()
    parsed = _host_and_port(rest)
    if parsed is None:
        return None
    host, port = parsed
    return scheme, host, _DEFAULT_PORTS[scheme] if port is None else port


def _rebinding_proof(host: str) -> bool:
    """Whether a browser can reach ``host`` only where it says: an IP literal
    or ``localhost``, never a name DNS could point elsewhere."""
    if host.startswith("[") or host == "localhost":
        return True
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def same_origin(origin: str, host: str, *, names: bool) -> bool:
    """Whether ``origin`` is the origin of the server this ``Host`` names: the
    same host, and the same port (a ``Host`` without one means the default port
    of the origin's scheme). A host that is a DNS name counts only with
    ``names`` (the server requires an API key: see the module's docstring)."""
    parsed_origin = parse_origin(origin)
    parsed_host = parse_host(host)
    if parsed_origin is None or parsed_host is None:
        return False
    scheme, origin_host, origin_port = parsed_origin
    host_name, host_port = parsed_host
    if origin_host != host_name:
        return False
    if (host_port if host_port is not None else _DEFAULT_PORTS[scheme]) != origin_port:
        return False
    return names or _rebinding_proof(host_name)
