"""lm-evaluation-harness, unchanged, against ``python -m trioserve``: its
``local-completions`` model on two small local tasks (tests/data/lm_eval: a
multiple-choice task and a perplexity task over the same jsonl), with the hub
and datasets offline. Every loglikelihood it logged must be the one computed
from the engine's weights directly (a float32 forward over the same ids and a
log-softmax) to 1e-3, and its is_greedy, acc and acc_norm must follow from
those figures.

lm-eval finds the server's tokenizer by itself: ``/tokenizer_info`` answers,
so it takes ``tokenizer_backend=remote`` (``/tokenize``, ``/detokenize``) and
sends token-id prompts with ``echo``, ``max_tokens: 1`` and ``logprobs: 1``.

The command is docs/openai.md's (``lm-eval``), run as shown. lm-eval is
not in the ``test`` group (it pulls pandas, pyarrow, scikit-learn
...): ``nox -s clients`` installs the ``clients`` group and runs this file;
without lm-eval the test skips, saying so.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

from .serverproc import ROOT, open_server_process
from .test_logprobs import direct_logprobs

if TYPE_CHECKING:
    from trioserve.engine.cpu.engine import CpuEngine

_MISSING = [
    name for name in ("lm_eval", "tenacity", "aiohttp") if importlib.util.find_spec(name) is None
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("model_dir"),
    pytest.mark.skipif(
        bool(_MISSING),
        reason=f"lm-eval[api] is not installed (no {', '.join(_MISSING)}): "
        "`nox -s clients` installs it and runs this test",
    ),
]

DIFFERENCE = 1e-3


def lm_eval_pair(engine: CpuEngine, context: str, continuation: str) -> tuple[list[int], int]:
    """The ids lm-eval sends for ``(context, continuation)`` and the context's
    length: trailing whitespace moves to the continuation, and the
    continuation is what the whole text has past the context's ids."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    return engine.encode(context + continuation), len(engine.encode(context))


def scored(engine: CpuEngine, ids: list[int], start: int) -> tuple[float, bool]:
    """The log probability of ``ids[start:]`` after ``ids[:start]``, and
    whether each of those tokens is the likeliest, from the weights."""
    rows = direct_logprobs(engine, ids)
    total = sum(float(rows[i - 1][ids[i]]) for i in range(start, len(ids)))
    greedy = all(int(rows[i - 1].argmax()) == ids[i] for i in range(start, len(ids)))
    return total, greedy


def samples(out: Path, task: str) -> list[dict[str, Any]]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def documented_command(port: int, out: Path) -> tuple[list[str], dict[str, str]]:
    """docs/openai.md's lm-eval command (its ``VAR=value`` prefix as the
    environment) for the server on ``port``, writing to ``out``, run by this
    interpreter's ``-m lm_eval``."""
    from .test_doc_blocks import block_named

    text = block_named("lm-eval").text.replace("\\\n", " ")
    words = shlex.split(text.replace("127.0.0.1:7862", f"127.0.0.1:{port}"))
    env = {}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[0] == "lm_eval"
    words[words.index("--output_path") + 1] = str(out)
    return [sys.executable, "-m", *words], env


async def test_lm_eval_scores_as_the_engine_does(cpu_engine: CpuEngine, tmp_path: Path) -> None:
    began = time.monotonic()
    out = tmp_path / "out"
    async with open_server_process() as server:
        command, env = documented_command(server.port, out)
        assert env == {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        caches = {"HF_DATASETS_CACHE": str(tmp_path / "datasets"), "HF_HOME": str(tmp_path / "hf")}
        with trio.fail_after(900):
            run = await trio.run_process(
                command,
                cwd=ROOT,
                env={**os.environ, **env, **caches},
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
        log = (run.stdout + run.stderr).decode("utf-8", "replace")
        assert run.returncode == 0, log[-4000:]
        assert "Using remote tokenizer" in log
        assert not server.error_lines(), server.error_reports()

    worst = 0.0
    requests = 0
    right = right_norm = 0
    mc = samples(out, "trioserve_mc")
    for sample in mc:
        doc = sample["doc"]
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        assert [c for _, c in pairs] == [" " + choice for choice in doc["choices"]]
        figures = []
        for (context, continuation), resp in zip(pairs, sample["resps"], strict=True):
            loglikelihood, is_greedy = float(resp[0][0]), resp[0][1] == "True"
            ids, start = lm_eval_pair(cpu_engine, context, continuation)
            direct, greedy = scored(cpu_engine, ids, start)
            worst = max(worst, abs(loglikelihood - direct))
            assert loglikelihood == pytest.approx(direct, abs=DIFFERENCE), (context, continuation)
            assert is_greedy == greedy, (context, continuation)
            figures.append(direct)
            requests += 1
        best = max(range(len(figures)), key=figures.__getitem__)
        lengths = [len(choice) for choice in doc["choices"]]
        best_norm = max(range(len(figures)), key=lambda i: figures[i] / lengths[i])
        assert sample["acc"] == float(best == doc["answer"])
        assert sample["acc_norm"] == float(best_norm == doc["answer"])
        right += best == doc["answer"]
        right_norm += best_norm == doc["answer"]

    rolling = samples(out, "trioserve_rolling")
    bos = cpu_engine.info.bos_token_id
    assert bos is not None
    for sample in rolling:
        (text,) = (a["arg_0"] for a in sample["arguments"].values())
        # One window: the text after the BOS token, all of it scored.
        direct, _ = scored(cpu_engine, [bos, *cpu_engine.encode(text)], 1)
        loglikelihood = float(sample["resps"][0][0])
        worst = max(worst, abs(loglikelihood - direct))
        assert loglikelihood == pytest.approx(direct, abs=DIFFERENCE), text
        requests += 1

    (results_path,) = out.rglob("results_*.json")
    results = json.loads(results_path.read_text())["results"]
    assert results["trioserve_mc"]["acc,none"] == pytest.approx(right / len(mc))
    assert results["trioserve_mc"]["acc_norm,none"] == pytest.approx(right_norm / len(mc))
    assert math.isfinite(results["trioserve_rolling"]["word_perplexity,none"])
    print(
        f"\nlm-eval: {len(mc)} + {len(rolling)} docs, {requests} loglikelihoods, "
        f"max |lm-eval - direct| = {worst:.2e}, acc {right}/{len(mc)}, "
        f"{time.monotonic() - began:.0f} s"
    )
