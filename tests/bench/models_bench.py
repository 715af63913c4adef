"""Several models on one server (docs/models.md), measured through the CLI.

A folder holds two ids of the embedded model (hard links of its converted
directory). Per round, alternating which side goes first where there are two:

* **switch**: ``--models-max 1`` with ``a`` loaded; ``POST /models/load b``
  until ``b`` is loaded (``a``'s drain and unload, then ``b``'s load),
  against a cold ``python -m trioserve --model DIR`` from exec to listening;
* **another model while one loads**: ``a`` streams 128-token greedy
  completions while ``b`` is loaded and unloaded in a loop, against ``a``
  alone; and a WebSocket ``echo`` every 20 ms on another connection, its
  round trip's p99, in both phases;
* **memory**: the server's RSS after a first load/unload of ``b`` (which
  imports torch, once per process) and after each of 20 more cycles.

``python -m tests.bench.models_bench`` (or ``python tests/bench/run.py --only models``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 3
TOKENS = 128
CYCLES = 20


def _folder(where: Path) -> Path:
    from trioserve.engine.models import default_model_dir

    source = default_model_dir()
    root = where / "models"
    root.mkdir()
    for name in ("a", "b"):
        try:
            shutil.copytree(source, root / name, copy_function=os.link)
        except OSError:
            shutil.copytree(source, root / name)
    return root


@contextmanager
def _server(*args: str) -> Iterator[tuple[subprocess.Popen[str], int, float]]:
    """``python -m trioserve --port 0 ARGS``; yields it, its port and the
    seconds from exec to its listening line."""
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "trioserve", "--port", "0", "--threads", "1", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        elapsed = time.perf_counter() - started
        port = int(line.split("listening on ws://127.0.0.1:")[1].split("/")[0])
        yield process, port, elapsed
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def _post(port: int, path: str, body: Any) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)


def _status(port: int, model: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/models", timeout=30) as reply:
        models = {m["id"]: m for m in json.load(reply)["data"]}
    return str(models[model]["status"]["value"])


def _until(port: int, model: str, status: str) -> None:
    deadline = time.perf_counter() + 120
    while _status(port, model) != status:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{model} never became {status}")
        time.sleep(0.01)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _stream_tok_s(port: int, model: str) -> float:
    """One streamed greedy completion of TOKENS tokens: its tokens per second
    from the first to the last."""
    body = {
        "model": model,
        "prompt": "Tell me a long story about a lighthouse.",
        "max_tokens": TOKENS,
        "min_tokens": TOKENS,
        "temperature": 0,
        "stream": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(), method="POST"
    )
    times: list[float] = []
    with urllib.request.urlopen(request, timeout=300) as reply:
        for raw in reply:
            if raw.startswith(b"data: {"):
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def _echoes(port: int, stop: threading.Event, out: list[float]) -> None:
    import websockets.sync.client

    with websockets.sync.client.connect(f"ws://127.0.0.1:{port}/") as ws:
        while not stop.is_set():
            sent = time.perf_counter()
            ws.send('{"action":"echo"}')
            ws.recv()
            out.append(time.perf_counter() - sent)
            time.sleep(0.02)


def _p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _phase(port: int, loading: bool) -> tuple[float, float]:
    """``a``'s tokens/s and the echo p99 (s), while ``b`` loads and unloads
    in a loop (``loading``) or alone."""
    stop = threading.Event()
    echoes: list[float] = []
    threads = [threading.Thread(target=_echoes, args=(port, stop, echoes))]
    if loading:

        def churn() -> None:
            while not stop.is_set():
                _post(port, "/models/load", {"model": "b"})
                _until(port, "b", "loaded")
                _post(port, "/models/unload", {"model": "b"})
                _until(port, "b", "unloaded")

        threads.append(threading.Thread(target=churn))
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)
        rates = [_stream_tok_s(port, "a") for _ in range(2)]
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    return statistics.median(rates), _p99(echoes)


def run(results: list[dict[str, Any]], *, say: Callable[[str], None], rounds: int = ROUNDS) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = _folder(Path(tmp))
        for index in range(rounds):
            row: dict[str, Any] = {"round": index + 1}
            say(f"models bench round {index + 1}: switch and cold start")
            sides = ["cold", "switch"] if index % 2 == 0 else ["switch", "cold"]
            for side in sides:
                if side == "cold":
                    with _server("--model", str(root / "a")) as (_, _, elapsed):
                        row["cold_s"] = elapsed
                else:
                    with _server("--models-dir", str(root), "--models-max", "1") as (_, port, _):
                        _post(port, "/models/load", {"model": "a"})
                        _until(port, "a", "loaded")
                        begun = time.perf_counter()
                        _post(port, "/models/load", {"model": "b"})
                        _until(port, "b", "loaded")
                        row["switch_s"] = time.perf_counter() - begun
            say(f"models bench round {index + 1}: another model while one loads")
            with _server("--models-dir", str(root), "--models-max", "2") as (_, port, _):
                _post(port, "/models/load", {"model": "a"})
                _until(port, "a", "loaded")
                _stream_tok_s(port, "a")  # warm
                for loading in (False, True) if index % 2 == 0 else (True, False):
                    rate, p99 = _phase(port, loading)
                    key = "during" if loading else "alone"
                    row[f"{key}_tok_s"], row[f"{key}_echo_p99_ms"] = rate, p99 * 1000
            results.append(row)
            say(f"  {row}")
        say(f"models bench: memory over {CYCLES} load/unload cycles")
        with _server("--models-dir", str(root), "--models-max", "1") as (process, port, _):
            time.sleep(1)
            idle = _rss(process.pid)
            # The first load imports torch and maps the kernels: once per process.
            _post(port, "/models/load", {"model": "b"})
            _until(port, "b", "loaded")
            _post(port, "/models/unload", {"model": "b"})
            _until(port, "b", "unloaded")
            before = _rss(process.pid)
            after: list[int] = []
            loaded: list[int] = []
            for _ in range(CYCLES):
                _post(port, "/models/load", {"model": "b"})
                _until(port, "b", "loaded")
                loaded.append(_rss(process.pid))
                _post(port, "/models/unload", {"model": "b"})
                _until(port, "b", "unloaded")
                after.append(_rss(process.pid))
            results.append(
                {"memory": True, "idle": idle, "before": before, "loaded": loaded, "after": after}
            )


def markdown(results: Sequence[dict[str, Any]]) -> str:
    rounds = [r for r in results if "round" in r]
    memory = next((r for r in results if r.get("memory")), None)

    def median(key: str) -> float:
        return float(statistics.median(r[key] for r in rounds))

    def spread(key: str, ratio_of: str | None = None) -> str:
        values = [r[key] / r[ratio_of] if ratio_of else r[key] for r in rounds]
        return f"{min(values):.3g} to {max(values):.3g}"

    def ratio(key: str, of: str) -> float:
        return float(statistics.median(r[key] / r[of] for r in rounds))

    lines = [
        "| measure | value | against | ratio (rounds' range) |",
        "|---|---|---|---|",
        f"| switch (unload a, load b) | {median('switch_s'):.2f} s | cold start to listening: "
        f"{median('cold_s'):.2f} s | {ratio('switch_s', 'cold_s'):.2f}"
        f" ({spread('switch_s', 'cold_s')}) |",
        f"| a's tokens/s while b loads and unloads | {median('during_tok_s'):.1f} | alone: "
        f"{median('alone_tok_s'):.1f} | {ratio('during_tok_s', 'alone_tok_s'):.3f}"
        f" ({spread('during_tok_s', 'alone_tok_s')}) |",
        f"| echo p99 while b loads and unloads | {median('during_echo_p99_ms'):.1f} ms | alone: "
        f"{median('alone_echo_p99_ms'):.1f} ms | |",
    ]
    if memory is not None:
        mib = 2**20
        lines.append(
            f"| RSS after {len(memory['after'])} load/unload cycles | "
            f"last {memory['after'][-1] / mib:.0f} MiB, most {max(memory['after']) / mib:.0f} MiB"
            f" (loaded: {statistics.median(memory['loaded']) / mib:.0f} MiB) | after a first "
            f"cycle: {memory['before'] / mib:.0f} MiB (before any load: "
            f"{memory['idle'] / mib:.0f} MiB) | {memory['after'][-1] / memory['before']:.3f}"
            f" (most {max(memory['after']) / memory['before']:.3f}) |"
        )
    return "\n".join(lines)


def main() -> None:
    results: list[dict[str, Any]] = []
    run(results, say=lambda text: print(text, file=sys.stderr, flush=True))
    print(markdown(results))


if __name__ == "__main__":
    main()
