"""Run the benchmarks and print Markdown tables for docs/performance.md.

``nox -s bench`` calls this as ``python tests/bench/run.py [args]``. The engine
bench (engine alone) and the server bench (engine behind the WebSocket server)
run one after the other in this one process, on the machine described at the
top of the output. Progress goes to stderr, the tables to stdout.

    python tests/bench/run.py                  # everything, full scale (< ~10 min)
    python tests/bench/run.py --quick          # smaller server scale (~2-3 min)
    python tests/bench/run.py --only server    # one part
    python tests/bench/run.py --only hostile   # the hostile-client bench (docs/reliability.md)
    python tests/bench/run.py --only constraints  # structured output's cost (docs/performance.md)
    python tests/bench/run.py --only choices   # n choices against n requests (docs/performance.md)
    python tests/bench/run.py --only speculative  # drafts by prompt lookup against plain decoding
    python tests/bench/run.py --only fairness  # one client's 8 streams; a newcomer beside a flood
    python tests/bench/run.py --only doors     # /v1/responses, /v1/messages against chat
    python tests/bench/run.py --only llama-server  # trioserve against llama.cpp's llama-server
    python tests/bench/run.py --only gateway   # nginx's least_conn against SGLang's gateway
    python tests/bench/run.py --only models    # switching models, a load beside another model

The gateway part runs only when named: it starts nginx (installing Debian's with apt,
as root, when it is missing) and needs sglang-router (``pip install -e '.[gateway]'``,
or ``SGLANG_ROUTER_PYTHON`` naming a Python that has it); ``--quick`` makes it one small
round (about 3 minutes on two cores), the full one three rounds (about 13).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Run as a script, this file's directory is on sys.path, not the repository's;
# the benches import `trioserve` and `tests.*` from the checkout.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import attrs  # noqa: E402
import torch  # noqa: E402
import trio  # noqa: E402

from tests.bench import (  # noqa: E402
    choices_bench,
    constraint_bench,
    doors_bench,
    engine_bench,
    fairness_bench,
    gateway_bench,
    hostile_bench,
    models_bench,
    server_bench,
    server_vs_llama,
)
from trioserve.engine.cpu.engine import CpuEngine  # noqa: E402
from trioserve.engine.cpu.options import DTYPE_NAMES  # noqa: E402
from trioserve.engine.models import default_model_dir  # noqa: E402
from trioserve.generation.engine_thread import open_engine_thread  # noqa: E402

PARTS = (
    "engine",
    "server",
    "hostile",
    "constraints",
    "choices",
    "speculative",
    "fairness",
    "doors",
    "llama-server",
    "gateway",
    "models",
)
#: What runs without --only: everything but the parts that install and start other
#: servers' software (the gateway bench: nginx and sglang-router).
DEFAULT_PARTS = tuple(part for part in PARTS if part != "gateway")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def machine(dtype: str) -> str:
    """The machine and settings the numbers belong to, as a Markdown list."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return "\n".join(
        [
            f"- CPU: {cpu_model()}, nproc {usable}, memory {memory_total()}",
            f"- torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {dtype}",
            f"- Python {platform.python_version()}, {platform.system()} {platform.release()}",
            f"- load average at start (1/5/15 min): {load_average()}",
        ]
    )


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run trioserve's benchmarks and print Markdown tables."
    )
    parser.add_argument(
        "--only", choices=PARTS, action="append", help="run only this part (repeatable)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smaller server scale: fewer rounds, tokens, trials"
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the 1,000 idle connections measurement"
    )
    parser.add_argument(
        "--dtype", choices=DTYPE_NAMES, default="bfloat16", help="the server bench's dtype"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument(
        "--attack",
        choices=list(hostile_bench.ATTACKS),
        action="append",
        help="hostile bench: run only this attack (repeatable)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="hostile bench: one more argument for its python -m trioserve (repeatable)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    parts = args.only or list(DEFAULT_PARTS)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    begun = time.perf_counter()
    # Obtain and convert the model before anything is timed.
    default_model_dir()
    print("## Machine\n")
    print(machine(args.dtype))
    if "engine" in parts:
        say("engine bench")
        results: list[dict[str, Any]] = []
        engine_bench.run(results, say=say)
        print("\n## Engine\n")
        print(engine_bench.markdown(results))
    if "server" in parts:
        scale = server_bench.QUICK if args.quick else server_bench.FULL
        say(f"server bench ({'quick' if args.quick else 'full'} scale)")
        max_batch = max(32, *scale.aggregate_clients)

        async def server_part() -> server_bench.ServerResults:
            # Loaded, stepped and closed on one thread, as the CLI does.
            async with open_engine_thread() as thread:
                engine = await thread.run_sync(
                    lambda: CpuEngine.load(None, dtype=args.dtype, max_batch=max_batch)
                )
                try:
                    return await server_bench.run_server_bench(
                        engine, scale, engine_thread=thread, memory=not args.no_memory, say=say
                    )
                finally:
                    await thread.run_sync(engine.close)

        server_results = trio.run(server_part)
        print("\n## Server\n")
        print(server_bench.format_server_tables(server_results))
    if "hostile" in parts:
        hostile_scale = hostile_bench.QUICK if args.quick else hostile_bench.FULL
        say(f"hostile bench ({'quick' if args.quick else 'full'} scale)")
        hostile_results = trio.run(
            lambda: hostile_bench.run_hostile_bench(
                hostile_scale, only=args.attack, server_args=args.server_arg, say=say
            )
        )
        print("\n## Hostile clients\n")
        print(hostile_bench.format_hostile_table(hostile_results))
    if "constraints" in parts:
        say("constraint bench")
        constraint_results: list[dict[str, Any]] = []
        constraint_bench.run(constraint_results, say=say)
        print("\n## Structured output\n")
        print(constraint_bench.markdown(constraint_results))
    if "choices" in parts:
        say("choices bench")
        choice_results: list[dict[str, Any]] = []
        choices_bench.run(choice_results, say=say)
        print("\n## Several choices\n")
        print(choices_bench.markdown(choice_results))
    if "speculative" in parts:
        say("speculative bench")
        speculative_results: list[dict[str, Any]] = []
        engine_bench.run_speculative(
            speculative_results, say=say, rounds=3 if args.quick else engine_bench.ROUNDS
        )
        print("\n## Speculative decoding\n")
        print(engine_bench.markdown(speculative_results, "speculative"))
    if "fairness" in parts:
        say("fairness bench: the default flags against the caps")
        fairness: list[dict[str, Any]] = []
        fairness_bench.run(fairness, say=say, rounds=3 if args.quick else fairness_bench.ROUNDS)
        print("\n## Fairness that uses the whole machine\n")
        print(fairness_bench.markdown(fairness))
    if "doors" in parts:
        say("the API doors: /v1/responses and /v1/messages against /v1/chat/completions")
        doors = trio.run(
            lambda: doors_bench.run_doors_bench(rounds=3 if args.quick else 7, tokens=128, say=say)
        )
        print("\n## The API doors\n")
        doors = attrs.evolve(doors, store=doors_bench.measure_store())
        print(doors_bench.format_doors_table(doors))
    if "llama-server" in parts:
        say("trioserve against llama-server (skipped, saying why, without the binary)")
        versus: list[dict[str, Any]] = []
        server_vs_llama.run(versus, say=say)
        print("\n## Against llama-server\n")
        print(server_vs_llama.markdown(versus))
    if "gateway" in parts:
        gateway_scale = gateway_bench.QUICK if args.quick else gateway_bench.FULL
        say(f"gateway bench ({'quick' if args.quick else 'full'} scale)")
        gateway = gateway_bench.run(gateway_scale, say=say, threads=args.threads)
        print("\n## Replicas behind SGLang's Model Gateway\n")
        print(gateway_bench.format_gateway_table(gateway))
    if "models" in parts:
        say("models bench: switching, a load beside another model, memory")
        models_results: list[dict[str, Any]] = []
        models_bench.run(models_results, say=say, rounds=1 if args.quick else models_bench.ROUNDS)
        print("\n## Several models on one server\n")
        print(models_bench.markdown(models_results))
    total = time.perf_counter() - begun
    print(f"\nLoad average at the end: {load_average()}; total {total:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
