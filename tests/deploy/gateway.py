"""trioserve replicas behind SGLang's Model Gateway and nginx, on loopback, for the
gateway test and the gateway bench.

What runs is what an operator runs: ``deploy/gateway/run-replicas`` (the replicas and
the gateway, one process, its output parsed here), and nginx with
``deploy/gateway/trioserve-front.conf`` and its two snippets as shipped, only ports,
certificate and log paths replaced (:class:`Front`, a :class:`~.cluster.Balancer`).

sglang-router is found in this Python (``nox -s gateway`` installs the project's
``gateway`` extra) or in the Python that ``SGLANG_ROUTER_PYTHON`` names (a separate
environment, so that the development one stays as it is); without either, the caller
is skipped, saying so.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import pytest

from .cluster import API_KEY, AUTH, NGINX_PROXY_CONF, ROOT, Balancer, Metrics, wait_for

__all__ = [
    "FRONT_CONF",
    "GATEWAY_ROUTES",
    "RUN_REPLICAS",
    "Front",
    "Pool",
    "consecutive_free_ports",
    "http_get",
    "router_python_or_skip",
]

GATEWAY_DIR = ROOT / "deploy" / "gateway"
RUN_REPLICAS = GATEWAY_DIR / "run-replicas"
FRONT_CONF = GATEWAY_DIR / "trioserve-front.conf"
GATEWAY_ROUTES = GATEWAY_DIR / "trioserve-gateway-routes.conf"
#: The environment variable naming a Python with sglang-router, when this one lacks it.
ROUTER_PYTHON_ENV = "SGLANG_ROUTER_PYTHON"
_PID = re.compile(
    r"run-replicas: replica (\d+) (?:started|exited with -?\d+; started again), pid (\d+)"
)


def router_python_or_skip() -> str:
    """A Python that imports ``sglang_router``: this one, else ``$SGLANG_ROUTER_PYTHON``."""
    candidates = [sys.executable]
    named = os.environ.get(ROUTER_PYTHON_ENV)
    if named:
        candidates.append(named)
    for python in candidates:
        found = subprocess.run(
            [python, "-c", "import sglang_router.launch_router"],
            capture_output=True,
            check=False,
        )
        if found.returncode == 0:
            return python
    pytest.skip(
        f"sglang-router is not installed for {sys.executable}"
        + (f" nor for ${ROUTER_PYTHON_ENV} ({named})" if named else "")
        + ": 'nox -s gateway' installs it (the project's gateway extra), or set "
        f"{ROUTER_PYTHON_ENV} to a Python that has sglang-router==0.3.2"
    )


def consecutive_free_ports(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports (run-replicas numbers
    its replicas from one base port)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - count)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise AssertionError(f"no {count} consecutive free ports found")


def http_get(url: str, headers: Mapping[str, str] = AUTH, timeout: float = 30) -> tuple[int, bytes]:
    """A GET: its status and body (0 and nothing when nothing answers)."""
    request = urllib.request.Request(url, headers=dict(headers))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except OSError:
        return 0, b""


class Front(Balancer):
    """nginx running deploy/gateway/trioserve-front.conf: three replicas and the gateway."""

    conf = FRONT_CONF
    snippets = (NGINX_PROXY_CONF, GATEWAY_ROUTES)

    def __init__(
        self,
        nginx: str,
        directory: Path,
        *,
        upstreams: Sequence[int],
        gateway_port: int,
        http_port: int,
        tls_port: int,
        certificate: tuple[Path, Path],
    ) -> None:
        self.gateway_port = gateway_port
        super().__init__(
            nginx,
            directory,
            upstreams=upstreams,
            http_port=http_port,
            tls_port=tls_port,
            certificate=certificate,
        )

    def upstream_replacements(self, upstreams: Sequence[int]) -> list[tuple[str, str, int]]:
        assert len(upstreams) == 3, "the shipped front names three replicas"
        shipped = [f"server 127.0.0.1:{port} max_fails=1" for port in (7862, 7863, 7864)]
        return [
            *(
                (line, line.replace(f":{7862 + n} ", f":{port} "), 1)
                for n, (line, port) in enumerate(zip(shipped, upstreams, strict=True))
            ),
            ("server 127.0.0.1:30000;", f"server 127.0.0.1:{self.gateway_port};", 1),
        ]

    def upstream_of(self, line: str) -> str:
        """The ``upstream=`` field of an access log line."""
        found = re.search(r"upstream=(\S+(?:, \S+)*) upstream_status=", line)
        return found.group(1) if found else ""


class Pool:
    """``deploy/gateway/run-replicas`` as a subprocess: N replicas from ``base_port``,
    the gateway on ``gateway_port``, its metrics on ``metrics_port``; the output kept."""

    def __init__(
        self,
        *,
        replicas: int,
        base_port: int,
        gateway_port: int,
        metrics_port: int,
        router_python: str,
        trioserve_args: Sequence[str],
        gateway_args: Sequence[str] = (),
        policy: str = "cache_aware",
    ) -> None:
        self.ports = [base_port + n for n in range(replicas)]
        self.gateway_port = gateway_port
        self.metrics_port = metrics_port
        self.command = [
            sys.executable,
            str(RUN_REPLICAS),
            "--replicas",
            str(replicas),
            "--base-port",
            str(base_port),
            "--gateway-port",
            str(gateway_port),
            "--metrics-port",
            str(metrics_port),
            "--policy",
            policy,
            "--gateway-python",
            router_python,
            *(f"--gateway-arg={arg}" for arg in gateway_args),
            "--",
            *trioserve_args,
        ]
        self.lines: list[str] = []
        self.process: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        """The gateway's address (the OpenAI API is under /v1)."""
        return f"http://127.0.0.1:{self.gateway_port}"

    def replica_url(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.command,
            cwd=ROOT,
            env={**os.environ, "TRIOSERVE_API_KEY": API_KEY, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        assert self.process.stdout is not None
        threading.Thread(target=self._pump, args=(self.process.stdout,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            with self._lock:
                self.lines.append(line.rstrip("\n"))
            if line.startswith("run-replicas: ready:"):
                self._ready.set()

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.5):
            if self.process is None or self.process.poll() is not None:
                raise AssertionError(f"run-replicas exited before it was ready: {self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"run-replicas not ready within {timeout:g} s: {self.tail()}")

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM (run-replicas stops the gateway, then drains every replica); its status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def tail(self, lines: int = 20) -> str:
        return " | ".join(self.snapshot()[-lines:])

    def own_lines(self) -> list[str]:
        """run-replicas' own lines (not its children's)."""
        return [line for line in self.snapshot() if line.startswith("run-replicas: ")]

    def replica_log(self, port: int) -> list[str]:
        prefix = f"replica {port} | "
        return [line[len(prefix) :] for line in self.snapshot() if line.startswith(prefix)]

    def gateway_log(self) -> list[str]:
        return [
            line[len("gateway | ") :] for line in self.snapshot() if line.startswith("gateway | ")
        ]

    def pid(self, port: int) -> int:
        """The replica's current process, as run-replicas last printed it."""
        pids = [
            int(m[2]) for line in self.own_lines() if (m := _PID.match(line)) and m[1] == str(port)
        ]
        assert pids, f"no pid printed for replica {port}: {self.own_lines()}"
        return pids[-1]

    def signal(self, port: int, signum: int) -> int:
        pid = self.pid(port)
        os.kill(pid, signum)
        return pid

    def metrics(self, port: int) -> Metrics:
        status, body = http_get(f"{self.replica_url(port)}/metrics")
        assert status == 200, f"replica {port}: /metrics answered {status}: {body[:200]!r}"
        return Metrics(body.decode())

    def gateway_metrics(self) -> Metrics:
        status, body = http_get(f"http://127.0.0.1:{self.metrics_port}/metrics", {})
        assert status == 200, f"the gateway's metrics answered {status}: {body[:200]!r}"
        return Metrics(body.decode())

    def counts(self, name: str, **labels: str) -> dict[int, float]:
        """A metric's value on every replica."""
        return {port: self.metrics(port).value(name, **labels) for port in self.ports}

    def error_lines(self) -> list[str]:
        """The replicas' log lines at ERROR or above, and tracebacks."""
        return [
            f"{port}: {line}"
            for port in self.ports
            for line in self.replica_log(port)
            if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback")
        ]

    def wait_replica_ready(self, port: int, timeout: float = 300.0) -> None:
        wait_for(
            lambda: http_get(f"{self.replica_url(port)}/ready", {})[0] == 200,
            f"replica {port} to be ready",
            timeout=timeout,
            interval=0.5,
        )
