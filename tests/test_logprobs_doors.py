"""Log probabilities through both doors on the real model over real
sockets: the ``openai`` SDK's own types parse them (chat, completions, echo
with ``max_tokens: 0``), streamed and whole answers agree, a constraint's
mask holds in the alternatives, and the WebSocket ``infer`` carries them on
chunk frames and the final frame."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import openai
import pytest
import trio

from .helpers import raw_client, running_server
from .test_logprobs import direct_logprobs

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

QUESTION: Any = [{"role": "user", "content": "Name three colours."}]


async def test_the_sdk_parses_chat_logprobs_streamed_and_whole(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening:
        base = f"http://127.0.0.1:{listening.port}/v1"

        def use_the_sdk() -> None:
            client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            whole = client.chat.completions.create(
                model="m",
                messages=QUESTION,
                temperature=0,
                max_tokens=20,
                logprobs=True,
                top_logprobs=5,
            )
            choice = whole.choices[0]
            assert choice.logprobs is not None and choice.logprobs.content is not None
            content = choice.logprobs.content
            assert "".join(t.token for t in content) == choice.message.content
            for token in content:
                assert bytes(token.bytes or []).decode() == token.token
                assert len(token.top_logprobs) == 5
                assert token.top_logprobs[0].token == token.token  # greedy: the top one
                assert sum(math.exp(t.logprob) for t in token.top_logprobs) <= 1 + 1e-6
            stream = client.chat.completions.create(
                model="m",
                messages=QUESTION,
                temperature=0,
                max_tokens=20,
                logprobs=True,
                top_logprobs=5,
                stream=True,
            )
            streamed = []
            text = ""
            for chunk in stream:
                if not chunk.choices:
                    continue
                text += chunk.choices[0].delta.content or ""
                if chunk.choices[0].logprobs is not None:
                    streamed.extend(chunk.choices[0].logprobs.content or [])
            assert text == choice.message.content
            assert [t.token for t in streamed] == [t.token for t in content]
            for a, b in zip(streamed, content, strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
            # Without logprobs: none.
            plain = client.chat.completions.create(
                model="m", messages=QUESTION, temperature=0, max_tokens=4
            )
            assert plain.choices[0].logprobs is None
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(
                    model="m", messages=QUESTION, logprobs=True, top_logprobs=21
                )
            assert isinstance(info.value.body, dict)
            assert info.value.body["param"] == "top_logprobs"

        await trio.to_thread.run_sync(use_the_sdk)


async def test_completions_logprobs_and_echo_score_the_prompt(cpu_engine: CpuEngine) -> None:
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = cpu_engine.encode(prompt)
    direct = direct_logprobs(cpu_engine, ids)
    async with running_server(cpu_engine) as listening:
        base = f"http://127.0.0.1:{listening.port}/v1"

        def use_the_sdk() -> None:
            client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            scored = client.completions.create(
                model="m", prompt=prompt, echo=True, max_tokens=0, logprobs=1, temperature=0
            )
            choice = scored.choices[0]
            assert choice.text == prompt
            assert scored.usage is not None and scored.usage.completion_tokens == 0
            lp = choice.logprobs
            assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
            assert lp.top_logprobs is not None and lp.text_offset is not None
            assert "".join(lp.tokens) == prompt and len(lp.tokens) == len(ids)
            # The SDK types them as never null; OpenAI's answers have null first.
            first: list[Any] = [lp.token_logprobs[0], lp.top_logprobs[0]]
            assert first == [None, None]
            for i in range(1, len(ids)):
                value = lp.token_logprobs[i]
                assert value == pytest.approx(float(direct[i - 1][ids[i]]), abs=1e-3)
                assert len(lp.top_logprobs[i]) == 1
            assert lp.text_offset == [
                sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))
            ]
            # As lm-evaluation-harness's local-completions sends it by default:
            # token ids, a batch of one, max_tokens 1.
            harness = client.completions.create(
                model="m", prompt=[ids], echo=True, max_tokens=1, logprobs=1, temperature=0
            ).choices[0]
            assert harness.text.startswith(prompt)
            assert harness.logprobs is not None and harness.logprobs.token_logprobs is not None
            assert harness.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(
                lp.token_logprobs[1:], abs=1e-5
            )
            # echo with max_tokens 1 (as lm-evaluation-harness asks): the
            # prompt's figures, then the generated token's.
            more = client.completions.create(
                model="m", prompt=prompt, echo=True, max_tokens=1, logprobs=2, temperature=0
            ).choices[0]
            assert more.logprobs is not None and more.logprobs.token_logprobs is not None
            assert len(more.logprobs.token_logprobs) == len(ids) + 1
            assert more.logprobs.token_logprobs[1:-1] == pytest.approx(
                lp.token_logprobs[1:], abs=1e-5
            )
            # Generated tokens only, streamed and not.
            whole = client.completions.create(
                model="m", prompt=prompt, max_tokens=8, logprobs=3, temperature=0
            ).choices[0]
            assert whole.logprobs is not None and whole.logprobs.tokens is not None
            assert "".join(whole.logprobs.tokens) == whole.text
            stream = client.completions.create(
                model="m", prompt=prompt, max_tokens=8, logprobs=3, temperature=0, stream=True
            )
            tokens: list[str] = []
            offsets: list[int] = []
            for chunk in stream:
                if chunk.choices and chunk.choices[0].logprobs is not None:
                    tokens.extend(chunk.choices[0].logprobs.tokens or [])
                    offsets.extend(chunk.choices[0].logprobs.text_offset or [])
            assert tokens == whole.logprobs.tokens
            assert offsets == whole.logprobs.text_offset

        await trio.to_thread.run_sync(use_the_sdk)


ANSWERED = "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\nYes."


async def test_a_completion_lists_its_stop_token_last(cpu_engine: CpuEngine) -> None:
    # lm-evaluation-harness sends prompt ids with echo and max_tokens 1 and
    # drops the last entry: when the model's next token is the end of its
    # turn, that entry must still be there, or the prompt's last one goes.
    ids = cpu_engine.encode(ANSWERED)
    direct = direct_logprobs(cpu_engine, ids)
    end = int(direct[-1].argmax())
    assert end in cpu_engine.info.eos_token_ids  # the premise: greedy ends the turn
    async with running_server(cpu_engine) as listening:
        base = f"http://127.0.0.1:{listening.port}/v1"

        def use_the_sdk() -> None:
            client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            scored = client.completions.create(
                model="m", prompt=[ids], echo=True, max_tokens=1, logprobs=1, temperature=0
            ).choices[0]
            assert scored.finish_reason == "stop"
            assert scored.text == ANSWERED  # the stop token's text is not in the text
            lp = scored.logprobs
            assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
            assert len(lp.token_logprobs) == len(ids) + 1
            assert lp.tokens[-1] == cpu_engine.decode([end])
            # A generated token's figure: a few thousandths (docs/sampling.md, "Exactness").
            assert lp.token_logprobs[-1] == pytest.approx(float(direct[-1][end]), abs=5e-3)
            for i in range(1, len(ids)):
                assert lp.token_logprobs[i] == pytest.approx(float(direct[i - 1][ids[i]]), abs=1e-3)
            # Generated and streamed: the last chunk carries it.
            tokens: list[str] = []
            for chunk in client.completions.create(
                model="m", prompt=ANSWERED, max_tokens=4, logprobs=1, temperature=0, stream=True
            ):
                if chunk.choices and chunk.choices[0].logprobs is not None:
                    tokens.extend(chunk.choices[0].logprobs.tokens or [])
            assert tokens == [cpu_engine.decode([end])]
            # Chat lists the content's tokens only, as OpenAI's does.
            chat = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "Say yes."}],
                max_tokens=8,
                temperature=0,
                logprobs=True,
            ).choices[0]
            assert chat.logprobs is not None and chat.logprobs.content is not None
            assert "".join(t.token for t in chat.logprobs.content) == chat.message.content

        await trio.to_thread.run_sync(use_the_sdk)


async def test_alternatives_respect_a_constraint(cpu_engine: CpuEngine) -> None:
    choices = ("yes", "no", "maybe")
    async with running_server(cpu_engine) as listening:
        base = f"http://127.0.0.1:{listening.port}/v1"

        def use_the_sdk() -> None:
            client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            for seed in range(3):
                answer = client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "Is the sky green?"}],
                    temperature=1.0,
                    seed=seed,
                    logprobs=True,
                    top_logprobs=20,
                    extra_body={"guided_choice": list(choices)},
                ).choices[0]
                assert answer.message.content in choices
                assert answer.logprobs is not None and answer.logprobs.content is not None
                so_far = ""
                for token in answer.logprobs.content:
                    assert 1 <= len(token.top_logprobs) < 20
                    for other in token.top_logprobs:
                        assert any(c.startswith(so_far + other.token) for c in choices)
                    so_far += token.token

        await trio.to_thread.run_sync(use_the_sdk)


@pytest.mark.parametrize("stream", [False, True])
async def test_infer_carries_logprobs(cpu_engine: CpuEngine, stream: bool) -> None:
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    async with running_server(cpu_engine) as listening, raw_client(listening.url) as ws:
        await ws.send(
            {
                "action": "infer",
                "request_id": "a",
                "text": text,
                "max_new_tokens": 16,
                "temperature": 0,
                "stream": stream,
                "logprobs": 2,
                "stop_conditions": ["Paris"],
            }
        )
        frames = await ws.recv_until_final(request_id="a")
        final = frames[-1]
        assert final["response_type"] == "full", final
        assert final["eos_reason"] == "stop_string"
        entries = final["logprobs"]
        joined = "".join(e["token"] for e in entries)
        # The stop string cuts the text inside the last token with an entry.
        assert joined.startswith(final["response"]) and "Paris" in joined
        assert len("".join(e["token"] for e in entries[:-1])) < len(final["response"])
        for entry in entries:
            assert bytes(entry["bytes"]).decode() == entry["token"]
            assert entry["top_logprobs"][0]["token_id"] == entry["token_id"]
            assert len(entry["top_logprobs"]) == 2
        if stream:
            chunks = frames[:-1]
            assert all("logprobs" in f for f in chunks)
            sent = [e for f in chunks for e in f["logprobs"]]
            assert sent == entries[: len(sent)]
        # Without the field, no frame has one.
        await ws.send({"action": "infer", "request_id": "b", "text": text, "max_new_tokens": 3})
        (plain,) = await ws.recv_until_final(request_id="b")
        assert "logprobs" not in plain
