"""A short run of the fuzzer (tests/fuzz/) in the default suite.

``nox -s fuzz`` sends 100,000 frames to a server in a subprocess; this sends a
few thousand to a server in this process on the real model, with the same
checks: every frame answered exactly once, malformed WebSocket frames closed
with the RFC's codes, a bystander streaming the whole time untouched, and no
job left behind. The seed is fixed so that a failure replays; set
``TRIOSERVE_FUZZ_SEED`` to explore others.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

from tests.fuzz.__main__ import bystander_frame
from tests.fuzz.http import run_http_fuzz
from tests.fuzz.run import run_fuzz

from .helpers import serving, wait_until

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

FRAMES = 2500
HTTP_REQUESTS = 600


@pytest.mark.slow
async def test_a_few_thousand_fuzzed_frames_each_get_one_answer(cpu_engine: CpuEngine) -> None:
    seed = int(os.environ.get("TRIOSERVE_FUZZ_SEED", "8"))
    async with serving(cpu_engine) as (server, listening):
        report = await run_fuzz(
            listening.url,
            frames=FRAMES,
            seed=seed,
            connections=6,
            ws_connections=4,
            bystander_frame=bystander_frame,
        )
        await wait_until(
            lambda: (
                server.statistics().scheduler.running == 0
                and server.statistics().scheduler.waiting == 0
            ),
            within=60,
        )
    assert report.total_frames == FRAMES
    assert report.ok, report.format()
    # The run exercised what it is for: every family, and real answers.
    assert set(report.families) >= {"valid", "mutated", "deep", "binary", "long"}
    assert report.replies["error:invalid_json"] and report.replies["infer:full"]


@pytest.mark.slow
async def test_fuzzed_openai_bodies_never_get_a_server_error(cpu_engine: CpuEngine) -> None:
    """The OpenAI door under hostile bodies (tests/fuzz/http.py): each is a
    200, or a 4xx/503 in OpenAI's error shape; never a 500, never a dropped
    connection."""
    seed = int(os.environ.get("TRIOSERVE_FUZZ_SEED", "8"))
    # A small cap on new tokens: a body without max_tokens generates at most that.
    async with serving(cpu_engine, max_message_bytes=64 * 1024, max_new_tokens=8) as (
        server,
        listening,
    ):
        report = await run_http_fuzz(
            "127.0.0.1", listening.port, requests=HTTP_REQUESTS, seed=seed, connections=4
        )
        await wait_until(lambda: server.statistics().scheduler.running == 0, within=60)
    assert report.requests == HTTP_REQUESTS
    assert report.ok, report.format()
    # The run reached the generation, the parser and the limits.
    assert report.statuses[200] and report.statuses[400] and report.statuses[413]
