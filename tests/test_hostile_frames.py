"""Issue 8 defect 2 over a real socket: the deeply nested frames that crashed
the server are answered with ``invalid_json``, the connection and every other
request go on, and the deepest values allowed still work end to end."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from trioserve import protocol as p

from .helpers import raw_client, running_server

if TYPE_CHECKING:
    from trioserve.engine.cpu import CpuEngine

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
