"""vLLM's and SGLang's request fields on the real embedded model over a real
socket, sent by the OpenAI SDK unchanged (``extra_body``, as their users
send them), and the figures endpoint pickers read from ``/metrics``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from .helpers import running_server

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

TEMPLATE = str(Path(__file__).parent / "templates" / "chatml_thinking.jinja")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREETING = [{"role": "user", "content": "Say hi"}]


def sdk(port: int, key: str = "x") -> Any:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)


def scrape(port: int, key: str | None = None) -> dict[str, float]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=30) as reply:
        text = reply.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("vllm:")
    }


async def test_each_field_changes_the_reply_as_its_server_documents(
    cpu_engine: CpuEngine,
) -> None:
    async with running_server(cpu_engine) as listening:

        def flow() -> None:
            client = sdk(listening.port)
            chat = client.chat.completions.create
            # ignore_eos: the model's turn ends early; with it, the reply runs to max_tokens.
            ended = chat(model="m", messages=GREETING, max_tokens=40, temperature=0)
            assert ended.choices[0].finish_reason == "stop"
            assert ended.usage.completion_tokens < 40
            long = chat(
                model="m",
                messages=GREETING,
                max_tokens=40,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert long.choices[0].finish_reason == "length"
            assert long.usage.completion_tokens == 40
            text = long.choices[0].message.content
            # Past the turn's end the model opens a turn of its own: its special
            # tokens are left out by default, written with skip_special_tokens false.
            raw = (
                chat(
                    model="m",
                    messages=GREETING,
                    max_tokens=40,
                    temperature=0,
                    extra_body={"ignore_eos": True, "skip_special_tokens": False},
                )
                .choices[0]
                .message.content
            )
            assert "<|im_end|>" in raw and "<|im_end|>" not in text
            assert raw.replace("<|im_end|>", "").replace("<|im_start|>", "") == text
            assert text.startswith(ended.choices[0].message.content)
            # no_stop_trim (SGLang) and include_stop_str_in_output (vLLM).
            cut = chat(model="m", messages=QUESTION, max_tokens=30, temperature=0, stop=["Paris"])
            kept = chat(
                model="m",
                messages=QUESTION,
                max_tokens=30,
                temperature=0,
                stop=["Paris"],
                extra_body={"no_stop_trim": True},
            )
            assert kept.choices[0].finish_reason == "stop"
            assert kept.choices[0].message.content == cut.choices[0].message.content + "Paris"
            streamed = client.completions.create(
                model="m",
                prompt="The capital of France is",
                max_tokens=10,
                temperature=0,
                stop=[" Paris"],
                stream=True,
                extra_body={"include_stop_str_in_output": True},
            )
            assert "".join(c.choices[0].text for c in streamed if c.choices).endswith(" Paris")
            # continue_final_message: the assistant's words are continued, not repeated.
            prefix = "The capital of France is"
            continued = chat(
                model="m",
                messages=[*QUESTION, {"role": "assistant", "content": prefix}],
                max_tokens=8,
                temperature=0,
                extra_body={"continue_final_message": True, "add_generation_prompt": False},
            )
            said = continued.choices[0].message.content
            assert "Paris" in said and not said.startswith(prefix)
            # SGLang's gateway defaults and a refused value, through the SDK.
            same = chat(
                model="m",
                messages=QUESTION,
                max_tokens=30,
                temperature=0,
                stop=["Paris"],
                extra_body={"return_hidden_states": False, "priority": 0, "top_k": -1},
            )
            assert same.choices[0].message.content == cut.choices[0].message.content
            with pytest.raises(openai.BadRequestError) as refused:
                chat(model="m", messages=QUESTION, extra_body={"return_hidden_states": True})
            assert refused.value.body["param"] == "return_hidden_states"  # type: ignore[index]
            # The Responses door takes what the gateway writes into its bodies.
            response = client.responses.create(
                model="m",
                input="Say hi",
                max_output_tokens=30,
                temperature=0,
                extra_body={"ignore_eos": True, "top_k": -1, "repetition_penalty": 1.0},
            )
            assert response.usage.output_tokens == 30

        await trio.to_thread.run_sync(flow)


async def test_reasoning_kept_in_the_answer_or_sent_in_one_chunk(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine, chat_template=TEMPLATE, reasoning_budget=12) as listening:

        def flow() -> None:
            chat = sdk(listening.port).chat.completions.create
            apart = chat(model="m", messages=QUESTION, temperature=0, max_tokens=40)
            thought = apart.choices[0].message.reasoning_content
            assert thought
            # separate_reasoning false: no split, the text as the model wrote it.
            together = (
                chat(
                    model="m",
                    messages=QUESTION,
                    temperature=0,
                    max_tokens=40,
                    extra_body={"separate_reasoning": False},
                )
                .choices[0]
                .message
            )
            assert getattr(together, "reasoning_content", None) is None
            # The same tokens (temperature 0), the budget's forced end marker
            # among them, then the same answer.
            assert together.content.startswith(thought + "</think>")
            assert together.content.rstrip().endswith(apart.choices[0].message.content.strip())
            # stream_reasoning false: the reasoning comes whole, in one chunk, first.
            stream = chat(
                model="m",
                messages=QUESTION,
                temperature=0,
                max_tokens=40,
                stream=True,
                extra_body={"stream_reasoning": False},
            )
            pieces, kinds = [], []
            for chunk in stream:
                delta = chunk.choices[0].delta if chunk.choices else None
                if delta is not None and getattr(delta, "reasoning_content", None):
                    pieces.append(delta.reasoning_content)
                    kinds.append("r")
                elif delta is not None and delta.content:
                    kinds.append("c")
            assert pieces == [thought]
            assert kinds[0] == "r"

        await trio.to_thread.run_sync(flow)


async def test_pickers_read_queue_kv_use_and_prefix_hits(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine, api_key="k", public_metrics=True) as listening:
        port = listening.port

        def flow() -> None:
            # --public-metrics: a picker that sends no key reads them.
            before = scrape(port)
            for gauge in (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
            ):
                assert before[gauge] == 0.0
            assert before["vllm:prefix_cache_queries_total"] == 0.0
            client = sdk(port, "k")
            system = "You answer questions about geography. " * 60
            messages = [{"role": "system", "content": system}, *QUESTION]
            first = client.chat.completions.create(
                model="m", messages=messages, max_tokens=4, temperature=0
            )
            second = client.chat.completions.create(
                model="m", messages=messages, max_tokens=4, temperature=0
            )
            cached = second.usage.prompt_tokens_details.cached_tokens
            assert cached > 0
            after = scrape(port, "k")
            assert after["vllm:prefix_cache_queries_total"] == (
                first.usage.prompt_tokens + second.usage.prompt_tokens
            )
            assert after["vllm:prefix_cache_hits_total"] == (
                first.usage.prompt_tokens_details.cached_tokens + cached
            )
            # While a generation runs, its KV cache is in use and it is counted.
            stream = client.chat.completions.create(
                model="m",
                messages=messages,
                max_tokens=200,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            seen: dict[str, float] = {}
            for index, _ in enumerate(stream):
                if index == 20:
                    seen = scrape(port, "k")
            assert 0.0 < seen["vllm:kv_cache_usage_perc"] <= 1.0
            assert seen["vllm:num_requests_running"] == 1.0
            # SGLang's model_info names the model (never a path), behind the key.
            request = urllib.request.Request(f"http://127.0.0.1:{port}/model_info")
            request.add_header("Authorization", "Bearer k")
            with urllib.request.urlopen(request, timeout=30) as reply:
                info = json.loads(reply.read())
            assert info["served_model_name"] == "SmolLM2-135M-Instruct"
            assert "model_path" not in info and "tokenizer_path" not in info
            with pytest.raises(urllib.error.HTTPError) as unkeyed:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/model_info", timeout=30)
            assert unkeyed.value.code == 401

        await trio.to_thread.run_sync(flow)
