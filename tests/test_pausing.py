"""Work-conserving fairness on the real model: the CPU engine pauses a job
(its keys and values, sampler, text and constraint state kept) and resumes it
where it stopped, and the server lets a lone client use every slot while a
second client's request still starts within a step.

Nothing of a paused job may be lost or changed: every test compares with the
same job run without a pause, bit for bit (greedy and seeded sampling alike).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import trio

from tests.helpers import raw_client, serving, wait_until
from trioserve.engine.base import GenerationSpec
from trioserve.engine.cpu.engine import CpuEngine
from trioserve.vocabulary.results import Failed, Finished, TextUpdate, Update
from trioserve.vocabulary.sampling import SamplingSettings

GREEDY = SamplingSettings(temperature=0.0, rep_pen=1.0)
SAMPLED = SamplingSettings(temperature=0.9, top_p=0.9, rep_pen=1.15, seed=1234)
_ids = itertools.count(7_000_000)


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def spec_of(
    engine: CpuEngine, question: str, n: int, sampling: SamplingSettings = GREEDY
) -> GenerationSpec:
    return GenerationSpec(
        job_id=next(_ids),
        prompt_ids=tuple(engine.encode(chat(question))),
        max_new_tokens=n,
        sampling=sampling,
        stop_token_ids=engine.info.eos_token_ids,
    )


def fresh(spec: GenerationSpec) -> GenerationSpec:
    return attrs.evolve(spec, job_id=next(_ids))


class Run:
    """Steps an engine and keeps each job's updates."""

    def __init__(self, engine: CpuEngine) -> None:
        self.engine = engine
        self.updates: dict[int, list[Update]] = {}

    def step(
        self,
        submit: Sequence[GenerationSpec] = (),
        cancel: Sequence[int] = (),
        pause: Sequence[int] = (),
    ) -> list[Update]:
        for spec in submit:
            self.updates.setdefault(spec.job_id, [])
        got = self.engine.step(submit, cancel, pause)
        for update in got:
            self.updates[update.job_id].append(update)
        return got

    def done(self, job_id: int) -> bool:
        ups = self.updates.get(job_id, [])
        return bool(ups) and isinstance(ups[-1], Finished | Failed)

    def until_done(self, *job_ids: int, most: int = 2_000) -> None:
        for _ in range(most):
            if all(self.done(i) for i in job_ids):
                return
            self.step()
        raise AssertionError(f"jobs {job_ids} did not finish")

    def text(self, job_id: int) -> str:
        return "".join(u.text for u in self.updates[job_id] if isinstance(u, TextUpdate | Finished))

    def final(self, job_id: int) -> Finished:
        end = self.updates[job_id][-1]
        assert isinstance(end, Finished), end
        return end


def alone(engine: CpuEngine, spec: GenerationSpec) -> tuple[str, Finished]:
    run = Run(engine)
    run.step([spec])
    run.until_done(spec.job_id)
    return run.text(spec.job_id), run.final(spec.job_id)


def same_outcome(a: Finished, b: Finished) -> bool:
    fields = ("reason", "generated_tokens", "prompt_tokens", "stop_token", "stop_string")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_paused_job_resumes_where_it_stopped(cpu_engine: CpuEngine, sampling: Any) -> None:
    """Two jobs paused mid-answer, a third run to its end in their slots
    meanwhile, then both resumed: their text and ends are those of the same
    jobs run without a pause, and the paused keys and values are counted
    while kept and given back after."""
    a = spec_of(cpu_engine, "Tell me about the sea.", 24, sampling)
    b = spec_of(cpu_engine, "Name three fruits and say why you like them.", 24, sampling)
    expected = {spec.job_id: alone(cpu_engine, fresh(spec)) for spec in (a, b)}
    run = Run(cpu_engine)
    run.step([a, b])
    for _ in range(6):
        run.step()
    assert not run.done(a.job_id) and not run.done(b.job_id)
    assert run.step(pause=[a.job_id, b.job_id]) == []
    stats = cpu_engine.statistics()
    assert (stats.running_jobs, stats.paused_jobs) == (0, 2)
    assert stats.paused_bytes > 0
    # Another job takes the slots and overwrites them.
    other = spec_of(cpu_engine, "What is two plus two?", 12, sampling)
    run.step([other])
    run.until_done(other.job_id)
    assert cpu_engine.statistics().paused_jobs == 2
    run.step([a, b])  # resumed
    run.until_done(a.job_id, b.job_id)
    for spec in (a, b):
        text, end = expected[spec.job_id]
        assert run.text(spec.job_id) == text
        assert same_outcome(run.final(spec.job_id), end)
    stats = cpu_engine.statistics()
    assert (stats.running_jobs, stats.paused_jobs, stats.paused_bytes) == (0, 0, 0)


def test_a_resumed_job_does_not_recompute_its_context(cpu_engine: CpuEngine) -> None:
    """With 16-token prefill chunks, recomputing a 100-token context would
    take seven steps before the next token; a resumed job's next step gives
    its next token: its keys and values came back from where they were kept.
    And a job paused in the middle of its prompt goes on with the chunk it
    stopped at, to the same text."""
    question = "Write one sentence about " + ", ".join(["rivers", "mountains", "cities"] * 16)
    spec = spec_of(cpu_engine, question, 10)
    assert len(spec.prompt_ids) > 100
    text, end = alone(cpu_engine, fresh(spec))
    chunk, cpu_engine.prefill_chunk = cpu_engine.prefill_chunk, 16
    try:
        run = Run(cpu_engine)
        run.step([spec])
        run.step()
        run.step(pause=[spec.job_id])  # mid-prompt: two chunks done
        run.step([spec])
        while not any(isinstance(u, TextUpdate) for u in run.updates[spec.job_id]):
            run.step()
        run.step()
        run.step(pause=[spec.job_id])
        before = len(run.updates[spec.job_id])
        got = run.step([spec])
        assert [u.job_id for u in got] == [spec.job_id], "the next token at the next step"
        assert len(run.updates[spec.job_id]) == before + 1
        run.until_done(spec.job_id)
    finally:
        cpu_engine.prefill_chunk = chunk
    assert run.text(spec.job_id) == text
    assert same_outcome(run.final(spec.job_id), end)


def test_a_paused_job_cancelled_is_dropped_with_its_memory(cpu_engine: CpuEngine) -> None:
    spec = spec_of(cpu_engine, "Count to twenty.", 30)
    run = Run(cpu_engine)
    run.step([spec])
    run.step()
    run.step(pause=[spec.job_id])
    assert cpu_engine.statistics().paused_bytes > 0
    assert run.step(cancel=[spec.job_id]) == []
    stats = cpu_engine.statistics()
    assert (stats.running_jobs, stats.paused_jobs, stats.paused_bytes) == (0, 0, 0)
    # Its id is free: a resubmission is a new job, from the start.
    again = run.step([spec])
    assert not any(isinstance(u, Failed) for u in again)
    run.until_done(spec.job_id)
    assert run.final(spec.job_id).generated_tokens > 0


def test_pausing_unknown_or_finished_jobs_changes_nothing(cpu_engine: CpuEngine) -> None:
    spec = spec_of(cpu_engine, "Say hi.", 3)
    run = Run(cpu_engine)
    run.step([spec])
    run.until_done(spec.job_id)
    assert run.step(pause=[spec.job_id, 123_456_789]) == []
    assert cpu_engine.statistics().paused_jobs == 0


@pytest.mark.parametrize("kv", ["int8"])
def test_pausing_keeps_an_8_bit_cache_exact(model_dir: Any, kv: str) -> None:
    engine = CpuEngine.load(None, max_batch=2, kv_cache_dtype=kv)
    try:
        spec = spec_of(engine, "Tell me about the moon.", 20)
        text, end = alone(engine, fresh(spec))
        run = Run(engine)
        run.step([spec])
        for _ in range(5):
            run.step()
        run.step(pause=[spec.job_id])
        other = spec_of(engine, "And the sun?", 8)
        run.step([other])
        run.until_done(other.job_id)
        run.step([spec])
        run.until_done(spec.job_id)
        assert run.text(spec.job_id) == text
        assert same_outcome(run.final(spec.job_id), end)
    finally:
        engine.close()


# --- through the server, over real sockets --------------------------------------------


def as_client(n: int) -> dict[str, Any]:
    """A connection from client address ``n``, through a trusted proxy on loopback."""
    return {"extra_headers": [(b"X-Forwarded-For", f"192.0.2.{n}".encode())]}


FLOOD = [
    "Tell me a story about a dragon.",
    "Explain rain to a child.",
    "Write a poem about bread.",
    "Describe a busy market.",
    "Why is the sky blue?",
    "List some uses of salt.",
    "Describe a quiet library.",
    "What do cats like?",
]


@pytest.mark.slow
async def test_a_lone_client_uses_every_slot_and_a_newcomer_starts_within_a_step(
    cpu_engine: CpuEngine,
) -> None:
    """With the default flags, one client's 8 requests hold all 8 slots; a
    second client's request then starts within a step (the first client's
    newest job is paused) and is answered, and the first client's answers
    are those it gets with no one else there, to the byte."""
    capacity = cpu_engine.info.max_batch
    assert capacity == len(FLOOD)
    eos = sorted(cpu_engine.info.eos_token_ids)

    def request(i: int, text: str) -> dict[str, Any]:
        # EOS banned: every answer runs its 48 tokens, so the flood lasts.
        return {
            "action": "infer",
            "text": chat(text),
            "max_new_tokens": 48,
            "temperature": 0.0,
            "bann_bann": eos,
            "request_id": i,
        }

    async with serving(cpu_engine, trusted_proxies=("127.0.0.1",)) as (server, listening):
        url = listening.url

        async def flood(answers: dict[int, str], newcomer: bool) -> int:
            async with raw_client(url, **as_client(1)) as ws:
                for i, text in enumerate(FLOOD):
                    await ws.send(request(i, text))
                await wait_until(lambda: server.statistics().scheduler.running == capacity, 60)
                assert server.statistics().scheduler.waiting == 0
                steps = -1
                if newcomer:
                    async with raw_client(url, **as_client(2)) as other:
                        before = server.statistics().scheduler.steps
                        await other.send(
                            {**request(99, "Say hello."), "stream": True, "max_new_tokens": 4}
                        )
                        first = await other.recv(60)
                        assert first.get("response_type") == "chunk", first
                        steps = server.statistics().scheduler.steps - before
                        frames = await other.recv_until_final(99, 60)
                        assert frames[-1]["response_type"] == "full", frames[-1]
                for _ in FLOOD:
                    frame = await ws.recv(120)
                    assert frame["response_type"] == "full", frame
                    answers[frame["request_id"]] = frame["response"]
                return steps

        quiet: dict[int, str] = {}
        await flood(quiet, newcomer=False)
        assert server.statistics().scheduler.pauses == 0
        shared: dict[int, str] = {}
        steps = await flood(shared, newcomer=True)
        stats = server.statistics().scheduler
    # Admitted at once; its first token at the first or second step after
    # (the one running when it arrived may finish first).
    assert 1 <= steps <= 3, steps
    assert stats.pauses >= 1
    assert shared == quiet
    assert stats.paused == 0 and stats.running == 0 and stats.waiting == 0


@pytest.mark.slow
async def test_a_cap_given_still_holds_on_a_pausing_engine(cpu_engine: CpuEngine) -> None:
    """``max_running_per_client`` given explicitly is a cap even though the
    engine could pause: a lone client's fourth request waits with slots free."""
    async with serving(cpu_engine, max_running_per_client=3) as (server, listening):
        async with raw_client(listening.url) as ws:
            eos = sorted(cpu_engine.info.eos_token_ids)
            for i in range(4):
                await ws.send(
                    {
                        "action": "infer",
                        "text": chat("Tell me a long story."),
                        "max_new_tokens": 400,
                        "bann_bann": eos,
                        "request_id": i,
                        "stream": True,
                    }
                )
            await wait_until(lambda: server.statistics().scheduler.waiting == 1, 60)
            await trio.sleep(0.2)
            stats = server.statistics().scheduler
            assert (stats.running, stats.waiting, stats.pauses) == (3, 1, 0)
            await ws.send({"action": "stop"})
