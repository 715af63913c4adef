"""``python -m trioserve``: options -> ServerConfig + EngineOptions -> engine -> serve.

Errors a user can fix (a bad option, a missing model, a busy port) are one
line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from ._version import __version__
from .engine import ENGINE_NAMES, EngineOptions, load_engine
from .engine.base import Engine
from .errors import ConfigError, ListenError, TrioserveError
from .server import Listening, Server, ServerConfig

__all__ = ["build_parser", "main"]

log = logging.getLogger("trioserve.cli")

EXIT_USAGE = 2
EXIT_FAILURE = 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def _gpu_split(text: str) -> tuple[float, ...]:
    try:
        parts = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected GB per GPU separated by commas (e.g. 20,24), got {text!r}"
        ) from None
    if not parts or any(part <= 0 for part in parts):
        raise argparse.ArgumentTypeError(f"expected positive GB per GPU, got {text!r}")
    return parts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trioserve",
        description=(
            "Serve a text-generation model over WebSocket with the ExLlamaV2 protocol. "
            "Without --model it serves the embedded SmolLM2-135M-Instruct on the CPU "
            "(obtained and converted on first start)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"trioserve {__version__}")
    net = parser.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: all)")
    net.add_argument("--port", type=_port, default=7862, help="port to bind (0: any free port)")
    net.add_argument(
        "--api-key",
        default=os.environ.get("TRIOSERVE_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' or '?api_key=KEY' at the handshake "
        "(default: $TRIOSERVE_API_KEY; none)",
    )
    net.add_argument(
        "--allowed-origin",
        action="append",
        dest="allowed_origins",
        metavar="ORIGIN",
        help=(
            "browser origin allowed to connect besides the loopback origins, repeatable; "
            "'*' allows any, 'none' removes the loopback default"
        ),
    )
    model = parser.add_argument_group("model and engine")
    model.add_argument(
        "--model",
        type=Path,
        default=None,
        help="Hugging Face Llama-family model directory (default: the embedded SmolLM2)",
    )
    model.add_argument(
        "--engine",
        choices=ENGINE_NAMES,
        default="auto",
        help="backend: exllamav2 on NVIDIA GPUs, cpu anywhere; auto picks exllamav2 when usable",
    )
    model.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="cpu engine: weight and activation dtype",
    )
    model.add_argument("--device", default="cpu", help="cpu engine: torch device")
    model.add_argument(
        "--threads", type=_positive_int, default=None, help="cpu engine: torch threads"
    )
    model.add_argument(
        "--context-length",
        type=_positive_int,
        default=None,
        help="lower the context length below the model's (saves memory)",
    )
    model.add_argument(
        "--max-batch",
        type=_positive_int,
        default=None,
        help="jobs generated together (default: 8 on cpu, 32 on exllamav2)",
    )
    model.add_argument(
        "--offline",
        action="store_true",
        help="never download the embedded model; fail with instructions instead",
    )
    exl = parser.add_argument_group("exllamav2 engine")
    exl.add_argument("--cache-type", choices=("fp16", "q4", "q6", "q8"), default="fp16")
    exl.add_argument(
        "--cache-size",
        type=_positive_int,
        default=None,
        help="cache size in tokens, a multiple of 256 (default: context length x batch)",
    )
    exl.add_argument(
        "--gpu-split",
        type=_gpu_split,
        default=None,
        help="GB of weights per GPU, e.g. 20,24 (default: autosplit)",
    )
    exl.add_argument(
        "--tensor-parallel", action="store_true", help="split every layer across the GPUs"
    )
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-message-bytes",
        type=_positive_int,
        default=None,
        help=(
            "largest frame or HTTP body accepted, in bytes; a larger frame closes the "
            "connection with 1009 (default: 16 bytes per token of context, at least 256 KiB)"
        ),
    )
    limits.add_argument(
        "--max-requests-per-connection",
        type=_positive_int,
        default=32,
        help="infer requests in flight per connection",
    )
    limits.add_argument(
        "--max-waiting-jobs",
        type=_positive_int,
        default=256,
        help="jobs waiting for the engine, all connections",
    )
    limits.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=None,
        help="upper bound of max_new_tokens (default: context length - 1)",
    )
    limits.add_argument("--ping-interval", type=_seconds, default=20.0, help="keepalive ping")
    limits.add_argument(
        "--ping-timeout", type=_seconds, default=20.0, help="close a peer that does not answer"
    )
    limits.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="seconds running jobs may finish after SIGINT/SIGTERM",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="log verbosity",
    )
    return parser


def _configs(args: argparse.Namespace) -> tuple[EngineOptions, ServerConfig]:
    engine = EngineOptions(
        engine=args.engine,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        context_length=args.context_length,
        max_batch=args.max_batch,
        offline=args.offline,
        threads=args.threads,
        cache_type=args.cache_type,
        cache_size=args.cache_size,
        gpu_split=args.gpu_split,
        tensor_parallel=args.tensor_parallel,
    )
    server = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        allowed_origins=tuple(o for o in args.allowed_origins or () if o.lower() != "none"),
        allow_loopback_origins=not any(o.lower() == "none" for o in args.allowed_origins or ()),
        max_message_bytes=args.max_message_bytes,
        max_requests_per_connection=args.max_requests_per_connection,
        max_waiting_jobs=args.max_waiting_jobs,
        max_new_tokens=args.max_new_tokens,
        ping_interval=args.ping_interval,
        ping_timeout=args.ping_timeout,
        shutdown_grace=args.shutdown_grace,
    )
    return engine, server


async def run_until_signalled(engine: Engine, config: ServerConfig) -> None:
    """Serve until SIGINT or SIGTERM: the first starts the graceful shutdown,
    a second one interrupts everything at once."""
    server = Server(engine, config)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            serve_scope = trio.CancelScope()

            async def run_server(*, task_status: trio.TaskStatus[Listening]) -> None:
                with serve_scope:
                    await server.run(task_status=task_status)
                nursery.cancel_scope.cancel()

            listening = await nursery.start(run_server)
            info = engine.info
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


def _listen_error(config: ServerConfig, error: OSError) -> None:
    reason = error.strerror or str(error)
    print(
        f"trioserve: error: cannot listen on {config.host}:{config.port}: {reason}", file=sys.stderr
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        engine_options, server_config = _configs(args)
    except ConfigError as exc:
        parser.error(str(exc))
    unusable = _cannot_listen(server_config.host, server_config.port)
    if unusable is not None:
        _listen_error(server_config, unusable)
        return EXIT_FAILURE
    try:
        engine = load_engine(engine_options)
    except TrioserveError as exc:
        print(f"trioserve: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    try:
        trio.run(run_until_signalled, engine, server_config)
    except BaseException as exc:
        # The port was taken between the check above and the server's bind.
        error = _unwrap(exc)
        if not isinstance(error, ListenError):
            raise
        print(f"trioserve: error: {error}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        engine.close()
    return 0
