"""``python -m tests.fuzz``: fuzz a trioserve server (``nox -s fuzz`` runs this).

By default it starts ``python -m trioserve`` on the embedded model with a
small context (fast prefills) and sends 100,000 fuzzed frames while a
bystander streams; ``--url`` fuzzes a server that is already running instead.
It prints the report and exits 1 if any frame was not answered exactly once,
the bystander failed, the server logged an error, or the server died.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import trio  # noqa: E402

from tests.fuzz.http import HttpFuzzReport, run_http_fuzz  # noqa: E402
from tests.fuzz.run import FuzzReport, run_fuzz, urllib_split  # noqa: E402
from tests.serverproc import open_server_process  # noqa: E402

#: The bystander's request: a chat turn, 12 greedy tokens with EOS banned.
BYSTANDER_PROMPT = (
    "<|im_start|>user\nTell me a long story about a dragon.<|im_end|>\n<|im_start|>assistant\n"
)


def bystander_frame(serial: int) -> dict[str, Any]:
    return {
        "action": "infer",
        "text": BYSTANDER_PROMPT,
        "max_new_tokens": 12,
        "stream": True,
        "temperature": 0,
        "bann_bann": [2],
    }


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--frames", type=int, default=100_000, help="fuzzed frames to send")
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock")
    parser.add_argument("--connections", type=int, default=8, help="JSON-level connections")
    parser.add_argument("--ws-connections", type=int, default=8, help="byte-level connections")
    parser.add_argument(
        "--ws-share", type=float, default=0.03, help="share of frames malformed at the byte level"
    )
    parser.add_argument(
        "--http-requests",
        type=int,
        default=5000,
        help="fuzzed OpenAI request bodies to send after the frames (tests/fuzz/http.py)",
    )
    parser.add_argument("--url", help="fuzz this running server instead of starting one")
    parser.add_argument("--context-length", type=int, default=256)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="one more argument for python -m trioserve (repeatable)",
    )
    return parser.parse_args(argv)


async def fuzz_http(args: argparse.Namespace, seed: int, url: str) -> HttpFuzzReport:
    host, port = urllib_split(url)
    report = await run_http_fuzz(host, port, requests=args.http_requests, seed=seed)
    say(report.format())
    return report


async def fuzz(args: argparse.Namespace, seed: int) -> tuple[FuzzReport, list[str], str]:
    """The report, the server's error lines, and how the server ended."""
    options: dict[str, Any] = {
        "frames": args.frames,
        "seed": seed,
        "connections": args.connections,
        "ws_connections": args.ws_connections,
        "ws_share": args.ws_share,
        "bystander_frame": bystander_frame,
        "say": say,
    }
    if args.url:
        report = await run_fuzz(args.url, **options)
        if not (await fuzz_http(args, seed, args.url)).ok:
            report.fail("the OpenAI door failed fuzzed bodies (above)")
        return report, [], "not started here"
    server_args = [
        "--context-length",
        str(args.context_length),
        "--max-batch",
        str(args.max_batch),
        # A body without max_tokens generates at most this many.
        "--max-new-tokens",
        "16",
        *args.server_arg,
    ]
    async with open_server_process(server_args) as server:
        say(f"server pid {server.pid} at {server.url}, rss {server.rss_bytes() / 2**20:.0f} MiB")
        report = await run_fuzz(server.url, **options)
        if not (await fuzz_http(args, seed, server.url)).ok:
            report.fail("the OpenAI door failed fuzzed bodies (above)")
        alive = server.alive
        rss = server.rss_bytes() if alive else 0
    ending = (
        f"alive at the end (rss {rss / 2**20:.0f} MiB), exit status {server.returncode} "
        "after SIGINT"
        if alive
        else f"DIED during the run (exit status {server.returncode})"
    )
    errors = server.error_reports()
    if not alive or server.returncode != 0:
        errors.append(f"the server ended with status {server.returncode}")
    return report, errors, ending


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    say(f"fuzzing with seed {seed}, {args.frames} frames; load average {load}")
    report, errors, ending = trio.run(fuzz, args, seed)
    print(report.format())
    print(f"server: {ending}; {len(errors)} error lines in its log")
    for line in errors[:20]:
        print(f"  {line}")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    ok = report.ok and not errors and report.total_frames >= args.frames
    print("RESULT: " + ("pass" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
