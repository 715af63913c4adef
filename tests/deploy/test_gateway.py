"""Three replicas behind SGLang's Model Gateway (docs/scale-out.md, "The gateway"):
``deploy/gateway/run-replicas`` starts three ``python -m trioserve`` on the embedded
model and sglang-router (cache_aware) in front of them, and nginx runs
``deploy/gateway/trioserve-front.conf`` in front of both, all on loopback. ``nox -s
gateway`` runs it (``pytest -m gateway tests/deploy/test_gateway.py``); the default
suite leaves it out.

Clients are the ``openai`` SDK (through nginx, which sends the OpenAI generation routes
to the gateway, and straight to the gateway), ``anthropic`` and ``websockets`` (through
nginx, which sends those to the replicas). Which replica served a request is read from
each replica's own ``/metrics``; what the gateway did, from its metrics and nginx's
access log. Some tests pin what sglang-router 0.3.2 does not carry (the WebSocket,
/v1/messages, fields it does not know, DELETE of a stored response), which the docs
state: a newer gateway that does fails there, and the docs change with it. The tests
run in file order; the last drains a replica with SIGTERM while clients stream.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import attrs
import openai
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as websocket_connect

from .cluster import (
    API_KEY,
    AUTH,
    cleared_proxy_environment,
    ensure_nginx,
    enterable_directory,
    free_ports,
    make_certificate,
    wait_for,
)
from .gateway import Front, Pool, consecutive_free_ports, http_get, router_python_or_skip

pytestmark = pytest.mark.gateway

REPLICAS = 3
REPLICA_ARGS = (
    # The tenants' system prompts are about 1,100 tokens; a small context keeps each
    # replica's memory small.
    "--context-length",
    "2048",
    # Three replicas share this machine's cores: one torch thread each.
    "--threads",
    "1",
    # Longer than any request here takes on two busy cores, so that a drain lets
    # every running request finish.
    "--shutdown-grace",
    "300",
)
TIMEOUT = 300.0
MODEL = "SmolLM2-135M-Instruct"


@attrs.define
class Stack:
    pool: Pool
    front: Front

    @property
    def ports(self) -> list[int]:
        return self.pool.ports

    def client(self, base: str | None = None, key: str = API_KEY) -> openai.OpenAI:
        """The openai SDK, through nginx by default; never retrying by itself, so
        that every error the stack lets through is seen."""
        return openai.OpenAI(
            base_url=(base or self.front.url) + "/v1", api_key=key, max_retries=0, timeout=TIMEOUT
        )

    def served(self) -> dict[int, float]:
        """OpenAI requests each replica has answered."""
        return self.pool.counts("trioserve_requests_total", api="openai")

    def wait_idle(self) -> None:
        """Until no replica runs a job of an earlier test."""

        def idle() -> bool:
            running = self.pool.counts("trioserve_jobs_running")
            return not any(running.values())

        wait_for(idle, "every replica to be idle", timeout=TIMEOUT)

    def access_since(self, start: int) -> list[str]:
        return self.front.access_lines()[start:]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    router_python = router_python_or_skip()
    nginx = ensure_nginx()
    directory = enterable_directory("trioserve-gateway-")
    pool = front = None
    try:
        with cleared_proxy_environment():
            base = consecutive_free_ports(REPLICAS)
            gateway_port, metrics_port, http_port, tls_port = free_ports(4)
            pool = Pool(
                replicas=REPLICAS,
                base_port=base,
                gateway_port=gateway_port,
                metrics_port=metrics_port,
                router_python=router_python,
                trioserve_args=REPLICA_ARGS,
            )
            pool.start()
            front = Front(
                nginx,
                directory,
                upstreams=pool.ports,
                gateway_port=gateway_port,
                http_port=http_port,
                tls_port=tls_port,
                certificate=make_certificate(directory),
            )
            print(f"nginx -t: {front.check()}")
            front.start()
            pool.wait_ready()
            print(f"run-replicas: {pool.own_lines()[-1]}")
            yield Stack(pool=pool, front=front)
    finally:
        if front is not None:
            front.stop()
        if pool is not None:
            status = pool.stop()
            print(f"run-replicas exited with {status}: {pool.own_lines()[-2:]}")
        shutil.rmtree(directory, ignore_errors=True)


def _status_of(access_line: str) -> int:
    """The status nginx answered, from a line of the shipped ``trioserve`` log format."""
    match = re.search(r'" (\d{3}) ', access_line)
    assert match is not None, access_line
    return int(match.group(1))


def _post(
    base: str, path: str, body: dict[str, Any], headers: dict[str, str] = AUTH
) -> tuple[int, str]:
    """A JSON POST: its status and body."""
    request = urllib.request.Request(
        f"{base}{path}",
        data=json.dumps(body).encode(),
        headers={**headers, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _chat(system: str, user: str) -> list[Any]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _tenant_prompt(name: str) -> str:
    """A tenant's system prompt of about 1,100 tokens, distinct from its first words."""
    rules = " ".join(
        f"Rule {n} of {name}: answer questions about {name} politely, briefly and in English."
        for n in range(1, 41)
    )
    return f"You are the assistant of {name}. {rules}"


# --- The OpenAI doors through nginx and the gateway -------------------------------------


def test_the_openai_doors_go_through_the_gateway(stack: Stack) -> None:
    client = stack.client()
    direct = stack.client(stack.pool.replica_url(stack.ports[0]))
    start = len(stack.front.access_lines())
    routed = stack.pool.gateway_metrics()

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=12, temperature=0
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage is not None and chat.usage.completion_tokens > 0
    # The gateway rewrites the body with its own engine's fields at their defaults:
    # greedy text through it is the text a replica gives without it.
    same = direct.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=12, temperature=0
    )
    assert chat.choices[0].message.content == same.choices[0].message.content

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    completion = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0
    )
    streamed = list(
        client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == completion.choices[0].text
    print(f"chat {chat.choices[0].message.content!r}, completion {completion.choices[0].text!r}")

    # Each went nginx -> gateway -> a replica (nginx writes a line once the client has
    # its whole answer, so the last one may come a moment after the SDK returned).
    def posted() -> list[str]:
        return [line for line in stack.access_since(start) if '"POST /v1/' in line]

    wait_for(lambda: len(posted()) >= 4, "nginx to log the four requests", timeout=30)
    lines = posted()
    assert len(lines) == 4, lines
    for line in lines:
        assert stack.front.upstream_of(line) == f"127.0.0.1:{stack.pool.gateway_port}", line
    after = stack.pool.gateway_metrics()
    for path, count in (("/v1/chat/completions", 2), ("/v1/completions", 2)):
        grew = after.value("smg_http_requests_total", path=path) - routed.value(
            "smg_http_requests_total", path=path
        )
        assert grew == count, (path, grew)


def test_the_responses_door_through_the_gateway(stack: Stack) -> None:
    stack.wait_idle()
    client = stack.client()
    first = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=8)
    assert first.status in ("completed", "incomplete")
    assert first.output_text
    events = [
        e.type
        for e in client.responses.create(
            model=MODEL, input="Name a colour.", max_output_tokens=8, stream=True
        )
    ]
    assert events[0] == "response.created"
    assert events[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in events

    # A stored response lives on the replica that made it. The gateway asks every
    # replica for GET /v1/responses/ID (one has it)...
    assert client.responses.retrieve(first.id).id == first.id
    # ...but routes a follow-up by its text, not by previous_response_id. Make the
    # storing replica busy with requests that share the stored one's text (so they go
    # there too): a short follow-up matches nothing, goes to a less loaded replica, and
    # is a 404 there (docs/scale-out.md: stateless requests instead).
    stack.wait_idle()
    question = "Name a famous lighthouse."
    before = stack.served()
    stored = client.responses.create(model=MODEL, input=question, max_output_tokens=6)
    after = stack.served()
    (holder,) = [p for p in stack.ports if after[p] > before[p]]

    def busy(n: int) -> None:
        list(
            client.chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "user", "content": f"{question} Then tell its story, part {n}."}
                ],
                max_tokens=64,
                extra_body={"ignore_eos": True},
                stream=True,
            )
        )

    with ThreadPoolExecutor(3) as pool:
        loads = [pool.submit(busy, n) for n in range(3)]
        wait_for(
            lambda: stack.pool.metrics(holder).value("trioserve_jobs_running") == 3,
            f"the three requests on replica {holder}",
            timeout=TIMEOUT,
        )
        with pytest.raises(openai.NotFoundError) as lost:
            client.responses.create(
                model=MODEL,
                input="Another one.",
                previous_response_id=stored.id,
                max_output_tokens=4,
            )
        assert lost.value.code == "previous_response_not_found"
        # The stateless form carries its history and goes anywhere.
        stateless = client.responses.create(
            model=MODEL,
            input=[
                {"role": "user", "content": question},
                {"role": "assistant", "content": stored.output_text},
                {"role": "user", "content": "Another one."},
            ],
            store=False,
            max_output_tokens=4,
        )
        assert stateless.status in ("completed", "incomplete")
        for load in loads:
            load.result(TIMEOUT)

    # DELETE is not implemented by sglang-router 0.3.2 (docs/scale-out.md says so).
    with pytest.raises(openai.APIStatusError) as refused:
        client.responses.delete(first.id)
    assert refused.value.status_code == 501
    print(
        f"responses: {first.output_text!r}, {len(events)} events; previous_response_id to a "
        f"busy replica {holder}: 404; DELETE: 501 from the gateway"
    )


def test_models_and_the_api_key(stack: Stack) -> None:
    gateway = stack.client(stack.pool.url)
    # The gateway learns the model's name from each replica's /model_info and lists it
    # itself, asking for no key; through nginx a replica answers (and checks the key).
    assert [m.id for m in gateway.models.list().data] == [MODEL]
    status, body = http_get(f"{stack.pool.url}/v1/models", {})
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [MODEL]
    assert [m.id for m in stack.client().models.list().data] == [MODEL]
    assert http_get(f"{stack.front.url}/v1/models", {})[0] == 401
    with pytest.raises(openai.AuthenticationError):
        stack.client(key="wrong").models.list()

    # Generation without the key, or with a wrong one: 401 at the gateway itself
    # (run-replicas gives it the key) and through nginx; no replica computes anything.
    before = stack.pool.counts("trioserve_prompt_tokens_total")
    bodies: dict[str, dict[str, Any]] = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
        "/v1/completions": {"prompt": "Hi"},
        "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
    }
    for base in (stack.front.url, stack.pool.url):
        for path, payload in bodies.items():
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                request = {"model": MODEL, "max_tokens": 2, **payload}
                status, text = _post(base, path, request, headers)
                assert status == 401, (base, path, headers, status, text)
        client = stack.client(base, key="wrong")
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
    assert stack.pool.counts("trioserve_prompt_tokens_total") == before

    # The gateway's control plane (workers, cache flush) asks for the key too, and
    # is not reachable through nginx at all (a replica answers 404).
    workers_url = f"{stack.pool.url}/workers"
    assert http_get(workers_url, {})[0] == 401
    status, body = http_get(workers_url)
    assert status == 200
    listed = json.loads(body)["workers"]
    assert sorted(w["url"] for w in listed) == [f"http://127.0.0.1:{p}" for p in stack.ports]
    assert all(w["is_healthy"] for w in listed)
    assert http_get(f"{stack.front.url}/workers")[0] == 404


def test_fields_the_gateway_does_not_know_never_arrive(stack: Stack) -> None:
    """sglang-router re-serializes the body into its own request type: a field of
    trioserve's own that it does not know is dropped, so a bad value a replica would
    refuse (400, naming the field) is answered as if it had not been sent; and its
    own rules apply (top_k 0, trioserve's "off", is refused: -1 is its "off")."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    def post(base: str, extra: dict[str, Any]) -> tuple[int, str]:
        return _post(base, "/v1/chat/completions", {**body, **extra})

    replica = stack.pool.replica_url(stack.ports[0])
    for extra in ({"dry_multiplier": -1}, {"mirostat": "yes"}, {"bann_bann": "x"}):
        status, text = post(replica, extra)
        assert status == 400 and next(iter(extra)) in text, (extra, status, text)
        assert post(stack.front.url, extra)[0] == 200, extra
    assert post(replica, {"top_k": 0})[0] == 200
    status, text = post(stack.front.url, {"top_k": 0})
    assert status == 400 and "top_k" in text, text
    assert post(stack.front.url, {"top_k": -1})[0] == 200


# --- What the gateway cannot carry: nginx sends it to the replicas ----------------------


def test_websocket_and_messages_go_to_the_replicas(stack: Stack) -> None:
    start = len(stack.front.access_lines())
    replicas = {f"127.0.0.1:{port}" for port in stack.ports}
    ws_url = f"ws://127.0.0.1:{stack.front.http_port}/"
    with websocket_connect(ws_url, additional_headers=AUTH, open_timeout=60) as ws:
        ws.send(json.dumps({"action": "echo", "request_id": 1}))
        assert json.loads(ws.recv(timeout=TIMEOUT)) == {"action": "echo", "request_id": 1}
        ws.send(
            json.dumps({"action": "infer", "request_id": 2, "text": "Hello", "max_new_tokens": 6})
        )
        final = json.loads(ws.recv(timeout=TIMEOUT))
        while final.get("response_type") == "chunk":
            final = json.loads(ws.recv(timeout=TIMEOUT))
        assert final["response_type"] == "full", final
        assert final["usage"]["generated_tokens"] > 0

    messages = anthropic.Anthropic(base_url=stack.front.url, api_key=API_KEY, max_retries=0)
    reply = messages.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
    )
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.usage.output_tokens > 0

    def logged() -> tuple[list[str], list[str]]:
        lines = stack.access_since(start)
        return (
            [line for line in lines if '"GET / ' in line],
            [line for line in lines if '"POST /v1/messages ' in line],
        )

    wait_for(lambda: all(logged()), "nginx to log the upgrade and the message", timeout=30)
    upgrade, posted = logged()
    lines = stack.access_since(start)
    assert len(upgrade) == 1 and len(posted) == 1, lines
    for line in (*upgrade, *posted):
        assert stack.front.upstream_of(line) in replicas, line
    print(f"websocket and /v1/messages through nginx: {upgrade + posted}")

    # The gateway itself answers neither (404): why the front sends them elsewhere.
    with pytest.raises(InvalidStatus) as refused:
        websocket_connect(f"ws://127.0.0.1:{stack.pool.gateway_port}/", additional_headers=AUTH)
    assert refused.value.response.status_code == 404
    direct = anthropic.Anthropic(base_url=stack.pool.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        direct.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
        )


# --- Cache-aware routing ------------------------------------------------------------------


def test_a_shared_prefix_stays_on_one_replica(stack: Stack) -> None:
    """Two tenants, each with its own long system prompt, five users each: every
    request of a tenant lands on one replica, and there every request after the
    first finds the system prompt in the prefix cache."""
    stack.wait_idle()
    client = stack.client()
    for tenant in ("the Lighthouse Keepers' Guild", "the Beekeepers' Society"):
        system = _tenant_prompt(tenant)
        placed: list[int] = []
        cached: list[int] = []
        prompt_tokens = 0
        for user in range(5):
            before = stack.served()
            answer = client.chat.completions.create(
                model=MODEL,
                messages=_chat(system, f"I am user {user}. What is rule {user + 3}?"),
                max_tokens=4,
                temperature=0,
            )
            after = stack.served()
            grew = [port for port in stack.ports if after[port] > before[port]]
            assert len(grew) == 1, (before, after)
            placed.append(grew[0])
            assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
            cached.append(answer.usage.prompt_tokens_details.cached_tokens or 0)
            prompt_tokens = answer.usage.prompt_tokens
        print(f"{tenant}: {prompt_tokens} prompt tokens, replicas {placed}, cached {cached}")
        assert len(set(placed)) == 1, placed
        # The system prompt is most of each prompt; the cache holds whole blocks of 64.
        assert all(c >= prompt_tokens - 64 - 20 for c in cached[1:]), cached

    # Several at once go to the tenant's replica too (the gateway records a prefix
    # when it routes, before the answer).
    system = _tenant_prompt("the Lighthouse Keepers' Guild")
    before = stack.served()
    with ThreadPoolExecutor(3) as pool:
        answers = list(
            pool.map(
                lambda n: client.chat.completions.create(
                    model=MODEL, messages=_chat(system, f"Quick question {n}?"), max_tokens=2
                ),
                range(3),
            )
        )
    assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
    after = stack.served()
    assert sorted(after[p] - before[p] for p in stack.ports) == [0, 0, 3], (before, after)
    assert stack.pool.error_lines() == []


# --- A drain: every client answered --------------------------------------------------------


def test_a_drained_replica_loses_no_request(stack: Stack) -> None:
    """SIGTERM to the replica that holds a tenant while four of its clients stream
    through nginx and the gateway, then more clients of that tenant come: every
    request is answered in full (the SDK retries nothing), the draining replica's
    refusals are retried by the gateway on another replica, run-replicas starts the
    replica again and the gateway takes it back."""
    stack.wait_idle()
    client = stack.client()
    system = _tenant_prompt("the Ferry Company")
    tokens = 48
    before = stack.served()
    logged = len(stack.front.access_lines())
    client.chat.completions.create(
        model=MODEL, messages=_chat(system, "Hello?"), max_tokens=1, temperature=0
    )
    after = stack.served()
    (held,) = [p for p in stack.ports if after[p] > before[p]]
    wait_for(lambda: len(stack.front.access_lines()) > logged, "nginx to log the first request")
    start = len(stack.front.access_lines())
    routed = stack.pool.gateway_metrics()

    firsts = threading.Semaphore(0)
    answers: dict[str, int] = {}
    errors: list[str] = []

    def stream(name: str, signal_first: bool) -> None:
        try:
            produced = 0
            for chunk in client.chat.completions.create(
                model=MODEL,
                messages=_chat(system, f"I am {name}. Tell me about the ferries."),
                max_tokens=tokens,
                # Past the model's end of text, so that each runs its whole length.
                extra_body={"ignore_eos": True},
                stream=True,
                stream_options={"include_usage": True},
            ):
                if chunk.choices and chunk.choices[0].delta.content and signal_first:
                    signal_first = False
                    firsts.release()
                if chunk.usage is not None:
                    produced = chunk.usage.completion_tokens
            answers[name] = produced
        except Exception as error:
            errors.append(f"{name}: {error!r}")
            if signal_first:
                firsts.release()

    running = [
        threading.Thread(target=stream, args=(f"early-{n}", True), daemon=True) for n in range(4)
    ]
    for thread in running:
        thread.start()
    for _ in running:
        assert firsts.acquire(timeout=TIMEOUT)
    assert not errors, errors
    in_flight = stack.pool.metrics(held).value("trioserve_jobs_running")
    assert in_flight == 4, f"the tenant's clients were not all on replica {held}: {in_flight}"

    pid = stack.pool.signal(held, signal.SIGTERM)
    wait_for(
        lambda: http_get(f"{stack.pool.replica_url(held)}/ready", {})[0] == 503,
        f"replica {held} to drain",
    )
    print(f"SIGTERM to replica {held} (pid {pid}) while 4 of its clients stream")
    # New clients of the same tenant at once: the gateway's tree still says `held`.
    late = [
        threading.Thread(target=stream, args=(f"late-{n}", False), daemon=True) for n in range(4)
    ]
    for thread in late:
        thread.start()
        time.sleep(0.2)
    non_streamed = client.chat.completions.create(
        model=MODEL, messages=_chat(system, "One more question?"), max_tokens=4
    )
    assert non_streamed.choices[0].finish_reason in ("stop", "length")
    for thread in (*running, *late):
        thread.join(TIMEOUT)
    assert errors == [], errors
    assert answers == {name: tokens for name in answers} and len(answers) == 8, answers

    # The draining replica refused what reached it (503), and the gateway passed those
    # on: the client saw none of it.
    done = stack.pool.gateway_metrics()
    retries = done.value("smg_worker_retries_total") - routed.value("smg_worker_retries_total")
    failures = done.value(
        "smg_worker_cb_outcomes_total", worker=f"http://127.0.0.1:{held}", outcome="failure"
    ) - routed.value(
        "smg_worker_cb_outcomes_total", worker=f"http://127.0.0.1:{held}", outcome="failure"
    )
    print(f"the gateway retried {retries:g} time(s); replica {held} failed {failures:g}")
    assert failures >= 1 and retries >= failures

    # run-replicas starts it again, and the gateway takes it back.
    wait_for(
        lambda: any(
            f"replica {held} exited with 0; started again" in line
            for line in stack.pool.own_lines()
        ),
        f"run-replicas to restart replica {held}",
        timeout=TIMEOUT,
    )
    stack.pool.wait_replica_ready(held)

    def healthy() -> bool:
        status, body = http_get(f"{stack.pool.url}/workers")
        workers = json.loads(body)["workers"] if status == 200 else []
        return any(w["url"].endswith(f":{held}") and w["is_healthy"] for w in workers)

    wait_for(healthy, f"the gateway to take replica {held} back", timeout=60)
    assert stack.pool.pid(held) != pid

    # No client got an error from nginx or through it (all nine requests logged by now).
    lines = [line for line in stack.access_since(start) if '"POST /v1/' in line]
    assert len(lines) == 9, lines
    assert [line for line in lines if _status_of(line) >= 500] == [], lines
    assert stack.pool.error_lines() == []
