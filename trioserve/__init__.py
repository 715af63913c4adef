"""trioserve: a WebSocket text-generation server on trio."""

from ._version import __version__

__all__ = ["__version__"]
