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

from tests.fuzz.__main__ import bystander_frame
from tests.fuzz.run import run_fuzz

from .helpers import serving, wait_until

if TYPE_CHECKING:
    from trioserve.engine.cpu import CpuEngine

FRAMES = 2500


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
