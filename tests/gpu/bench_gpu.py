"""GPU benchmark: trioserve's ExLlamaV2 engine against a bare ExLlamaV2 generator loop.

Both generate the same greedy tokens on the same model in the same process:

* ``raw``: an ``ExLlamaV2DynamicGenerator`` of its own (its own model and
  cache), driven by a plain ``while num_remaining_jobs(): iterate()`` loop on
  the thread that loaded it: the fastest way to use ExLlamaV2, as a user of
  ExLlamaV2 alone would;
* ``trioserve``: the full stack: a WebSocket client, the server, the
  generation task, the engine's steps, a chunk frame per token.

Single-stream runs alternate between the two (raw, trioserve, raw, ...), so
that whatever else the machine does falls on both; the ratio is the median of
the per-pair ratios (the goal is >= 0.95). Then trioserve's aggregate tokens
per second at 1, 8 and 32 concurrent streams (one connection each). Every job
is forced to its full length by banning the EOS ids, in both paths, so the
work is identical.

Without flash-attn >= 2.5.7 ExLlamaV2 has no paged attention: its generator
then runs one job at a time, and the aggregate figures show trioserve staying
correct under concurrency, not batching gains. The report says which, and the
rows are 1 and 8 streams only (32 streams of 256 tokens one after the other
would take most of the GPU check's time to show nothing new). Both sides then
set up ExLlamaV2 as the engine does (``configure_attention``: torch's matmul
attention, since 0.3.2's SDPA branch prefills without a causal mask; the
prefill chunk from ``unpaged_chunk_size``).

Usage (on a machine with CUDA and exllamav2)::

    python tests/gpu/bench_gpu.py [--model DIR] [--tokens 256] [--out bench.json]

Timing is informative only; nothing here passes or fails on a number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio
import trio_websocket

from trioserve.engine.base import EngineInfo
from trioserve.engine.exllamav2.engine import ExLlamaV2Engine, probe_exllamav2
from trioserve.engine.exllamav2.plan import PAGE_SIZE, configure_attention, unpaged_chunk_size
from trioserve.engine.models import default_model_dir
from trioserve.engine.tokenizer import Tokenizer
from trioserve.generation.engine_thread import EngineThread, open_engine_thread
from trioserve.server import Server, ServerConfig

PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWrite a long story about a lighthouse keeper and a storm."
    "<|im_end|>\n<|im_start|>assistant\n"
)
PAIRS = 5
#: Concurrent streams measured: with paged attention (batching), and without.
CONCURRENCY = (1, 8, 32)
CONCURRENCY_UNPAGED = (1, 8)


class RawLoop:
    """A bare ExLlamaV2 dynamic generator with a model and cache of its own."""

    def __init__(self, model_dir: Path, prompt_ids: list[int], eos_ids: list[int]) -> None:
        import torch
        from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
        from exllamav2.attn import has_flash_attn_with_paged
        from exllamav2.generator import (
            ExLlamaV2DynamicGenerator,
            ExLlamaV2DynamicJob,
            ExLlamaV2Sampler,
        )

        config = ExLlamaV2Config(str(model_dir))
        config.arch_compat_overrides(quiet=True)
        # As the engine does, before the model is built: unpaged, matmul attention.
        self.paged = configure_attention(config, flash_attn_paged=bool(has_flash_attn_with_paged))
        self.model = ExLlamaV2(config)
        cache_tokens = -(-int(config.max_seq_len) // PAGE_SIZE) * PAGE_SIZE
        cache = ExLlamaV2Cache(self.model, max_seq_len=cache_tokens, lazy=True)
        self.model.load_autosplit(cache)
        self.tokenizer = ExLlamaV2Tokenizer(config)
        chunk = int(config.max_input_len)
        if not self.paged:
            chunk = min(
                chunk, unpaged_chunk_size(int(config.max_seq_len), int(config.max_attention_size))
            )
        self.generator = ExLlamaV2DynamicGenerator(
            model=self.model,
            cache=cache,
            tokenizer=self.tokenizer,
            max_batch_size=32 if self.paged else 1,
            max_chunk_size=chunk,
            paged=self.paged,
        )
        self._torch = torch
        self._job_class = ExLlamaV2DynamicJob
        self._settings_class = ExLlamaV2Sampler.Settings
        self._prompt_ids = prompt_ids
        self._eos_ids = eos_ids

    def run(self, tokens: int) -> float:
        """Tokens per second of one job of ``tokens`` tokens, prefill included."""
        torch = self._torch
        # The settings trioserve's sampler_fields gives a temperature-0,
        # rep_pen-1 request, with the EOS ids banned through the token bias.
        settings = self._settings_class(
            temperature=1.0, top_k=1, top_p=0.8, token_repetition_penalty=1.0
        )
        settings.disallow_tokens(self.tokenizer, self._eos_ids)
        job = self._job_class(
            input_ids=torch.tensor([self._prompt_ids], dtype=torch.long),
            max_new_tokens=tokens,
            gen_settings=settings,
            stop_conditions=list(self._eos_ids),
            decode_special_tokens=True,
            identifier=0,
        )
        started = time.perf_counter()
        generated = 0
        with torch.inference_mode():
            self.generator.enqueue(job)
            while self.generator.num_remaining_jobs():
                for result in self.generator.iterate():
                    if result["stage"] == "streaming":
                        generated += 1
        elapsed = time.perf_counter() - started
        assert generated == tokens, f"raw loop generated {generated} tokens, not {tokens}"
        return generated / elapsed

    def close(self) -> None:
        self.model.unload()
        self._torch.cuda.empty_cache()


async def _one_stream(url: str, tokens: int, eos_ids: list[int]) -> int:
    async with trio_websocket.open_websocket_url(url) as ws:
        request = {
            "action": "infer",
            "request_id": 1,
            "text": PROMPT,
            "max_new_tokens": tokens,
            "stream": True,
            "temperature": 0,
            "rep_pen": 1.0,
            "bann_bann": eos_ids,
        }
        await ws.send_message(json.dumps(request))
        while True:
            frame = json.loads(await ws.get_message())
            if frame.get("response_type") == "full":
                return int(frame["usage"]["generated_tokens"])
            if frame.get("response_type") == "error":
                raise RuntimeError(f"the server answered an error: {frame!r}")


async def bench(
    engine: ExLlamaV2Engine,
    raw: RawLoop,
    tokens: int,
    eos_ids: list[int],
    thread: EngineThread,
) -> dict[str, Any]:
    """Alternating single-stream runs, then trioserve's aggregate at each concurrency.

    Both sides run on ``thread``, the one that loaded both models: the raw loop
    through ``thread.run_sync`` while the server is idle, the server's step
    loop while it serves (CUDA streams and graphs are per thread).
    """
    results: dict[str, Any] = {}
    server = Server(engine, ServerConfig(host="127.0.0.1", port=0), engine_thread=thread)
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(server.run)
        url = listening.url
        # Warm-up: kernels, CUDA graphs, allocator, tokenizer tables.
        await thread.run_sync(raw.run, 16)
        await _one_stream(url, 16, eos_ids)
        raw_rates: list[float] = []
        trio_rates: list[float] = []
        for _ in range(PAIRS):
            raw_rates.append(await thread.run_sync(raw.run, tokens))
            started = time.perf_counter()
            generated = await _one_stream(url, tokens, eos_ids)
            assert generated == tokens, f"trioserve generated {generated} tokens, not {tokens}"
            trio_rates.append(generated / (time.perf_counter() - started))
        ratios = [t / r for t, r in zip(trio_rates, raw_rates, strict=True)]
        results["raw_single_stream_tok_s"] = statistics.median(raw_rates)
        results["trioserve_single_stream_tok_s"] = statistics.median(trio_rates)
        results["ratios"] = ratios
        results["ratio"] = statistics.median(ratios)
        aggregate: dict[str, float] = {}
        for streams in CONCURRENCY if engine.info.batching else CONCURRENCY_UNPAGED:
            counts: list[int] = []

            async def stream(counts: list[int] = counts) -> None:
                counts.append(await _one_stream(url, tokens, eos_ids))

            started = time.perf_counter()
            async with trio.open_nursery() as streams_nursery:
                for _ in range(streams):
                    streams_nursery.start_soon(stream)
            aggregate[str(streams)] = sum(counts) / (time.perf_counter() - started)
        results["trioserve_aggregate_tok_s"] = aggregate
        nursery.cancel_scope.cancel()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", type=Path, default=None, help="model directory")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)

    usable, reason = probe_exllamav2()
    if not usable:
        print(f"bench_gpu: cannot run: {reason}", file=sys.stderr)
        return 2
    import torch

    model_dir = args.model or default_model_dir(offline=True)
    tokens: int = args.tokens

    # Room in the cache for every stream of the largest concurrency at once.
    job_pages = -(-(len(Tokenizer.from_dir(model_dir).encode(PROMPT)) + tokens) // PAGE_SIZE)
    cache_size = max(8192, max(CONCURRENCY) * job_pages * PAGE_SIZE)

    async def run_all() -> tuple[dict[str, Any], EngineInfo, list[int]]:
        # Every model call of both sides on one engine thread.
        async with open_engine_thread() as thread:
            engine = await thread.run_sync(
                lambda: ExLlamaV2Engine.load(
                    model_dir, max_batch=max(CONCURRENCY), cache_size=cache_size
                )
            )
            raw: RawLoop | None = None
            try:
                prompt_ids = engine.encode(PROMPT)
                eos_ids = sorted(engine.info.eos_token_ids)
                raw = await thread.run_sync(RawLoop, model_dir, prompt_ids, eos_ids)
                results = await bench(engine, raw, tokens, eos_ids, thread)
                return results, engine.info, prompt_ids
            finally:
                await thread.run_sync(engine.close)
                if raw is not None:
                    await thread.run_sync(raw.close)

    results, info, prompt_ids = trio.run(run_all)

    graphs = "EXLLAMA_NO_GRAPHS" not in os.environ
    note = (
        "paged attention: jobs are batched"
        if info.batching
        else "no flash-attn >= 2.5.7, so no paged attention: ExLlamaV2 runs one job at a time, "
        "and the aggregate figures measure trioserve under concurrency, not batching"
    )
    report = {
        "model": str(model_dir),
        "gpu": torch.cuda.get_device_name(0),
        "tokens_per_stream": tokens,
        "prompt_tokens": len(prompt_ids),
        "pairs": PAIRS,
        "batching": info.batching,
        "max_batch": info.max_batch,
        "cuda_graphs": graphs,
        "note": note,
        **results,
    }
    print(f"{report['gpu']}; {tokens} tokens per stream; CUDA graphs {'on' if graphs else 'off'}")
    rows = [
        (f"raw ExLlamaV2 loop, 1 stream (median of {PAIRS})", results["raw_single_stream_tok_s"]),
        (f"trioserve, 1 stream (median of {PAIRS})", results["trioserve_single_stream_tok_s"]),
    ]
    print("| measure | tok/s |")
    print("|---|---|")
    for label, rate in rows:
        print(f"| {label} | {rate:.1f} |")
    ratio = results["ratio"]
    print(f"| ratio trioserve / raw (median of per-pair ratios; goal >= 0.95) | {ratio:.3f} |")
    for streams, rate in results["trioserve_aggregate_tok_s"].items():
        print(f"| trioserve aggregate, {streams} streams | {rate:.1f} |")
    print(f"per-pair ratios: {', '.join(f'{r:.3f}' for r in results['ratios'])}")
    print(note)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
