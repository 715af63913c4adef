"""``python -m trioserve`` on the embedded model, as an operator and the
ecosystem's clients meet it: curl on /health, a Prometheus scrape, the
``openai`` SDK (streamed and not), a WebSocket client on the same port, and
the access log line of each request."""

from __future__ import annotations

import json
import shutil
import subprocess

import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from .helpers import raw_client
from .http_helpers import get
from .serverproc import open_server_process

pytestmark = pytest.mark.usefixtures("model_dir")

QUESTION = "What is the capital of France?"


def _counter(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def _curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["curl", "-sS", "--max-time", "30", *args], capture_output=True, text=True, check=False
    )


@pytest.mark.slow
async def test_curl_prometheus_and_the_openai_sdk_against_the_cli() -> None:
    args = ["--context-length", "512", "--log-format", "json"]
    async with open_server_process(args) as server:
        base = f"http://127.0.0.1:{server.port}"
        if shutil.which("curl") is not None:
            health = await trio.to_thread.run_sync(_curl, "-i", f"{base}/health")
            assert health.stdout.startswith("HTTP/1.1 200"), health.stdout
            # (text mode turned the CRLFs into newlines)
            assert json.loads(health.stdout.split("\n\n", 1)[1]) == {"status": "ok"}
            ready = await trio.to_thread.run_sync(_curl, "-fsS", f"{base}/ready")
            assert json.loads(ready.stdout) == {"status": "ready"}

        def use_the_sdk() -> tuple[str, str, int, str]:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            models = [m.id for m in client.models.list()]
            assert models == ["SmolLM2-135M-Instruct"]
            plain = client.chat.completions.create(
                model=models[0],
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=20,
                temperature=0,
            )
            streamed = client.chat.completions.create(
                model=models[0],
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=20,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            parts: list[str] = []
            usage_tokens = -1
            for chunk in streamed:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
            content = plain.choices[0].message.content or ""
            assert plain.usage is not None
            assert plain.usage.completion_tokens == usage_tokens
            assert plain.choices[0].finish_reason == "stop"
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(
                    model=models[0],
                    messages=[{"role": "user", "content": QUESTION}],
                    max_tokens=0,
                )
            text = client.completions.create(
                model=models[0], prompt="The capital of France is", max_tokens=3, temperature=0
            )
            return content, "".join(parts), usage_tokens, text.choices[0].text

        content, streamed, tokens, completion = await trio.to_thread.run_sync(use_the_sdk)
        assert content == "The capital of France is Paris."
        assert streamed == content and tokens >= 8
        assert completion.strip()

        # The same port speaks the WebSocket protocol, with the model's template.
        async with raw_client(server.url) as ws:
            await ws.send(
                {
                    "action": "infer",
                    "messages": [{"role": "user", "content": QUESTION}],
                    "max_new_tokens": 20,
                    "temperature": 0,
                    "request_id": "ws",
                }
            )
            (final,) = await ws.recv_until_final(request_id="ws")
        assert final["response"] == content

        scrape = (await get(server.port, "/metrics")).body.decode()
        assert (
            _counter(scrape, "trioserve_requests_total", api="openai", action="chat_completions")
            == 3
        )
        assert (
            _counter(
                scrape,
                "trioserve_requests_total",
                api="openai",
                action="completions",
                outcome="num_tokens",
            )
            == 1
        )
        assert (
            _counter(
                scrape, "trioserve_requests_total", api="websocket", action="infer", outcome="eos"
            )
            == 1
        )
        assert _counter(scrape, "trioserve_time_to_first_token_seconds_count", api="openai") == 3
        assert _counter(scrape, "trioserve_generated_tokens_total", api="openai") >= 2 * tokens
        # The engine's own figures, read on its thread after each step.
        # The 4-bit layers (63 MiB) and the 8-bit vocabulary projection (27 MiB);
        # the bfloat16 embedding table is mapped from its file, not counted.
        weight_bytes = _counter(scrape, "trioserve_engine_weight_bytes")
        assert 85 * 2**20 < weight_bytes < 95 * 2**20, weight_bytes
        assert _counter(scrape, "trioserve_engine_kv_cache_bytes") == 0  # nothing runs now
        assert _counter(scrape, "trioserve_prefix_cache_capacity_bytes") == 128 * 2**20
        # Four generations (2 chats, 1 completion, 1 infer; the third chat was
        # refused) each looked the cache up once.
        assert _counter(scrape, "trioserve_prefix_cache_lookups_total") == 4

    # One access-log line per finished request, as JSON, without the prompt.
    records = [json.loads(line) for line in server.log if line.startswith("{")]
    done = [r for r in records if r.get("logger") == "trioserve.access"]
    infer = [r for r in done if r.get("action") == "infer"]
    assert len(infer) == 1 and infer[0]["stop_reason"] == "eos"
    assert infer[0]["generated_tokens"] == final["usage"]["generated_tokens"]
    chats = [r for r in done if r.get("action") == "chat_completions"]
    assert [r["outcome"] for r in chats] == ["eos", "eos", "invalid_request"]
    assert all(r["api"] == "openai" and r["peer"].startswith("127.0.0.1:") for r in chats)
    assert all("prompt" not in r for r in done)
    assert QUESTION not in "\n".join(server.log)
