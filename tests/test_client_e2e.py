"""trioserve.client against the real server and the real embedded model.

``test_client_codec.py`` tests the client against a rule-based server; here
every method meets the real thing over a loopback socket, and the chat CLI
runs as a user would run it.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pytest
import trio

from trioserve import (
    ConnectionClosed,
    ConnectionFailed,
    InferChunk,
    InferFinal,
    InferStream,
    ServerError,
    open_client,
)

from .helpers import running_server, serving, wait_until

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

EOS = 2
QUESTION = "What is the capital of France?"
PARIS = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
STORY = "<|im_start|>user\nTell me a long story about a dragon.<|im_end|>\n<|im_start|>assistant\n"
# A job that cannot end on its own before max_new_tokens: EOS is banned.
ENDLESS = {"temperature": 0, "bann_bann": [EOS]}


async def test_quick_methods(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening, open_client(listening.url) as client:
        assert not client.closed
        echo = await client.echo(request_id={"mine": [1, 2]})
        assert echo.echoed == {"request_id": {"mine": [1, 2]}}
        assert await client.estimate_token(PARIS) == len(cpu_engine.encode(PARIS))
        assert await client.estimate_token("<|im_start|><|im_end|>") == 2
        text = "The quick brown fox jumps over the lazy dog"
        last_three = await client.lefttrim_token(text, 3)
        assert last_three == cpu_engine.decode(cpu_engine.encode(text)[-3:])
        assert text.endswith(last_three) and last_three != text
        assert await client.lefttrim_token(text, 0) == ""
        assert await client.lefttrim_token(text, 1000) == text
        info = await client.info()
        assert info.model.name == "SmolLM2-135M-Instruct"
        assert info.model.engine == "cpu"
        assert info.model.context_length == cpu_engine.info.context_length
        assert info.limits.max_new_tokens == cpu_engine.info.context_length - 1
        # Stopping nothing is not an error.
        assert await client.stop() == 0


async def test_infer_streams_chunks_then_the_final(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening, open_client(listening.url) as client:
        chunks: list[str] = []
        async with client.infer(PARIS, 40, stream=True, temperature=0, tag="t") as stream:
            async for message in stream:
                # The final frame is the last one, and ends the stream.
                assert stream.done == isinstance(message, InferFinal)
                assert message.echoed["tag"] == "t"
                if isinstance(message, InferChunk):
                    chunks.append(message.chunk)
        assert stream.done
        final = stream.final
        assert len(chunks) > 1
        assert "".join(chunks) == final.response
        assert "Paris" in final.response
        assert (final.stop_reason, final.eos_reason, final.stop_token) == ("eos", "stop_token", EOS)
        assert final.util_text == PARIS
        assert final.usage.prompt_tokens == len(cpu_engine.encode(PARIS))
        # generate() reads the same request to its end: greedy, same text.
        again = await client.generate(PARIS, 40, temperature=0)
        assert again.response == final.response
        assert again.usage.generated_tokens == final.usage.generated_tokens


async def test_bad_requests_raise_server_error_naming_the_field(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening, open_client(listening.url) as client:
        with pytest.raises(ServerError) as caught:
            await client.generate(PARIS, 0)
        assert (caught.value.error_type, caught.value.field) == (
            "invalid_request",
            "$.max_new_tokens",
        )
        assert caught.value.action == "infer"
        with pytest.raises(ServerError) as caught:
            await client.generate(PARIS, 10, top_kk=5)
        assert caught.value.field == "$.top_kk"
        assert "top_kk" in caught.value.message
        too_many = cpu_engine.info.context_length
        with pytest.raises(ServerError) as caught:
            await client.generate(PARIS, too_many)
        assert caught.value.field == "$.max_new_tokens"
        assert str(too_many - 1) in caught.value.message
        with pytest.raises(ServerError) as caught:
            await client.lefttrim_token("text", -1)
        assert (caught.value.action, caught.value.field) == ("lefttrim_token", "$.trimmed_length")
        # The stream reports the error frame as the same exception.
        stream = client.infer(PARIS, 10, stop_conditions=[""])
        with pytest.raises(ServerError) as caught:
            await stream.result()
        assert caught.value.field is not None
        assert caught.value.field.startswith("$.stop_conditions")
        assert stream.done
        # Each error was one frame; the connection goes on.
        assert (await client.generate(PARIS, 40, temperature=0)).stop_reason == "eos"


async def test_stop_with_a_target_and_two_infers_on_one_client(cpu_engine: CpuEngine) -> None:
    async with (
        serving(cpu_engine) as (server, listening),
        open_client(listening.url) as client,
    ):
        long = client.infer(STORY, 400, stream=True, **ENDLESS)
        short = client.infer(PARIS, 40, stream=True, temperature=0)
        results: dict[str, tuple[list[str], InferFinal]] = {}
        first_chunk = trio.Event()

        async def read(name: str, stream: InferStream) -> None:
            chunks: list[str] = []
            async with stream:
                async for message in stream:
                    if isinstance(message, InferChunk):
                        chunks.append(message.chunk)
                        if name == "long":
                            first_chunk.set()
            results[name] = (chunks, stream.final)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, "long", long)
            nursery.start_soon(read, "short", short)
            await first_chunk.wait()
            assert server.statistics().requests_in_flight >= 1
            # Stops only the long one, by its request_id; its final frame has
            # arrived by the time stop() returns.
            assert await client.stop(target=long.request_id) == 1
            assert long.done

        long_chunks, long_final = results["long"]
        assert long_final.stop_reason == "interrupted"
        assert "".join(long_chunks) == long_final.response
        assert 0 < long_final.usage.generated_tokens < 400
        short_chunks, short_final = results["short"]
        assert short_final.stop_reason == "eos"
        assert "Paris" in short_final.response
        assert "".join(short_chunks) == short_final.response
        # Nothing is left running on the engine.
        assert server.statistics().requests_in_flight == 0


async def test_two_concurrent_infers_get_their_own_frames(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening, open_client(listening.url) as client:
        finals: dict[str, InferFinal] = {}

        async def ask(name: str, prompt: str, tokens: int) -> None:
            finals[name] = await client.generate(prompt, tokens, stream=True, **ENDLESS)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "paris", PARIS, 12)
            nursery.start_soon(ask, "story", STORY, 20)
    # Each final is its own request's: prompt and length match what was asked.
    assert finals["paris"].util_text == PARIS
    assert finals["story"].util_text == STORY
    assert finals["paris"].usage.generated_tokens == 12
    assert finals["story"].usage.generated_tokens == 20
    assert finals["paris"].stop_reason == finals["story"].stop_reason == "num_tokens"
    assert "Paris" in finals["paris"].response


async def test_raw_frames_and_unrouted_replies(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine) as listening, open_client(listening.url) as client:
        await client.send_raw({"action": "echo", "response_id": 7})
        assert await client.next_unrouted() == {"action": "echo", "response_id": 7}
        await client.send_raw(b"\x00binary")
        error = await client.next_unrouted()
        assert error["response_type"] == "error"
        assert error["error"]["type"] == "invalid_json"
        await client.send_raw('{"action": "dance"}')
        error = await client.next_unrouted()
        assert (error["error"]["type"], error["error"]["field"]) == ("unknown_action", "$.action")


async def test_api_key(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine, api_key="s3cret") as listening:
        with pytest.raises(ConnectionFailed) as caught:
            async with open_client(listening.url):
                pass  # pragma: no cover - the handshake fails
        assert caught.value.status_code == 401
        with pytest.raises(ConnectionFailed) as caught:
            async with open_client(listening.url, api_key="wrong"):
                pass  # pragma: no cover
        assert caught.value.status_code == 401
        async with open_client(listening.url, api_key="s3cret") as client:
            assert (await client.echo()).echoed
        # Browsers cannot set headers: the key may be a query parameter.
        async with open_client(listening.url + "?api_key=s3cret") as client:
            assert await client.estimate_token("hello") >= 1


@pytest.mark.slow
async def test_server_shutdown_closes_the_client_with_1001(cpu_engine: CpuEngine) -> None:
    async with serving(cpu_engine) as (server, listening), open_client(listening.url) as client:
        await client.echo()
        server.begin_shutdown()
        await wait_until(lambda: client.closed, within=30)
        with pytest.raises(ConnectionClosed) as caught:
            await client.echo()
    assert caught.value.code == 1001


def chat_env(**extra: str) -> dict[str, str]:
    """The environment without a TRIOSERVE_API_KEY the developer may have set."""
    env = {k: v for k, v in os.environ.items() if k != "TRIOSERVE_API_KEY"}
    return {**env, **extra}


async def run_chat(
    *args: str, env: dict[str, str] | None = None, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(120):
        return await trio.run_process(
            [sys.executable, "-m", "trioserve.client", *args],
            stdin=stdin,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=chat_env() if env is None else env,
        )


@pytest.mark.slow
async def test_chat_cli_answers_once(cpu_engine: CpuEngine) -> None:
    async with running_server(cpu_engine, api_key="k") as listening:
        # An http:// URL is taken for the ws:// one at the same address.
        http_url = listening.url.replace("ws://", "http://")
        once = ["--once", QUESTION, "--temperature", "0", "--max-new-tokens", "40"]
        result = await run_chat(*once, "--url", http_url, "--api-key", "k")
        assert result.returncode == 0
        assert "Paris" in result.stdout.decode()
        assert result.stdout.decode().endswith("\n")
        assert result.stderr == b""
        # The key may come from the environment instead.
        from_env = await run_chat(
            *once, "--url", listening.url, env=chat_env(TRIOSERVE_API_KEY="k")
        )
        assert from_env.stdout == result.stdout
        # Without the key the chat says why, and what to do, in one line.
        rejected = await run_chat(*once, "--url", listening.url)
        assert rejected.returncode == 1
        assert rejected.stdout == b""
        host = listening.url.split("/")[2]
        assert rejected.stderr.decode() == (
            f"error: {host} requires an API key: pass --api-key KEY (or set TRIOSERVE_API_KEY)\n"
        )
        wrong = await run_chat(*once, "--url", listening.url, "--api-key", "nope")
        assert wrong.stderr.decode() == (
            f"error: {host} refused the API key (http 401): check --api-key or TRIOSERVE_API_KEY\n"
        )
        assert b"nope" not in wrong.stderr
        # A question the server refuses: its error, in one line, and status 1.
        refused = await run_chat(
            "--once",
            QUESTION,
            "--url",
            listening.url,
            "--api-key",
            "k",
            "--max-new-tokens",
            "99999",
        )
        assert refused.returncode == 1
        assert refused.stderr.decode().startswith(
            "error: invalid_request at $.max_new_tokens: max_new_tokens must be at most"
        )
        assert refused.stderr.decode().count("\n") == 1
        # In a conversation the error is reported and the chat goes on.
        chat = await run_chat(
            *("--url", listening.url, "--api-key", "k", "--max-new-tokens", "99999"),
            stdin=f"{QUESTION}\n/help\n".encode(),
        )
        assert chat.returncode == 0
        notes = chat.stderr.decode()
        assert "error: invalid_request at $.max_new_tokens" in notes
        assert notes.index("error:") < notes.index("/reset  forget the conversation")


async def test_chat_cli_says_when_no_server_is_there() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Nothing listens on the port now: the connection is refused.
    result = await run_chat("--once", "hi", "--url", f"ws://127.0.0.1:{port}/")
    assert result.returncode == 1
    assert result.stderr.decode() == (
        f"error: connection refused: is the server running on 127.0.0.1:{port}?\n"
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--once", ""], "--once needs a question, got an empty one"),
        (["--once", " \n"], "--once needs a question, got an empty one"),
        (["--url", "ftp://host/"], "expected a ws://, wss://, http:// or https:// URL"),
        (["--max-new-tokens", "0"], "argument --max-new-tokens: expected an integer >= 1"),
        (["--temperature", "nan"], "argument --temperature: expected a number >= 0"),
    ],
)
async def test_chat_cli_refuses_bad_options(args: list[str], says: str) -> None:
    result = await run_chat(*args)
    assert result.returncode == 2
    assert result.stdout == b""
    last = result.stderr.decode().splitlines()[-1]
    assert last.startswith("python -m trioserve.client: error:")
    assert says in last


def test_chat_cli_help_has_help_and_a_default_for_every_option() -> None:
    from trioserve.client.chat import build_chat_parser

    secret = "sk-chat-secret-91d2"
    result = subprocess.run(
        [sys.executable, "-m", "trioserve.client", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=chat_env(TRIOSERVE_API_KEY=secret),
    )
    assert secret not in result.stdout
    for action in build_chat_parser()._actions:
        if action.dest == "help":
            continue
        assert action.help and action.help.count("(default:") == 1, action.option_strings
        assert action.option_strings[0] in result.stdout
    text = " ".join(result.stdout.split())
    for needle in ("Ctrl-C stops the answer", "/reset", "Ctrl-D", "ChatML"):
        assert needle in text


class Terminal:
    """The chat client on a pseudo-terminal of its own, as a user runs it:
    the terminal turns Ctrl-C into SIGINT and Ctrl-D into end of input."""

    # Make the pty the child's controlling terminal (a new session that opens
    # it), so that the line discipline sends it SIGINT; then run the client.
    LAUNCH = (
        "import os, sys; os.setsid(); os.close(os.open(os.ttyname(0), os.O_RDWR)); "
        "os.execv(sys.executable, [sys.executable, '-m', 'trioserve.client', *sys.argv[1:]])"
    )

    def __init__(self, process: trio.Process, master: trio.lowlevel.FdStream) -> None:
        self.process = process
        self.master = master
        self.output = ""
        self.seen = 0

    async def expect(self, pattern: str) -> re.Match[str]:
        """Read until ``pattern`` matches output after the last match."""
        with trio.fail_after(120):
            while True:
                found = re.compile(pattern).search(self.output, self.seen)
                if found:
                    self.seen = found.end()
                    return found
                try:
                    data = await self.master.receive_some(4096)
                except trio.BrokenResourceError:  # EIO: the child closed the terminal
                    data = b""
                if not data:
                    raise AssertionError(f"{pattern!r} not in {self.output[self.seen :]!r}")
                self.output += data.decode(errors="replace").replace("\r\n", "\n")

    async def type(self, text: str) -> None:
        await self.master.send_all(text.encode())


@asynccontextmanager
async def terminal(*args: str) -> AsyncIterator[Terminal]:
    master, slave = os.openpty()
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-c", Terminal.LAUNCH, *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=chat_env(),
        )
    finally:
        os.close(slave)
    stream = trio.lowlevel.FdStream(master)
    try:
        yield Terminal(process, stream)
    finally:
        if process.returncode is None:
            process.kill()
        with trio.move_on_after(10):
            await process.wait()
        await stream.aclose()


async def test_chat_in_a_terminal(cpu_engine: CpuEngine) -> None:
    stats = r"\[(\w+): (\d+) tokens in [\d.]+ s, first after [^;]+; prompt (\d+) tokens\]"
    async with (
        serving(cpu_engine) as (server, listening),
        terminal("--url", listening.url, "--temperature", "0", "--stats") as term,
    ):
        # The banner: the server, the model, and how to leave.
        await term.expect(
            r"trioserve \S+ at ws://\S+: SmolLM2-135M-Instruct \(cpu engine, context \d+"
        )
        await term.expect(r"Ctrl-C stops an answer; /reset forgets the conversation.*Ctrl-D leaves")
        await term.expect(r"\n> $")
        await term.type(QUESTION + "\n")
        await term.expect("Paris")
        first = await term.expect(stats)
        assert first[1] == "eos"
        # The second question is sent with the first exchange: a longer prompt.
        await term.expect(r"> $")
        await term.type(QUESTION + "\n")
        second = await term.expect(stats)
        assert int(second[3]) > int(first[3]) + int(first[2])
        # After /reset, the same question is a prompt of its own again.
        await term.expect(r"> $")
        await term.type("/reset\n")
        await term.expect(r"\[conversation cleared\]\n> $")
        await term.type(QUESTION + "\n")
        third = await term.expect(stats)
        assert third[3] == first[3]
        # Ctrl-C while an answer streams stops that answer on the server...
        await term.expect(r"> $")
        await term.type("Tell me a long story about a dragon.\n")
        await wait_until(lambda: server.statistics().requests_in_flight == 1, within=60)
        await term.expect(r"\w+ \w+")  # some of the answer
        await term.type("\x03")
        await term.expect(r"\[stopped\]")
        stopped = await term.expect(stats)
        assert stopped[1] == "interrupted"
        assert server.statistics().requests_in_flight == 0
        # ...and the chat goes on; Ctrl-D at the prompt leaves, on a new line.
        await term.expect(r"> $")
        await term.type("\x04")
        with trio.fail_after(30):
            status = await term.process.wait()
        assert status == 0
        await term.expect(r"\n$")
        assert term.output.endswith("> \n")
        assert "Traceback" not in term.output


async def test_ctrl_c_at_the_prompt_leaves_on_a_new_line(cpu_engine: CpuEngine) -> None:
    async with (
        running_server(cpu_engine) as listening,
        terminal("--url", listening.url) as term,
    ):
        await term.expect(r"\n> $")
        await term.type("\x03")
        with trio.fail_after(30):
            status = await term.process.wait()
        assert status == 0
        await term.expect(r"\n$")
        # The terminal echoes "^C"; the chat ends that line.
        assert re.search(r"> (\^C)?\n$", term.output), repr(term.output[-80:])
