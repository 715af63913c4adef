"""The exception hierarchy of trioserve.

Every error trioserve raises on purpose derives from :class:`TrioserveError`, so
a host application can catch one base class. Errors that a *client* caused are
protocol errors (``trioserve.protocol.ProtocolError``) and carry the error frame
that answers them; errors here are about configuration, models and engines.
"""

from __future__ import annotations


class TrioserveError(Exception):
    """Base class of every error trioserve raises on purpose."""


class ConfigError(TrioserveError):
    """A server or engine option is invalid (bad value, conflicting options)."""


class ModelError(TrioserveError):
    """A model cannot be found, obtained, verified, converted or loaded."""


class EngineError(TrioserveError):
    """An engine failed as a whole (not just one job) or cannot be created."""


class ListenError(TrioserveError):
    """The server cannot listen on its address (port in use, unknown host)."""
