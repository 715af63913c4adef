"""Scale-out behind nginx (issue 11, docs/scale-out.md): two ``python -m trioserve``
instances on the embedded model and Debian's nginx running deploy/nginx/ as shipped,
all on loopback. ``nox -s scale-out`` runs it (``pytest -m scaleout tests/deploy``);
the default suite leaves it out, since it installs nginx and starts three servers.

Instances are told apart by their own ``/metrics``, read straight from their ports:
open WebSocket connections, engine steps, OpenAI requests. Clients are the
``websockets`` library and the ``openai`` SDK. The tests run in file order; the last
one drains an instance with SIGTERM and starts it again.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import shutil
import signal
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import attrs
import openai
import pytest
import trio
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as websocket_connect
from websockets.sync.connection import Connection

from tests.browser import chromium_or_skip, open_browser

from .cluster import (
    API_KEY,
    AUTH,
    Balancer,
    Instance,
    cleared_proxy_environment,
    ensure_nginx,
    enterable_directory,
    free_ports,
    make_certificate,
    tls_context,
    wait_for,
)

pytestmark = pytest.mark.scaleout

#: A small context keeps each instance's memory and the test's time small.
INSTANCE_ARGS = (
    "--context-length",
    "512",
    # Two instances share this machine's cores; one torch thread each.
    "--threads",
    "1",
    # Far longer than a drained request here takes (under a minute on two busy
    # cores), so that the drain lets every one finish.
    "--shutdown-grace",
    "300",
)
PROMPT = "Once upon a time, in a small village by the sea, there lived"
#: nginx's fail_timeout in the shipped upstream: how long a failed instance rests.
FAIL_TIMEOUT = 10.0
RECV_TIMEOUT = 300.0


# --- The cluster ------------------------------------------------------------------------


@attrs.define
class Cluster:
    instances: tuple[Instance, Instance]
    balancer: Balancer
    certificate: Path
    #: The model's EOS ids: banned in long requests, so they run to max_new_tokens.
    eos: list[int] = attrs.Factory(list)

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.balancer.http_port}/"

    def connect(
        self, url: str | None = None, tls: ssl.SSLContext | None = None
    ) -> ClientConnection:
        return websocket_connect(
            url or self.ws_url,
            additional_headers=AUTH,
            ssl=tls,
            open_timeout=60,
            close_timeout=10,
            max_size=None,
        )

    def connect_on(self, stack: ExitStack) -> tuple[Connection, Instance]:
        """A WebSocket connection through nginx, closed with ``stack``, and the
        instance it reached (the one whose count of open WebSocket connections
        went up)."""
        before = [i.open_websockets() for i in self.instances]
        ws = stack.enter_context(self.connect())
        after = [i.open_websockets() for i in self.instances]
        grew = [i for i, b, a in zip(self.instances, before, after, strict=True) if a == b + 1]
        assert len(grew) == 1, f"open websocket connections went from {before} to {after}"
        return ws, grew[0]

    def wait_idle(self) -> None:
        """Until no WebSocket connection of an earlier test is open on any instance."""
        for instance in self.instances:
            assert instance.alive, f"{instance} is not running: {instance.tail()}"
            instance.wait_no_websockets()

    def openai_client(
        self, base: str | None = None, key: str = API_KEY, **kwargs: Any
    ) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=(base or self.balancer.url) + "/v1",
            api_key=key,
            max_retries=0,
            timeout=RECV_TIMEOUT,
            **kwargs,
        )

    def assert_no_errors_logged(self) -> None:
        for instance in self.instances:
            assert instance.error_lines() == [], f"{instance} logged errors"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    nginx = ensure_nginx()
    directory = enterable_directory("trioserve-scale-out-")
    instances: tuple[Instance, ...] = ()
    balancer = None
    try:
        with cleared_proxy_environment():
            certificate = make_certificate(directory)
            port_a, port_b, http_port, tls_port = free_ports(4)
            a, b = Instance("A", port_a, INSTANCE_ARGS), Instance("B", port_b, INSTANCE_ARGS)
            instances = (a, b)
            for instance in instances:
                instance.start()
            balancer = Balancer(
                nginx,
                directory,
                upstreams=(port_a, port_b),
                http_port=http_port,
                tls_port=tls_port,
                certificate=certificate,
            )
            print(f"nginx -t: {balancer.check()}")
            balancer.start()
            for instance in instances:
                instance.wait_listening()
            wait_for(lambda: _status(f"{balancer.url}/ready") == 200, "nginx to answer /ready")
            cluster = Cluster(instances=(a, b), balancer=balancer, certificate=certificate[0])
            with cluster.connect() as ws:
                info = _ask(ws, {"action": "info", "request_id": "eos"})
            cluster.eos = list(info["model"]["eos_token_ids"])
            print(
                f"instances A on {port_a}, B on {port_b}; nginx on {http_port} (http) and "
                f"{tls_port} (tls); model {info['model']['name']}, eos {cluster.eos}"
            )
            yield cluster
    finally:
        if balancer is not None:
            balancer.stop()
        for instance in instances:
            instance.stop()
        if balancer is not None:
            errors = [line for line in balancer.error_lines() if "[error]" in line]
            print(f"nginx logged {len(errors)} error line(s); the last: {errors[-3:]}")
        shutil.rmtree(directory, ignore_errors=True)


# --- Clients ----------------------------------------------------------------------------


def _status(url: str, context: ssl.SSLContext | None = None) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30, context=context) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _receive(ws: Connection) -> dict[str, Any]:
    frame = json.loads(ws.recv(timeout=RECV_TIMEOUT))
    assert isinstance(frame, dict)
    return frame


def _ask(ws: Connection, request: dict[str, Any]) -> dict[str, Any]:
    """Send a request; its one reply (frames of other requests are not expected)."""
    ws.send(json.dumps(request))
    frame = _receive(ws)
    assert frame.get("request_id") == request.get("request_id"), frame
    assert frame.get("response_type") != "error", frame
    return frame


def _infer(request_id: str, tokens: int, eos: list[int], *, stream: bool = True) -> str:
    return json.dumps(
        {
            "action": "infer",
            "request_id": request_id,
            "text": PROMPT,
            "max_new_tokens": tokens,
            "stream": stream,
            # Without an EOS the request runs to max_new_tokens, so it is
            # reliably still running when the test acts on it.
            "bann_bann": eos,
        }
    )


@attrs.define(eq=False)
class Generation:
    """The frames of one ``infer`` on one connection, as they arrive."""

    request_id: str
    chunks: list[str] = attrs.Factory(list)
    final: dict[str, Any] | None = None
    #: Frames of other requests on the connection (the replies to ``stop``), and
    #: whether the final frame had already come when each arrived.
    others: list[tuple[dict[str, Any], bool]] = attrs.Factory(list)

    def pump(self, ws: Connection, until: Callable[[], bool]) -> None:
        while not until():
            frame = _receive(ws)
            if frame.get("request_id") != self.request_id:
                self.others.append((frame, self.final is not None))
            elif frame.get("response_type") == "chunk":
                assert self.final is None, f"a chunk after the final frame: {frame}"
                self.chunks.append(frame["chunk"])
            else:
                assert self.final is None, f"a second terminal frame: {frame}"
                self.final = frame

    def run(self, ws: Connection) -> None:
        """Every frame until the terminal one."""
        self.pump(ws, lambda: self.final is not None)

    def pump_chunks(self, ws: Connection, more: int) -> None:
        wanted = len(self.chunks) + more
        self.pump(ws, lambda: len(self.chunks) >= wanted or self.final is not None)
        assert self.final is None, f"{self.request_id} ended early: {self.final}"

    def check_final(self, stop_reason: str) -> dict[str, Any]:
        final = self.final
        assert final is not None
        assert final.get("response_type") == "full", final
        assert final["stop_reason"] == stop_reason, final
        if self.chunks:  # streamed: the chunks add up to the response
            assert "".join(self.chunks) == final["response"]
        return final


def _status_of(access_line: str) -> int:
    """The status nginx answered, from a line of the shipped ``trioserve`` log format."""
    match = re.search(r'" (\d{3}) ', access_line)
    assert match is not None, access_line
    return int(match.group(1))


def _infers(instance: Instance) -> float:
    return instance.metrics().value("trioserve_requests_total", api="websocket", action="infer")


def _stops(instance: Instance) -> float:
    return instance.metrics().value("trioserve_cancellations_total", cause="stop")


def _openai_requests(instance: Instance) -> float:
    return instance.metrics().value("trioserve_requests_total", api="openai")


def _wait_engine_idle(instance: Instance) -> None:
    """Until the instance's scheduler reports no job running or waiting."""

    def idle() -> bool:
        metrics = instance.metrics()
        jobs = metrics.value("trioserve_jobs_running") + metrics.value("trioserve_jobs_waiting")
        return jobs == 0

    wait_for(idle, f"{instance} to have no job running or waiting")


def _steps(cluster: Cluster) -> list[int]:
    return [instance.steps() for instance in cluster.instances]


def _wait_steps(cluster: Cluster, index: int, steps: int) -> None:
    """Until instance ``index`` has run ``steps`` engine steps."""
    instance = cluster.instances[index]
    wait_for(lambda: instance.steps() >= steps, f"{instance} to reach {steps} engine steps")


# --- (a) WebSocket connections spread over both instances -----------------------------


def test_websocket_connections_spread_over_both_instances(cluster: Cluster) -> None:
    cluster.wait_idle()
    placed: list[Instance] = []
    connections: list[Connection] = []
    with ExitStack() as stack:
        for _ in range(6):
            ws, instance = cluster.connect_on(stack)
            connections.append(ws)
            placed.append(instance)
        counts = {i.name: placed.count(i) for i in cluster.instances}
        print(f"6 connections through nginx, in order: {[i.name for i in placed]}; {counts}")
        # least_conn: each new connection goes to the instance with fewer.
        assert max(counts.values()) - min(counts.values()) <= 1

        for n, ws in enumerate(connections):
            reply = _ask(ws, {"action": "info", "request_id": n})
            assert reply["server"]["name"] == "trioserve"

        # Every connection generates, on its own instance: both engines step, and
        # each instance counts the requests of its own connections.
        before = _steps(cluster)
        infers_before = [_infers(i) for i in cluster.instances]

        def generate(n: int) -> dict[str, Any]:
            generation = Generation(f"a-{n}")
            connections[n].send(_infer(generation.request_id, 12, cluster.eos))
            generation.run(connections[n])
            return generation.check_final("num_tokens")

        with ThreadPoolExecutor(len(connections)) as pool:
            finals = list(pool.map(generate, range(len(connections))))
        after = _steps(cluster)
        infers = [_infers(i) - b for i, b in zip(cluster.instances, infers_before, strict=True)]
        print(f"engine steps per instance during 6 generations: {before} -> {after}")
        print(f"infer requests counted per instance: {infers}")
        assert all(f["usage"]["generated_tokens"] == 12 for f in finals)
        assert all(a > b for a, b in zip(after, before, strict=True))
        assert infers == [placed.count(i) for i in cluster.instances]
    cluster.assert_no_errors_logged()


# --- (b) stop reaches the instance that runs the request ------------------------------


def test_stop_reaches_the_instance_that_runs_the_request(cluster: Cluster) -> None:
    cluster.wait_idle()
    eos = cluster.eos
    with ExitStack() as stack:
        first_ws, first_on = cluster.connect_on(stack)
        second_ws, second_on = cluster.connect_on(stack)
        assert first_on is not second_on, "least_conn put both connections on one instance"
        x, y = cluster.instances.index(first_on), cluster.instances.index(second_on)

        stops_before = [_stops(i) for i in cluster.instances]
        # Each request runs far longer than the test needs (the context is 512):
        # both are still running when they are stopped.
        first = Generation("b-first")
        first_ws.send(_infer(first.request_id, 480, eos))
        first.pump_chunks(first_ws, 2)
        # The engine steps are counted by the instances themselves: chunks may
        # wait in buffers on the way, steps do not.
        s0 = _steps(cluster)
        _wait_steps(cluster, x, s0[x] + 3)
        s1 = _steps(cluster)
        print(f"first request running: steps {s0} -> {s1}")
        assert s1[y] == s0[y], "the first request runs on its own instance only"

        second = Generation("b-second")
        second_ws.send(_infer(second.request_id, 480, eos))
        second.pump_chunks(second_ws, 2)

        # A stop with a target, on the first connection.
        first_ws.send(json.dumps({"action": "stop", "target": "b-first", "request_id": "stop-1"}))
        first.pump(first_ws, lambda: first.final is not None and len(first.others) == 1)
        final = first.check_final("interrupted")
        (reply, after_final), *_ = first.others
        assert reply == {"action": "stop", "stopped": 1, "request_id": "stop-1"}
        assert after_final, "the stopped request's final frame comes before the stop reply"
        print(
            f"stopped the first after {final['usage']['generated_tokens']} tokens on "
            f"{first_on.name}; stop reply {reply}"
        )
        stops = [_stops(i) - b for i, b in zip(cluster.instances, stops_before, strict=True)]
        print(f"cancellations by stop per instance: {stops}")
        assert stops[x] == 1 and stops[y] == 0

        # Its instance goes idle while the other one goes on with the second
        # request: the engine has dropped the job (the gauge is set by the step
        # that hands the engine its cancellation), and it steps no more.
        _wait_engine_idle(first_on)
        u0 = _steps(cluster)
        _wait_steps(cluster, y, u0[y] + 3)
        u1 = _steps(cluster)
        print(f"after the stop: steps {u0} -> {u1} ({first_on.name} idle)")
        assert u1[x] == u0[x], f"{first_on} still steps after the stop"

        # A stop without a target, on the second connection.
        second_ws.send(json.dumps({"action": "stop", "request_id": "stop-2"}))
        second.pump(second_ws, lambda: second.final is not None and len(second.others) == 1)
        second.check_final("interrupted")
        assert second.others[0][0]["stopped"] == 1
        _wait_engine_idle(second_on)
        v0 = _steps(cluster)
        # Both idle: nothing is left to step. Read again after a pause long enough
        # for several steps; with a job left, the count would move.
        time.sleep(2.0)
        v1 = _steps(cluster)
        print(f"after both stops, both engines idle: steps {v0} -> {v1}")
        assert v1 == v0
    cluster.assert_no_errors_logged()


# --- (d) the OpenAI routes are balanced too -------------------------------------------


def test_openai_routes_are_balanced(cluster: Cluster) -> None:
    cluster.wait_idle()
    client = cluster.openai_client()
    model = client.models.list().data[0].id
    before = [_openai_requests(i) for i in cluster.instances]

    def plain(n: int) -> str:
        response = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Name {n + 2} colours."}],
            max_tokens=12,
        )
        assert response.choices[0].finish_reason in ("stop", "length")
        return response.choices[0].message.content or ""

    def streamed(n: int) -> str:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Name {n + 2} animals."}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts: list[str] = []
        reasons: list[str] = []
        usage = None
        for chunk in stream:
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                if choice.finish_reason:
                    reasons.append(choice.finish_reason)
            usage = chunk.usage or usage
        assert reasons in (["stop"], ["length"]), reasons
        assert usage is not None and usage.completion_tokens >= 1
        return "".join(parts)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(plain, n) for n in range(4)]
        futures += [pool.submit(streamed, n) for n in range(4)]
        answers = [future.result() for future in futures]
    after = [_openai_requests(i) for i in cluster.instances]
    served = [a - b for a, b in zip(after, before, strict=True)]
    print(f"8 chat completions (4 streamed) through nginx: served per instance {served}")
    print(f"answers: {answers}")
    assert sum(served) == 8
    assert all(n >= 1 for n in served), "one instance took every request"

    cluster.assert_no_errors_logged()


# --- Keys, limits and errors through nginx --------------------------------------------


def test_keys_limits_and_errors_through_nginx(cluster: Cluster) -> None:
    cluster.wait_idle()
    client = cluster.openai_client()
    model = client.models.list().data[0].id

    # The key is forwarded as sent, and checked by the instance: a wrong one is
    # refused, on HTTP and at the WebSocket handshake, and not retried elsewhere.
    with pytest.raises(openai.AuthenticationError):
        cluster.openai_client(key="wrong").models.list()
    with pytest.raises(InvalidStatus) as handshake:
        with websocket_connect(
            cluster.ws_url, additional_headers={"Authorization": "Bearer wrong"}
        ):
            pass
    assert handshake.value.response.status_code == 401

    # A body over the limit is refused by nginx itself, in OpenAI's error shape,
    # before any instance sees it.
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x" * 300_000}], max_tokens=1
        )
    assert refused.value.status_code == 413
    assert "larger than 262144 bytes" in str(refused.value)

    # (nginx logs the request once its lingering close, reading what the client
    # still sends of the refused body, is over.)
    def logged_413() -> bool:
        return any(
            '"POST /v1/chat/' in line and _status_of(line) == 413 and "upstream=-" in line
            for line in cluster.balancer.access_lines()
        )

    wait_for(logged_413, "nginx to log the 413 it answered itself")

    # A WebSocket frame over the instance's limit (the same 256 KiB) ends that
    # connection with 1009, which nginx passes on.
    with cluster.connect() as ws:
        # The instance may close before the whole frame is through: then the send
        # fails, and the receive below says why.
        with contextlib.suppress(ConnectionClosed):
            ws.send(json.dumps({"action": "estimate_token", "text": "x" * 300_000}))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=RECV_TIMEOUT)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    print(
        f"wrong key: 401 (HTTP and handshake); 300 kB body: 413 from nginx; "
        f"300 kB frame: closed {closed.value.rcvd.code} by the instance"
    )

    # /metrics is per instance: nginx does not hand out a random instance's.
    assert _status(f"{cluster.balancer.url}/metrics") == 404
    cluster.assert_no_errors_logged()


# --- (e) TLS ------------------------------------------------------------------------------


def test_tls_termination(cluster: Cluster) -> None:
    cluster.wait_idle()
    tls = tls_context(cluster.certificate)
    base = f"localhost:{cluster.balancer.tls_port}"

    with cluster.connect(f"wss://{base}/", tls) as ws:
        assert _ask(ws, {"action": "echo", "request_id": 1}) == {"action": "echo", "request_id": 1}
        generation = Generation("tls")
        ws.send(_infer("tls", 8, cluster.eos, stream=True))
        generation.run(ws)
        generation.check_final("num_tokens")
    print(f"wss://{base}/: echo and a streamed infer of 8 tokens")

    client = cluster.openai_client(
        f"https://{base}", http_client=openai.DefaultHttpx2Client(verify=tls)
    )
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=6
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    streamed = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, stream=True
    )
    assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in streamed)
    assert _status(f"https://{base}/ready", tls) == 200
    print(f"https://{base}/v1: a chat completion, streamed and not; /ready 200")

    # The certificate is really checked: a client that does not trust it fails.
    with pytest.raises(ssl.SSLCertVerificationError):
        cluster.connect(f"wss://{base}/", ssl.create_default_context())
    cluster.assert_no_errors_logged()


def test_the_chat_page_over_https(cluster: Cluster) -> None:
    """The chat page at / through nginx over https, under a host name (not a loopback
    one, so the instances accept its WebSocket by the same-origin rule alone), with the
    test's self-signed certificate pinned in Chromium; a foreign origin is refused."""
    chromium = chromium_or_skip()
    cluster.wait_idle()
    with cleared_proxy_environment():
        trio.run(_chat_page_over_https, cluster, chromium)
    tls = tls_context(cluster.certificate)
    base = f"localhost:{cluster.balancer.tls_port}"
    for origin in ("https://evil.example", f"https://trioserve.test:{cluster.balancer.tls_port}"):
        # The second is the page's own origin, but this client asks for localhost.
        with pytest.raises(InvalidStatus) as refused:
            websocket_connect(
                f"wss://{base}/",
                ssl=tls,
                additional_headers={**AUTH, "Origin": origin},
                open_timeout=60,
            )
        assert refused.value.response.status_code == 403, origin
    cluster.assert_no_errors_logged()


async def _chat_page_over_https(cluster: Cluster, chromium: str) -> None:
    port = cluster.balancer.tls_port
    spki = _spki_sha256(cluster.certificate)
    args = (
        "--host-resolver-rules=MAP trioserve.test 127.0.0.1",
        f"--ignore-certificate-errors-spki-list={spki}",
    )
    async with open_browser(chromium, args) as browser:
        page = await browser.new_page()
        await page.goto(f"https://trioserve.test:{port}/")
        await page.wait_for("!document.getElementById('key-form').hidden", what="the key prompt")
        await page.type_text("#key", API_KEY)
        await page.click("#key-form button")
        await page.wait_for(
            "document.getElementById('status').dataset.state === 'open'", within=60, what="wss"
        )
        model = await page.wait_for("document.getElementById('model').textContent.trim()")
        assert "SmolLM2-135M-Instruct" in model
        await page.evaluate("document.getElementById('max_new_tokens').value = '8'")
        await page.type_text("#input", "Hello!")
        await page.press_enter()
        await page.wait_for(
            "!!document.querySelector('#log .turn.assistant .stats')",
            within=RECV_TIMEOUT,
            what="the answer's final frame",
        )
        text = await page.evaluate(
            "document.querySelector('#log .turn.assistant .text').textContent"
        )
        assert text, "no answer"
        assert await page.evaluate("location.protocol") == "https:"
        assert page.errors == []
    print(f"https://trioserve.test:{port}/: the chat page answered {text!r} over wss")


def _spki_sha256(certificate: Path) -> str:
    """base64 sha256 of the certificate's public key, as Chromium pins it."""
    der = subprocess.run(
        "openssl x509 -pubkey -noout | openssl pkey -pubin -outform der",
        shell=True,
        input=certificate.read_bytes(),
        capture_output=True,
        check=True,
    ).stdout
    return base64.b64encode(hashlib.sha256(der).digest()).decode()


# --- No instance at all ---------------------------------------------------------------


def test_with_no_instance_up_nginx_answers_503_in_openai_shape() -> None:
    """The shipped configuration with both upstream ports closed: nginx's own answer
    replaces its 502 page (no cluster needed)."""
    directory = enterable_directory("trioserve-no-upstream-")
    balancer = None
    try:
        with cleared_proxy_environment():
            nginx = ensure_nginx()
            dead_a, dead_b, http_port, tls_port = free_ports(4)
            balancer = Balancer(
                nginx,
                directory,
                upstreams=(dead_a, dead_b),
                http_port=http_port,
                tls_port=tls_port,
                certificate=make_certificate(directory),
            )
            balancer.start()
            wait_for(lambda: _status(f"{balancer.url}/health") != 0, "nginx to listen")
            client = openai.OpenAI(
                base_url=f"{balancer.url}/v1", api_key=API_KEY, max_retries=0, timeout=30
            )
            with pytest.raises(openai.APIStatusError) as unavailable:
                client.models.list()
            response = unavailable.value.response
            assert response.status_code == 503
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "overloaded"
            with pytest.raises(InvalidStatus) as handshake:
                with websocket_connect(f"ws://127.0.0.1:{http_port}/", additional_headers=AUTH):
                    pass
            assert handshake.value.response.status_code == 503
            refused = [line for line in balancer.error_lines() if "Connection refused" in line]
            print(f"both instances down: 503 {response.json()}; nginx tried {len(refused)} times")
            # Each request tried both instances before giving up.
            assert any(str(dead_a) in line for line in refused)
            assert any(str(dead_b) in line for line in refused)
    finally:
        if balancer is not None:
            balancer.stop()
        shutil.rmtree(directory, ignore_errors=True)


# --- (c) a drained instance leaves the rotation without losing a request --------------


def _upgrade_status(instance: Instance) -> tuple[int, str | None]:
    """A WebSocket handshake straight to ``instance``: its status and Retry-After."""
    try:
        with websocket_connect(f"ws://{instance.address}/", additional_headers=AUTH):
            return 101, None
    except InvalidStatus as refused:
        return refused.response.status_code, refused.response.headers.get("Retry-After")


def test_a_drained_instance_leaves_the_rotation_without_losing_a_request(
    cluster: Cluster,
) -> None:
    cluster.wait_idle()
    a, b = cluster.instances
    eos = cluster.eos
    tokens = 200
    a_connections_before = a.metrics().value("trioserve_connections_total", protocol="websocket")
    access_before = len(cluster.balancer.access_lines())

    # Four clients streaming through nginx, two on each instance.
    stack = ExitStack()
    placed = [cluster.connect_on(stack) for _ in range(4)]
    on_b = [ws for ws, instance in placed if instance is b]
    assert len(on_b) == 2, [instance.name for _, instance in placed]
    generations = [Generation(f"c-{n}") for n in range(4)]
    outcomes: list[str] = ["" for _ in placed]
    failures: list[BaseException] = []

    def client(n: int) -> None:
        ws, instance = placed[n]
        generation = generations[n]
        try:
            ws.send(_infer(generation.request_id, tokens, eos))
            generation.run(ws)
            if instance is b:
                # The drained instance closes its connections once their requests
                # are answered: 1001, going away.
                try:
                    ws.recv(timeout=RECV_TIMEOUT)
                    outcomes[n] = "frame after the final frame"
                except ConnectionClosed as closed:
                    code = closed.rcvd.code if closed.rcvd is not None else None
                    outcomes[n] = f"closed {code}"
            else:
                reply = _ask(ws, {"action": "echo", "request_id": "still-open"})
                outcomes[n] = "open" if reply["action"] == "echo" else repr(reply)
        except BaseException as exc:
            failures.append(exc)
            raise
        finally:
            ws.close()

    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    wait_for(
        lambda: all(g.chunks for g in generations) or bool(failures), "every client's first chunk"
    )
    assert not failures

    # Drain B while all four stream.
    b.signal(signal.SIGTERM)
    wait_for(lambda: b.has_logged("SIGTERM: shutting down"), f"{b} to start draining")
    in_flight = {g.request_id: len(g.chunks) for g in generations}
    assert all(g.final is None for g in generations), "every request was in flight at SIGTERM"
    print(f"SIGTERM to B; chunks so far {in_flight}")
    # What nginx meets at B while it drains: not ready, no new WebSocket (503 is
    # what proxy_next_upstream passes on), but alive.
    ready = b.get("/ready")
    upgrade = _upgrade_status(b)
    health = b.get("/health")
    print(f"B draining, asked directly: /ready {ready}, upgrade {upgrade}, /health {health}")
    assert ready == (503, b'{"status":"draining"}')
    assert upgrade == (503, "1")
    assert health[0] == 200

    # New clients while B drains: every one is served, by A.
    assert b.alive, "B was still draining when the new clients came"
    new_clients = 4
    for n in range(new_clients):
        with cluster.connect() as ws:
            generation = Generation(f"new-{n}")
            ws.send(_infer(generation.request_id, 8, eos, stream=False))
            generation.run(ws)
            generation.check_final("num_tokens")
    openai_client = cluster.openai_client()
    chat = openai_client.chat.completions.create(
        model=openai_client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
    )
    assert chat.choices[0].finish_reason in ("stop", "length")

    # Every request that was in flight gets its whole answer; B's connections close.
    for thread in threads:
        thread.join(RECV_TIMEOUT)
    stack.close()
    assert not failures, failures
    for generation in generations:
        final = generation.check_final("num_tokens")
        assert final["usage"]["generated_tokens"] == tokens
    print(f"in-flight requests: all {tokens} tokens, then {outcomes}")
    assert sorted(outcomes) == ["closed 1001", "closed 1001", "open", "open"]
    assert b.wait_exit(60) == 0
    print(f"B exited with status 0: {b.tail(3)}")

    # B's clients come back through nginx and land on A.
    for n in range(2):
        with cluster.connect() as ws:
            assert _ask(ws, {"action": "echo", "request_id": n})["action"] == "echo"
    a_connections = a.metrics().value("trioserve_connections_total", protocol="websocket")
    print(f"A accepted {a_connections - a_connections_before:g} websocket connections")
    # Its two first ones, the four new clients, B's two returning clients.
    assert a_connections - a_connections_before == 2 + new_clients + 2

    # nginx tried B, got its 503 (or, once B had gone, a refused connection:
    # nginx's 502), and passed the request on to A: in its access log.
    lines = cluster.balancer.access_lines()[access_before:]
    retried = [line for line in lines if f"upstream={b.address}, {a.address} " in line]
    print(f"nginx passed {len(retried)} request(s) from B to A, e.g. {retried[:2]}")
    assert retried, "\n".join(lines)
    for line in retried:
        assert _status_of(line) in (101, 200)
        assert re.search(r"upstream_status=50[23], (101|200)$", line), line
    # No client got an error from nginx (a 502 or 503 of its own, or one passed on).
    assert [line for line in lines if _status_of(line) >= 500] == []

    # A rolling restart's second half: B starts again and rejoins the rotation once
    # its fail_timeout has passed.
    b.start()
    b.wait_listening()
    held: list[Connection] = []
    with ExitStack() as stack:

        def b_has_one() -> bool:
            held.append(stack.enter_context(cluster.connect()))
            return b.open_websockets() > 0

        wait_for(b_has_one, "B to rejoin the rotation", timeout=FAIL_TIMEOUT + 60, interval=1.0)
        print(f"B rejoined after {len(held)} connection(s) through nginx")
    cluster.assert_no_errors_logged()
