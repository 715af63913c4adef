"""Issue 8 defect 2 over a real socket: the deeply nested frames that crashed
the server are answered with ``invalid_json``, the connection and every other
request go on, and the deepest values allowed still work end to end."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from trioserve import protocol as p

from .helpers import raw_client, running_server

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

PROMPT = "<|im_start|>user\nTell me a long story about a dragon.<|im_end|>\n<|im_start|>assistant\n"


def nested(depth: int) -> str:
    return "[" * depth + '"x"' + "]" * depth


async def test_deep_frames_are_invalid_json_and_harm_nothing(cpu_engine: CpuEngine) -> None:
    deep = nested(350)
    worst = [
        '{"action":"echo","request_id":' + nested(979) + "}",
        '{"action":"echo","response_id":' + nested(979) + "}",
        '{"action":"infer","request_id":' + deep + ',"text":"hi","max_new_tokens":4}',
        '{"action":"infer","tag":' + deep + ',"text":"hi","max_new_tokens":4}',
        '{"action":"stop","target":' + deep + "}",
        '{"action":"info","request_id":' + nested(5000) + "}",
        '{"action":"nope","request_id":' + nested(979) + "}",
        "[" * 100_000,
    ]
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        # A request in flight that the bad frames must not disturb.
        await ws.send(
            {"action": "infer", "request_id": "bystander", "text": PROMPT, "max_new_tokens": 24}
        )
        bystander: list[dict[str, Any]] = []
        for frame in worst:
            await ws.send(frame)
            reply = await ws.recv()
            while reply.get("request_id") == "bystander":
                bystander.append(reply)
                reply = await ws.recv()
            assert reply["response_type"] == "error"
            assert reply["error"]["type"] == "invalid_json"
            assert "nested too deeply" in reply["error"]["message"]
            assert set(reply) == {"action", "response_type", "error"}
        if not bystander:
            bystander = await ws.recv_until_final(request_id="bystander")
        assert bystander[-1]["stop_reason"] in ("eos", "num_tokens")
        assert await ws.request({"action": "echo", "request_id": 1}) == {
            "action": "echo",
            "request_id": 1,
        }


async def test_the_deepest_ids_allowed_echo_and_stop(cpu_engine: CpuEngine) -> None:
    # The frame is one level: an id may nest 63 more, and must round-trip.
    deepest: Any = json.loads(nested(p.MAX_JSON_DEPTH - 1))
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        echo = await ws.request({"action": "echo", "request_id": deepest, "response_id": deepest})
        assert echo == {"action": "echo", "request_id": deepest, "response_id": deepest}
        await ws.send(
            {
                "action": "infer",
                "request_id": deepest,
                "tag": deepest,
                "text": PROMPT,
                "max_new_tokens": 200,
                "stream": True,
            }
        )
        first = await ws.recv()
        assert first["request_id"] == deepest and first["tag"] == deepest
        await ws.send({"action": "stop", "request_id": "s", "target": deepest})
        reply, frames = await ws.until("stop")
        assert reply == {"action": "stop", "request_id": "s", "stopped": 1}
        assert frames[-1]["stop_reason"] == "interrupted"
        assert frames[-1]["request_id"] == deepest


async def test_extreme_sampler_values_share_a_batch_harmlessly(cpu_engine: CpuEngine) -> None:
    """Issue 8 defect 3: values that overflowed the sampler failed every job
    of the step. Now the edges of each range run, in one batch with a
    bystander; beyond them is an invalid_request naming the field."""
    edges: list[dict[str, Any]] = [
        {"top_k": 2**31 - 1, "temperature": 1000, "top_a": 1000, "skew": 100},
        {"top_k": 0, "top_p": 1e-300, "temperature": 1e-300, "rep_pen": 0.01},
        {"rep_pen": 100, "freq_pen": -100, "pres_pen": 100, "skew": -100, "min_p": 1e-300},
        {"freq_pen": 100, "pres_pen": -100, "typical": 1e-300, "seed": 2**64 - 1},
    ]
    beyond = [("top_k", 2**63), ("temperature", 1e308), ("rep_pen", 1e-300), ("pres_pen", -1e308)]
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        await ws.send({"action": "infer", "request_id": "b", "text": PROMPT, "max_new_tokens": 8})
        for index, fields in enumerate(edges):
            await ws.send(
                {"action": "infer", "request_id": index, "text": PROMPT, "max_new_tokens": 8}
                | fields
            )
        for field, value in beyond:
            await ws.send(
                {"action": "infer", "request_id": field, "text": PROMPT, "max_new_tokens": 8}
                | {field: value}
            )
        finals: dict[str, dict[str, Any]] = {}
        while len(finals) < 1 + len(edges) + len(beyond):
            frame = await ws.recv(within=120)
            finals[json.dumps(frame["request_id"])] = frame
    for field, _ in beyond:
        error = finals[json.dumps(field)]
        assert error["error"]["type"] == "invalid_request"
        assert error["error"]["field"] == f"$.{field}"
    for key in ["b", *range(len(edges))]:
        final = finals[json.dumps(key)]
        assert final["response_type"] == "full", final
        assert final["usage"]["generated_tokens"] >= 1
