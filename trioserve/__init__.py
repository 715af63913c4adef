"""trioserve: a WebSocket text-generation server on trio.

The public API is what this module exports (``__all__``); everything else may
change between releases. Serving from a trio program::

    options = EngineOptions(engine="cpu")
    async with trio.open_nursery() as nursery:
        # serve loads the engine on its engine thread, serves, and closes it.
        listening = await nursery.start(serve, lambda: load_engine(options), ServerConfig(port=0))
        async with open_client(listening.url) as client:
            print((await client.generate("Hello", 20)).response)
        nursery.cancel_scope.cancel()

``import trioserve`` does not import torch: the engines import it when one is
loaded, so a program that only talks to a server never pays for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .engine import EngineOptions, load_engine
from .engine.base import (
    Engine,
    EngineInfo,
    Failed,
    Finished,
    FinishReason,
    GenerationSpec,
    SamplingSettings,
    TextUpdate,
    Update,
)
from .errors import ConfigError, EngineError, ListenError, ModelError, TrioserveError
from .protocol import InferChunk, InferFinal, ProtocolError
from .scheduler import Job, QueueFull, Scheduler, SchedulerClosed, SchedulerStatistics
from .server import Listening, Server, ServerConfig, ServerStatistics, serve
from .worker import EngineThread, EngineThreadClosed, open_engine_thread

if TYPE_CHECKING:
    from .client import (
        Client,
        ConnectionClosed,
        ConnectionFailed,
        InferStream,
        ServerError,
        open_client,
    )

__all__ = [
    "Client",
    "ConfigError",
    "ConnectionClosed",
    "ConnectionFailed",
    "Engine",
    "EngineError",
    "EngineInfo",
    "EngineOptions",
    "EngineThread",
    "EngineThreadClosed",
    "Failed",
    "FinishReason",
    "Finished",
    "GenerationSpec",
    "InferChunk",
    "InferFinal",
    "InferStream",
    "Job",
    "ListenError",
    "Listening",
    "ModelError",
    "ProtocolError",
    "QueueFull",
    "SamplingSettings",
    "Scheduler",
    "SchedulerClosed",
    "SchedulerStatistics",
    "Server",
    "ServerConfig",
    "ServerError",
    "ServerStatistics",
    "TextUpdate",
    "TrioserveError",
    "Update",
    "__version__",
    "load_engine",
    "open_client",
    "open_engine_thread",
    "serve",
]

# The client's names are imported on first use, not here: ``python -m
# trioserve.client`` imports this package first, and an eager import would make
# runpy run the client module a second time as ``__main__`` (with its own copies
# of the client's classes, and a RuntimeWarning saying so).
_CLIENT_NAMES = frozenset(
    {"Client", "ConnectionClosed", "ConnectionFailed", "InferStream", "ServerError", "open_client"}
)


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from . import client

        value = getattr(client, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trioserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _CLIENT_NAMES)
