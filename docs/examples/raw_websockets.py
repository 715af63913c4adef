"""Talk to trioserve with no trioserve code: asyncio and the ``websockets`` library.

Any WebSocket client can do this; the frames are plain JSON (docs/protocol.md).
Usage: ``python docs/examples/raw_websockets.py [ws://127.0.0.1:7862/]``.
"""

from __future__ import annotations

import asyncio
import json
import sys

from websockets.asyncio.client import connect

QUESTION = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


async def ask(url: str) -> None:
    async with connect(url) as ws:
        await ws.send(json.dumps({"action": "estimate_token", "text": QUESTION}))
        count = json.loads(await ws.recv())
        print(f"the prompt is {count['num_tokens']} tokens")

        request = {
            "action": "infer",
            "request_id": "q1",
            "text": QUESTION,
            "max_new_tokens": 64,
            "temperature": 0,
            "stream": True,
        }
        await ws.send(json.dumps(request))
        while True:
            frame = json.loads(await ws.recv())
            if frame["response_type"] == "chunk":
                print(frame["chunk"], end="", flush=True)
            elif frame["response_type"] == "full":
                print(f"\n[{frame['stop_reason']}, {frame['usage']['generated_tokens']} tokens]")
                return
            else:  # "error": one frame that says what was wrong, and where
                raise SystemExit(f"error: {frame['error']}")


if __name__ == "__main__":
    asyncio.run(ask(sys.argv[1] if len(sys.argv) > 1 else "ws://127.0.0.1:7862/"))
