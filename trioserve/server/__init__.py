"""The trio shell: one listening port, its HTTP/1.1 front door and WebSocket
upgrades, one :class:`~.connection.Connection` per WebSocket client, and the
HTTP routes. It turns requests of each door into generations
(:mod:`trioserve.generation`) and their outcomes into that door's wire format
(:mod:`trioserve.protocol`, :mod:`trioserve.openai`)."""

from .models import ModelError, Models
from .served import ModelSettings
from .server import Listening, Server, ServerConfig, ServerStatistics, serve

__all__ = [
    "Listening",
    "ModelError",
    "ModelSettings",
    "Models",
    "Server",
    "ServerConfig",
    "ServerStatistics",
    "serve",
]
