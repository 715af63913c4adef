"""Logging for the command line: text or JSON lines, structured fields, startup phases.

trioserve's modules log with the standard :mod:`logging` module, one logger per
area (``trioserve.server``, ``trioserve.engine``, ...). A record may carry
structured fields as ``extra={"fields": {...}}``, a flat dict of names to
JSON-compatible values::

    log.info("infer finished", extra={"fields": {"request_id": 7, "generated_tokens": 12}})

The formatters here show them: :class:`TextFormatter` appends ``key=value``
pairs after the message, :class:`JsonFormatter` writes one JSON object per
record (``time``, ``level``, ``logger``, ``message``, then the fields) for log
shippers. The server logs one line per finished request on
``trioserve.access``, and handshake rejections on ``trioserve.server``, this way.

Secrets never reach a log line through the fields: a field whose name says it
holds a key (``api_key``, ``authorization``, ...) is written as
``"[redacted]"``. Whether prompts are logged is the server's
``ServerConfig.log_prompts`` (``--log-prompts``), off by default.

:func:`configure_logging` is what ``python -m trioserve`` calls; a program that
embeds trioserve configures logging its own way and may reuse the formatters.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Final, Literal, TextIO

__all__ = [
    "LOG_FORMATS",
    "LOG_LEVELS",
    "JsonFormatter",
    "TextFormatter",
    "configure_logging",
    "phase",
    "record_fields",
]

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final[tuple[LogFormat, ...]] = ("text", "json")
LOG_LEVELS: Final = ("debug", "info", "warning", "error")

#: Field names whose values are never written (compared in lowercase).
SECRET_FIELDS: Final = frozenset(
    {"api_key", "apikey", "authorization", "password", "secret", "key"}
)
REDACTED: Final = "[redacted]"

#: The keys every JSON line has; a field of the same name cannot replace them
#: (it is written as ``field.<name>`` instead).
_JSON_CORE: Final = ("time", "level", "logger", "message")

log = logging.getLogger("trioserve.cli")

#: Characters that JSON allows raw in a string but some line readers (Python's
#: str.splitlines among them) take for line breaks: written escaped.
_LINE_BREAKS: Final = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields of ``record`` (``extra={"fields": {...}}``),
    secrets redacted; empty when it has none or they are not a mapping."""
    fields = getattr(record, "fields", None)
    if not isinstance(fields, Mapping):
        return {}
    return {
        str(name): REDACTED if str(name).lower() in SECRET_FIELDS else value
        for name, value in fields.items()
    }


def _text_value(value: Any) -> str:
    """One ``key=value`` value: ``-`` for None, bare when it is a plain word or
    number, JSON-quoted when it has spaces, quotes, ``=`` or control
    characters (or is ``-`` itself), so that a line splits back into its
    pairs unambiguously. Lists and objects are their compact JSON text."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    # "-" alone is the missing value: a string "-" is quoted to differ from it.
    if text and text != "-" and all(c.isprintable() and c not in ' "=\\' for c in text):
        return text
    return json.dumps(text, ensure_ascii=False).translate(_LINE_BREAKS)


class TextFormatter(logging.Formatter):
    """``2025-01-31 12:00:00,123 INFO trioserve.access: message key=value ...``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = record_fields(record)
        if not fields:
            return line
        pairs = " ".join(f"{name}={_text_value(value)}" for name, value in fields.items())
        # The traceback, if any, follows the first line: the pairs stay on it.
        head, newline, rest = line.partition("\n")
        return f"{head} {pairs}{newline}{rest}"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``time`` (UTC, ISO 8601 with
    milliseconds), ``level`` (lowercase), ``logger``, ``message``, the
    record's fields, and ``exception`` (the formatted traceback) when there
    is one. Values that JSON cannot hold are written as their ``str()``."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, tz=UTC)
        entry: dict[str, Any] = {
            "time": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in record_fields(record).items():
            entry[f"field.{name}" if name in _JSON_CORE or name == "exception" else name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # allow_nan=False would raise on a NaN timing; such a value is written
        # as a string instead, so that every line stays valid JSON.
        line = json.dumps(_finite(entry), ensure_ascii=False, default=str)
        return line.translate(_LINE_BREAKS)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def configure_logging(
    level: str = "info", log_format: LogFormat = "text", *, stream: TextIO | None = None
) -> logging.Handler:
    """Send every log record at ``level`` or above to ``stream`` (stderr by
    default) in ``log_format``; returns the handler it installed.

    It replaces the root logger's handlers, so that calling it twice does not
    write each line twice.
    """
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {LOG_LEVELS}, got {level!r}")
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Python's own warnings (a DeprecationWarning from a library) go through
    # the same handler, so that a JSON log stays all JSON.
    logging.captureWarnings(True)
    return handler


@contextmanager
def phase(
    name: str, doing: str, *, logger: logging.Logger = log, **fields: Any
) -> Iterator[dict[str, Any]]:
    """Log the start and the end of one startup phase, with its duration.

    ``doing`` says what happens (``"loading the model"``); the start line is
    ``"<doing> ..."`` and the end line ``"<doing>: done in 6.1 s"``, both at
    INFO with the fields ``phase`` (``name``) and, at the end,
    ``duration_s``. The block may add fields to the end line through the
    dict it gets. A phase that raises logs nothing more: the error is
    reported by whoever catches it.
    """
    extra: dict[str, Any] = dict(fields)
    logger.info("%s ...", doing, extra={"fields": {"phase": name, **fields}})
    started = time.perf_counter()
    yield extra
    duration = time.perf_counter() - started
    logger.info(
        "%s: done in %.1f s",
        doing,
        duration,
        extra={"fields": {"phase": name, **extra, "duration_s": round(duration, 3)}},
    )
