"""Starting the server: the checks made before anything slow (the model
path, the device, the port), obtaining the model, loading the engine on its
thread, serving until SIGINT or SIGTERM, and :func:`main`, which turns what
can go wrong into one line and an exit status.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from .._version import __version__
from ..engine import EngineOptions, load_engine
from ..engine.base import Engine
from ..errors import TrioserveError
from ..generation import EngineThread
from ..generation.engine_thread import open_loaded_engine
from ..logs import configure_logging, phase
from ..server import Listening, Server, ServerConfig
from .settings import UsageError, build_parser, resolve, unknown_env

__all__ = ["device_problem", "load_and_serve", "main", "model_problem", "run_until_signalled"]

log = logging.getLogger("trioserve.cli")

EXIT_USAGE = 2
EXIT_FAILURE = 1


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
    from ..engine.models import MODEL_DIR_CONTENTS, missing_model_files

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
    async with contextlib.AsyncExitStack() as stack:
        with phase("load", f"loading the model (engine {options.engine})") as fields:
            engine, thread = await stack.enter_async_context(
                open_loaded_engine(functools.partial(load_engine, options))
            )
            fields.update(engine=engine.info.engine, model=engine.info.model_name)
        warm_up = getattr(engine, "warm_up", None)
        if callable(warm_up):
            with phase("warm-up", "warming up the engine"):
                await thread.run_sync(warm_up)
        await run_until_signalled(engine, config, started=started, engine_thread=thread)


async def serve_models_dir(
    options: EngineOptions, config: ServerConfig, *, started: float | None = None
) -> None:
    """Serve ``--models-dir``'s models, each loaded on demand on a thread of
    its own, until SIGINT or SIGTERM."""
    from ..engine.catalog import Catalog
    from ..server.models import Models, ModelSlot
    from ..server.server import model_settings

    assert options.models_dir is not None
    with phase("models", f"reading the models in {options.models_dir}") as fields:
        catalog = Catalog.scan(options.models_dir, options.models_preset, base=options)
        fields.update(models=list(catalog.ids))
    base = attrs.evolve(options, models_dir=None, models_preset=None)
    if any(entry.options.get("engine", options.engine) != "exllamav2" for entry in catalog.entries):
        # Imported now, once: an import holds the GIL for long stretches,
        # which a model's first load would take from the models serving.
        with phase("import", "importing the cpu engine (torch)"):
            import trioserve.engine.cpu.engine  # noqa: F401

    def loader_of(slot: ModelSlot) -> Callable[[], Engine]:
        assert slot.entry is not None
        return functools.partial(_load_entry, slot.entry.engine_options(base))

    models = Models.from_catalog(
        catalog,
        loader_of,
        model_settings(config),
        max_loaded=config.models_max,
        autoload=config.models_autoload,
        unload_timeout=config.unload_timeout,
        sleep_idle_s=config.sleep_idle_seconds,
    )
    await run_until_signalled(None, config, started=started, models=models)


def _load_entry(options: EngineOptions) -> Engine:
    """Load one model of a folder (on its engine thread): a GGUF file is
    converted once into the cache first; then the engine warms up."""
    from ..engine.models import gguf_model_dir
    from ..engine.progress import span

    # The load's progress (GET /models): a conversion, the weights, a warm-up.
    if options.model is not None and options.model.is_file():
        with span(0.0, 0.1):
            options = attrs.evolve(options, model=gguf_model_dir(options.model))
    with span(0.1, 0.9):
        engine = load_engine(options)
    warm_up = getattr(engine, "warm_up", None)
    if callable(warm_up):
        with span(0.9, 1.0):
            warm_up()
    return engine


async def run_until_signalled(
    engine: Engine | None,
    config: ServerConfig,
    *,
    started: float | None = None,
    engine_thread: EngineThread | None = None,
    models: Any = None,
) -> None:
    """Serve until SIGINT or SIGTERM: the first starts the graceful shutdown,
    a second one interrupts everything at once. ``started`` (a
    :func:`time.perf_counter` value) dates the process start for the log."""
    server = Server(engine, config, engine_thread=engine_thread, models=models)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            serve_scope = trio.CancelScope()

            async def run_server(*, task_status: trio.TaskStatus[Listening]) -> None:
                with serve_scope:
                    await server.run(task_status=task_status)
                nursery.cancel_scope.cancel()

            listening = await nursery.start(run_server)
            fields: dict[str, Any] = {"phase": "listen", "url": listening.url}
            if engine is not None:
                info = engine.info
                fields.update(
                    engine=info.engine,
                    model=info.model_name,
                    context_length=info.context_length,
                    max_batch=info.max_batch,
                )
                serving = (
                    f"engine {info.engine}, model {info.model_name}, "
                    f"context {info.context_length}, batch {info.max_batch}"
                )
            else:
                ids = list(server.models.slots)
                fields.update(models=ids)
                serving = f"models {', '.join(ids)}, loaded on demand"
            if started is not None:
                fields["startup_s"] = round(time.perf_counter() - started, 3)
            log.info("listening on %s", listening.url, extra={"fields": fields})
            # The one line on stdout: scripts wait for it and read the URL.
            print(f"trioserve {__version__} listening on {listening.url} ({serving})", flush=True)
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
    record when the log is JSON (so that a log shipper sees it too). The
    prefix is argparse's for a usage error (``python -m trioserve: error:``,
    or ``trioserve: error:`` from the console script): every error a start
    can end with begins the same way."""
    if log_format == "json":
        log.error(message)
    else:
        print(f"{_prog()}: error: {message}", file=sys.stderr)
    return EXIT_FAILURE


def _obtain_model(options: EngineOptions) -> EngineOptions:
    """The startup phase that makes the model directory exist: the embedded
    model is downloaded and converted on first start, a .gguf file converted
    on first use. Returns the options with ``model`` a directory (or None,
    for the embedded model)."""
    from ..engine.models import DEFAULT_MODEL_NAME, default_model_dir, gguf_model_dir

    model = options.model
    if model is None:
        with phase("model", f"obtaining the embedded model {DEFAULT_MODEL_NAME}") as fields:
            fields["path"] = str(default_model_dir(offline=options.offline))
    elif model.is_file():
        with phase("model", f"obtaining a model directory from {model.name}") as fields:
            directory = gguf_model_dir(model)
            fields["path"] = str(directory)
        options = attrs.evolve(options, model=directory)
    else:
        return options
    _log_cache()
    return options


def _log_cache() -> None:
    """The cache's size, and how to see and empty it, once it was used."""
    from ..engine.models import cache_entries, cache_root

    root = cache_root()
    size = sum(entry.size for entry in cache_entries(root))
    log.info(
        "model cache %s: %.1f MiB (%s cache list | clean)",
        root,
        size / 2**20,
        _prog(),
        extra={"fields": {"cache": str(root), "cache_bytes": size}},
    )


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    arguments = sys.argv[1:] if argv is None else list(argv)
    if arguments[:1] == ["cache"]:
        from .cache import cache_main

        return cache_main(arguments[1:], _prog())
    parser = build_parser(_prog())
    args = parser.parse_args(arguments)
    try:
        settings = resolve(args, os.environ)
        options = settings.engine
        problem = None
        if options.models_dir is not None and options.model is not None:
            problem = (
                f"{settings.source('model')} and {settings.source('models_dir')}: give one model "
                "or a folder of models, not both"
            )
        elif options.models_preset is not None and options.models_dir is None:
            problem = f"{settings.source('models_preset')} needs --models-dir"
        elif options.model is not None:
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
    if options.models_dir is not None:
        run = functools.partial(serve_models_dir, options, server_config, started=started)
    else:
        try:
            options = _obtain_model(options)
        except TrioserveError as exc:
            return _fail(str(exc), settings.log_format)
        run = functools.partial(load_and_serve, options, server_config, started=started)
    try:
        trio.run(run)
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
