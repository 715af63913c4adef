"""Both doors, one rule set: every field the OpenAI API shares with the
WebSocket ``infer`` gets the same verdict on both (except where OpenAI's
documented range is narrower, which is declared and checked), and no client
input makes either door answer with a server error.

The verdicts are read from the sans-IO cores (thousands of examples); the
end-to-end tests send the same boundary values through a real server on the
real embedded model, over a real socket, on both doors.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import raw_client, serving, wait_until
from tests.http_helpers import connect, request
from tests.serverproc import open_server_process
from trioserve import openai as oa
from trioserve import protocol as p
from trioserve.engine.base import EngineInfo
from trioserve.engine.cpu import native
from trioserve.generation import GenerationRequest, InvalidGeneration
from trioserve.generation.generation import build_spec, check_request, fit_prompt, trim_prompt
from trioserve.openai.fields import OPENAI_RANGES, OPENAI_SYNONYMS, SHARED_FIELDS
from trioserve.server.doors import from_infer, from_openai, openai_param, websocket_path
from trioserve.server.http_types import RequestHead, client_address, parse_networks
from trioserve.vocabulary.constraint import CONSTRAINT_KINDS
from trioserve.vocabulary.sampling import SamplingSettings, setting_ranges

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

SAMPLERS = tuple(a.name for a in attrs.fields(SamplingSettings))
NAMES = {name: oa.OPENAI_NAMES.get(name, name) for name in (*SAMPLERS, *SHARED_FIELDS)}

INFO = EngineInfo(
    engine="test",
    model_name="m",
    context_length=64,
    vocab_size=1000,
    bos_token_id=None,
    eos_token_ids=frozenset({2}),
    max_batch=4,
    constraints=CONSTRAINT_KINDS,
)


def websocket_verdict(field: str, value: Any) -> str | None:
    """None when ``infer`` takes ``field: value``, else the path it names."""
    frame = {"action": "infer", "text": "x", "max_new_tokens": 1, field: value}
    try:
        request = p.decode_request(json.dumps(frame))
    except p.ProtocolError as error:
        if error.error_type != "invalid_request":
            raise AssertionError(f"{field}={value!r}: {error!r}") from None
        return error.field
    assert isinstance(request, p.InferRequest)
    try:
        check_request(from_infer(request), INFO, max_new_tokens=63, renders_messages=True)
    except InvalidGeneration as error:
        return websocket_path(error, request)
    return None


def openai_verdict(field: str, value: Any) -> str | None:
    """None when ``/v1/completions`` takes ``field: value``, else its param."""
    body = json.dumps({"prompt": "x", "max_tokens": 1, field: value}).encode()
    try:
        parsed = oa.parse_completion_request(body)
    except oa.OpenAIError as error:
        if error.status != 400:
            raise AssertionError(f"{field}={value!r}: {error!r}") from None
        return error.param
    try:
        check_request(from_openai(parsed), INFO, max_new_tokens=63, renders_messages=True)
    except InvalidGeneration as error:
        return openai_param(error)
    return None


def values() -> st.SearchStrategy[Any]:
    """In range, out of range, at the edges, and not numbers at all."""
    edges = st.sampled_from(
        [0, 1, -1, 2, -2, 0.5, 1000, 1001, -101, 100, 2**31 - 1, 2**31, 2**63, 2**64, -(2**63)]
    )
    return st.one_of(
        edges,
        st.integers(min_value=-(2**65), max_value=2**65),
        st.floats(allow_nan=False, allow_infinity=False, width=64),
        st.booleans(),
        st.text(max_size=5),
        st.lists(st.integers(min_value=-5, max_value=2000), max_size=4),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )


def as_websocket(field: str, value: Any) -> Any:
    """The WebSocket's value for what ``value`` means on the OpenAI door
    (``OPENAI_SYNONYMS``: vLLM's ``top_k: -1`` is 0 there)."""
    synonyms = OPENAI_SYNONYMS.get(field, {})
    return synonyms.get(value, value) if type(value) is int else value


def test_top_k_minus_one_is_off_on_the_openai_door_and_refused_on_the_websocket() -> None:
    """vLLM's "off" is taken where vLLM's clients (and SGLang's gateway)
    speak; the ExLlamaV2 protocol keeps its own range, naming the field."""
    assert openai_verdict("top_k", -1) is None
    assert websocket_verdict("top_k", -1) == "$.top_k"
    assert openai_verdict("top_k", -2) == "top_k"


@settings(max_examples=600, deadline=None)
@given(field=st.sampled_from(sorted(NAMES)), value=values())
def test_both_doors_give_the_same_verdict(field: str, value: Any) -> None:
    ws = websocket_verdict(field, as_websocket(field, value))
    openai = openai_verdict(NAMES[field], value)
    narrow = OPENAI_RANGES.get(field)
    if narrow is not None and ws is None and not narrow.contains(value):
        # Declared: OpenAI's documented range is narrower (checked at import
        # to lie within the declared one).
        assert openai == NAMES[field]
        return
    assert (ws is None) == (openai is None), (field, value, ws, openai)
    if ws is not None:
        assert ws.startswith(f"$.{field}"), ws
        assert openai is not None and openai.startswith(NAMES[field]), openai


#: The constraint fields of infer and the OpenAI door's field that is read by
#: the same rule (llama.cpp's json_schema and grammar, TabbyAPI's
#: regex_pattern, vLLM's guided_choice).
CONSTRAINT_NAMES = {
    "json_schema": "json_schema",
    "grammar": "grammar",
    "regex": "regex_pattern",
    "choice": "guided_choice",
}


def constraint_values() -> st.SearchStrategy[Any]:
    texts = st.text(max_size=8)
    return st.one_of(
        values(),
        st.just(""),
        st.just({}),
        texts,
        st.lists(texts, max_size=4),
        st.dictionaries(st.sampled_from(["type", "enum", "properties"]), texts, max_size=3),
        st.just("x" * 70_000),
        st.just(["c"] * 1025),
        st.just({"enum": ["x" * 100] * 700}),
    )


@settings(max_examples=400, deadline=None)
@given(field=st.sampled_from(sorted(CONSTRAINT_NAMES)), value=constraint_values())
def test_both_doors_give_constraints_the_same_verdict(field: str, value: Any) -> None:
    ws = websocket_verdict(field, value)
    openai = openai_verdict(CONSTRAINT_NAMES[field], value)
    assert (ws is None) == (openai is None), (field, value, ws, openai)
    if ws is not None:
        assert ws.startswith(f"$.{field}"), ws
        assert openai is not None and openai.startswith(CONSTRAINT_NAMES[field]), openai


def test_the_overrides_are_narrower() -> None:
    ranges = setting_ranges()
    for name, narrow in OPENAI_RANGES.items():
        wide = ranges[name]
        assert wide.lo <= narrow.lo <= narrow.hi <= wide.hi


def test_top_a_5000_is_refused_naming_top_a_on_both_doors() -> None:
    """The issue's report: top_a 5000 was taken by the OpenAI parser (range
    1e6), refused by the engine (1000) and answered 500."""
    assert websocket_verdict("top_a", 5000) == "$.top_a"
    assert openai_verdict("top_a", 5000) == "top_a"


# -- the pure steps of the one pipeline --------------------------------------------------------


def generation(**fields: Any) -> GenerationRequest:
    return GenerationRequest(**{"text": "x", "max_new_tokens": 4, **fields})


def test_trim_prompt() -> None:
    assert trim_prompt([1, 2, 3, 4, 5], 3, keep_first=False) == [3, 4, 5]
    assert trim_prompt([1, 2, 3, 4, 5], 3, keep_first=True) == [1, 4, 5]
    assert trim_prompt([1, 2, 3, 4, 5], 1, keep_first=True) == [1]
    assert trim_prompt([1, 2], 3, keep_first=True) == [1, 2]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=200),
    new=st.one_of(st.none(), st.integers(min_value=1, max_value=63)),
    bos=st.booleans(),
)
def test_fit_prompt_trims_to_the_context_or_refuses(n: int, new: int | None, bos: bool) -> None:
    ids = list(range(10, 10 + n))
    trimmed = generation(max_new_tokens=new, custom_bos="<s>" if bos else "")
    fitted, max_new = fit_prompt(trimmed, ids, INFO, max_new_tokens=63)
    assert len(fitted) + max_new <= INFO.context_length
    assert fitted == ids[len(ids) - len(fitted) :] or (bos and fitted[0] == ids[0])
    if new is not None:
        assert max_new == new
    refused = attrs.evolve(trimmed, fit="refuse")
    if n + (new or 1) <= INFO.context_length:
        assert fit_prompt(refused, ids, INFO, max_new_tokens=63) == (ids, max_new)
    else:
        with pytest.raises(InvalidGeneration) as error:
            fit_prompt(refused, ids, INFO, max_new_tokens=63)
        assert error.value.code == "context_length_exceeded"


def test_build_spec_adds_the_models_eos() -> None:
    request = generation(stop_strings=("\n",), stop_token_ids=(9,), banned_ids=(4,))
    spec = build_spec(7, request, [1, 2], INFO, max_new_tokens=3)
    assert (spec.job_id, spec.prompt_ids, spec.max_new_tokens) == (7, (1, 2), 3)
    assert spec.stop_token_ids == {2, 9}
    assert spec.banned_ids == {4}
    assert spec.stop_strings == ("\n",)


def test_check_request_names_the_field() -> None:
    for bad, field, index in [
        (generation(max_new_tokens=64), "max_new_tokens", None),
        (generation(banned_ids=(1, 1000)), "banned_ids", 1),
        (generation(stop_token_ids=(-1,)), "stop_token_ids", 0),
        (generation(prompt_ids=(5, 10**9)), "prompt", 1),
    ]:
        with pytest.raises(InvalidGeneration) as error:
            check_request(bad, INFO, max_new_tokens=63, renders_messages=False)
        assert (error.value.field, error.value.index) == (field, index)
    with pytest.raises(InvalidGeneration) as error:
        check_request(
            generation(messages=({"role": "user", "content": "hi"},)),
            INFO,
            max_new_tokens=63,
            renders_messages=False,
        )
    assert error.value.code == "no_chat_template"


# -- who a client is -------------------------------------------------------------------------


def head(peer: str, forwarded: str | None = None) -> RequestHead:
    headers = () if forwarded is None else ((b"x-forwarded-for", forwarded.encode()),)
    return RequestHead("GET", "/", "/", "", headers, "1.1", peer)


def test_client_address_trusts_only_trusted_proxies() -> None:
    trusted = parse_networks(["10.0.0.0/8", "::1"])
    # A client that sends the header itself, straight to the server: ignored.
    assert client_address(head("203.0.113.9:5000", "1.2.3.4"), trusted) == "203.0.113.9"
    # Behind a trusted proxy: the nearest untrusted hop, read from the right,
    # so a forged left part cannot choose the address.
    assert client_address(head("10.0.0.2:80", "6.6.6.6, 198.51.100.7"), trusted) == ("198.51.100.7")
    assert client_address(head("10.0.0.2:80", "198.51.100.7, 10.1.1.1"), trusted) == (
        "198.51.100.7"
    )
    assert client_address(head("[::1]:80", "[2001:db8::1]:443"), trusted) == "2001:db8::1"
    # Garbage in the header: trust stops there.
    assert client_address(head("10.0.0.2:80", "not-an-ip"), trusted) == "10.0.0.2"
    # No proxies configured: always the peer.
    assert client_address(head("10.0.0.2:80", "1.2.3.4"), ()) == "10.0.0.2"
    # A huge header is read only from the right, a bounded number of hops.
    many = ", ".join(["10.0.0.1"] * 100_000)
    assert client_address(head("10.0.0.2:80", many), trusted) == "10.0.0.1"


# -- end to end: both doors, the real model, real sockets ---------------------------------------

#: Boundary values for every shared field: the edges of its range, just
#: outside, and wrong types.
BOUNDARY: list[Any] = [0, 1, -1, 0.5, 2.5, 1000, 1001, 2**31, 2**64, "1", True, None, [1], {}]


async def http_post(port: int, path: str, payload: dict[str, Any]) -> tuple[int, Any]:
    body = json.dumps(payload).encode()
    async with connect(port) as client:
        await client.send(request("POST", path, {"Content-Type": "application/json"}, body=body))
        reply = await client.response("POST", within=60)
    assert reply is not None
    return reply.status, reply.json()


@pytest.mark.slow
async def test_no_client_input_is_a_server_error_on_either_door(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (_, listening), raw_client(listening.url) as ws:
        for field in sorted(NAMES):
            for value in BOUNDARY:
                frame = {
                    "action": "infer",
                    "text": "Hi",
                    "max_new_tokens": 1,
                    field: as_websocket(field, value),
                }
                reply = await ws.request(frame)
                assert reply.get("response_type") in ("full", "error"), reply
                if reply["response_type"] == "error":
                    assert reply["error"]["type"] == "invalid_request", (field, value, reply)
                status, body = await http_post(
                    listening.port,
                    "/v1/completions",
                    {"prompt": "Hi", "max_tokens": 1, NAMES[field]: value},
                )
                assert status in (200, 400), (field, value, status, body)
                ws_ok = reply["response_type"] == "full"
                narrow = OPENAI_RANGES.get(field)
                # null is "the default" on OpenAI's side, an error on ours.
                comparable = narrow is None or narrow.contains(value) or not ws_ok
                if comparable and value is not None:
                    assert ws_ok == (status == 200), (field, value, reply, body)


@pytest.mark.slow
async def test_one_client_cannot_take_the_last_slot_through_the_other_door(
    cpu_engine: CpuEngine,
) -> None:
    """A client holding its slot cap (``--max-running-per-client``, here all
    but one slot) over WebSocket gets no more through HTTP: on loopback, both
    doors are one client (the address)."""
    capacity = cpu_engine.info.max_batch
    async with (
        serving(cpu_engine, max_running_per_client=capacity - 1) as (server, listening),
        raw_client(listening.url) as ws,
    ):
        eos = sorted(cpu_engine.info.eos_token_ids)
        long = {
            "action": "infer",
            "text": "Tell me a long story.",
            "max_new_tokens": 400,
            "bann_bann": eos,
        }
        for i in range(capacity - 1):
            await ws.send({**long, "request_id": i, "stream": True})
        await wait_until(lambda: server.statistics().scheduler.running >= capacity - 1, 60)
        client: Hashable = server.identity.of(head(f"127.0.0.1:{listening.port}"))
        assert server.generations.in_flight(client) == capacity - 1
        async with trio.open_nursery() as nursery:

            async def over_http() -> None:
                await http_post(
                    listening.port, "/v1/completions", {"prompt": "Hi", "max_tokens": 4}
                )

            nursery.start_soon(over_http)
            await wait_until(lambda: server.statistics().scheduler.waiting >= 1, 30)
            # The HTTP job waits although a slot is free: the client holds its cap.
            stats = server.statistics().scheduler
            assert (stats.running, stats.waiting) == (capacity - 1, 1)
            await ws.send({"action": "stop"})


@pytest.mark.slow
async def test_one_key_is_one_client_on_both_doors_through_the_cli(model_dir: Any) -> None:
    """``python -m trioserve --api-key K --max-batch 3
    --max-running-per-client 2``: a WebSocket client holding the client's two
    slots sends its third request over HTTP with the same key: it waits
    although a slot is free, and the limit on requests per client counts both
    doors."""
    key = "k3y-one-client"
    args = ["--api-key", key, "--max-batch", "3", "--max-requests-per-client", "3"]
    args += ["--max-running-per-client", "2"]
    async with open_server_process(args) as server:
        url = f"{server.url}?api_key={key}"
        async with raw_client(url) as ws:
            eos = (await ws.request({"action": "info"}))["model"]["eos_token_ids"]
            # Banned end of sequence: these run until stopped, however fast.
            long = {
                "action": "infer",
                "text": "Tell me a long story.",
                "max_new_tokens": 2000,
                "bann_bann": eos,
            }
            for i in range(2):
                await ws.send({**long, "request_id": i, "stream": True, "compact_chunks": True})

            async def status() -> dict[str, Any]:
                await ws.send({"action": "info", "request_id": "s"})
                frame, _ = await ws.until("info")
                return dict(frame["status"])

            with trio.fail_after(120):
                while (await status())["running_jobs"] < 2:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
            async with trio.open_nursery() as nursery:
                replies: list[tuple[int, Any]] = []

                async def over_http() -> None:
                    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
                    async with connect(server.port) as http:
                        await http.send(request("POST", "/v1/completions", auth, body=body))
                        reply = await http.response("POST", within=120)
                    assert reply is not None
                    replies.append((reply.status, reply.json()))

                nursery.start_soon(over_http)
                with trio.fail_after(60):
                    while (await status())["waiting_jobs"] < 1:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                now = await status()
                assert (now["running_jobs"], now["waiting_jobs"]) == (2, 1)
                # A fourth request of the same client, on either door, is over its limit.
                body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
                async with connect(server.port) as http:
                    await http.send(request("POST", "/v1/completions", auth, body=body))
                    refused = await http.response("POST", within=60)
                assert refused is not None and refused.status == 429
                assert "requests in flight" in refused.json()["error"]["message"]
                await ws.send({"action": "stop", "request_id": "x"})
            assert replies and replies[0][0] == 200


def test_logit_bias_on_the_openai_door() -> None:
    parsed = oa.parse_completion_request(
        json.dumps({"prompt": "x", "logit_bias": {"7": -100, "3": 5.5}}).encode()
    )
    assert parsed.sampling_settings().logit_bias == ((3, 5.5), (7, -100.0))
    assert openai_verdict("logit_bias", {"1000000000": 1}) == "logit_bias"
    assert websocket_verdict("logit_bias", {"1000000000": 1}) == '$.logit_bias["1000000000"]'


@pytest.mark.slow
async def test_logit_bias_bans_and_forces_on_both_doors(cpu_engine: CpuEngine) -> None:
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    paris = cpu_engine.encode(" Paris")
    london = cpu_engine.encode(" London")
    assert len(paris) == 1 and len(london) == 1
    async with serving(cpu_engine) as (_, listening), raw_client(listening.url) as ws:
        for bias, check in (
            ({str(paris[0]): -100}, lambda text: "Paris" not in text),
            ({str(london[0]): 100}, lambda text: text.startswith(" London London")),
        ):
            frame = {"action": "infer", "text": prompt, "max_new_tokens": 8, "temperature": 0}
            final = await ws.request({**frame, "logit_bias": bias})
            status, body = await http_post(
                listening.port,
                "/v1/completions",
                {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logit_bias": bias},
            )
            assert status == 200, body
            text = body["choices"][0]["text"]
            assert check(final["response"]), final["response"]
            assert text == final["response"]
        plain = await ws.request(
            {"action": "infer", "text": prompt, "max_new_tokens": 8, "temperature": 0}
        )
        assert "Paris" in plain["response"]


async def test_models_report_the_same_limits_as_info(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (_, listening), raw_client(listening.url) as ws:
        info = await ws.request({"action": "info"})
        async with connect(listening.port) as client:
            await client.send(request("GET", "/v1/models"))
            reply = await client.response("GET")
        assert reply is not None and reply.status == 200
        (model,) = reply.json()["data"]
        # And llama-server's models array (Ollama's shape), for the clients that read it.
        (listed,) = reply.json()["models"]
        assert listed["name"] == listed["model"] == model["id"]
        assert model["max_model_len"] == info["model"]["context_length"]
        assert model["limits"] == info["limits"]
        # Which kernels run the model, the same words on both doors and in the log.
        assert model["kernels"] == info["model"]["kernels"] == cpu_engine.info.kernels
        path = native.path()
        if path is not None:  # the fixture's weights are 4-bit: on the kernels where they run
            assert model["kernels"] == f"native {path}"
        else:
            assert model["kernels"] == f"torch ({native.unavailable_reason()})"
        assert model["limits"]["max_stop_string_chars"] == oa.OpenAILimits().max_stop_string_chars


def test_a_bad_top_k_says_that_minus_one_is_taken_on_the_openai_doors() -> None:
    """The range alone (0 to 2^31-1) would read as if -1 were refused."""
    from trioserve.responses.requests import parse_responses_request

    with pytest.raises(oa.OpenAIError) as chat:
        oa.parse_completion_request(json.dumps({"prompt": "x", "top_k": -2}).encode())
    assert chat.value.param == "top_k"
    assert "-1 is taken for 0" in chat.value.message
    with pytest.raises(oa.OpenAIError) as responses:
        parse_responses_request({"model": "m", "input": "x", "top_k": -2})
    assert responses.value.param == "top_k"
    assert "-1 is taken for 0" in str(responses.value)
