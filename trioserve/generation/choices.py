"""The ``n`` choices of one request: one prompt, prefilled once, ``n`` jobs.

An OpenAI request with ``n`` > 1 asks for ``n`` answers to one prompt.
:meth:`Generations.open_choices` admits them together (each counts against
the client's request limit, so a client cannot go past it with ``n``); each is
an engine job of the same client and connection, so the scheduler's fairness
treats them as that client's jobs, never as ``n`` clients.

:func:`start_choices` prefills the prompt once: the first choice is rendered,
tokenized, fitted and compiled, and submitted with ``share_prompt`` (the CPU
engine offers its prompt to the prefix cache as soon as it is prefilled);
when its first update arrives, the prompt is prefilled, and the others are
submitted with the same prompt ids and compiled constraint: they start from
the cached prefix (every whole block of the prompt) and compute only its last
partial block. The others start one step behind the first, which a client
cannot tell from batching. An engine that shares a prompt among running jobs
by itself (ExLlamaV2's paged cache deduplicates pages) gets the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from .generation import Generation

__all__ = ["follow_choices", "start_choices"]


async def start_choices(choices: Sequence[Generation]) -> None:
    """Start the choices of one request (opened together by
    :meth:`~trioserve.generation.Generations.open_choices`), the prompt
    prefilled once. Raises what :meth:`Generation.start` raises; the caller
    closes every choice then (none, some or all may have a job)."""
    first, *others = choices
    await first.start(share_prompt=bool(others))
    if not others:
        return
    await first.first_update()
    if first.outcome not in (None, "finished"):
        # The request has failed already: the others share its fate, unrun.
        for choice in others:
            choice.settle_unrun(first)
        return
    for choice in others:
        choice.start_like(first)


async def follow_choices(choices: Sequence[Generation]) -> None:
    """Follow every choice to its end, concurrently. A choice that fails (or
    is interrupted) ends the following of the others: the request has
    failed, and the caller interrupts what is left (their outcome is None)."""
    if len(choices) == 1:
        await choices[0].follow()
        return
    async with trio.open_nursery() as nursery:

        async def follow(choice: Generation) -> None:
            await choice.follow()
            if choice.outcome != "finished":
                nursery.cancel_scope.cancel()

        for choice in choices:
            nursery.start_soon(follow, choice)
