"""Two trioserve instances behind Debian's nginx, on loopback, for the scale-out test.

Everything here is the real thing an operator runs: ``python -m trioserve`` on the
embedded model (the shared cache in ``~/.cache/trioserve``), and nginx with
``deploy/nginx/`` as shipped. The test replaces only what must differ on a test
machine (ports, the certificate, log paths), and each replacement must match the
shipped text exactly, so a change there that the test does not follow fails here
instead of testing something else.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "API_KEY",
    "AUTH",
    "Balancer",
    "Instance",
    "Metrics",
    "cleared_proxy_environment",
    "ensure_nginx",
    "enterable_directory",
    "free_ports",
    "make_certificate",
    "tls_context",
    "wait_for",
]

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "deploy" / "nginx" / "trioserve.conf"
NGINX_PROXY_CONF = ROOT / "deploy" / "nginx" / "trioserve-proxy.conf"
API_KEY = "scale-out-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
#: Where Debian's nginx lives; /usr/sbin is not on a non-root PATH.
_SBIN = ("/usr/sbin", "/sbin")
_LISTENING = re.compile(r"listening on ws://\S+:(\d+)/")


def wait_for(
    condition: Callable[[], bool], what: str, timeout: float = 60.0, interval: float = 0.1
) -> None:
    """Poll ``condition`` every ``interval`` until it holds; fail naming ``what``
    after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (bound together, so never twice)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


@contextlib.contextmanager
def cleared_proxy_environment() -> Iterator[None]:
    """Without proxy variables: every client here talks to loopback, and both the
    websockets library and the openai SDK would otherwise honour ``http_proxy``."""
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.lower() in {"http_proxy", "https_proxy", "all_proxy", "ws_proxy", "wss_proxy"}:
                patch.delenv(name)
        yield


# --- nginx ---------------------------------------------------------------------------


def _nginx_binary() -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN])
    return shutil.which("nginx", path=path)


def ensure_nginx() -> str:
    """The nginx binary; installs Debian's ``nginx-light`` (or ``nginx``) with apt
    when it is missing, as root. Skips the calling test, saying why, when nginx is
    missing and cannot be installed here."""
    found = _nginx_binary()
    if found is not None:
        return found
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(
            "nginx is not installed and this test can install it only as root with apt-get: "
            "run 'apt-get install nginx-light' (or nginx), then rerun 'nox -s scale-out'"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    pid_file = Path("/run/nginx.pid")
    had_service = pid_file.exists()
    update = subprocess.run(
        ["apt-get", "update"], env=env, capture_output=True, text=True, check=False
    )
    errors = [] if update.returncode == 0 else [f"apt-get update: {update.stderr.strip()[-300:]}"]
    for package in ("nginx-light", "nginx"):
        done = subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", package],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        found = _nginx_binary()
        if done.returncode == 0 and found is not None:
            # The package's maintainer script starts the system's nginx where an
            # init system lets it: a daemon on port 80 this test did not ask for.
            if not had_service and pid_file.exists():
                subprocess.run([found, "-s", "quit"], capture_output=True, check=False)
            print(f"installed Debian's {package}: {found}")
            return found
        errors.append(f"apt-get install {package}: {done.stderr.strip()[-300:]}")
    pytest.skip("cannot install Debian's nginx here: " + " | ".join(errors))


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1, and its key."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is needed to make the test's certificate (apt-get install openssl)")
    cert, key = directory / "localhost.pem", directory / "localhost.key"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def _replace(text: str, old: str, new: str, count: int, source: Path) -> str:
    found = text.count(old)
    if found != count:
        raise AssertionError(
            f"{source.name}: expected {count} occurrence(s) of {old!r} to template, found {found}"
        )
    return text.replace(old, new)


class Balancer:
    """nginx running deploy/nginx/ on loopback, in a directory of its own.

    :attr:`conf` is the file installed as ``conf.d/trioserve.conf``, :attr:`snippets`
    those installed in ``snippets/``; a subclass serves another shipped configuration
    by naming its files and overriding :meth:`upstream_replacements`."""

    conf: Path = NGINX_CONF
    snippets: tuple[Path, ...] = (NGINX_PROXY_CONF,)

    def __init__(
        self,
        nginx: str,
        directory: Path,
        *,
        upstreams: Sequence[int],
        http_port: int,
        tls_port: int,
        certificate: tuple[Path, Path],
    ) -> None:
        self.nginx = nginx
        self.directory = directory
        self.http_port = http_port
        self.tls_port = tls_port
        self.access_log = directory / "access.log"
        self.error_log = directory / "error.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._write_config(upstreams, certificate)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def config(self) -> Path:
        return self.directory / "nginx.conf"

    def replacements(
        self, upstreams: Sequence[int], certificate: tuple[Path, Path]
    ) -> list[tuple[str, str, int]]:
        """(shipped text, the test's text, how often the shipped text occurs)."""
        cert, key = certificate
        return [
            *self.upstream_replacements(upstreams),
            ("listen 443 ssl;", f"listen 127.0.0.1:{self.tls_port} ssl;", 1),
            # IPv6 may be off on a test machine; the IPv4 line above serves.
            ("listen [::]:443 ssl;", "# listen [::]:443 ssl;", 1),
            ("listen 127.0.0.1:8080;", f"listen 127.0.0.1:{self.http_port};", 1),
            ("/etc/ssl/certs/trioserve.example.com.pem", str(cert), 1),
            ("/etc/ssl/private/trioserve.example.com.key", str(key), 1),
            ("/var/log/nginx/trioserve.access.log", str(self.access_log), 2),
        ]

    def upstream_replacements(self, upstreams: Sequence[int]) -> list[tuple[str, str, int]]:
        """The shipped upstream's two instances become the test's: its second line is
        repeated for each instance beyond two."""
        assert len(upstreams) >= 2, upstreams
        first = "server 127.0.0.1:7862 max_fails=1 fail_timeout=10s;"
        second = "server 127.0.0.1:7863 max_fails=1 fail_timeout=10s;"
        rest = [second.replace(":7863 ", f":{port} ") for port in upstreams[1:]]
        return [
            (first, first.replace(":7862 ", f":{upstreams[0]} "), 1),
            (second, "\n    ".join(rest), 1),
        ]

    def _write_config(self, upstreams: Sequence[int], certificate: tuple[Path, Path]) -> None:
        d = self.directory
        text = self.conf.read_text()
        for old, new, count in self.replacements(upstreams, certificate):
            text = _replace(text, old, new, count, self.conf)
        (d / "conf.d").mkdir()
        (d / "conf.d" / "trioserve.conf").write_text(text)
        # Relative includes resolve against the main file's directory, as
        # /etc/nginx/snippets/ does for /etc/nginx/nginx.conf.
        (d / "snippets").mkdir()
        for snippet in self.snippets:
            shutil.copy(snippet, d / "snippets" / snippet.name)
        # Debian's nginx.conf, reduced to what a test needs. Two worker processes,
        # so that the upstream's shared zone is what makes least_conn global.
        built = subprocess.run([self.nginx, "-V"], capture_output=True, text=True).stderr
        temp_paths = "\n".join(
            f"    {module}_temp_path {d}/temp/{module};"
            for module in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
            if f"--without-http_{module}_module" not in built
        )
        (d / "temp").mkdir()
        self.config.write_text(
            f"""worker_processes 2;
pid {d}/nginx.pid;
error_log {self.error_log} notice;
daemon off;
events {{ worker_connections 1024; }}
http {{
{temp_paths}
    default_type application/octet-stream;
    access_log off;
    include conf.d/trioserve.conf;
}}
"""
        )

    def check(self) -> str:
        """``nginx -t`` on the configuration; its output."""
        done = subprocess.run(
            [self.nginx, "-t", "-p", str(self.directory), "-c", str(self.config)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"nginx -t failed: {done.stderr}"
        return done.stderr.strip()

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.nginx, "-p", str(self.directory), "-c", str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=(self.directory / "stderr.log").open("wb"),
        )

    def stop(self) -> None:
        """Graceful quit (SIGQUIT), then kill what is left after 15 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGQUIT)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def access_lines(self) -> list[str]:
        return self.access_log.read_text().splitlines() if self.access_log.exists() else []

    def error_lines(self) -> list[str]:
        return self.error_log.read_text().splitlines() if self.error_log.exists() else []


# --- trioserve instances ---------------------------------------------------------------


class Metrics:
    """One scrape of an instance's ``/metrics``."""

    def __init__(self, text: str) -> None:
        self.samples: list[tuple[str, dict[str, str], float]] = [
            (sample.name, dict(sample.labels), float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` whose labels include ``labels``."""
        return sum(
            value
            for sample, have, value in self.samples
            if sample == name and all(have.get(k) == v for k, v in labels.items())
        )


class Instance:
    """``python -m trioserve --port PORT`` on the embedded model, as an operator runs it
    (the API key from ``TRIOSERVE_API_KEY``); its output is kept line by line."""

    def __init__(self, name: str, port: int, args: tuple[str, ...]) -> None:
        self.name = name
        self.port = port
        self.args = args
        self.log: list[str] = []
        self.process: subprocess.Popen[str] | None = None
        self._listening = threading.Event()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Instance({self.name}, port {self.port})"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self._listening.clear()
        self.log.append(f"--- start on port {self.port}")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "trioserve", "--port", str(self.port), *self.args],
            cwd=ROOT,
            env={**os.environ, "TRIOSERVE_API_KEY": API_KEY, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        assert self.process.stdout is not None and self.process.stderr is not None
        for stream in (self.process.stdout, self.process.stderr):
            threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            line = line.rstrip("\n")
            with self._lock:
                self.log.append(line)
            if _LISTENING.search(line):
                self._listening.set()

    def wait_listening(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._listening.wait(0.2):
            if not self.alive:
                raise AssertionError(f"{self} exited before it listened: {self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self} did not listen within {timeout:g} s: {self.tail()}")

    def has_logged(self, text: str) -> bool:
        with self._lock:
            return any(text in line for line in self.log)

    def tail(self, lines: int = 15) -> str:
        with self._lock:
            return " | ".join(self.log[-lines:])

    def error_lines(self) -> list[str]:
        """Log lines at ERROR or above, and tracebacks."""
        with self._lock:
            return [
                line
                for line in self.log
                if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback")
            ]

    def get(self, path: str, headers: Mapping[str, str] = AUTH) -> tuple[int, bytes]:
        """A GET straight to this instance, not through nginx."""
        request = urllib.request.Request(f"http://{self.address}{path}", headers=dict(headers))
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def metrics(self) -> Metrics:
        status, body = self.get("/metrics")
        assert status == 200, f"{self}: /metrics answered {status}: {body[:200]!r}"
        return Metrics(body.decode())

    def open_websockets(self) -> int:
        return int(self.metrics().value("trioserve_open_connections", protocol="websocket"))

    def wait_no_websockets(self) -> None:
        wait_for(lambda: self.open_websockets() == 0, f"{self} to have no websocket open")

    def steps(self) -> int:
        return int(self.metrics().value("trioserve_engine_steps_total"))

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def wait_exit(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def stop(self) -> None:
        """SIGINT (the graceful shutdown), then SIGKILL after 60 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def tls_context(certificate: Path) -> ssl.SSLContext:
    """A client context that trusts exactly the test's self-signed certificate."""
    return ssl.create_default_context(cafile=str(certificate))


def enterable_directory(prefix: str) -> Path:
    """A directory nginx's workers can enter: when the master runs as root they
    run as ``nobody``, and pytest's own temporary directories are private (0700)."""
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    directory.chmod(0o755)
    return directory
