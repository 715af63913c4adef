"""Content negotiation for ``/``: does the client prefer HTML to JSON?

A browser's navigation asks for ``text/html`` first
(``text/html,application/xhtml+xml,...,*/*;q=0.8``) and gets the chat page;
curl, SDKs and scripts send ``*/*``, ``application/json`` or nothing, and keep
the JSON document ``/`` has always answered. HTML wins only when the client
rates it strictly above JSON (RFC 9110, section 12.5.1: the most specific range
that matches a type gives its quality), so a tie keeps the JSON.
"""

from __future__ import annotations

from typing import Final

__all__ = ["prefers_html"]

#: Longer Accept headers are read up to here; a browser's is under 200 bytes.
MAX_ACCEPT_CHARS: Final = 1024
#: Media ranges looked at, at most.
MAX_RANGES: Final = 32


def _ranges(accept: str) -> list[tuple[str, str, float]]:
    """``(type, subtype, q)`` of each well-formed media range."""
    ranges: list[tuple[str, str, float]] = []
    for item in accept[:MAX_ACCEPT_CHARS].split(",")[:MAX_RANGES]:
        media, *params = item.split(";")
        kind, slash, subtype = media.strip().lower().partition("/")
        if not slash or not kind or not subtype:
            continue
        q = 1.0
        for param in params:
            name, _, value = param.strip().partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0
                if not 0.0 <= q <= 1.0:  # nan and out of range: refuse the range
                    q = 0.0
        ranges.append((kind, subtype, q))
    return ranges


def _quality(ranges: list[tuple[str, str, float]], kind: str, subtype: str) -> float:
    """The quality of ``kind/subtype``: from the most specific matching range."""
    best = (-1, 0.0)
    for k, s, q in ranges:
        if (k, s) == (kind, subtype):
            specificity = 2
        elif (k, s) == (kind, "*"):
            specificity = 1
        elif (k, s) == ("*", "*"):
            specificity = 0
        else:
            continue
        if specificity > best[0]:
            best = (specificity, q)
    return best[1]


def prefers_html(accept: str | None) -> bool:
    """Whether an ``Accept`` header rates ``text/html`` above ``application/json``."""
    if not accept:
        return False
    ranges = _ranges(accept)
    html = _quality(ranges, "text", "html")
    return html > 0.0 and html > _quality(ranges, "application", "json")
