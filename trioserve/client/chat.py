"""``python -m trioserve.client``: a terminal chat with a trioserve server,
on the client library.

It keeps the conversation, renders it as ChatML (the format of the embedded
model) or sends it as ``messages`` for the server's own chat template, and
streams each answer; Ctrl-C stops the answer being written, not the chat.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any, Final, TextIO
from urllib.parse import urlsplit

import attrs
import trio

from trioserve import protocol as p
from trioserve.errors import TrioserveError

from .library import (
    Client,
    ConnectionFailed,
    InferStream,
    ServerError,
    leaf_error,
    open_client,
)

__all__ = ["build_chat_parser", "chatml_turn", "main"]

# python -m trioserve.client: a small chat
#
# The chat keeps the conversation as a list of messages. Today it writes the
# prompt itself in ChatML (the format of SmolLM2-Instruct and many others) and
# sends it as `text`; the model's own chat template, applied by the server to
# an `infer` carrying `messages`, replaces that by changing _Chat.request()
# alone: everything else (history, /reset, stop, fitting the context) works on
# messages and does not know the prompt format.

DEFAULT_URL: Final = "ws://127.0.0.1:7862/"
DEFAULT_MAX_NEW_TOKENS: Final = 512

#: Ends an assistant turn in ChatML (the model's EOS token ends it too).
CHATML_END: Final = "<|im_end|>"
_COMMANDS: Final = {
    "/reset": "forget the conversation (the system message stays)",
    "/help": "show these commands",
    "/exit": "leave (so do /quit, Ctrl-D, and Ctrl-C at the prompt)",
}


def chatml_turn(role: str, text: str) -> str:
    """One ChatML message, the chat format of SmolLM2-Instruct and many
    others."""
    return f"<|im_start|>{role}\n{text}{CHATML_END}\n"


@attrs.frozen
class _Message:
    role: str
    content: str


def _chatml_prompt(messages: Sequence[_Message]) -> str:
    """``messages`` in ChatML, ending with an open assistant turn."""
    return "".join(chatml_turn(m.role, m.content) for m in messages) + "<|im_start|>assistant\n"


@attrs.define(eq=False)
class _Chat:
    """A conversation with one server: its messages, and one answer at a time.

    Answers go to ``out`` (stdout); everything else the chat says (notes,
    errors, statistics) goes to ``notes`` (stderr), so that
    ``--once ... > answer.txt`` holds the answer alone.
    """

    client: Client
    max_new_tokens: int
    sampling: dict[str, Any]
    out: TextIO
    notes: TextIO
    system: str | None = None
    #: The model's context length (from ``info``); None when unknown.
    context_length: int | None = None
    #: Print a line of statistics after each answer.
    stats: bool = False
    history: list[_Message] = attrs.Factory(list)
    current: InferStream | None = None
    stopping: bool = False
    #: Set when Ctrl-C ended the chat.
    interrupted: bool = False

    def reset(self) -> None:
        self.history.clear()

    def messages(self, question: str) -> list[_Message]:
        system = [_Message("system", self.system)] if self.system else []
        return [*system, *self.history, _Message("user", question)]

    def request(self, messages: Sequence[_Message]) -> InferStream:
        """The ``infer`` for ``messages``: the only place that knows the
        prompt format."""
        return self.client.infer(
            _chatml_prompt(messages),
            self.max_new_tokens,
            stream=True,
            stop_conditions=[CHATML_END],
            **self.sampling,
        )

    async def fit(self, question: str) -> int:
        """Drop the oldest exchanges until the prompt and the answer fit the
        context (the server would otherwise trim the prompt from the left,
        the system message first). Returns how many messages were dropped."""
        if self.context_length is None:
            return 0
        budget = self.context_length - self.max_new_tokens
        dropped = 0
        while self.history:
            tokens = await self.client.estimate_token(_chatml_prompt(self.messages(question)))
            if tokens <= budget:
                break
            del self.history[:2]  # the oldest question and its answer
            dropped += 2
        return dropped

    async def ask(self, question: str) -> p.InferFinal:
        """Send ``question`` with the conversation so far, stream the answer,
        and add both to the conversation (a stopped answer as far as it got).

        Raises:
            ServerError: the server refused the question; the conversation
                is unchanged.
        """
        if dropped := await self.fit(question):
            self.note(f"[the oldest {dropped} messages were dropped to fit the context]")
        stream = self.request(self.messages(question))
        self.current, self.stopping = stream, False
        try:
            async with stream:
                async for message in stream:
                    if isinstance(message, p.InferChunk):
                        self.out.write(message.chunk)
                        self.out.flush()
        finally:
            self.current = None
        final = stream.final
        self.out.write("\n")
        self.out.flush()
        if final.stop_reason == "interrupted":
            self.note("[stopped]")
        if trimmed := final.usage.trimmed_tokens:
            # Nothing older was left to drop: the question itself did not fit.
            kept = final.usage.prompt_tokens
            self.note(
                f"[the question is too long for the context: the server kept its last {kept} "
                f"tokens of {kept + trimmed}, so this answers only that end; "
                "ask a shorter question, or lower --max-new-tokens]"
            )
        if self.stats:
            first = final.timing.first_token_s
            self.note(
                f"[{final.stop_reason}: {final.usage.generated_tokens} tokens in "
                f"{final.timing.total_s:.2f} s, first after "
                f"{'-' if first is None else f'{first:.2f} s'}; "
                f"prompt {final.usage.prompt_tokens} tokens]"
            )
        self.history += [_Message("user", question), _Message("assistant", final.response)]
        return final

    def note(self, text: str) -> None:
        print(text, file=self.notes, flush=True)

    async def stop_on_interrupt(
        self, leave: trio.CancelScope, *, task_status: trio.TaskStatus[None]
    ) -> None:
        """Ctrl-C: stop the answer being streamed (the server keeps what it
        generated); when none is, or when it is already being stopped, leave.
        Started (``nursery.start``) once Ctrl-C is caught."""
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            task_status.started()
            async for _ in signals:
                stream = self.current
                if stream is not None and not self.stopping:
                    self.stopping = True
                    await self.client.stop(target=stream.request_id)
                else:
                    self.interrupted = True
                    leave.cancel()
                    return

    async def converse(self, interactive: bool) -> None:
        """Questions from stdin until end of input or /exit; a refused
        question is reported and the chat goes on."""
        while True:
            if interactive:
                self.notes.write("> ")
                self.notes.flush()
            line = await _read_line()
            if not line:  # end of input: Ctrl-D on a terminal
                if interactive:
                    self.notes.write("\n")
                return
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                command = text.split()[0].lower()
                if command in ("/exit", "/quit"):
                    return
                if command == "/reset":
                    self.reset()
                    self.note("[conversation cleared]")
                elif command == "/help":
                    for name, what in _COMMANDS.items():
                        self.note(f"  {name:7} {what}")
                else:
                    self.note(f"[unknown command {command}: /help lists them]")
                continue
            try:
                await self.ask(line.rstrip("\n"))
            except ServerError as exc:
                self.note(f"error: {exc}")


async def _read_line() -> str:
    # A thread, since trio cannot wait on a terminal's stdin portably; it is
    # abandoned when the chat ends, so a pending read never holds the exit up.
    return await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)


def _websocket_url(url: str) -> str:
    """``url`` as a WebSocket URL: http(s):// becomes ws(s)://, and a bare
    ``host:port`` gets ws://. Raises ValueError for any other scheme."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return f"ws://{url}"
    mapped = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}.get(scheme.lower())
    if mapped is None or not rest:
        raise ValueError(f"expected a ws://, wss://, http:// or https:// URL, got {url!r}")
    return f"{mapped}://{rest}"


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and everything it was raised from, groups opened."""
    found: list[BaseException] = []
    todo = [error]
    while todo:
        current = todo.pop()
        if any(current is seen for seen in found):
            continue
        found.append(current)
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return found


def _connect_failure(error: ConnectionFailed, url: str, api_key: str | None) -> str:
    """What went wrong connecting to ``url``, and what to do about it."""
    where = urlsplit(url).netloc or url
    status = error.status_code
    if status == 401:
        if api_key is None:
            return f"{where} requires an API key: pass --api-key KEY (or set TRIOSERVE_API_KEY)"
        return f"{where} refused the API key (http 401): check --api-key or TRIOSERVE_API_KEY"
    if status == 403:
        return f"{where} refused this client's origin (http 403)"
    if status == 503:
        return f"{where} is shutting down (http 503)"
    if status is not None:
        return f"{where} rejected the connection with http status {status}"
    causes = _causes(error)
    for cause in causes:
        if isinstance(cause, ConnectionRefusedError):
            return f"connection refused: is the server running on {where}?"
        if isinstance(cause, socket.gaierror):
            return f"cannot find the host of {url}: {cause.strerror}"
        if isinstance(cause, TimeoutError | trio.TooSlowError):
            return f"no answer from {where} in time: is a trioserve server there?"
    reasons = [c.strerror for c in causes if isinstance(c, OSError) and c.strerror]
    if reasons:
        return f"cannot connect to {where}: {reasons[-1]}"
    return f"cannot connect to {where}: is a trioserve server there?"


def _banner(url: str, info: p.InfoReply | None) -> str:
    if info is None:
        about = f"connected to {url}"
    else:
        model = info.model
        about = (
            f"{info.server.name} {info.server.version} at {url}: {model.name} "
            f"({model.engine} engine, context {model.context_length} tokens)"
        )
    return (
        f"{about}\nType a message and press Enter. Ctrl-C stops an answer; /reset forgets the "
        "conversation; /help lists commands; Ctrl-D leaves."
    )


class _ChatFailed(TrioserveError):
    """The chat cannot go on; the message says why and what to do."""


async def _run_chat(args: argparse.Namespace) -> None:
    url = args.url
    sampling: dict[str, Any] = {}
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    try:
        async with open_client(url, api_key=args.api_key) as client:
            try:
                info: p.InfoReply | None = await client.info()
            except ServerError:
                info = None  # a server without `info` (ExLlamaV2's own): chat anyway
            max_new_tokens = args.max_new_tokens
            if max_new_tokens is None:
                # The default leaves at least half the context to the
                # conversation; a number the user gave is the server's to judge.
                max_new_tokens = DEFAULT_MAX_NEW_TOKENS
                if info is not None:
                    max_new_tokens = min(
                        max_new_tokens,
                        info.limits.max_new_tokens,
                        max(1, info.model.context_length // 2),
                    )
            chat = _Chat(
                client,
                max_new_tokens,
                sampling,
                sys.stdout,
                sys.stderr,
                system=args.system,
                context_length=None if info is None else info.model.context_length,
                stats=args.stats,
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(chat.stop_on_interrupt, nursery.cancel_scope)
                if args.once is not None:
                    try:
                        await chat.ask(args.once)
                    except ServerError as exc:
                        raise _ChatFailed(str(exc)) from None
                else:
                    chat.note(_banner(url, info))
                    await chat.converse(sys.stdin.isatty())
                nursery.cancel_scope.cancel()
            if chat.interrupted:
                # Left with Ctrl-C: end the prompt's (or the answer's) line.
                sys.stderr.write("\n")
    except ConnectionFailed as exc:
        raise _ChatFailed(_connect_failure(exc, url, args.api_key)) from None


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def build_chat_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trioserve.client",
        description=(
            "Chat with a trioserve server from a terminal. The answer streams as it is "
            "generated; the conversation is kept and sent with each question (the oldest "
            "exchanges are dropped when it outgrows the context)."
        ),
        epilog=(
            "In the chat: Ctrl-C stops the answer being written (the server stops generating "
            "it); /reset forgets the conversation; /help lists the commands; Ctrl-D, /exit, or "
            "Ctrl-C at the prompt leaves. Answers go to stdout, everything else to stderr. "
            "The prompt is written in ChatML, the format of SmolLM2-Instruct (the embedded "
            "model) and many others."
        ),
    )
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help=f"the server: ws://, wss://, or http(s):// for the same (default: {DEFAULT_URL})",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help="API key, when the server requires one (default: $TRIOSERVE_API_KEY, else none)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=_tokens,
        default=None,
        metavar="N",
        help=f"longest answer, in tokens (default: {DEFAULT_MAX_NEW_TOKENS}, or half the model's "
        "context when that is less)",
    )
    parser.add_argument(
        "--temperature",
        type=_temperature,
        default=None,
        metavar="T",
        help="sampling temperature; 0 always takes the likeliest token (default: the server's)",
    )
    parser.add_argument(
        "--system",
        default=None,
        metavar="TEXT",
        help="a system message that starts the conversation and survives /reset (default: none)",
    )
    parser.add_argument(
        "--once",
        default=None,
        metavar="QUESTION",
        help="ask one question, print the answer and exit (default: a conversation on stdin)",
    )
    parser.add_argument(
        "--stats",
        action="store_true",
        help="after each answer, print its tokens and times to stderr (default: off)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Chat with a trioserve server from a terminal."""
    parser = build_chat_parser()
    args = parser.parse_args(argv)
    if args.once is not None and not args.once.strip():
        parser.error("--once needs a question, got an empty one")
    try:
        args.url = _websocket_url(args.url)
    except ValueError as exc:
        parser.error(f"--url: {exc}")
    if args.api_key is None:
        # The environment, not a default shown in --help: a key is never printed.
        args.api_key = os.environ.get("TRIOSERVE_API_KEY") or None
    try:
        trio.run(_run_chat, args)
    except BaseException as exc:
        leaf = leaf_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
        if isinstance(leaf, KeyboardInterrupt):
            sys.stderr.write("\n")
            return 130
        if isinstance(leaf, TrioserveError):
            print(f"error: {leaf}", file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
