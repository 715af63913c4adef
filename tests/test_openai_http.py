"""The official ``openai`` SDK against the front door serving the OpenAI core's
responses: non-streamed and streamed (SSE over chunked encoding) completions
and chat completions, the model list, errors as the SDK's exceptions, and the
API key. Generation here is a fixed script; the real model behind these
routes is tested once the server composes them (phase 2 of issue 10)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import openai
import pytest
import trio

from tests.http_helpers import running
from trioserve.engine.base import EngineInfo
from trioserve.generation import InvalidGeneration
from trioserve.generation.generation import check_request, fit_prompt
from trioserve.openai import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionStream,
    CompletionChoice,
    CompletionRequest,
    CompletionStream,
    OpenAIError,
    TokenUsage,
    chat_completion_response,
    completion_response,
    models_response,
    new_id,
    parse_chat_request,
    parse_completion_request,
)
from trioserve.server.doors import from_openai, openai_error
from trioserve.server.front_door import FrontDoor
from trioserve.server.http_types import (
    AccessPolicy,
    BodyWriter,
    HTTPRequest,
    Response,
    Router,
    StreamingResponse,
    event_stream,
)
from trioserve.server.routes import http_errors

pytestmark = pytest.mark.unit

KEY = "sk-test"
MODEL = EngineInfo(
    engine="scripted",
    model_name="scripted-model",
    context_length=128,
    vocab_size=256,
    bos_token_id=None,
    eos_token_ids=frozenset({0}),
    max_batch=1,
)
CAP = 100


def max_new_tokens(parsed: CompletionRequest | ChatCompletionRequest, ids: list[int]) -> int:
    """The job's max_new_tokens through the one pipeline's pure steps, its
    errors in OpenAI's terms (as the routes answer them)."""
    request = from_openai(parsed)
    try:
        check_request(request, MODEL, max_new_tokens=CAP, renders_messages=True)
        return fit_prompt(request, ids, MODEL, max_new_tokens=CAP)[1]
    except InvalidGeneration as exc:
        raise openai_error(exc) from None


PIECES = ["Hel", "lo", ", ", "wor", "ld"]

T = TypeVar("T")


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def scripted(max_tokens: int, stop: tuple[str, ...]) -> tuple[list[str], str]:
    """The pieces the script produces under ``max_tokens`` (one piece per
    token) and ``stop`` (found within one piece: no hold-back here), and the
    finish reason."""
    out: list[str] = []
    text = ""
    for piece in PIECES[:max_tokens]:
        for s in stop:
            if s in text + piece:
                cut = (text + piece).index(s)
                if cut > len(text):
                    out.append((text + piece)[len(text) : cut])
                return out, "stop"
        out.append(piece)
        text += piece
    return out, "length" if max_tokens < len(PIECES) else "stop"


class Routes:
    def __init__(self) -> None:
        self.created = int(time.time())
        self.disconnected = trio.Event()

    def router(self) -> Router:
        router = Router()
        router.add("GET", "/v1/models", http_errors(self.models))
        router.add("POST", "/v1/completions", http_errors(self.completions))
        router.add("POST", "/v1/chat/completions", http_errors(self.chat))
        return router

    async def models(self, request: HTTPRequest) -> Response:
        return Response(200, models_response([(MODEL.model_name, {})], self.created))

    async def completions(self, request: HTTPRequest) -> Response | StreamingResponse:
        parsed = parse_completion_request(request.body)
        prompt = parsed.prompt if isinstance(parsed.prompt, str) else ""
        ids = encode(prompt) if isinstance(parsed.prompt, str) else list(parsed.prompt)
        pieces, reason = scripted(max_new_tokens(parsed, ids), parsed.stop)
        usage = TokenUsage(len(ids), len(pieces))
        if not parsed.stream:
            text = (prompt if parsed.echo else "") + "".join(pieces)
            body = completion_response(
                id=new_id("cmpl"),
                created=self.created,
                model=MODEL.model_name,
                choices=[CompletionChoice(text=text, finish_reason=reason)],  # type: ignore[arg-type]
                usage=usage,
            )
            return Response(200, body)
        stream = CompletionStream(
            new_id("cmpl"), self.created, MODEL.model_name, parsed.include_usage
        )

        async def write(out: BodyWriter) -> None:
            for piece in pieces:
                await out.send(stream.text(piece))
            await out.send(stream.finish(reason, usage))  # type: ignore[arg-type]

        return event_stream(write)

    async def chat(self, request: HTTPRequest) -> Response | StreamingResponse:
        parsed = parse_chat_request(request.body)
        prompt = "".join(f"{m.role}: {m.content}\n" for m in parsed.messages)
        ids = encode(prompt)
        pieces, reason = scripted(max_new_tokens(parsed, ids), parsed.stop)
        usage = TokenUsage(len(ids), len(pieces), cached_tokens=2)
        if not parsed.stream:
            body = chat_completion_response(
                id=new_id("chatcmpl"),
                created=self.created,
                model=MODEL.model_name,
                choices=[ChatChoice(content="".join(pieces), finish_reason=reason)],  # type: ignore[arg-type]
                usage=usage,
            )
            return Response(200, body)
        stream = ChatCompletionStream(
            new_id("chatcmpl"), self.created, MODEL.model_name, parsed.include_usage
        )

        async def write(out: BodyWriter) -> None:
            try:
                await out.send(stream.start())
                if parsed.max_tokens == 99:  # the test of a disconnect
                    while True:
                        await out.send(stream.text("."))
                        await trio.sleep(0.01)
                if parsed.max_tokens == 98:  # the test of an error mid-stream
                    await out.send(stream.text("partial"))
                    await out.send(stream.error(OpenAIError(503, "the server is shutting down")))
                    return
                for piece in pieces:
                    await out.send(stream.text(piece))
                await out.send(stream.finish(reason, usage))  # type: ignore[arg-type]
            finally:
                if parsed.max_tokens == 99:
                    self.disconnected.set()

        return event_stream(write)


async def in_thread(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


def client(port: int, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"http://127.0.0.1:{port}/v1", max_retries=0)


def front_door(routes: Routes) -> FrontDoor:
    return FrontDoor(routes.router(), policy=AccessPolicy(api_key=KEY))


async def test_models() -> None:
    async with running(front_door(Routes())) as port:
        models = await in_thread(lambda: list(client(port).models.list()))
    assert [m.id for m in models] == [MODEL.model_name]


async def test_completion_and_chat_completion() -> None:
    async with running(front_door(Routes())) as port:
        sdk = client(port)
        done = await in_thread(
            lambda: sdk.completions.create(model="x", prompt="Say hi", max_tokens=3)
        )
        chat = await in_thread(
            lambda: sdk.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "Hi"}], stop=["lo"]
            )
        )
    assert done.choices[0].text == "Hello, "
    assert done.choices[0].finish_reason == "length"
    assert done.model == MODEL.model_name
    assert done.usage is not None and done.usage.completion_tokens == 3
    assert chat.choices[0].message.content == "Hel"
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == len("user: Hi\n")
    assert chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == 2


async def test_streamed_chat_with_usage() -> None:
    async with running(front_door(Routes())) as port:
        sdk = client(port)

        def run() -> list[Any]:
            stream = sdk.chat.completions.create(
                model="x",
                messages=[{"role": "user", "content": "Hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            return list(stream)

        chunks = await in_thread(run)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(PIECES)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(PIECES)


async def test_streamed_completion() -> None:
    async with running(front_door(Routes())) as port:
        sdk = client(port)
        chunks = await in_thread(
            lambda: list(sdk.completions.create(model="x", prompt="p", max_tokens=2, stream=True))
        )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello"
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_errors_are_the_sdks_exceptions() -> None:
    async with running(front_door(Routes())) as port:
        sdk = client(port)

        def bad_max_tokens() -> BaseException | None:
            try:
                sdk.completions.create(model="x", prompt="p", max_tokens=1000)
            except openai.BadRequestError as exc:
                return exc
            return None

        error = await in_thread(bad_max_tokens)
        assert isinstance(error, openai.BadRequestError)
        assert error.status_code == 400
        assert "max_tokens must be at most 100" in error.message
        assert isinstance(error.body, dict) and error.body["param"] == "max_tokens"

        def wrong_key() -> BaseException | None:
            try:
                client(port, key="wrong").models.list()
            except openai.AuthenticationError as exc:
                return exc
            return None

        assert isinstance(await in_thread(wrong_key), openai.AuthenticationError)

        def error_mid_stream() -> BaseException | None:
            stream = sdk.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "Hi"}], stream=True, max_tokens=98
            )
            try:
                for _ in stream:
                    pass
            except openai.APIError as exc:
                return exc
            return None

        error = await in_thread(error_mid_stream)
        assert isinstance(error, openai.APIError)
        assert "shutting down" in error.message


async def test_a_client_that_leaves_mid_stream_ends_the_handler() -> None:
    routes = Routes()
    async with running(front_door(routes)) as port:
        sdk = client(port)

        def leave_early() -> str:
            stream = sdk.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "Hi"}], stream=True, max_tokens=99
            )
            text = ""
            for chunk in stream:
                text += chunk.choices[0].delta.content or ""
                if len(text) >= 5:
                    break
            stream.close()
            return text

        assert (await in_thread(leave_early)).startswith(".....")
        with trio.fail_after(10):
            await routes.disconnected.wait()
