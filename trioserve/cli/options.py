"""The option table: every option of ``python -m trioserve`` is a row of
:data:`OPTIONS`, and an :class:`Option` gives its flag, its environment
variable, its default, its parser and its help from the attrs field it sets.
"""

from __future__ import annotations

import argparse
import functools
import math
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Literal

import attrs

from ..engine import SPECULATIVE_MODES, VOCAB_PROJECTIONS, EngineOptions
from ..engine.cpu.options import CPU_KERNELS, DTYPE_NAMES, KV_CACHE_DTYPES, WEIGHT_MODES
from ..logs import LOG_FORMATS, LOG_LEVELS
from ..server import ServerConfig

__all__ = [
    "ENV_PREFIX",
    "GROUPS",
    "NOT_OPTIONS",
    "OPTIONS",
    "OTHER_ENV",
    "Option",
    "env_name",
    "target_fields",
]

ENV_PREFIX: Final = "TRIOSERVE_"
#: Environment variables of trioserve that are not options (they are read
#: elsewhere), so that they are not reported as unknown.
OTHER_ENV: Final = frozenset({"TRIOSERVE_CACHE", "TRIOSERVE_NATIVE", "TRIOSERVE_TORCH"})

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
        return target_fields(self.target)[self.name]

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
def target_fields(cls: type) -> dict[str, attrs.Attribute[Any]]:
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
        "admin_key",
        NET,
        "with --models-dir: loading and unloading models also needs 'X-Admin-Key: KEY'",
        S,
        metavar="KEY",
        secret=True,
    ),
    Option(
        "public_metrics",
        NET,
        "serve /metrics without the API key (for a scraper or an endpoint picker that sends "
        "none); it shows counts and timings, never prompts or keys",
        S,
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
        "models_dir",
        MODEL,
        "serve every model in this folder by name, loaded on demand (docs/models.md)",
        E,
        metavar="DIR",
        shown_default="none: one model, --model",
    ),
    Option("models_preset", MODEL, "per-model options for --models-dir (TOML)", E, metavar="FILE"),
    Option(
        "models_max",
        MODEL,
        "with --models-dir: at most N models loaded; one more unloads the least recently used",
        S,
        metavar="N",
        shown_default="no bound",
    ),
    Option("models_autoload", MODEL, "with --models-dir: a request loads its model", S),
    Option(
        "unload_timeout",
        MODEL,
        "seconds an unloading model's requests may take to finish before they end",
        S,
        metavar="SECONDS",
    ),
    Option(
        "sleep_idle_seconds",
        MODEL,
        "with --models-dir: unload a model idle this long, until its next request",
        S,
        metavar="SECONDS",
        shown_default="never",
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
        choices=DTYPE_NAMES,
    ),
    Option("device", MODEL, "cpu engine: torch device, cpu or cuda[:N]", E, metavar="DEVICE"),
    Option(
        "tool_call_format",
        MODEL,
        "how the model writes tool calls: auto (from its chat template; Hermes when the template"
        " has no tools), hermes, llama3 or mistral",
        S,
        choices=("auto", "hermes", "llama3", "mistral"),
    ),
    Option(
        "chat_template",
        MODEL,
        "a Jinja chat template file to use instead of the model's own (its special tokens kept)",
        S,
        metavar="FILE",
        shown_default="the model's",
    ),
    Option(
        "reasoning_format",
        MODEL,
        "a thinking chat template's reasoning (<think> ... </think> and the like): auto keeps it"
        " apart from the answer (reasoning_content, reasoning items, thinking blocks), none"
        " leaves it in the answer",
        S,
        choices=("auto", "none"),
    ),
    Option(
        "reasoning_budget",
        MODEL,
        "at most this many tokens of a thinking template's reasoning per reply, then its section"
        " is closed and the answer follows (a request's own budget, when lower, wins)",
        S,
        metavar="TOKENS",
        shown_default="no bound",
    ),
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
        "vocab_projection",
        MODEL,
        "cpu engine: what the last matmul (hidden state to logits) runs on: auto (int8 when the "
        "linear layers are quantized, else bfloat16), bfloat16, or int8 (half the bytes; the "
        "candidates near the best are recomputed in float32, so greedy text is unchanged)",
        E,
        choices=VOCAB_PROJECTIONS,
    ),
    Option(
        "cpu_kernels",
        MODEL,
        "cpu engine: the kernel 4-bit layers run on: auto (trioserve's own where it builds "
        "with the machine's C compiler and passes its check: activations in 8 bits per group "
        "of 32 and integer dot products with AVX-512 VNNI, as llama.cpp; else torch's), "
        "native (trioserve's, or an error saying why not) or torch",
        E,
        choices=CPU_KERNELS,
    ),
    Option(
        "kv_cache_dtype",
        MODEL,
        "what the KV cache stores: auto (the model's dtype; exllamav2: as --cache-type) or "
        "int8 (8 bits and a scale per head and position: about half the memory for the "
        "running requests and the prefix cache, slower decoding; exllamav2: its Q8 cache "
        "where --cache-type is fp16)",
        E,
        choices=KV_CACHE_DTYPES,
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
        "speculative",
        MODEL,
        "cpu engine: speculative decoding: ngram feeds each stream up to --draft-tokens tokens "
        "looked up in its own prompt and output and keeps those the model agrees with, several "
        "tokens a step when the answer copies its prompt (code edits, quotes); the text is the "
        "same either way",
        E,
        choices=SPECULATIVE_MODES,
    ),
    Option(
        "draft_tokens",
        MODEL,
        "cpu engine: with --speculative ngram, the tokens drafted per stream and step, at most",
        E,
        _positive_int,
        "N",
    ),
    Option(
        "threads",
        MODEL,
        "cpu engine: torch threads (one per physical core is best; where other processes "
        "keep cores busy, fewer: every step waits for its slowest thread, and the log says "
        "so at startup)",
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
        "max_n",
        LIMITS,
        "choices one OpenAI request may ask for (n); each is a generation of its client and"
        " counts against the client's request limit, which caps n too when lower",
        S,
        metavar="N",
    ),
    Option(
        "responses_store_mib",
        LIMITS,
        "MiB the stored responses of /v1/responses may take (for previous_response_id, GET and"
        " DELETE); over it, the least recently used response of the client holding the most goes;"
        " 0 stores none",
        S,
        metavar="MIB",
    ),
    Option(
        "responses_ttl",
        LIMITS,
        "seconds a stored response is kept after its last use",
        S,
        metavar="SECONDS",
    ),
    Option(
        "max_running_per_client",
        LIMITS,
        "engine slots one client may hold while others wait",
        S,
        metavar="N",
        shown_default="every slot on the CPU engine (a newcomer's job pauses the biggest holder's"
        " newest), all but one on ExLlamaV2",
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
