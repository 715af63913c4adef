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

from ._version import __version__
from .client import (
    Client,
    ConnectionClosed,
    ConnectionFailed,
    InferStream,
    ServerError,
    open_client,
)
from .engine import EngineOptions, load_engine
from .engine.base import Engine, EngineInfo, GenerationSpec
from .errors import ConfigError, EngineError, ListenError, ModelError, TrioserveError
from .generation import (
    EngineThread,
    EngineThreadClosed,
    Job,
    QueueFull,
    Scheduler,
    SchedulerClosed,
    SchedulerStatistics,
    open_engine_thread,
)
from .protocol import InferChunk, InferFinal, ProtocolError
from .server import Listening, Models, ModelSettings, Server, ServerConfig, ServerStatistics, serve
from .vocabulary.results import Failed, Finished, FinishReason, TextUpdate, Update
from .vocabulary.sampling import SamplingSettings

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
    "ModelSettings",
    "Models",
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
