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
"""

from __future__ import annotations

import argparse
import errno
import functools
import logging
import math
import os
import re
import signal
import socket
import sys
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import attrs
import trio

from ._version import __version__
from .engine import EngineOptions, load_engine
from .engine.base import WEIGHT_MODES, Engine
from .errors import ConfigError, TrioserveError
from .generation import EngineThread, open_engine_thread
from .logs import LOG_FORMATS, LOG_LEVELS, configure_logging, phase
from .server import Listening, Server, ServerConfig

__all__ = ["OPTIONS", "Option", "build_parser", "env_name", "main"]

log = logging.getLogger("trioserve.cli")

EXIT_USAGE = 2
EXIT_FAILURE = 1
ENV_PREFIX: Final = "TRIOSERVE_"
#: Environment variables of trioserve that are not options (they are read
#: elsewhere), so that they are not reported as unknown.
OTHER_ENV: Final = frozenset({"TRIOSERVE_CACHE", "TRIOSERVE_TORCH"})

_TRUE: Final = ("1", "true", "yes", "on")
_FALSE: Final = ("0", "false", "no", "off")


# --- parsing one value ---------------------------------------------------------


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    # nan and inf parse as floats; no setting means either.
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text!r}")
    return value


def _gpu_split(text: str) -> tuple[float, ...]:
    try:
        parts = tuple(_number(part) for part in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected GB per GPU separated by commas (e.g. 20,24), got {text!r}"
        ) from None
    if any(part <= 0 for part in parts):
        raise argparse.ArgumentTypeError(f"expected positive GB per GPU, got {text!r}")
    return parts


def _boolean(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(_TRUE + _FALSE)}, got {text!r}")


def _nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a value, got ''")
    return text


# --- the option table ------------------------------------------------------------

NET = "network"
MODEL = "model and engine"
EXL = "exllamav2 engine"
LIMITS = "limits"
LOGGING = "logging"
GROUPS: Final = (NET, MODEL, EXL, LIMITS, LOGGING)

Kind = Literal["value", "flag", "repeat"]


@attrs.frozen
class Option:
    """One command-line option and its environment variable.

    ``name`` is the attribute of ``target`` (:class:`ServerConfig` or
    :class:`EngineOptions`) it sets, or, with no target, a setting of the
    command line itself (then ``default`` is required). The option's
    default, its type (a plain value, an on/off flag for a ``bool``, or a
    list given by repeating the option for a ``tuple``) and its validation
    come from the target's attrs field.
    """

    name: str
    group: str
    help: str
    target: type | None = None
    #: Text -> value; by default from the field's type (int, float, str, Path).
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    #: How the default reads in ``--help`` when its value says little (a
    #: None that means "the model's").
    shown_default: str | None = None
    #: The flag, when it is not ``--`` + the name with dashes.
    flag_name: str | None = None
    #: Only for options without a target.
    default: Any = None
    #: A value that must never be printed (the API key).
    secret: bool = False

    @property
    def flag(self) -> str:
        return self.flag_name or "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return env_name(self.flag)

    def field(self) -> attrs.Attribute[Any] | None:
        if self.target is None:
            return None
        return _fields(self.target)[self.name]

    def default_value(self) -> Any:
        field = self.field()
        if field is None:
            return self.default
        # An attrs.Factory default (none of the options has one yet) is called.
        factory = getattr(field.default, "factory", None)
        return factory() if callable(factory) else field.default

    def kind(self) -> Kind:
        field = self.field()
        base = _base_type(field.type) if field is not None else type(self.default)
        if base is bool:
            return "flag"
        if typing.get_origin(base) is tuple and self.parse is None:
            return "repeat"
        return "value"

    def parser(self) -> Callable[[str], Any]:
        """Text -> value (for a repeated option: one item's value)."""
        if self.parse is not None:
            return self.parse
        field = self.field()
        base = _base_type(field.type) if field is not None else type(self.default)
        if self.kind() == "flag":
            return _boolean
        if self.kind() == "repeat":
            base = typing.get_args(base)[0]
        if typing.get_origin(base) is Literal:
            return str
        if base not in _PARSERS:
            raise TypeError(f"option {self.flag}: no parser for {base!r}; give parse=")
        return _PARSERS[base]

    def all_choices(self) -> tuple[str, ...] | None:
        if self.choices is not None:
            return self.choices
        field = self.field()
        if field is not None:
            base = _base_type(field.type)
            if typing.get_origin(base) is Literal:
                return tuple(str(arg) for arg in typing.get_args(base))
        return None

    def help_text(self) -> str:
        if self.secret:
            shown = "none"
        elif self.shown_default is not None:
            shown = self.shown_default
        else:
            value = self.default_value()
            if self.kind() == "flag":
                shown = "on" if value else "off"
            elif value is None:
                shown = "none"
            else:
                shown = str(value)
        return f"{self.help} (default: {shown})"


def env_name(flag: str) -> str:
    """``--max-batch`` -> ``TRIOSERVE_MAX_BATCH``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


#: How a value of each field type is read from text.
_PARSERS: Final[dict[Any, Callable[[str], Any]]] = {
    int: _integer,
    float: _number,
    str: _nonempty,
    Path: lambda text: Path(_nonempty(text)).expanduser(),
}


@functools.cache
def _fields(cls: type) -> dict[str, attrs.Attribute[Any]]:
    # The classes' annotations are strings (`from __future__ import
    # annotations`); resolving them gives the types the parsers go by.
    attrs.resolve_types(cls)
    return attrs.fields_dict(cls)


def _base_type(annotation: Any) -> Any:
    """``int | None`` -> ``int``; other types as they are."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


S, E = ServerConfig, EngineOptions

#: Every option. A setting added to ServerConfig or EngineOptions is one row,
#: ``Option("max_connections", LIMITS, "connections open at once", S, metavar="N")``:
#: its default, type and validation come from the field; tests check that
#: every field has a row and that docs/deployment.md's table lists it.
OPTIONS: Final[tuple[Option, ...]] = (
    # network
    Option("host", NET, "interface to bind: 0.0.0.0 (or ::) for all; then set an API key", S),
    Option("port", NET, "TCP port to bind; 0 picks a free one (printed)", S, _port, "PORT"),
    Option(
        "api_key",
        NET,
        "require 'Authorization: Bearer KEY' or '?api_key=KEY' at the handshake; prefer the "
        "environment variable, which other users of the machine cannot read from the process list",
        S,
        metavar="KEY",
        secret=True,
    ),
    Option(
        "allowed_origins",
        NET,
        "browser origin allowed to connect besides the loopback origins (e.g. "
        "https://app.example.com); repeat it for more (in the environment: commas); '*' allows "
        "any, 'none' removes the loopback origins",
        S,
        metavar="ORIGIN",
        shown_default="the loopback origins only: localhost, 127.0.0.1 and [::1], any port",
        flag_name="--allowed-origin",
    ),
    Option(
        "trusted_proxies",
        NET,
        "a proxy (address or CIDR, e.g. 10.0.0.0/8) whose X-Forwarded-For names the client's "
        "address; repeat it for more (in the environment: commas); other peers' headers are "
        "ignored",
        S,
        metavar="CIDR",
        shown_default="none: the client is the peer's address",
        flag_name="--trusted-proxy",
    ),
    # model and engine
    Option(
        "model",
        MODEL,
        "a Hugging Face Llama-family directory (config.json, tokenizer.json, *.safetensors), "
        "or a llama .gguf file (converted once into the cache)",
        E,
        metavar="PATH",
        shown_default="the embedded SmolLM2-135M-Instruct",
    ),
    Option(
        "engine",
        MODEL,
        "backend: exllamav2 on NVIDIA GPUs, cpu anywhere; auto takes exllamav2 when it and a "
        "CUDA device are usable, and logs why",
        E,
    ),
    Option(
        "dtype",
        MODEL,
        "cpu engine: dtype of weights and activations",
        E,
        choices=("bfloat16", "float16", "float32"),
    ),
    Option("device", MODEL, "cpu engine: torch device, cpu or cuda[:N]", E, metavar="DEVICE"),
    Option(
        "weights",
        MODEL,
        "cpu engine: what the linear layers run on: auto (the model's own 4-bit weights where "
        "they are exact enough, else the dtype), float (the dtype), q4 (4-bit groups of 32) or "
        "int8 (per channel)",
        E,
        choices=WEIGHT_MODES,
    ),
    Option(
        "prefix_cache_mib",
        MODEL,
        "cpu engine: memory for the keys and values of finished prompts, reused by requests "
        "that start the same way (multi-turn chats); 0 turns it off",
        E,
        _integer,
        "MIB",
    ),
    Option(
        "prefill_share",
        MODEL,
        "cpu engine: while some requests stream, the share of the engine's time that new "
        "prompts' prefill may take (0 < share <= 1; 1 gives every step a prefill chunk): a "
        "long prompt then slows the streams to about half speed, not to a token per chunk",
        E,
        _number,
        "SHARE",
    ),
    Option(
        "threads",
        MODEL,
        "cpu engine: torch threads (one per physical core is best)",
        E,
        _positive_int,
        "N",
        shown_default="torch's, one per physical core",
    ),
    Option(
        "context_length",
        MODEL,
        "context length in tokens, at most the model's; less saves memory, and longer prompts "
        "are trimmed from the left",
        E,
        metavar="TOKENS",
        shown_default="the model's",
    ),
    Option(
        "max_batch",
        MODEL,
        "jobs generated together; more wait in arrival order",
        E,
        metavar="N",
        shown_default="8 on cpu, 32 on exllamav2",
    ),
    Option(
        "offline",
        MODEL,
        "never download the embedded model; fail with instructions instead",
        E,
    ),
    # exllamav2
    Option(
        "cache_type",
        EXL,
        "KV cache precision: fp16, or quantised to 4, 6 or 8 bits (less memory, more "
        "jobs or context)",
        E,
        choices=("fp16", "q4", "q6", "q8"),
    ),
    Option(
        "cache_size",
        EXL,
        "KV cache size in tokens, a multiple of 256",
        E,
        metavar="TOKENS",
        shown_default="context length x max batch",
    ),
    Option(
        "gpu_split",
        EXL,
        "GB of weights per GPU, comma-separated, e.g. 20,24",
        E,
        _gpu_split,
        "GB,GB",
        shown_default="autosplit",
    ),
    Option("tensor_parallel", EXL, "split every layer across the GPUs", E),
    # limits
    Option(
        "max_message_bytes",
        LIMITS,
        "largest frame or HTTP body accepted; a larger frame closes the connection with 1009",
        S,
        metavar="BYTES",
        shown_default="16 bytes per token of context, at least 256 KiB",
    ),
    Option(
        "max_connections",
        LIMITS,
        "connections open at once, handshakes included; more are answered HTTP 503",
        S,
        metavar="N",
    ),
    Option(
        "max_requests_per_connection",
        LIMITS,
        "infer requests in flight per connection; more are answered 'overloaded'",
        S,
        metavar="N",
    ),
    Option(
        "max_requests_per_client",
        LIMITS,
        "generation requests in flight per client, over all its WebSocket connections and HTTP "
        "requests (a client is its API key, else its address); more are answered 'overloaded' "
        "(HTTP 429)",
        S,
        metavar="N",
    ),
    Option(
        "max_running_per_client",
        LIMITS,
        "engine slots one client may hold while others wait",
        S,
        metavar="N",
        shown_default="all but one of the engine's slots",
    ),
    Option(
        "max_waiting_jobs",
        LIMITS,
        "jobs waiting for the engine, all connections; more are answered 'overloaded'",
        S,
        metavar="N",
    ),
    Option(
        "max_output_bytes",
        LIMITS,
        "unsent output one connection may hold before it is closed (1008)",
        S,
        metavar="BYTES",
    ),
    Option(
        "max_new_tokens",
        LIMITS,
        "upper bound of a request's max_new_tokens",
        S,
        metavar="TOKENS",
        shown_default="context length - 1",
    ),
    Option(
        "ping_interval",
        LIMITS,
        "seconds between keepalive pings on each connection",
        S,
        metavar="SECONDS",
    ),
    Option(
        "ping_timeout",
        LIMITS,
        "seconds a peer has to answer a ping before it is closed (1011)",
        S,
        metavar="SECONDS",
    ),
    Option(
        "send_timeout",
        LIMITS,
        "seconds a client may accept no byte of a frame before it is closed (1008)",
        S,
        metavar="SECONDS",
    ),
    Option(
        "handshake_timeout",
        LIMITS,
        "seconds a peer has to complete its WebSocket handshake",
        S,
        metavar="SECONDS",
    ),
    Option(
        "close_timeout",
        LIMITS,
        "seconds a close handshake may take before the socket is dropped",
        S,
        metavar="SECONDS",
    ),
    Option(
        "shutdown_grace",
        LIMITS,
        "seconds running jobs may finish after SIGINT/SIGTERM before they are interrupted",
        S,
        metavar="SECONDS",
    ),
    # logging
    Option(
        "log_level",
        LOGGING,
        "least severe level logged; info has a line per request and per startup phase",
        parse=str.lower,
        choices=LOG_LEVELS,
        default="info",
    ),
    Option(
        "log_format",
        LOGGING,
        "text, or json: one JSON object per line for log shippers",
        parse=str.lower,
        choices=LOG_FORMATS,
        default="text",
    ),
    Option(
        "log_prompts",
        LOGGING,
        "let log lines carry prompts and generated text (user data; API keys are never logged)",
        S,
    ),
)
del S, E

#: Fields of the config classes that are not options of their own; every
#: other field must have a row above. ``allow_loopback_origins`` is set by
#: ``--allowed-origin none``.
NOT_OPTIONS: Final = frozenset({"allow_loopback_origins"})


def build_parser(prog: str = "python -m trioserve") -> argparse.ArgumentParser:
    """The command-line parser. An option that is not given is absent from
    the namespace (not set to its default), so that :func:`resolve` can tell
    it from one given with the default's value and look at the environment."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Serve a text-generation model over WebSocket with the ExLlamaV2 protocol. "
            "Without --model it serves the embedded SmolLM2-135M-Instruct on the CPU "
            "(downloaded and converted into $TRIOSERVE_CACHE, default ~/.cache/trioserve, "
            "on first start)."
        ),
        epilog=(
            "Every option can also be set by an environment variable: TRIOSERVE_ and the "
            "option's name in capitals, dashes as underscores (--max-batch: "
            "TRIOSERVE_MAX_BATCH; on/off options take 1/0, true/false, yes/no or on/off). "
            "The command line wins over the environment. TRIOSERVE_CACHE sets where models "
            "are kept. See docs/deployment.md."
        ),
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--version", action="version", version=f"trioserve {__version__}")
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    for option in OPTIONS:
        group = groups[option.group]
        kind = option.kind()
        if kind == "flag":
            group.add_argument(
                option.flag,
                dest=option.name,
                action=argparse.BooleanOptionalAction,
                help=option.help_text(),
            )
        else:
            group.add_argument(
                option.flag,
                dest=option.name,
                type=option.parser(),
                choices=option.all_choices(),
                metavar=option.metavar,
                action="append" if kind == "repeat" else "store",
                help=option.help_text(),
            )
    return parser


@attrs.frozen
class Settings:
    """What the command line and the environment asked for."""

    engine: EngineOptions
    server: ServerConfig
    log_level: str
    log_format: Literal["text", "json"]
    #: Option name -> where its value came from ("--model" or
    #: "TRIOSERVE_MODEL"), for the options that were given.
    sources: Mapping[str, str] = attrs.field(factory=dict)

    def source(self, name: str) -> str:
        """Where option ``name`` came from, for messages about its value."""
        option = next(o for o in OPTIONS if o.name == name)
        return self.sources.get(name, option.flag)


class UsageError(Exception):
    """A bad option or environment value: the usage block and this message."""


def _from_env(option: Option, text: str) -> Any:
    try:
        if option.kind() == "repeat":
            items = [item for item in re.split(r"[,\s]+", text) if item]
            return tuple(option.parser()(item) for item in items)
        value = option.parser()(text)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"{option.env}: {exc}") from None
    choices = option.all_choices()
    if choices is not None and value not in choices:
        raise UsageError(
            f"{option.env}: invalid choice: {text!r} (choose from {', '.join(choices)})"
        )
    return value


def resolve(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """Merge the command line, the environment and the defaults into settings.

    Raises:
        UsageError: an environment value cannot be parsed, or the settings
            are refused by ServerConfig or EngineOptions; the message names
            the option or the variable the bad value came from.
    """
    given: dict[str, tuple[Any, str]] = {}  # name -> (value, where it came from)
    for option in OPTIONS:
        if option.name in vars(args):
            value = getattr(args, option.name)
            if option.kind() == "repeat":
                value = tuple(value)
            given[option.name] = (value, option.flag)
        elif environ.get(option.env):
            # An empty variable counts as unset, as systemd's `Environment=X=` means.
            given[option.name] = (_from_env(option, environ[option.env]), option.env)
    values = {name: value for name, (value, _) in given.items()}
    if "allowed_origins" in values:
        # 'none' is not an origin: it removes the loopback origins.
        origins = values["allowed_origins"]
        values["allowed_origins"] = tuple(o for o in origins if o.lower() != "none")
        if len(values["allowed_origins"]) < len(origins):
            values["allow_loopback_origins"] = False
            given["allow_loopback_origins"] = (False, given["allowed_origins"][1])

    secrets = [str(values[o.name]) for o in OPTIONS if o.secret and values.get(o.name)]

    def build(target: type) -> Any:
        names = set(_fields(target))
        kwargs = {name: values[name] for name in names if name in values}
        try:
            return target(**kwargs)
        except ConfigError as exc:
            message = _blame(target, exc, kwargs, given)
            # A message shows the bad value (house style); never a key's.
            for secret in secrets:
                message = message.replace(secret, "[redacted]")
            raise UsageError(message) from None

    cli = {o.name: values.get(o.name, o.default) for o in OPTIONS if o.target is None}
    return Settings(
        engine=build(EngineOptions),
        server=build(ServerConfig),
        log_level=cli["log_level"],
        log_format=cli["log_format"],
        sources={name: source for name, (_, source) in given.items()},
    )


def _blame(
    target: type,
    error: ConfigError,
    kwargs: dict[str, Any],
    given: dict[str, tuple[Any, str]],
) -> str:
    """The message of ``error``, prefixed with the option or variable whose
    value alone raises the same error (a check between two settings names
    neither)."""
    for name, value in kwargs.items():
        try:
            target(**{name: value})
        except ConfigError as alone:
            if str(alone) == str(error):
                source = given[name][1]
                return f"{'argument ' if source.startswith('--') else ''}{source}: {error}"
    return str(error)


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """``TRIOSERVE_*`` variables that are neither an option's nor known
    (a misspelt one would otherwise be ignored in silence)."""
    known = {option.env for option in OPTIONS} | OTHER_ENV
    return sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known)


# --- checks before anything slow ------------------------------------------------------

_DEVICE = re.compile(r"(?P<kind>[a-z]+)(?::(?P<index>\d+))?")


def device_problem(device: str, source: str = "--device") -> str | None:
    """Why the CPU engine cannot run on ``device``, or None when it can.

    The CPU engine runs on ``cpu`` and, where torch has CUDA, ``cuda[:N]``;
    ``meta`` and the rest would fail (or compute nothing) after the model
    loaded. torch is imported only for a device other than the CPU.
    """
    match = _DEVICE.fullmatch(device)
    if match is None or match["kind"] not in ("cpu", "cuda"):
        return f"{source} {device!r} cannot run the cpu engine: use cpu or cuda[:N]"
    if match["kind"] == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return f"{source} {device!r}: torch {torch.__version__} sees no CUDA device here"
    count = torch.cuda.device_count()
    if match["index"] is not None and int(match["index"]) >= count:
        return f"{source} {device!r}: torch sees {count} CUDA device(s), numbered from 0"
    return None


def model_problem(path: Path, source: str = "--model") -> str | None:
    """Why ``--model PATH`` is not a model, or None: a directory must hold
    config.json, tokenizer.json and *.safetensors; a file must be a .gguf."""
    from .engine.models import MODEL_DIR_CONTENTS, missing_model_files

    if path.is_dir():
        missing = missing_model_files(path)
        if not missing:
            return None
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; or pass the .gguf file itself: --model {ggufs[0]}" if ggufs else ""
        return (
            f"{source} {str(path)!r} lacks {', '.join(missing)}: a model directory holds "
            f"{MODEL_DIR_CONTENTS} (a Hugging Face Llama-family model){hint}"
        )
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return None
        return f"{source} {str(path)!r} is neither a model directory nor a .gguf file"
    return f"{source} {str(path)!r} does not exist"


# --- running ---------------------------------------------------------------------


async def load_and_serve(
    options: EngineOptions, config: ServerConfig, *, started: float | None = None
) -> None:
    """Load the engine on an engine thread, warm it up there, serve it until
    SIGINT or SIGTERM, and close it there: every torch (and CUDA) call of the
    model is made by that one thread."""
    async with open_engine_thread() as thread:
        with phase("load", f"loading the model (engine {options.engine})") as fields:
            engine = await thread.run_sync(load_engine, options)
            fields.update(engine=engine.info.engine, model=engine.info.model_name)
        try:
            warm_up = getattr(engine, "warm_up", None)
            if callable(warm_up):
                with phase("warm-up", "warming up the engine"):
                    await thread.run_sync(warm_up)
            await run_until_signalled(engine, config, started=started, engine_thread=thread)
        finally:
            with trio.CancelScope(shield=True):
                await thread.run_sync(engine.close)


async def run_until_signalled(
    engine: Engine,
    config: ServerConfig,
    *,
    started: float | None = None,
    engine_thread: EngineThread | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM: the first starts the graceful shutdown,
    a second one interrupts everything at once. ``started`` (a
    :func:`time.perf_counter` value) dates the process start for the log."""
    server = Server(engine, config, engine_thread=engine_thread)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            serve_scope = trio.CancelScope()

            async def run_server(*, task_status: trio.TaskStatus[Listening]) -> None:
                with serve_scope:
                    await server.run(task_status=task_status)
                nursery.cancel_scope.cancel()

            listening = await nursery.start(run_server)
            info = engine.info
            fields: dict[str, Any] = {
                "phase": "listen",
                "url": listening.url,
                "engine": info.engine,
                "model": info.model_name,
                "context_length": info.context_length,
                "max_batch": info.max_batch,
            }
            if started is not None:
                fields["startup_s"] = round(time.perf_counter() - started, 3)
            log.info("listening on %s", listening.url, extra={"fields": fields})
            # The one line on stdout: scripts wait for it and read the URL.
            print(
                f"trioserve {__version__} listening on {listening.url} "
                f"(engine {info.engine}, model {info.model_name}, "
                f"context {info.context_length}, batch {info.max_batch})",
                flush=True,
            )
            received = 0
            async for signum in signals:
                received += 1
                if received == 1:
                    log.info(
                        "%s: shutting down (up to %ss for running jobs; again to stop now)",
                        signal.Signals(signum).name,
                        config.shutdown_grace,
                    )
                    serve_scope.cancel()
                else:
                    log.info("%s: interrupting every job now", signal.Signals(signum).name)
                    server.abort()
    log.info("stopped")


def _unwrap(error: BaseException) -> BaseException:
    """The one error inside nested single-error groups (trio's nurseries wrap)."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def _cannot_listen(host: str, port: int) -> OSError | None:
    """Why ``host:port`` cannot be listened on now, or None.

    A pre-flight check, so that a busy port or an unknown host is reported
    before the model loads (seconds on a CPU, minutes for a large model on a
    GPU), not after. It binds the addresses the server will bind, with the same
    socket options as trio's listeners; a port taken between this check and
    the server's own bind is still reported, later.
    """
    if port == 0:
        return None
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return exc
    usable = False
    for family, type_, proto, _, address in addresses:
        try:
            sock = socket.socket(family, type_, proto)
        except OSError as exc:
            # A family this machine lacks (IPv6 off) is skipped, as trio does.
            if exc.errno == errno.EAFNOSUPPORT:
                continue
            return exc
        with sock:
            try:
                if sys.platform != "win32":
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
            except OSError as exc:
                return exc
        usable = True
    if not usable:
        return OSError(errno.EAFNOSUPPORT, "no usable address family")
    return None


def _prog() -> str:
    return "trioserve" if Path(sys.argv[0]).name == "trioserve" else "python -m trioserve"


def _fail(message: str, log_format: str) -> int:
    """Report a runtime failure in one line: plain on stderr, or as a JSON
    record when the log is JSON (so that a log shipper sees it too)."""
    if log_format == "json":
        log.error(message)
    else:
        print(f"trioserve: error: {message}", file=sys.stderr)
    return EXIT_FAILURE


def _obtain_model(options: EngineOptions) -> EngineOptions:
    """The startup phase that makes the model directory exist: the embedded
    model is downloaded and converted on first start, a .gguf file converted
    on first use. Returns the options with ``model`` a directory (or None,
    for the embedded model)."""
    from .engine.models import DEFAULT_MODEL_NAME, default_model_dir, gguf_model_dir

    model = options.model
    if model is None:
        with phase("model", f"obtaining the embedded model {DEFAULT_MODEL_NAME}") as fields:
            fields["path"] = str(default_model_dir(offline=options.offline))
        return options
    if model.is_file():
        with phase("model", f"obtaining a model directory from {model.name}") as fields:
            directory = gguf_model_dir(model)
            fields["path"] = str(directory)
        return attrs.evolve(options, model=directory)
    return options


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    parser = build_parser(_prog())
    args = parser.parse_args(argv)
    try:
        settings = resolve(args, os.environ)
        options = settings.engine
        problem = None
        if options.model is not None:
            problem = model_problem(options.model, settings.source("model"))
        if problem is None and options.engine != "exllamav2" and options.device != "cpu":
            problem = device_problem(options.device, settings.source("device"))
        if problem is not None:
            raise UsageError(problem)
    except UsageError as exc:
        parser.error(str(exc))
    configure_logging(settings.log_level, settings.log_format)
    for name in unknown_env(os.environ):
        log.warning("%s is not a trioserve setting: ignored (see --help)", name)
    server_config = settings.server
    unusable = _cannot_listen(server_config.host, server_config.port)
    if unusable is not None:
        reason = unusable.strerror or str(unusable)
        where = f"{server_config.host}:{server_config.port}"
        return _fail(f"cannot listen on {where}: {reason}", settings.log_format)
    try:
        options = _obtain_model(options)
    except TrioserveError as exc:
        return _fail(str(exc), settings.log_format)
    try:
        trio.run(functools.partial(load_and_serve, options, server_config, started=started))
    except BaseException as exc:
        # A model that cannot load, or the port taken between the check above
        # and the server's bind.
        error = _unwrap(exc)
        if isinstance(error, KeyboardInterrupt):
            # Ctrl-C before the server was up (while the model loaded).
            log.info("interrupted")
            return 130
        if not isinstance(error, TrioserveError):
            raise
        return _fail(str(error), settings.log_format)
    return 0
