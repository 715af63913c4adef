"""GPU benchmark: trioserve's ExLlamaV2 engine against a bare ExLlamaV2 generator loop.

Both generate the same greedy tokens on the same model in the same process, one
after the other:

* ``raw``: an ``ExLlamaV2DynamicGenerator`` driven by a plain ``while
  num_remaining_jobs(): iterate()`` loop, the fastest way to use ExLlamaV2;
* ``trioserve``: the full stack: a WebSocket client, the server, the
  generation task, ``Engine.step`` in a worker thread, a chunk frame per token.

Reported: single-stream tokens per second of each, their ratio (the goal is
>= 0.95), and trioserve's aggregate tokens per second at 1, 8 and 32
concurrent streams (one connection each). Every job is forced to its full
length by banning the EOS ids, in both paths, so the work is identical.

Usage (on a machine with CUDA and exllamav2)::

    python tests/gpu/bench_gpu.py [--model DIR] [--tokens 256] [--out bench.json]

Timing is informative only; nothing here passes or fails on a number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio
import trio_websocket

from trioserve.engine.exllamav2 import PAGE_SIZE, ExLlamaV2Engine, probe_exllamav2
from trioserve.engine.models import default_model_dir
from trioserve.engine.tokenizer import Tokenizer
from trioserve.server import ServerConfig, serve

PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWrite a long story about a lighthouse keeper and a storm."
    "<|im_end|>\n<|im_start|>assistant\n"
)
REPEATS = 3
CONCURRENCY = (1, 8, 32)


def bench_raw(model_dir: Path, prompt_ids: list[int], eos_ids: list[int], tokens: int) -> float:
    """Median single-stream tokens/s of a bare generator loop (prefill included)."""
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
    model = ExLlamaV2(config)
    cache_tokens = -(-int(config.max_seq_len) // PAGE_SIZE) * PAGE_SIZE
    cache = ExLlamaV2Cache(model, max_seq_len=cache_tokens, lazy=True)
    model.load_autosplit(cache)
    tokenizer = ExLlamaV2Tokenizer(config)
    paged = bool(has_flash_attn_with_paged)
    generator = ExLlamaV2DynamicGenerator(
        model=model,
        cache=cache,
        tokenizer=tokenizer,
        max_batch_size=32 if paged else 1,
        paged=paged,
    )

    def run(n: int) -> float:
        # The settings trioserve's sampler_fields gives a temperature-0,
        # rep_pen-1 request, with the EOS ids banned through the token bias.
        settings = ExLlamaV2Sampler.Settings(
            temperature=1.0, top_k=1, top_p=0.8, token_repetition_penalty=1.0
        )
        settings.disallow_tokens(tokenizer, eos_ids)
        job = ExLlamaV2DynamicJob(
            input_ids=torch.tensor([prompt_ids], dtype=torch.long),
            max_new_tokens=n,
            gen_settings=settings,
            stop_conditions=list(eos_ids),
            decode_special_tokens=True,
            identifier=0,
        )
        started = time.perf_counter()
        generator.enqueue(job)
        generated = 0
        while generator.num_remaining_jobs():
            for result in generator.iterate():
                if result["stage"] == "streaming":
                    generated += 1
        elapsed = time.perf_counter() - started
        assert generated == n, f"raw loop generated {generated} tokens, not {n}"
        return generated / elapsed

    run(16)  # warm-up: kernels, allocator, tokenizer tables
    rates = [run(tokens) for _ in range(REPEATS)]
    model.unload()
    torch.cuda.empty_cache()
    return statistics.median(rates)


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


async def bench_server(engine: ExLlamaV2Engine, tokens: int, eos_ids: list[int]) -> dict[str, Any]:
    """trioserve's median single-stream tokens/s and its aggregate at each concurrency."""
    results: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(serve, engine, ServerConfig(host="127.0.0.1", port=0))
        url = listening.url
        await _one_stream(url, 16, eos_ids)  # warm-up
        rates = []
        for _ in range(REPEATS):
            started = time.perf_counter()
            generated = await _one_stream(url, tokens, eos_ids)
            assert generated == tokens, f"trioserve generated {generated} tokens, not {tokens}"
            rates.append(generated / (time.perf_counter() - started))
        results["single_stream_tok_s"] = statistics.median(rates)
        aggregate: dict[str, float] = {}
        for streams in CONCURRENCY:
            counts: list[int] = []

            async def stream(counts: list[int] = counts) -> None:
                counts.append(await _one_stream(url, tokens, eos_ids))

            started = time.perf_counter()
            async with trio.open_nursery() as streams_nursery:
                for _ in range(streams):
                    streams_nursery.start_soon(stream)
            aggregate[str(streams)] = sum(counts) / (time.perf_counter() - started)
        results["aggregate_tok_s"] = aggregate
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
    model_dir = args.model or default_model_dir(offline=True)
    tokens: int = args.tokens

    # Room in the cache for every stream of the largest concurrency at once.
    job_pages = -(-(len(Tokenizer.from_dir(model_dir).encode(PROMPT)) + tokens) // PAGE_SIZE)
    cache_size = max(8192, max(CONCURRENCY) * job_pages * PAGE_SIZE)
    engine = ExLlamaV2Engine.load(model_dir, max_batch=max(CONCURRENCY), cache_size=cache_size)
    try:
        prompt_ids = engine.encode(PROMPT)
        eos_ids = sorted(engine.info.eos_token_ids)
        server = trio.run(bench_server, engine, tokens, eos_ids)
        info = engine.info
    finally:
        engine.close()
    raw = bench_raw(model_dir, prompt_ids, eos_ids, tokens)

    report = {
        "model": str(model_dir),
        "tokens_per_stream": tokens,
        "prompt_tokens": len(prompt_ids),
        "batching": info.batching,
        "max_batch": info.max_batch,
        "raw_single_stream_tok_s": raw,
        "trioserve_single_stream_tok_s": server["single_stream_tok_s"],
        "ratio": server["single_stream_tok_s"] / raw,
        "trioserve_aggregate_tok_s": server["aggregate_tok_s"],
    }
    print("| measure | tok/s |")
    print("|---|---|")
    print(f"| raw ExLlamaV2 loop, 1 stream | {raw:.1f} |")
    print(f"| trioserve, 1 stream | {server['single_stream_tok_s']:.1f} |")
    print(f"| ratio trioserve / raw | {report['ratio']:.3f} |")
    for streams, rate in server["aggregate_tok_s"].items():
        print(f"| trioserve aggregate, {streams} streams | {rate:.1f} |")
    print(f"(paged attention / batching: {info.batching}, max batch {info.max_batch})")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
