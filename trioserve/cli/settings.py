"""The command line and the environment -> :class:`Settings`: the argparse
parser built from :data:`~.options.OPTIONS`, and the merge of the command
line, the environment and the defaults (the command line wins over the
environment, which wins over the default), with messages that name the
option or the variable a bad value came from.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from .._version import __version__
from ..engine import EngineOptions
from ..errors import ConfigError
from ..server import ServerConfig
from .options import ENV_PREFIX, GROUPS, OPTIONS, OTHER_ENV, Option, target_fields

__all__ = ["Settings", "UsageError", "build_parser", "resolve", "unknown_env"]


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
            "are kept; '%(prog)s cache list' shows what it holds and '%(prog)s cache clean' "
            "empties it. See docs/deployment.md."
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
        names = set(target_fields(target))
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
