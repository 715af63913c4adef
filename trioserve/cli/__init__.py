"""``python -m trioserve`` (the ``trioserve`` command): options -> ServerConfig +
EngineOptions -> model -> engine -> serve.

Every option is a row of :data:`OPTIONS`. A row names an attribute of
:class:`~trioserve.server.ServerConfig` or :class:`~trioserve.engine.EngineOptions`,
and the option takes its default, its type (and so how its value is parsed) and
its validation from that attrs field, so that a setting added to either class
needs one row here. Each option can also come from the environment variable
``TRIOSERVE_<OPTION>`` (``--max-batch`` -> ``TRIOSERVE_MAX_BATCH``); the
command line wins over the environment, which wins over the default.

Errors a user can fix are short and never a traceback: a bad option, an invalid
environment value, a model path that is not a model or a device that cannot run
is the usage block and one line, exit status 2; a model that cannot be had or
loaded, or a port that cannot be bound, is one line, exit status 1.

The package: :mod:`.options` is the table, :mod:`.settings` turns the command
line and the environment into settings, :mod:`.run` checks them and starts
the server.
"""

from .options import NOT_OPTIONS, OPTIONS, OTHER_ENV, Option, env_name
from .run import main
from .settings import build_parser, resolve

__all__ = [
    "NOT_OPTIONS",
    "OPTIONS",
    "OTHER_ENV",
    "Option",
    "build_parser",
    "env_name",
    "main",
    "resolve",
]
