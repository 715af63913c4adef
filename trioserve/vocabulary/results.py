"""What a generation produces, as every layer above the engines sees it: the
text released step by step (:class:`TextUpdate`), how a job ended
(:class:`Finished`, its :data:`FinishReason`) or failed (:class:`Failed`),
and the log-probability entries (:class:`TokenLogprob`) both wire formats
report."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Literal, Protocol, TypeAlias

import attrs

if TYPE_CHECKING:
    from .tools import ToolFormat

__all__ = [
    "MAX_TOP_LOGPROBS",
    "Failed",
    "FailureCause",
    "FinishReason",
    "Finished",
    "GenerationState",
    "TextUpdate",
    "TokenLogprob",
    "Update",
]


#: The most alternatives a token's log-probability entry may list.
MAX_TOP_LOGPROBS: Final = 20


@attrs.frozen
class TokenLogprob:
    """One token's log probability under the model (docs/sampling.md,
    "Log probabilities", says which distribution), and, for a generated or
    prompt token, its likeliest alternatives (each with ``top`` empty)."""

    token: int
    #: The token's text on its own: its bytes decoded as UTF-8, a partial
    #: character written as U+FFFD (``bytes`` is exact).
    text: str
    bytes: bytes
    #: None only for a prompt's first token: nothing comes before it.
    logprob: float | None
    #: The likeliest tokens, most likely first (ties: lower id first).
    top: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class TextUpdate:
    """Tokens were generated for a job during one step."""

    job_id: int
    #: Newly released text; may be empty while text is held back.
    text: str
    #: Text held back now (a possible stop-string prefix, or an incomplete
    #: UTF-8 character written as U+FFFD); on interruption the caller appends
    #: it to the completion so that nothing generated is lost.
    held: str
    #: Tokens generated for this job so far (including this step's).
    generated_tokens: int
    #: With :attr:`GenerationSpec.logprobs`: the entries of the tokens whose
    #: text is released with ``text`` (docs/sampling.md says the rule).
    logprobs: tuple[TokenLogprob, ...] = ()


#: Why a job ended: a stop token, a stop string, ``max_new_tokens``, or its
#: constraint is complete (its grammar allows nothing more but the end).
FinishReason: TypeAlias = Literal["stop_token", "stop_string", "max_new_tokens", "constraint"]


@attrs.frozen
class Finished:
    """A job ended. Its slot is already free."""

    job_id: int
    #: Last released text: everything not sent in an earlier TextUpdate,
    #: including held text flushed at ``max_new_tokens``; never the stop
    #: string or the stop token's own text.
    text: str
    reason: FinishReason
    #: The stop string that matched, when ``reason == "stop_string"``.
    stop_string: str | None
    #: The stop token id sampled, when ``reason == "stop_token"``.
    stop_token: int | None
    #: Prompt tokens actually run (after token healing removed one, if it did).
    prompt_tokens: int
    #: Tokens generated, the stop token included.
    generated_tokens: int
    #: Of ``prompt_tokens``, those whose keys and values came from the
    #: engine's prefix cache instead of being computed (0 without one).
    cached_tokens: int = 0
    #: With :attr:`GenerationSpec.logprobs`: the entries released with ``text``.
    logprobs: tuple[TokenLogprob, ...] = ()
    #: With :attr:`GenerationSpec.prompt_logprobs`: one entry per prompt
    #: token run, the first one's ``logprob`` None (nothing comes before it).
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    #: With :attr:`GenerationSpec.logprobs`, when ``reason == "stop_token"``:
    #: the stop token's entry, which is in no ``logprobs`` above (its text is
    #: never released). The legacy completions list it last, as OpenAI's list
    #: ``<|endoftext|>``: a client scoring ``prompt + 1 token`` counts on it.
    stop_logprob: TokenLogprob | None = None


#: Why a job failed: the engine (a bug, memory: a 500), or what the request
#: asked for (a constraint that breaks down mid-generation, or grows too
#: costly to enforce: a 400 naming it).
FailureCause: TypeAlias = Literal["engine", "request"]


@attrs.frozen
class Failed:
    """A job failed alone; other jobs go on. Its slot is already free."""

    job_id: int
    #: What went wrong, for the client (lowercase, no traceback).
    message: str
    cause: FailureCause = "engine"


Update: TypeAlias = TextUpdate | Finished | Failed


class GenerationState(Protocol):
    """What an API's reply reads of a generation as it goes (the server's
    ``Generation`` is one; each API's reply takes what it needs of it)."""

    @property
    def response(self) -> str:
        """The text released so far (the answer: a thinking template's
        reasoning is apart, in :attr:`reasoning`)."""

    @property
    def reasoning(self) -> str:
        """The thinking released so far ("" unless the template thinks)."""

    @property
    def outcome(self) -> str | None:
        """Set when the generation has ended, however it ended."""

    @property
    def finished(self) -> Finished | None:
        """Set when it ended normally."""

    @property
    def failure(self) -> str | None:
        """Why it failed, when it failed."""

    @property
    def failure_cause(self) -> FailureCause:
        """Whose the failure is: the engine's or the request's."""

    @property
    def tool_format(self) -> ToolFormat | None:
        """How the model writes tool calls, when it may call tools."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def generated_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...
