"""trioserve sends what ExLlamaV2's server sends, key by key (issue 9).

Each request goes to a real server on the embedded model over a real socket;
the frames that come back are compared with the seed's sequence for the same
request (tests/exllamav2_reference.py): every key the seed sends must be
there with the seed's value, and only trioserve's documented extensions may
be added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.exllamav2_reference import SeedFrame, compare, seed_frames
from trioserve import protocol as p

from .helpers import RawClient, ScriptedEngine, chunks_of, raw_client, running_server

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

PARIS = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
STORY = "<|im_start|>user\nTell me a long story about a dragon.<|im_end|>\n<|im_start|>assistant\n"

#: Keys trioserve adds to the seed's frames (docs/protocol.md section 6).
EXTENSIONS: dict[str, set[str]] = {
    "echo": set(),
    "estimate_token": set(),
    "lefttrim_token": set(),
    "stop": {"stopped"},
    "chunk": set(),
    "full": {"eos_reason", "stop_string", "stop_token", "usage", "timing"},
}


async def exchange(ws: RawClient, request: dict[str, Any]) -> list[dict[str, Any]]:
    """Send one request; its frames up to its last."""
    await ws.send(request)
    if request["action"] != "infer":
        return [await ws.recv()]
    return await ws.recv_until_final(request_id=request.get("request_id"))


def check(
    frames: list[dict[str, Any]], request: dict[str, Any], expected: list[SeedFrame] | None = None
) -> None:
    added = compare(frames, expected or seed_frames(request))
    kinds = {f.get("response_type", f["action"]) for f in frames}
    allowed = set().union(*(EXTENSIONS[kind] for kind in kinds))
    assert added <= allowed, f"undocumented keys {added - allowed}"


IDS: list[dict[str, Any]] = [
    {},
    {"request_id": 7},
    {"response_id": "r"},
    {"request_id": [1, {"a": None}], "response_id": 2.5},
]


@pytest.mark.parametrize("ids", IDS)
async def test_quick_actions_answer_as_the_seed(cpu_engine: CpuEngine, ids: dict[str, Any]) -> None:
    requests = [
        {"action": "echo", **ids},
        {"action": "estimate_token", **ids, "text": PARIS},
        {"action": "lefttrim_token", **ids, "text": "The quick brown fox", "trimmed_length": 2},
        {"action": "lefttrim_token", **ids, "text": "The quick brown fox", "trimmed_length": 99},
        {"action": "stop", **ids},
    ]
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        for request in requests:
            frames = await exchange(ws, request)
            check(frames, request)
    # Values the seed gives them: the count without BOS, the text itself when
    # it fits.
    assert frames[0]["stopped"] == 0


async def test_token_counts_and_trims_are_the_seeds(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        count = await ws.request({"action": "estimate_token", "text": PARIS})
        fits = await ws.request(
            {"action": "lefttrim_token", "text": "The quick brown fox", "trimmed_length": 99}
        )
    assert count["num_tokens"] == len(cpu_engine.encode(PARIS))
    assert fits["trimmed_text"] == "The quick brown fox"


@pytest.mark.parametrize(
    "mode",
    [
        {},
        {"stream": True},
        {"stream": True, "stream_full": True},
        {"stream": False, "stream_full": True},
        {"stream": True, "customBos": "<|im_start|>system\nBe brief.<|im_end|>\n"},
    ],
)
async def test_infer_frames_are_the_seeds(cpu_engine: CpuEngine, mode: dict[str, Any]) -> None:
    request = {
        "action": "infer",
        "request_id": "q",
        "response_id": {"n": 1},
        "tag": ["t", 1],
        "text": PARIS,
        "max_new_tokens": 12,
        "temperature": 0,
        **mode,
    }
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        frames = await exchange(ws, request)
    check(frames, request)
    final = frames[-1]
    assert "Paris" in final["response"]
    if request.get("stream"):
        assert len(frames) > 2
        assert "".join(chunks_of(frames)) == final["response"]
        if request.get("stream_full"):
            so_far = ""
            for frame in frames[:-1]:
                so_far += frame["chunk"]
                assert frame["response"] == so_far
    else:
        assert len(frames) == 1


async def test_an_interrupted_stream_ends_as_the_seeds(cpu_engine: CpuEngine) -> None:
    request = {
        "action": "infer",
        "request_id": 1,
        "text": STORY,
        "max_new_tokens": 200,
        "stream": True,
        "seed": 3,
    }
    stop = {"action": "stop", "response_id": "s"}
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        await ws.send(request)
        frames = [await ws.recv(), await ws.recv()]  # two chunks: it is generating
        await ws.send(stop)
        reply, more = await ws.until("stop")
    frames += more
    check(frames, request)
    assert frames[-1]["stop_reason"] == "interrupted"
    assert "".join(chunks_of(frames)) == frames[-1]["response"]
    check([reply], stop)
    assert reply["stopped"] == 1


async def test_compact_chunks_leave_only_util_text_out(cpu_engine: CpuEngine) -> None:
    request = {
        "action": "infer",
        "request_id": "c",
        "text": PARIS,
        "max_new_tokens": 12,
        "temperature": 0,
        "stream": True,
        "compact_chunks": True,
    }
    expected = seed_frames(request)
    # The extension asks the seed's chunk frame to lose exactly util_text.
    chunk = expected[0]
    del chunk.keys["util_text"]
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        frames = await exchange(ws, request)
    check(frames, request, expected)
    assert all("util_text" not in f for f in frames[:-1])
    assert frames[-1]["util_text"] == PARIS


async def test_the_seeds_sequences_decode_with_the_codec(cpu_engine: CpuEngine) -> None:
    """A client built on trioserve.protocol reads seed-style frames: chunk
    frames with util_text, final frames with an empty chunk."""
    request = {"action": "infer", "text": PARIS, "max_new_tokens": 6, "stream": True}
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        frames = await exchange(ws, request)
    replies = [p.structure_reply(f) for f in frames]
    assert all(isinstance(r, p.InferChunk) and r.util_text == PARIS for r in replies[:-1])
    final = replies[-1]
    assert isinstance(final, p.InferFinal) and final.chunk == ""
    assert [p.unstructure_reply(r) for r in replies] == frames


async def test_messages_are_checked_then_rendered_with_the_models_template(
    cpu_engine: CpuEngine,
) -> None:
    """``messages`` is validated by the protocol and rendered by the server with
    the model's own chat template (issue 10): the same answer as the ChatML
    text a client would have written by hand, and util_text is the rendering."""
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        bad = await ws.request(
            {"action": "infer", "request_id": 1, "messages": [{"role": ""}], "max_new_tokens": 4}
        )
        both = await ws.request(
            {"action": "infer", "request_id": 2, "messages": chat, "text": "x", "max_new_tokens": 4}
        )
        await ws.send(
            {
                "action": "infer",
                "request_id": 3,
                "messages": chat,
                "max_new_tokens": 20,
                "temperature": 0,
            }
        )
        (rendered,) = await ws.recv_until_final(request_id=3)
    assert bad["error"]["field"] == "$.messages[0].role"
    assert both["error"]["message"] == "give exactly one of text and messages, not both"
    assert rendered["response_type"] == "full", rendered
    assert rendered["response"] == "The capital of France is Paris."
    # SmolLM2's template adds its default system prompt, then the turn.
    assert rendered["util_text"].startswith("<|im_start|>system\n")
    assert rendered["util_text"].endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


async def test_messages_need_a_chat_template() -> None:
    """A model without a template answers messages with invalid_request on $.messages."""
    chat = [{"role": "user", "content": "Hi!"}]
    async with running_server(ScriptedEngine()) as listening, raw_client(listening.url) as ws:
        refused = await ws.request(
            {"action": "infer", "request_id": 3, "messages": chat, "max_new_tokens": 4}
        )
    assert refused["error"]["type"] == "invalid_request"
    assert refused["error"]["field"] == "$.messages"
