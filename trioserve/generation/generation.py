"""One generation, from a request to its outcome, whichever door it came in by.

Both doors (the WebSocket protocol and the OpenAI API) turn a request into a
:class:`GenerationRequest` and ask :class:`Generations` (one per server) for a
:class:`Generation`. From there the path is one: the model checks
(:func:`check_request`), admission (the server drains, the client's request
limit, room in the scheduler), the chat template, tokenizing (long texts off
the event loop), fitting the prompt to the context (trimmed or refused, as the
request says), the engine's job (:func:`build_spec`), and following its
updates with their token counts and timing. The door reads what it needs to
answer from the ``Generation`` (text so far, counts, timing, the outcome) and
decides how to send it; nothing here knows a frame, a socket or a wire format.

The pure part (:func:`check_request`, :func:`fit_prompt`, :func:`build_spec`)
is in :mod:`.request`, tested without trio.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

import attrs
import trio

from trioserve.chat_template import ChatTemplate, ChatTemplateError
from trioserve.engine.base import EngineInfo
from trioserve.vocabulary.reasoning import ReasoningFormat, ReasoningSplitter
from trioserve.vocabulary.results import (
    Failed,
    FailureCause,
    Finished,
    TextUpdate,
    TokenLogprob,
)
from trioserve.vocabulary.tools import (
    ANSWER_KINDS,
    ToolFormat,
    format_for,
    prompt_messages,
    takes_tools,
)

from .constraining import ConstraintRefused, compile_constraint, tools_constraint
from .request import (
    Fit,
    GenerationRequest,
    InvalidGeneration,
    Overloaded,
    admit_client,
    build_spec,
    check_request,
    continued_prompt,
    fit_prompt,
    tail_chars,
    trim_prompt,
    with_seed_offset,
)
from .scheduler import Job, QueueFull, Scheduler, SchedulerClosed
from .thinking import after_thinking, find_thinking, kept_markers
from .tokenizing import Tokenizing

if TYPE_CHECKING:  # llguidance and torch load with the engine, not with this module
    from trioserve.engine.grammars import CompiledGrammar, Grammars

__all__ = [
    "Fit",
    "Generation",
    "GenerationObserver",
    "GenerationRequest",
    "Generations",
    "InvalidGeneration",
    "Outcome",
    "Overloaded",
    "Tokenizing",
    "admit_client",
    "build_spec",
    "check_request",
    "fit_prompt",
    "tail_chars",
    "trim_prompt",
]


# --------------------------------------------------------------------------
# Generations: one per server


Outcome: TypeAlias = Literal["finished", "failed", "interrupted"]


class GenerationObserver(Protocol):
    """What a generation reports as it goes (``trioserve.metrics.Metrics`` is one)."""

    def first_token(self, seconds: float, *, api: str) -> None: ...

    def tokens(self, seconds: float, count: int = 1) -> None: ...

    def constraint(self, kind: str, outcome: str, seconds: float = 0.0) -> None: ...


@attrs.define(eq=False)
class Generations:
    """Where both doors get their :class:`Generation`: the scheduler, the
    tokenizer, the model's chat template and limits, and the per-client
    request limit, shared by every request of a server.

    A client is what the door says it is (its API key, else its address):
    ``max_requests_per_client`` bounds the generations it has in flight across
    both doors, and the scheduler's slot guarantee (one client never holds
    every engine slot) is per client too.
    """

    scheduler: Scheduler
    tokenizing: Tokenizing
    #: The server's cap on generated tokens (at most the context length - 1).
    max_new_tokens: int
    chat_template: ChatTemplate | None = None
    observer: GenerationObserver | None = None
    is_draining: Callable[[], bool] = lambda: False
    max_requests_per_client: int = 64
    #: The engine's grammar compiler, when it enforces constraints.
    grammars: Grammars | None = None
    #: Grammars compile in worker threads of their own limiter: one at a
    #: time, so that a burst of hostile schemas takes one core at most.
    compiling: trio.CapacityLimiter = attrs.field(factory=lambda: trio.CapacityLimiter(1))
    #: How tool calls are written: ``auto`` (from the chat template) or a
    #: format of :data:`~trioserve.vocabulary.tools.TOOL_FORMATS`.
    tool_call_format: str = "auto"
    #: The chat template's thinking markers: a generation's reasoning is kept
    #: apart from its answer (None: ``--reasoning-format none``, or a
    #: template that does not think).
    reasoning: ReasoningFormat | None = None
    #: The most tokens of reasoning per reply (``--reasoning-budget``).
    reasoning_budget: int | None = None
    #: Generations in flight per client: a server with several models gives
    #: each model's ``Generations`` the same counter, so that
    #: ``max_requests_per_client`` holds across them.
    in_flight_counts: collections.Counter[Hashable] = attrs.field(factory=collections.Counter)
    _open: int = attrs.field(default=0, init=False)
    #: The model's id on a server of several (the access log names it).
    model_id: str | None = None
    #: Why a request is refused while ``is_draining()`` (an unloading model's names it).
    draining_message: str = "the server is shutting down and takes no new requests"

    @property
    def open_count(self) -> int:
        """This pipeline's generations not yet closed (every client's)."""
        return self._open

    @property
    def info(self) -> EngineInfo:
        return self.scheduler.engine.info

    def check(self, request: GenerationRequest) -> None:
        """:func:`check_request` against this server's model (synchronous:
        a door answers a bad request before it starts any task)."""
        check_request(
            request,
            self.info,
            max_new_tokens=self.max_new_tokens,
            renders_messages=self.chat_template is not None,
        )

    def open(
        self,
        request: GenerationRequest,
        *,
        client: Hashable,
        owner: Hashable | None = None,
        api: str = "websocket",
    ) -> Generation:
        """A new generation of ``request`` for ``client`` (``owner``: its
        connection, for fairness among one client's connections). Checks the
        request (:class:`InvalidGeneration`) and admission
        (:class:`Overloaded`); the generation counts against the client's
        limit until it is :meth:`Generation.close`\\ d."""
        return self.open_choices(request, 1, client=client, owner=owner, api=api)[0]

    def open_choices(
        self,
        request: GenerationRequest,
        n: int,
        *,
        client: Hashable,
        owner: Hashable | None = None,
        api: str = "websocket",
    ) -> list[Generation]:
        """``n`` generations of one ``request`` (the ``n`` choices of an
        OpenAI request), as :meth:`open` does one: each counts against the
        client's limit, so all of them are admitted or none. Choice ``i``
        samples with the request's seed plus ``i`` (when it has one), so that
        each choice draws its own stream. Start them with
        :func:`~trioserve.generation.choices.start_choices`."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n!r}")
        self.check(request)
        self.admit(client, n)
        self.in_flight_counts[client] += n
        self._open += n
        received = trio.current_time()
        return [
            Generation(
                request=request if index == 0 else with_seed_offset(request, index),
                generations=self,
                client=client,
                owner=owner if owner is not None else client,
                received=received,
                api=api,
            )
            for index in range(n)
        ]

    async def render_prompt(self, request: GenerationRequest) -> str:
        """The prompt text of a checked ``request`` that is not token ids:
        its messages (and tools) through the chat template, ending with the
        client's ``assistant_prefix`` (:func:`continued_prompt`); else its text
        after ``custom_bos``."""
        if request.messages is None:
            return request.custom_bos + request.text
        template = self.chat_template
        assert template is not None  # check_request refused it otherwise
        native = takes_tools(template.source)
        messages, tools = prompt_messages(request.messages, request.tools, native=native)
        variables: dict[str, Any] = {}
        if request.thinking is not None:
            # Qwen3's and its kin's switch; templates without it ignore it.
            variables["enable_thinking"] = request.thinking
        prefix = request.assistant_prefix
        try:
            if prefix:
                final = [*messages, {"role": "assistant", "content": prefix}]
                closed = await self.tokenizing.render(
                    template,
                    final,
                    tools=tools,
                    variables={**variables, "add_generation_prompt": False},
                )
                continued = continued_prompt(closed, prefix)
                if continued is not None:
                    return continued
            prompt = await self.tokenizing.render(
                template, messages, tools=tools, variables=variables
            )
        except ChatTemplateError as exc:
            raise InvalidGeneration(str(exc), "messages", code="chat_template_error") from None
        return prompt + prefix

    async def count_prompt_tokens(self, request: GenerationRequest, *, client: Hashable) -> int:
        """How many tokens ``request``'s prompt is, rendered and tokenized
        as a generation would be (before any fitting to the context). Checks
        it (:class:`InvalidGeneration`) and admits it as a generation of
        ``client`` while it is counted (:class:`Overloaded`: draining, or
        the client's limit), so that counting shares the tokenizer fairly.
        Nothing is queued."""
        self.check(request)
        self.admit(client, 1)
        self.in_flight_counts[client] += 1
        self._open += 1
        try:
            if request.prompt_ids is not None:
                return len(request.prompt_ids)
            return len(await self.tokenizing.encode(await self.render_prompt(request)))
        finally:
            self._closed(client)

    def admit(self, client: Hashable, n: int = 1) -> None:
        """Raise :class:`Overloaded` unless ``client`` may start ``n`` more."""
        if self.is_draining():
            raise Overloaded(self.draining_message, draining=True)
        admit_client(self.in_flight_counts, client, n, self.max_requests_per_client)

    def in_flight(self, client: Hashable) -> int:
        return self.in_flight_counts[client]

    def _closed(self, client: Hashable) -> None:
        self._open -= 1
        self.in_flight_counts[client] -= 1
        if self.in_flight_counts[client] <= 0:
            del self.in_flight_counts[client]


def _last_text(update: Finished, request: GenerationRequest) -> str:
    """A finished job's last text, and with ``include_stop_str`` the stop
    string that ended it."""
    if request.include_stop_str and update.stop_string is not None:
        return update.text + update.stop_string
    return update.text


def _budget(request: GenerationRequest, generations: Generations) -> int | None:
    """The lowest of the request's and the server's thinking budgets; one
    the context cannot reach bounds nothing."""
    budgets = (request.thinking_budget, generations.reasoning_budget)
    given = [budget for budget in budgets if budget is not None]
    return min(given) if given and min(given) < generations.info.context_length else None


@attrs.define(eq=False)
class Generation:
    """One generation in flight: its prompt, job, text so far and timing.

    :meth:`start` prepares and submits the job (raising
    :class:`InvalidGeneration` or :class:`Overloaded` before anything was
    queued); :meth:`follow` reads its updates to the end; :meth:`run` is
    both. ``on_text`` (set by the door) is called synchronously with each
    piece of released text, so the door decides how (and whether yet) to
    send it. Whatever happens, :meth:`end` finishes it: it interrupts a
    generation whose task was cancelled (a stop, a disconnect, a shutdown),
    which frees the job and settles the outcome with nothing generated lost,
    and closes it, which releases the job and the client's count. A door
    runs a generation inside ``with generation:``, which ends it on the way
    out, or calls :meth:`end` in a ``finally``.
    """

    request: GenerationRequest
    generations: Generations = attrs.field(repr=False)
    client: Hashable
    owner: Hashable
    #: trio.current_time() when the request arrived.
    received: float
    #: Under which name the metrics count it (``websocket``, ``openai``).
    api: str = "websocket"
    #: The prompt as the model reads it (rendered, trimmed), for replies.
    util_text: str = ""
    prompt_tokens: int = 0
    trimmed_tokens: int = 0
    #: Prompt tokens the engine took from its prefix cache.
    cached_tokens: int = 0
    response: str = ""
    held: str = ""
    #: The entries released with ``response`` (``request.logprobs``), and
    #: the prompt's (``request.prompt_logprobs``, at the end).
    logprobs: list[TokenLogprob] = attrs.field(factory=list, repr=False)
    prompt_logprobs: tuple[TokenLogprob, ...] = attrs.field(default=(), repr=False)
    generated_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    job: Job | None = None
    #: Set when the outcome is decided (a stop can no longer change it).
    outcome: Outcome | None = None
    finished: Finished | None = None
    failure: str | None = None
    #: Whose the failure is: the engine's (500) or the request's (400).
    failure_cause: FailureCause = "engine"
    ended_at: float | None = None
    #: Called with each piece of released text; the door sets it.
    on_text: Callable[[str], None] = attrs.field(default=lambda _text: None, repr=False)
    #: How the model writes tool calls, when the request lets it call tools.
    tool_format: ToolFormat | None = None
    #: A thinking template's reasoning so far, apart from ``response``.
    reasoning: str = ""
    _splitter: ReasoningSplitter | None = attrs.field(default=None, init=False, repr=False)
    _rendered: str | None = attrs.field(default=None, init=False, repr=False)
    _prompt_ids: list[int] = attrs.field(factory=list, init=False, repr=False)
    _max_new_tokens: int = attrs.field(default=0, init=False, repr=False)
    _compiled: CompiledGrammar | None = attrs.field(default=None, init=False, repr=False)
    _closed: bool = attrs.field(default=False, init=False, repr=False)

    @property
    def decided(self) -> bool:
        """Whether the outcome is known, or the job has delivered its last
        update (a stop arriving now is too late to change it)."""
        return self.outcome is not None or (self.job is not None and self.job.done)

    async def run(self) -> None:
        """:meth:`start`, then :meth:`follow`."""
        await self.start()
        await self.follow()

    async def start(self, *, share_prompt: bool = False) -> None:
        """Render, tokenize, fit and submit the job (``share_prompt``: other
        choices of the request will follow it, :func:`build_spec`). Raises
        :class:`InvalidGeneration` or :class:`Overloaded`; nothing is queued
        then."""
        self._check_room()
        self._compiled = await self._compile()
        await self._prepare()
        self._submit(share_prompt=share_prompt)

    def start_like(self, first: Generation) -> None:
        """Submit the job with ``first``'s prompt, as rendered, tokenized and
        fitted, and its compiled constraint: the other choices of a request
        (their own sampling, the same prompt). Raises :class:`Overloaded`."""
        self._check_room()
        self.util_text = first.util_text
        self.prompt_tokens = first.prompt_tokens
        self.trimmed_tokens = first.trimmed_tokens
        self.tool_format = first.tool_format
        if first._splitter is not None:
            self._splitter = ReasoningSplitter(first._splitter.fmt, first._splitter.start)
        self._prompt_ids = first._prompt_ids
        self._max_new_tokens = first._max_new_tokens
        self._compiled = first._compiled
        self._submit(share_prompt=False)

    def settle_unrun(self, first: Generation) -> None:
        """End a choice that is not run because ``first``, the request's
        first choice, failed or was interrupted: the same outcome."""
        assert first.outcome is not None and self.job is None
        self._settle(first.outcome, failure=first.failure, cause=first.failure_cause)

    def _check_room(self) -> None:
        # Room first, so a full server does not tokenize megabytes for nothing.
        scheduler = self.generations.scheduler
        if not scheduler.has_room(self.client):
            raise Overloaded(
                f"{scheduler.max_waiting} jobs are already waiting for the engine; retry later"
            )

    def _submit(self, *, share_prompt: bool) -> None:
        generations = self.generations
        scheduler = generations.scheduler
        spec = build_spec(
            scheduler.new_job_id(),
            self.request,
            self._prompt_ids,
            generations.info,
            max_new_tokens=self._max_new_tokens,
            constraint=self._compiled,
            share_prompt=share_prompt,
            kept_special=kept_markers(generations.reasoning, self.tool_format),
        )
        if generations.is_draining():
            raise Overloaded("the server is shutting down and takes no new requests", draining=True)
        try:
            self.job = scheduler.open_job(spec, owner=self.owner, client=self.client)
        except QueueFull as exc:
            raise Overloaded(str(exc)) from None
        except SchedulerClosed:
            raise Overloaded(
                "the server is shutting down and takes no new requests", draining=True
            ) from None

    async def follow(self) -> None:
        """Read the job's updates until it ends; the outcome says how."""
        if self.outcome is not None:
            return  # ended by its first update, or never run (:meth:`settle_unrun`)
        job = self.job
        assert job is not None, "start() first"
        async for update in job.updates:
            if self._apply(update):
                return
        # The job was cancelled under us (a shutdown past its grace).
        self.interrupt()

    async def first_update(self) -> None:
        """Wait for the job's first update (its prompt is prefilled by then)
        and take it; :meth:`follow` reads the rest."""
        job = self.job
        assert job is not None, "start() first"
        try:
            update = await job.updates.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            self.interrupt()
            return
        self._apply(update)

    async def _compile(self) -> CompiledGrammar | None:
        """The request's constraint (or its tools') compiled for the model,
        off the event loop (:mod:`.constraining`). Raises
        :class:`InvalidGeneration` naming the field."""
        request = self.request
        constraint = request.constraint
        tools = request.tools
        generations = self.generations
        # A thinking template's prompt is rendered now (thinking.py).
        self._rendered, self._splitter = await find_thinking(
            generations.reasoning, generations.render_prompt, request
        )
        answer = None
        if tools is not None and tools.calls_allowed:
            if constraint is not None and tools.choice == "auto" and tools.named is None:
                # The reply is the calls, or the answer in its format.
                if constraint.kind not in ANSWER_KINDS:
                    raise InvalidGeneration(
                        f"a {constraint.kind.replace('_', ' ')} constraint cannot stand beside"
                        " tools: only a JSON schema, a regex or choices can (or set"
                        " tool_choice to none)",
                        "constraint",
                        wire_name=constraint.field,
                    )
                answer = constraint
            # A turn that must call writes no answer: its format waits for a later turn.
            fmt = self.tool_format = format_for(
                None
                if self.generations.chat_template is None
                else self.generations.chat_template.source,
                self.generations.tool_call_format,
            )
            special = len(await self.generations.tokenizing.encode(fmt.trigger)) == 1
            constraint = tools_constraint(tools, fmt, special_trigger=special, answer=answer)
        constraint = await after_thinking(
            constraint,
            self._splitter,
            _budget(request, generations),
            generations.tokenizing.encode,
        )
        grammars = self.generations.grammars
        if constraint is None:
            return None
        if grammars is None:  # check_request refuses it first; kept for callers that skip it
            raise InvalidGeneration(
                "this engine does not enforce constraints", "constraint", wire_name=constraint.field
            )
        try:
            return await compile_constraint(
                constraint,
                grammars=grammars,
                limiter=self.generations.compiling,
                observer=self.generations.observer,
                tools=tools if constraint.field == "tools" else None,
                answer=answer,
            )
        except ConstraintRefused as exc:
            raise InvalidGeneration(exc.message, exc.field, wire_name=exc.wire_name) from None

    async def _prepare(self) -> None:
        """Render, tokenize and fit: protocol.md 3.4."""
        request = self.request
        generations = self.generations
        tokenizing = generations.tokenizing
        info = generations.info
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
            prompt = ""
        else:
            rendered = self._rendered
            prompt = rendered if rendered is not None else await generations.render_prompt(request)
            ids = await self._encode(prompt, request, info)
        fitted, self._max_new_tokens = fit_prompt(
            request, ids, info, max_new_tokens=generations.max_new_tokens
        )
        if len(fitted) < len(ids):
            self.trimmed_tokens = len(ids) - len(fitted)
            self.util_text = await tokenizing.decode(fitted)
        elif prompt:
            self.util_text = prompt
        else:
            self.util_text = await tokenizing.decode(fitted)
        self.prompt_tokens = len(fitted)
        self._prompt_ids = fitted

    async def _encode(self, prompt: str, request: GenerationRequest, info: EngineInfo) -> list[int]:
        tokenizing = self.generations.tokenizing
        keep = info.context_length - (request.max_new_tokens or 1)
        tail = tail_chars(info, keep)
        text = prompt[len(request.custom_bos) :] if request.messages is None else prompt
        if request.fit == "trim" and tail is not None and len(text) > tail:
            # Far longer than the context: only its tail can be kept, so only
            # the tail is tokenized. trimmed_tokens then counts the tokens of
            # that tail that were dropped (a lower bound).
            head = await tokenizing.encode(request.custom_bos) if request.custom_bos else []
            return head[:1] + await tokenizing.encode(text[len(text) - tail :])
        return await tokenizing.encode(prompt)

    def _apply(self, update: TextUpdate | Finished | Failed) -> bool:
        """Take one update; True when it was the last."""
        if isinstance(update, Failed):
            self._settle("failed", failure=update.message, cause=update.cause)
            return True
        self._count_tokens(update.generated_tokens)
        self.logprobs.extend(update.logprobs)
        if isinstance(update, TextUpdate):
            self.held = update.held
            self._release(update.text)
            return False
        self.prompt_logprobs = update.prompt_logprobs
        self.held = ""
        self.prompt_tokens = update.prompt_tokens
        self.cached_tokens = update.cached_tokens
        self._release(_last_text(update, self.request), final=True)
        self.finished = update
        self._settle("finished")
        return True

    def _count_tokens(self, generated: int) -> None:
        new = generated - self.generated_tokens
        if new <= 0:
            return
        now = trio.current_time()
        observer = self.generations.observer
        if self.first_token_at is None:
            self.first_token_at = now
            if observer is not None:
                observer.first_token(now - self.received, api=self.api)
                if new > 1:
                    observer.tokens(0.0, new - 1)
        elif observer is not None and self.last_token_at is not None:
            observer.tokens(now - self.last_token_at, new)
        self.last_token_at = now
        self.generated_tokens = generated

    def _release(self, text: str, *, final: bool = False) -> None:
        if self._splitter is None or not self.request.separate_reasoning:
            self.response += text
        else:
            thought, answer = self._splitter.split(text, final=final)
            self.reasoning += thought
            self.response += answer
        if text:
            self.on_text(text)

    def _settle(
        self, outcome: Outcome, *, failure: str | None = None, cause: FailureCause = "engine"
    ) -> None:
        self.outcome = outcome
        self.failure = failure
        self.failure_cause = cause
        self.ended_at = trio.current_time()

    def interrupt(self) -> None:
        """Settle a generation whose task was cancelled: synchronous, for
        ``finally`` blocks.

        A job that had already delivered its last update keeps its real
        outcome (a stop or a drain that races the end of a job must not turn
        an ``eos`` into ``interrupted``). Otherwise the job is cancelled and
        held text is flushed into the response: nothing generated is lost.
        """
        if self.outcome is not None:
            return
        job = self.job
        if job is not None and job.done:
            # Read what the task did not get to: the job's channel holds its
            # last updates and is closed, so this never waits.
            while True:
                try:
                    update = job.updates.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
                if self._apply(update):
                    return
        if job is not None:
            self.generations.scheduler.cancel(job)
        if self.held or self._splitter is not None:
            # The splitter's held text too (the start of a marker): the last release.
            self._release(self.held, final=True)
            self.held = ""
        self._settle("interrupted")

    def end(self) -> bool:
        """The lifecycle's last step, however the generation got here: one
        with no outcome yet is being abandoned (its task was cancelled, its
        client left) and is interrupted (:meth:`interrupt`), then it is
        closed (:meth:`close`). Synchronous and idempotent, so that it runs
        on cancellation; ``with generation:`` calls it on the way out, which
        is how a door cannot forget it. True when it was abandoned."""
        abandoned = self.outcome is None
        if abandoned:
            self.interrupt()
        self.close()
        return abandoned

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.end()

    def close(self) -> None:
        """Free the engine job (if it still runs) and the client's count:
        synchronous and idempotent, for ``finally`` blocks."""
        if self.job is not None:
            self.generations.scheduler.cancel(self.job)
        if not self._closed:
            self._closed = True
            self.generations._closed(self.client)

    # -- figures for replies and logs ------------------------------------------------

    @property
    def queued_s(self) -> float:
        job = self.job
        end = self.ended_at if self.ended_at is not None else trio.current_time()
        if job is None:
            return end - self.received
        started = job.started_at if job.started_at is not None else end
        return started - job.queued_at

    @property
    def first_token_s(self) -> float | None:
        if self.first_token_at is None:
            return None
        return self.first_token_at - self.received

    @property
    def total_s(self) -> float:
        end = self.ended_at if self.ended_at is not None else trio.current_time()
        return end - self.received

    @property
    def tokens_per_second(self) -> float | None:
        """Decode speed after the first token, or None with fewer than two tokens."""
        if self.first_token_at is None or self.ended_at is None or self.generated_tokens < 2:
            return None
        span = self.ended_at - self.first_token_at
        return (self.generated_tokens - 1) / span if span > 0 else math.inf
