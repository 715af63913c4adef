"""vLLM's tokenizer routes (``/tokenize``, ``/detokenize``,
``/tokenizer_info``): the parsers refuse every bad body with a 400 naming
the field, and the real server on the embedded model answers with the ids a
completion's prompt becomes, bounded, behind the API key."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
import trio
from hypothesis import given

from trioserve.openai import (
    OpenAIError,
    TokenizerLimits,
    parse_detokenize_request,
    parse_tokenize_request,
)

from .helpers import running_server
from .strategies import json_values

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

LIMITS = TokenizerLimits()
KEY = "sk-tokenize"
MiB = 1024 * 1024


def refused(parse: Any, body: Any) -> OpenAIError:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(OpenAIError) as info:
        parse(data)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": 42}, "prompt"),
        ({"prompt": ["a"]}, "prompt"),
        ({"prompt": [1, 2]}, "prompt"),
        ({"prompt": "\ud800"}, "prompt"),
        ({"prompt": "x" * (LIMITS.max_chars + 1)}, "prompt"),
        ({"prompt": "x", "return_token_strs": "yes"}, "return_token_strs"),
        ({"prompt": "x", "messages": []}, "messages"),
        ({"prompt": "x", "tokens": [1]}, "tokens"),
        ({"prompt": "x", "surprise": 1}, "surprise"),
        ([], None),
        (b"\xff", None),
        (b'{"prompt": "x"', None),
        (b"[" * 100_000, None),
    ],
)
def test_bad_tokenize_bodies_are_400s_naming_the_field(body: Any, param: str | None) -> None:
    assert refused(parse_tokenize_request, body).param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "tokens"),
        ({"tokens": "1 2"}, "tokens"),
        ({"tokens": {"0": 1}}, "tokens"),
        ({"tokens": [1, 1000]}, "tokens[1]"),
        ({"tokens": [-1]}, "tokens[0]"),
        ({"tokens": [1, True]}, "tokens[1]"),
        ({"tokens": [1.5]}, "tokens[0]"),
        ({"tokens": [2**63]}, "tokens[0]"),
        ({"tokens": ["1"]}, "tokens[0]"),
        ({"tokens": [[1]]}, "tokens[0]"),
        ({"tokens": [0] * (LIMITS.max_ids + 1)}, "tokens"),
        ({"tokens": [1], "prompt": "x"}, "prompt"),
    ],
)
def test_bad_detokenize_bodies_are_400s_naming_the_field(body: Any, param: str) -> None:
    error = refused(lambda data: parse_detokenize_request(data, 1000), body)
    assert error.param == param


def test_good_bodies() -> None:
    parsed = parse_tokenize_request(
        b'{"model": "m", "prompt": "hi", "add_special_tokens": true, "return_token_strs": true}'
    )
    assert (parsed.prompt, parsed.return_token_strs) == ("hi", True)
    assert parse_detokenize_request(b'{"tokens": [0, 999, 7.0]}', 1000).tokens == (0, 999, 7)
    assert parse_detokenize_request(b'{"tokens": []}', 1000).tokens == ()


@given(json_values())
def test_any_json_is_parsed_or_refused_with_a_400(value: Any) -> None:
    for body in ({"prompt": value}, {"tokens": value}, value):
        data = json.dumps(body).encode()
        for parse in (parse_tokenize_request, lambda d: parse_detokenize_request(d, 1000)):
            error: OpenAIError | None = None
            try:
                parse(data)
            except OpenAIError as exc:
                error = exc
            assert error is None or error.status == 400


# -- the real server ------------------------------------------------------------------------


async def call(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request with the key; the status and the decoded answer."""
    data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n"
        )
        await stream.send_all(head.encode() + data)
        received = b""
        while chunk := await stream.receive_some():
            received += chunk
    head_bytes, _, payload = received.partition(b"\r\n\r\n")
    return int(head_bytes.split()[1]), json.loads(payload) if payload else None


async def test_the_routes_on_the_embedded_model(cpu_engine: CpuEngine) -> None:
    info = cpu_engine.info
    text = "Hello <|im_end|> wörld 😀 and\n\ttabs"
    ids = cpu_engine.encode(text)
    async with running_server(cpu_engine, api_key=KEY, max_message_bytes=2 * MiB) as listening:
        port = listening.port
        status, answer = await call(port, "POST", "/tokenize", {"prompt": text})
        assert status == 200
        assert answer == {
            "count": len(ids),
            "max_model_len": info.context_length,
            "tokens": ids,
            "token_strs": None,
        }
        assert 2 in ids  # a special token's text is its id, as in a completion's prompt
        status, answer = await call(
            port, "POST", "/tokenize", {"prompt": text, "return_token_strs": True}
        )
        assert answer["token_strs"] == [cpu_engine.decode([i]) for i in ids]
        status, answer = await call(port, "POST", "/detokenize", {"tokens": ids})
        assert (status, answer) == (200, {"prompt": text})
        status, answer = await call(port, "GET", "/tokenizer_info")
        assert status == 200
        assert answer["eos_token"] == "<|im_end|>" and answer["bos_token"] == "<|im_start|>"
        assert answer["model_max_length"] == info.context_length
        assert answer["vocab_size"] == info.vocab_size
        assert "<|im_start|>" in answer["chat_template"]

        # The worst inputs: the longest prompt, the most ids, one past each,
        # ids out of the vocabulary, a body over the limit, no key.
        longest = "🙂a " * (LIMITS.max_chars // 3)
        status, answer = await call(port, "POST", "/tokenize", {"prompt": longest})
        assert status == 200 and answer["count"] == len(cpu_engine.encode(longest))
        status, answer = await call(port, "POST", "/tokenize", {"prompt": "x" * 262_145})
        assert status == 400 and answer["error"]["param"] == "prompt"
        most = [info.vocab_size - 1] * LIMITS.max_ids
        status, answer = await call(port, "POST", "/detokenize", {"tokens": most})
        assert status == 200 and isinstance(answer["prompt"], str)
        status, answer = await call(port, "POST", "/detokenize", {"tokens": [*most, 0]})
        assert status == 400 and answer["error"]["param"] == "tokens"
        status, answer = await call(port, "POST", "/detokenize", {"tokens": [info.vocab_size]})
        assert status == 400 and answer["error"]["param"] == "tokens[0]"
        status, _ = await call(port, "POST", "/tokenize", b'{"prompt": "' + b"x" * 3 * MiB + b'"}')
        assert status == 413
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET /tokenizer_info HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await stream.receive_some()).startswith(b"HTTP/1.1 401")
        # The server still answers.
        status, answer = await call(port, "POST", "/tokenize", {"prompt": "ok"})
        assert (status, answer["tokens"]) == (200, cpu_engine.encode("ok"))
