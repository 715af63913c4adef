"""The trio client library for the trioserve protocol (:mod:`.library`), and
the terminal chat on top of it (:mod:`.chat`, ``python -m trioserve.client``).
"""

from .library import (
    DEFAULT_MAX_MESSAGE_SIZE,
    Client,
    ConnectionClosed,
    ConnectionFailed,
    InferStream,
    RequestIdInUse,
    ServerError,
    open_client,
)

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE",
    "Client",
    "ConnectionClosed",
    "ConnectionFailed",
    "InferStream",
    "RequestIdInUse",
    "ServerError",
    "open_client",
]
