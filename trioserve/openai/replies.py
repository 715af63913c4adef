"""The reply to one OpenAI request, sans-IO: from the state of its ``n``
choices to a whole response body, or to the Server-Sent Events of a stream.

:class:`Reply` reads each choice through :class:`ChoiceState` (the
server's :class:`~trioserve.generation.Generation` is one) and keeps what a
stream has sent of it: the text, the logprob entries and the legacy
``logprobs`` offsets. It splits text into content and tool calls when the
request lets the model call tools (no call marker reaches the content; a
call's arguments stream in pieces), turns ``stop`` into ``tool_calls`` when
the model called one, lists a completion's stop token last in its legacy
``logprobs``, and echoes the prompt. It does no I/O and knows no trio: the
server follows the generations, calls :meth:`Reply.advance` when one has
released text, and writes the bytes it gets.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import attrs

from trioserve.vocabulary.results import Finished, GenerationState, TokenLogprob
from trioserve.vocabulary.tools import (
    CallArguments,
    CallStart,
    Content,
    ToolCallReader,
    ToolEvent,
    ToolFormat,
)

from .errors import OpenAIError
from .logprobs import LegacyLogprobs, chat_logprobs
from .requests import ChatCompletionRequest, CompletionRequest
from .responses import (
    ChatChoice,
    ChatCompletionStream,
    CompletionChoice,
    CompletionStream,
    FinishReason,
    TokenUsage,
    chat_completion_response,
    completion_response,
    finish_reason,
    new_id,
)

__all__ = ["SHUTTING_DOWN", "ChoiceState", "Reply"]

#: The message of a reply whose generations the server's shutdown interrupted.
SHUTTING_DOWN = "the server is shutting down"


class ChoiceState(GenerationState, Protocol):
    """What a reply reads of one choice's generation, as it goes: what
    every API's reply reads, and the log probabilities and the prompt."""

    @property
    def logprobs(self) -> Sequence[TokenLogprob]:
        """The entries released with :attr:`response`."""

    @property
    def prompt_logprobs(self) -> Sequence[TokenLogprob]:
        """The prompt's entries (set at the end)."""

    @property
    def util_text(self) -> str:
        """The prompt as the model read it (rendered, trimmed)."""


Request = CompletionRequest | ChatCompletionRequest
Stream = ChatCompletionStream | CompletionStream


def _stop_entry(finished: Finished) -> tuple[TokenLogprob, ...]:
    """The stop token's entry of a completion that ended on one: listed last
    in the legacy ``logprobs``, as OpenAI lists ``<|endoftext|>`` (its text is
    not in ``text``). lm-evaluation-harness scores ``prompt + 1 token`` and
    drops the last entry: without it, the prompt's last token would go."""
    return () if finished.stop_logprob is None else (finished.stop_logprob,)


@attrs.define(eq=False)
class _CallEvents:
    """A choice's released text as events: content as it is, or, when the
    request lets the model call tools, content and tool calls apart."""

    stream: Stream
    fmt: ToolFormat | None
    #: The choice's index.
    index: int = 0
    reader: ToolCallReader | None = None
    made: bool = False

    def __attrs_post_init__(self) -> None:
        if self.fmt is not None and isinstance(self.stream, ChatCompletionStream):
            self.reader = ToolCallReader(self.fmt)

    def text(self, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        if not text:
            return b""
        if self.reader is None:
            return self.stream.text(text, logprobs, index=self.index)
        return self._events(self.reader.feed(text))

    def finish(self) -> bytes:
        return b"" if self.reader is None else self._events(self.reader.finish())

    def _events(self, events: list[ToolEvent]) -> bytes:
        stream = self.stream
        assert isinstance(stream, ChatCompletionStream)
        out = b""
        for event in events:
            if isinstance(event, Content):
                if event.text:
                    out += stream.text(event.text, index=self.index)
            elif isinstance(event, CallStart):
                self.made = True
                out += stream.tool_call(event.index, id=event.id, name=event.name, index=self.index)
            elif isinstance(event, CallArguments):
                out += stream.tool_call(event.index, arguments=event.text, index=self.index)
        return out


@attrs.define(eq=False)
class _Sent:
    """What a stream has sent of one choice."""

    index: int
    state: ChoiceState
    calls: _CallEvents
    #: The legacy completions ``logprobs`` objects, their offsets counted on.
    legacy: LegacyLogprobs = attrs.Factory(LegacyLogprobs)
    text: int = 0
    reasoning: int = 0
    entries: int = 0
    ended: bool = False


@attrs.define(eq=False)
class Reply:
    """The answer to one started request (its ``n`` choices, in order),
    whole (:meth:`body`) or streamed (:meth:`opening`, then :meth:`advance`
    at each wake-up until :attr:`broken` or :attr:`complete`, then
    :meth:`error` or :meth:`end`)."""

    request: Request
    model: str
    choices: Sequence[ChoiceState]
    id: str = ""
    created: int = attrs.Factory(lambda: int(time.time()))
    _stream: Stream = attrs.field(init=False)
    _sent: list[_Sent] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if not self.choices:
            raise ValueError("a reply has at least one choice")
        self.id = self.id or new_id("chatcmpl" if self.chat else "cmpl")
        request = self.request
        if isinstance(request, ChatCompletionRequest):
            self._stream = ChatCompletionStream(
                self.id, self.created, self.model, request.include_usage
            )
        else:
            self._stream = CompletionStream(
                self.id, self.created, self.model, request.include_usage
            )
        self._sent = [
            _Sent(index, state, _CallEvents(self._stream, state.tool_format, index))
            for index, state in enumerate(self.choices)
        ]

    @property
    def chat(self) -> bool:
        return isinstance(self.request, ChatCompletionRequest)

    @property
    def _reasoning_streams(self) -> bool:
        return self.request.extras.stream_reasoning

    @property
    def echo(self) -> str:
        """What a completion echoes before its text (``echo``): token ids
        are echoed as their text (lm-evaluation-harness sends ids)."""
        request = self.request
        if isinstance(request, CompletionRequest) and request.echo:
            return request.prompt if isinstance(request.prompt, str) else self.choices[0].util_text
        return ""

    @property
    def finished(self) -> bool:
        """Every choice ended normally: the reply can be whole."""
        return all(choice.finished is not None for choice in self.choices)

    def usage(self) -> TokenUsage:
        """The prompt counted once (the choices share it), every choice's
        generated tokens."""
        first = self.choices[0]
        generated = sum(choice.generated_tokens for choice in self.choices)
        return TokenUsage(first.prompt_tokens, generated, first.cached_tokens)

    def outcome(self) -> Literal["num_tokens", "eos"]:
        """How a finished reply ended, for the access log and the metrics
        (the first choice's end, as the WebSocket side names it)."""
        finished = self.choices[0].finished
        assert finished is not None
        return "num_tokens" if finished.reason == "max_new_tokens" else "eos"

    def failure(
        self, *, draining: bool, message: str = SHUTTING_DOWN
    ) -> tuple[Literal["internal", "interrupted", "invalid_request"], OpenAIError]:
        """The error of a reply whose choices did not all finish, and the
        outcome to count: a choice failed by what the request asked for (its
        constraint broke down) is a 400; one the engine failed is a 500
        (unless the server is draining); anything else was interrupted under
        the request, which only the shutdown does (503, retry)."""
        failed = [choice for choice in self.choices if choice.outcome == "failed"]
        if failed and failed[0].failure_cause == "request":
            message = failed[0].failure or "the request cannot be generated"
            return "invalid_request", OpenAIError(400, message, code="constraint_failed")
        if failed and not draining:
            message = failed[0].failure or "the engine failed"
            return "internal", OpenAIError(500, message, code="internal")
        return "interrupted", OpenAIError(503, message, code="overloaded", retry_after=1)

    # ------------------------------------------------------------------
    # Whole

    def body(self) -> bytes:
        """The whole response's JSON; every choice has finished."""
        if not self.finished:
            raise ValueError("a whole reply needs every choice finished")
        if self.chat:
            return chat_completion_response(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[self._chat_choice(i, c) for i, c in enumerate(self.choices)],
                usage=self.usage(),
            )
        return completion_response(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[self._completion_choice(i, c) for i, c in enumerate(self.choices)],
            usage=self.usage(),
        )

    def _logprobs(
        self, entries: Sequence[TokenLogprob], legacy: LegacyLogprobs
    ) -> dict[str, Any] | None:
        """The ``logprobs`` object of these entries, when the request asked."""
        if self.request.logprobs.top is None:
            return None
        if self.chat:
            return chat_logprobs(entries)
        return legacy.of(entries)

    def _chat_choice(self, index: int, state: ChoiceState) -> ChatChoice:
        finished = state.finished
        assert finished is not None
        reason = finish_reason(finished)
        content, calls = state.response, []
        if state.tool_format is not None:
            reader = ToolCallReader(state.tool_format)
            events = reader.feed(content) + reader.finish()
            content = "".join(e.text for e in events if isinstance(e, Content))
            calls = reader.calls
            reason = _called(reason, bool(calls))
        return ChatChoice(
            index=index,
            content=content,
            finish_reason=reason,
            tool_calls=calls,
            logprobs=self._logprobs(state.logprobs, LegacyLogprobs()),
            reasoning=state.reasoning,
        )

    def _completion_choice(self, index: int, state: ChoiceState) -> CompletionChoice:
        finished = state.finished
        assert finished is not None
        entries = [*state.prompt_logprobs, *state.logprobs, *_stop_entry(finished)]
        return CompletionChoice(
            index=index,
            text=self.echo + state.response,
            finish_reason=finish_reason(finished),
            logprobs=self._logprobs(entries, LegacyLogprobs()),
        )

    # ------------------------------------------------------------------
    # Streamed

    @property
    def broken(self) -> bool:
        """A choice ended without finishing: the stream ends in :meth:`error`."""
        return any(sent.ended and sent.state.finished is None for sent in self._sent)

    @property
    def complete(self) -> bool:
        """Every choice's last chunk is out: the stream ends in :meth:`end`."""
        return all(sent.ended for sent in self._sent)

    def opening(self) -> bytes:
        """The events before any generated text: each chat choice's role,
        each completion's echoed prompt."""
        stream, echo = self._stream, self.echo
        out = b""
        for sent in self._sent:
            if isinstance(stream, ChatCompletionStream):
                out += stream.start(index=sent.index)
            if echo:
                out += stream.text(echo, index=sent.index)
        return out

    def advance(self) -> bytes:
        """The events of what every choice released since the last call, and
        the last chunk of each that has ended (never lost, never reordered:
        text released between two calls goes out as one event)."""
        return b"".join(self._advance(sent) for sent in self._sent if not sent.ended)

    def _advance(self, sent: _Sent) -> bytes:
        state = sent.state
        ended = state.outcome is not None
        # The thinking comes first: no answer is released before it ends.
        # With stream_reasoning false it goes out in one chunk, at its end
        # (when the answer starts, or the choice ends).
        out = b""
        if self._reasoning_streams or ended or state.response:
            thought = state.reasoning[sent.reasoning :]
            sent.reasoning += len(thought)
            if thought and isinstance(self._stream, ChatCompletionStream):
                out = self._stream.reasoning(thought, index=sent.index)
        return out + self._answer(sent, ended)

    def _answer(self, sent: _Sent, ended: bool) -> bytes:
        state, calls = sent.state, sent.calls
        text = state.response[sent.text :]
        sent.text += len(text)
        if not ended:
            if not text:
                return b""
            # With a tool-call reader the text is split into content and
            # calls: the entries then go with the last chunk.
            new = state.logprobs[sent.entries :]
            logprobs = None if calls.reader is not None else self._logprobs(new, sent.legacy)
            sent.entries += 0 if logprobs is None else len(new)
            return calls.text(text, logprobs)
        sent.ended = True
        events = calls.text(text) + calls.finish()
        finished = state.finished
        if finished is None:
            return events
        reason = _called(finish_reason(finished), calls.made)
        rest = [*state.logprobs[sent.entries :]]
        if not self.chat:
            rest += _stop_entry(finished)
        logprobs = self._logprobs(rest, sent.legacy)
        return events + self._stream.finish_choice(reason, "", logprobs, index=sent.index)

    def end(self) -> bytes:
        """The stream's last events: the usage chunk when asked, ``[DONE]``."""
        return self._stream.end(self.usage())

    def error(self, error: OpenAIError) -> bytes:
        """The stream's end when a choice failed or was interrupted."""
        return self._stream.error(error)


def _called(reason: FinishReason, called: bool) -> FinishReason:
    """A choice that called a tool and then stopped ends in ``tool_calls``."""
    return "tool_calls" if called and reason == "stop" else reason
