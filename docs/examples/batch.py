"""Use trioserve's scheduler without a server: a batch job in one trio program.

The scheduler is the generation task the server runs: it owns the engine, runs
every job that fits in one batched step, and routes each job's updates to its
own channel. Here three prompts are generated together and printed in order.

Run it with ``python docs/examples/batch.py``; ``tests/test_examples.py`` runs
it too, so this file keeps working.
"""

from __future__ import annotations

import trio

from trioserve import (
    Engine,
    EngineOptions,
    Failed,
    Finished,
    GenerationSpec,
    SamplingSettings,
    Scheduler,
    TextUpdate,
    load_engine,
)

QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is 2 + 2?",
]


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


async def answer(scheduler: Scheduler, engine: Engine, question: str) -> tuple[str, int]:
    """The answer to ``question`` and the tokens generated for it."""
    spec = GenerationSpec(
        job_id=scheduler.new_job_id(),
        prompt_ids=tuple(engine.encode(chat(question))),
        max_new_tokens=32,
        sampling=SamplingSettings(temperature=0.0),
        # Nothing adds the model's end-of-sequence ids for you at this level.
        stop_token_ids=engine.info.eos_token_ids,
    )
    job = scheduler.open_job(spec)
    text = ""
    try:
        async for update in job.updates:
            if isinstance(update, TextUpdate):
                text += update.text
            elif isinstance(update, Finished):
                return text + update.text, update.generated_tokens
            elif isinstance(update, Failed):
                raise RuntimeError(f"{question!r} failed: {update.message}")
    finally:
        # Synchronous and idempotent: if this task is cancelled, the engine
        # drops the job before its next step; after the end it does nothing.
        scheduler.cancel(job)
    raise RuntimeError("the job ended without a result")  # the scheduler never does that


async def main() -> None:
    engine = await trio.to_thread.run_sync(
        load_engine, EngineOptions(engine="cpu", context_length=512)
    )
    try:
        scheduler = Scheduler(engine)
        answers: dict[str, tuple[str, int]] = {}

        async def ask(question: str) -> None:
            answers[question] = await answer(scheduler, engine, question)

        async with trio.open_nursery() as nursery:
            await nursery.start(scheduler.run)
            async with trio.open_nursery() as jobs:
                for question in QUESTIONS:
                    jobs.start_soon(ask, question)
            stats = scheduler.statistics()
            # The generation task runs until cancelled.
            nursery.cancel_scope.cancel()
        for question in QUESTIONS:
            text, _ = answers[question]
            print(f"{question} -> {' '.join(text.split())}")
        tokens = sum(generated for _, generated in answers.values())
        # Fewer steps than tokens: the jobs shared batched steps.
        print(f"{stats.served} jobs, {tokens} tokens in {stats.steps} engine steps")
    finally:
        engine.close()


if __name__ == "__main__":
    trio.run(main)
