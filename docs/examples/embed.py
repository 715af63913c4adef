"""Host trioserve inside a trio application.

The application owns the engine and runs the server as one task of its own
nursery, beside a task of its own (here, one that logs the server's
statistics). It loads the engine on an engine thread, which then steps it
for the server (torch is fastest, and CUDA correct, when one thread does all
of a model's work). It asks the server one question over a real WebSocket,
prints the answer as it streams, then cancels the nursery: the server shuts
down gracefully and the application closes the engine on its thread.

Run it with ``python docs/examples/embed.py``; ``tests/test_examples.py`` runs
it too, so this file keeps working.
"""

from __future__ import annotations

import logging

import trio

from trioserve import (
    Engine,
    EngineOptions,
    EngineThread,
    InferChunk,
    Server,
    ServerConfig,
    load_engine,
    open_client,
    open_engine_thread,
)

log = logging.getLogger("embed")

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


async def log_statistics(server: Server, every: float) -> None:
    """The application's own task: it runs beside the server until cancelled."""
    while True:
        stats = server.statistics()
        log.info(
            "connections %d, requests in flight %d, jobs running %d, served %d",
            stats.connections,
            stats.requests_in_flight,
            stats.scheduler.running,
            stats.scheduler.served,
        )
        await trio.sleep(every)


async def main() -> None:
    # Loading blocks for seconds (minutes for a large model on a GPU): it runs
    # on the engine thread, so the application's other tasks keep running.
    options = EngineOptions(engine="cpu", context_length=1024)
    async with open_engine_thread() as thread:
        engine = await thread.run_sync(load_engine, options)
        try:
            await serve_and_ask(engine, thread)
        finally:
            # The application loaded the engine, so it closes it, on its
            # thread, after the server that used it has returned.
            await thread.run_sync(engine.close)


async def serve_and_ask(engine: Engine, thread: EngineThread) -> None:
    """The server as one task of the application's nursery, beside its own."""
    server = Server(engine, ServerConfig(port=0, shutdown_grace=5.0), engine_thread=thread)
    async with trio.open_nursery() as nursery:
        # start() returns once the port is bound; port 0 picked a free one.
        listening = await nursery.start(server.run)
        log.info("serving on %s", listening.url)
        nursery.start_soon(log_statistics, server, 1.0)

        async with open_client(listening.url) as client:
            async with client.infer(PROMPT, 40, stream=True, temperature=0) as stream:
                async for message in stream:
                    if isinstance(message, InferChunk):
                        print(message.chunk, end="", flush=True)
            final = stream.final
        print()
        print(
            f"stop reason {final.stop_reason}, {final.usage.generated_tokens} tokens, "
            f"first token after {final.timing.first_token_s} s, total {final.timing.total_s} s"
        )
        stats = server.statistics()
        print(f"served {stats.scheduler.served}, failed {stats.scheduler.failed}")

        # Cancelling the nursery stops the statistics task at once and
        # starts the server's graceful shutdown: it stops taking work, gives
        # running jobs up to shutdown_grace seconds, closes its connections
        # and returns; only then does the nursery exit.
        nursery.cancel_scope.cancel()
    log.info("the server has shut down")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    trio.run(main)
