"""End to end: the real embedded model (SmolLM2, bfloat16, CPU) over real sockets.

Greedy text is deterministic for one dtype; tests assert structure and
relations between runs, not exact model text, except the one well-known
answer (Paris).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

from .helpers import chunks_of, raw_client, server_in_thread, serving, wait_until

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

EOS = 2


def chat(prompt: str) -> str:
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


PARIS = chat("What is the capital of France?")
TIPS = chat("Give me three tips for staying healthy.")
STORY = chat("Tell me a long story about a dragon.")


def infer(text: str, max_new_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"action": "infer", "text": text, "max_new_tokens": max_new_tokens, **fields}


@pytest.fixture(scope="module")
def small_engine(model_dir: Path) -> Iterator[CpuEngine]:
    """The same model with a 64-token context, for trimming."""
    from trioserve.engine.cpu.engine import CpuEngine

    engine = CpuEngine.load(model_dir, context_length=64, max_batch=2)
    yield engine
    engine.close()


async def test_quick_actions(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (_, listening), raw_client(listening.url) as ws:
        assert await ws.request({"action": "echo", "request_id": [1], "response_id": "r"}) == {
            "action": "echo",
            "request_id": [1],
            "response_id": "r",
        }
        count = await ws.request({"action": "estimate_token", "text": PARIS})
        assert count["num_tokens"] == len(cpu_engine.encode(PARIS))
        # Special-token strings are one token each, as in infer's prompt.
        special = await ws.request({"action": "estimate_token", "text": "<|im_start|><|im_end|>"})
        assert special["num_tokens"] == 2
        text = "The quick brown fox jumps over the lazy dog"
        ids = cpu_engine.encode(text)
        trim = {"action": "lefttrim_token", "text": text}
        three = await ws.request({**trim, "trimmed_length": 3})
        assert (
            three["trimmed_text"]
            == cpu_engine.decode(ids[-3:])
            == " over the lazy dog"[-len(three["trimmed_text"]) :]
        )
        assert text.endswith(three["trimmed_text"])
        assert (await ws.request({**trim, "trimmed_length": 0}))["trimmed_text"] == ""
        assert (await ws.request({**trim, "trimmed_length": len(ids)}))["trimmed_text"] == text
        info = await ws.request({"action": "info"})
        assert info["model"]["name"] == "SmolLM2-135M-Instruct"
        assert info["model"]["engine"] == "cpu"
        assert info["model"]["eos_token_ids"] == [EOS]
        assert info["model"]["vocab_size"] == 49152
        assert info["limits"]["max_new_tokens"] == info["model"]["context_length"] - 1


@pytest.mark.parametrize("mode", ["plain", "stream", "stream_full"])
async def test_greedy_answer_in_every_mode(cpu_engine: CpuEngine, mode: str) -> None:
    fields = {"temperature": 0, "request_id": mode, "tag": {"mode": mode}}
    if mode != "plain":
        fields["stream"] = True
    if mode == "stream_full":
        fields["stream_full"] = True
    async with serving(cpu_engine) as (_, listening), raw_client(listening.url) as ws:
        await ws.send(infer(PARIS, 40, **fields))
        frames = await ws.recv_until_final(request_id=mode)
    final = frames[-1]
    assert "Paris" in final["response"]
    assert (final["stop_reason"], final["eos_reason"], final["stop_token"]) == (
        "eos",
        "stop_token",
        EOS,
    )
    assert final["util_text"] == PARIS
    assert final["usage"]["prompt_tokens"] == len(cpu_engine.encode(PARIS))
    assert all(frame["tag"] == {"mode": mode} for frame in frames)
    if mode == "plain":
        assert len(frames) == 1
    else:
        assert len(frames) > 2
        assert "".join(chunks_of(frames)) == final["response"]
        if mode == "stream_full":
            assert frames[-2]["response"] == final["response"]


@pytest.mark.slow
async def test_stop_string_found_in_one_run_cuts_the_next_there(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (_, listening), raw_client(listening.url) as ws:
        first = await ws.request(infer(TIPS, 60, temperature=0))
        whole = first["response"]
        assert first["stop_reason"] == "num_tokens" and len(whole) > 60
        # A stop string from the middle of the text: it spans tokens and
        # starts (and ends) inside words.
        stop = whole[31:40]
        await ws.send(infer(TIPS, 60, temperature=0, stream=True, stop_conditions=[stop]))
        frames = await ws.recv_until_final()
    final = frames[-1]
    assert final["response"] == whole[: whole.index(stop)]
    assert "".join(chunks_of(frames)) == final["response"]
    assert (final["stop_reason"], final["eos_reason"], final["stop_string"]) == (
        "eos",
        "stop_string",
        stop,
    )


@pytest.mark.slow
async def test_stop_token_and_banned_tokens(cpu_engine: CpuEngine) -> None:
    the = cpu_engine.encode("The")
    assert len(the) == 1
    async with serving(cpu_engine) as (_, listening), raw_client(listening.url) as ws:
        plain = await ws.request(infer(PARIS, 40, temperature=0))
        assert plain["response"].startswith("The capital")
        banned = await ws.request(infer(PARIS, 40, temperature=0, bann_bann=the))
        assert banned["response"] and not banned["response"].startswith("The")
        capital = cpu_engine.encode(" capital")[0]
        stopped = await ws.request(infer(PARIS, 40, temperature=0, stop_conditions=[capital]))
        assert stopped["response"] == "The"
        assert (stopped["eos_reason"], stopped["stop_token"]) == ("stop_token", capital)
        assert stopped["usage"]["generated_tokens"] == 2


@pytest.mark.slow
async def test_seed_makes_sampling_reproducible(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (_, listening), raw_client(listening.url) as ws:
        runs = [
            await ws.request(infer(STORY, 30, temperature=1.0, top_p=1, top_k=0, seed=seed))
            for seed in (11, 11, 12)
        ]
    assert runs[0]["response"] == runs[1]["response"]
    assert runs[0]["response"] != runs[2]["response"]


@pytest.mark.slow
async def test_new_samplers_over_the_socket(cpu_engine: CpuEngine) -> None:
    """DRY, logit_bias and mirostat through ``infer``; a bad value of each
    is an ``invalid_request`` naming the field, and the connection goes on."""
    prompt = "I like cats. I like dogs. I like"
    (paris,) = cpu_engine.encode(" Paris")
    async with serving(cpu_engine) as (_, listening), raw_client(listening.url) as ws:
        loop = await ws.request(infer(prompt, 40, temperature=0, rep_pen=1))
        assert loop["response"].count(" I'm a cat.") >= 4
        dry = await ws.request(
            infer(
                prompt,
                40,
                temperature=0,
                rep_pen=1,
                dry_multiplier=0.8,
                dry_sequence_breakers=["\n"],
            )
        )
        assert dry["response"].count(" I'm a cat.") <= 1, dry["response"]
        plain = await ws.request(infer(PARIS, 12, temperature=0))
        assert "Paris" in plain["response"]
        banned = await ws.request(infer(PARIS, 12, temperature=0, logit_bias={str(paris): -100}))
        assert "Paris" not in banned["response"]
        forced = await ws.request(
            infer(PARIS, 3, temperature=1, seed=5, logit_bias={str(paris): 100})
        )
        assert forced["response"] == " Paris" * 3
        miro = [
            await ws.request(
                infer(STORY, 16, temperature=1, top_k=0, top_p=1, mirostat=True, seed=9)
            )
            for _ in range(2)
        ]
        assert miro[0]["response"] == miro[1]["response"] != ""
        for field, bad in [
            ("logit_bias", {"1000000000": 5}),
            ("logit_bias", {"abc": 5}),
            # (100,000 would exceed the frame limit; the codec tests have them.)
            ("dry_sequence_breakers", ["x"] * 20_000),
            ("mirostat_tau", -1),
            ("dry_range", 5),
        ]:
            reply = await ws.request(infer(PARIS, 4, **{field: bad}, request_id=field))
            assert reply["error"]["type"] == "invalid_request", reply
            assert reply["error"]["field"].startswith(f"$.{field}"), reply
            assert reply["error"]["message"].startswith(field), reply
        assert (await ws.request(infer(PARIS, 2, temperature=0)))["response"]


async def test_trimming_with_and_without_custom_bos(small_engine: CpuEngine) -> None:
    text = " ".join(f"word{i}" for i in range(60))
    ids = small_engine.encode(text)
    assert len(ids) > 64
    async with serving(small_engine) as (_, listening), raw_client(listening.url) as ws:
        plain = await ws.request(infer(text, 16, temperature=0))
        bos = await ws.request(infer(text, 16, temperature=0, customBos="<|im_start|>"))
        refused = await ws.request(infer(text, 64))
    assert plain["util_text"] == small_engine.decode(ids[-48:])
    assert plain["usage"]["prompt_tokens"] == 48
    assert plain["usage"]["trimmed_tokens"] == len(ids) - 48
    assert bos["util_text"] == "<|im_start|>" + small_engine.decode(ids[-47:])
    assert bos["usage"]["prompt_tokens"] == 48
    assert bos["usage"]["trimmed_tokens"] == len(ids) + 1 - 48
    assert refused["response_type"] == "error"
    assert refused["error"]["field"] == "$.max_new_tokens"


async def test_stop_with_and_without_target_and_from_another_connection(
    cpu_engine: CpuEngine,
) -> None:
    endless = {"temperature": 0, "bann_bann": [EOS], "stream": True}
    async with serving(cpu_engine) as (server, listening):
        async with raw_client(listening.url) as a, raw_client(listening.url) as b:
            await b.send(infer(STORY, 24, request_id="b", **endless))
            await a.send(infer(STORY, 2000, request_id="r1", **endless))
            await a.send(infer(TIPS, 2000, request_id="r2", **endless))
            streaming: set[str] = set()
            while streaming != {"r1", "r2"}:
                streaming.add((await a.recv())["request_id"])
            # A stop from b touches nothing of a.
            await b.send({"action": "stop", "target": "r1"})
            reply, b_frames = await b.until("stop")
            assert reply == {"action": "stop", "stopped": 0}
            await a.send({"action": "stop", "target": "r1", "request_id": "s1"})
            reply, frames = await a.until("stop")
            assert reply == {"action": "stop", "request_id": "s1", "stopped": 1}
            r1 = [f for f in frames if f["request_id"] == "r1" and f["response_type"] == "full"]
            assert len(r1) == 1 and r1[0]["stop_reason"] == "interrupted"
            # r2 goes on streaming.
            while (frame := await a.recv())["request_id"] != "r2":
                pass
            assert frame["response_type"] == "chunk"
            await a.send({"action": "stop"})
            reply, frames = await a.until("stop")
            assert reply == {"action": "stop", "stopped": 1}
            assert [f["request_id"] for f in frames if f["response_type"] == "full"] == ["r2"]
            while not b_frames or b_frames[-1]["response_type"] != "full":
                b_frames.append(await b.recv())
            assert b_frames[-1]["stop_reason"] == "num_tokens"
            assert b_frames[-1]["usage"]["generated_tokens"] == 24
            assert "".join(chunks_of(b_frames)) == b_frames[-1]["response"]
        await wait_until(lambda: server.statistics().scheduler.running == 0)


async def test_disconnect_mid_stream_frees_the_slot(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (server, listening):
        async with raw_client(listening.url) as ws:
            for _ in range(3):
                await ws.send(infer(STORY, 3000, temperature=0, bann_bann=[EOS], stream=True))
            for _ in range(3):
                await ws.recv()
            assert server.statistics().scheduler.running == 3
        await wait_until(lambda: server.statistics().scheduler.running == 0)
        # All eight slots are free again: eight jobs run side by side.
        async with raw_client(listening.url) as ws:
            for i in range(8):
                await ws.send(infer(PARIS, 6, temperature=0, request_id=i))
            finals = [await ws.recv() for _ in range(8)]
        assert sorted(f["request_id"] for f in finals) == list(range(8))
        assert all(f["stop_reason"] == "num_tokens" for f in finals)
        assert all(f["timing"]["queued_s"] < f["timing"]["total_s"] for f in finals)
        assert server.statistics().scheduler.served >= 8


async def test_echo_is_answered_while_a_long_infer_runs(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (server, listening):
        async with raw_client(listening.url) as a, raw_client(listening.url) as b:
            await a.send(infer(STORY, 200, temperature=0, bann_bann=[EOS], stream=True))
            await a.recv()
            served = server.statistics().scheduler.served
            for _ in range(5):
                assert await b.request({"action": "echo"}) == {"action": "echo"}
            # The infer was still running while all five echoes came back.
            assert server.statistics().scheduler.running == 1
            assert server.statistics().scheduler.served == served
            await a.send({"action": "stop"})


async def test_errors_against_the_real_model(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine, max_requests_per_connection=1) as (_, listening):
        async with raw_client(listening.url) as ws:
            reply = await ws.request("{'single': 'quotes'}")
            assert reply["error"]["type"] == "invalid_json"
            reply = await ws.request({"action": "generate", "request_id": 5})
            assert (reply["error"]["type"], reply["request_id"]) == ("unknown_action", 5)
            reply = await ws.request(infer(PARIS, 10, top_p=1.5, tag="t"))
            assert (reply["error"]["type"], reply["error"]["field"], reply["tag"]) == (
                "invalid_request",
                "$.top_p",
                "t",
            )
            reply = await ws.request(infer(PARIS, 8192))
            assert reply["error"]["field"] == "$.max_new_tokens"
            await ws.send(infer(STORY, 500, bann_bann=[EOS], stream=True, request_id=1))
            await ws.recv()
            await ws.send(infer(PARIS, 5, request_id=2))
            while (frame := await ws.recv())["request_id"] != 2:
                pass
            assert frame["error"]["type"] == "overloaded"
            await ws.send({"action": "stop"})
            while (await ws.recv())["action"] != "stop":
                pass


async def test_token_healing_continues_a_cut_word(cpu_engine: CpuEngine) -> None:
    prompt = chat("What is the capital of France?") + "The capital of France is Par"
    async with serving(cpu_engine) as (_, listening), raw_client(listening.url) as ws:
        healed = await ws.request(infer(prompt, 6, temperature=0, token_healing=True))
    # Healing regenerates the cut token's text; only the new part is sent.
    assert healed["response"].startswith("is")
    assert healed["usage"]["prompt_tokens"] == len(cpu_engine.encode(prompt)) - 1


def test_the_seeds_own_client_runs_unchanged(cpu_engine: CpuEngine) -> None:
    """An asyncio client on the `websockets` library, written the way clients
    of ExLlamaV2's server are: the seed's request fields, streaming."""
    import websockets

    request = {
        "action": "infer",
        "request_id": "seed-1",
        "response_id": 42,
        "text": PARIS,
        "max_new_tokens": 40,
        "stream": True,
        "stream_full": False,
        "top_p": 0.8,
        "top_k": 100,
        "temperature": 0.0,
        "rep_pen": 1.05,
        "tag": "chat",
        "stop_conditions": ["<|im_end|>"],
    }

    async def client(url: str) -> list[dict[str, Any]]:
        received = []
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"action": "echo", "request_id": "ping"}))
            received.append(json.loads(await ws.recv()))
            await ws.send(json.dumps(request))
            while True:
                frame = json.loads(await ws.recv())
                received.append(frame)
                if frame.get("response_type") == "full":
                    return received

    with server_in_thread(lambda: cpu_engine) as (listening, _, _):
        frames = asyncio.run(client(listening.url))
    assert frames[0] == {"action": "echo", "request_id": "ping"}
    final = frames[-1]
    assert final["request_id"] == "seed-1" and final["response_id"] == 42
    assert final["tag"] == "chat"
    assert "Paris" in final["response"]
    assert "".join(f["chunk"] for f in frames[1:-1]) == final["response"]
    assert final["stop_reason"] == "eos"


@pytest.mark.trio
async def test_many_clients_share_the_engine(cpu_engine: CpuEngine) -> None:
    results: dict[int, dict[str, Any]] = {}

    async def one(i: int, url: str) -> None:
        async with raw_client(url) as ws:
            results[i] = await ws.request(infer(PARIS, 12, temperature=0, request_id=i))

    async with serving(cpu_engine) as (_, listening):
        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(one, i, listening.url)
    responses = {r["response"] for r in results.values()}
    # Greedy, same prompt: every client got the same text, batched or not.
    assert len(results) == 12 and len(responses) == 1
    assert "Paris" in responses.pop()
