"""A models folder served by ``python -m trioserve --models-dir``, on the
real embedded model: its converted directory, its GGUF, and a bfloat16 copy
by a preset, under several ids; clients no one here wrote (the ``openai``
SDK, the ``websockets`` library) pick them by name; loads, the LRU bound, a
failed load, names that are paths, an unload under a long generation, and
memory handed back over load and unload cycles."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
import trio
import websockets.sync.client

from tests.serverproc import ServerProcess, open_server_process
from tests.test_model_cache import smollm2_gguf, smollm2_wheel  # noqa: F401 (fixtures)

QUESTION = "What is the capital of France?"


def _link_tree(source: Path, target: Path) -> None:
    """``source`` copied to ``target`` as hard links where the file system
    allows (no bytes copied; not symlinks, which would lead out of the folder)."""
    try:
        shutil.copytree(source, target, copy_function=os.link)
    except OSError:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)


@pytest.fixture
def folder(model_dir: Path, smollm2_gguf: Path, tmp_path: Path) -> tuple[Path, Path]:  # noqa: F811
    root = tmp_path / "models"
    root.mkdir()
    _link_tree(model_dir, root / "smol")
    try:
        os.link(smollm2_gguf, root / "smol-gguf.gguf")
    except OSError:
        shutil.copy(smollm2_gguf, root / "smol-gguf.gguf")
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (broken / "tokenizer.json").write_text("{}")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    preset = tmp_path / "presets.toml"
    preset.write_text(
        '[smol]\nalias = ["default"]\ncontext_length = 1024\n\n'
        '[smol-bf16]\npath = "smol"\nweights = "float"\ncontext_length = 1024\n'
    )
    return root, preset


def _models(base: str) -> dict[str, dict[str, Any]]:
    import urllib.request

    with urllib.request.urlopen(f"{base}/models", timeout=30) as reply:
        return {m["id"]: m for m in json.load(reply)["data"]}


def _post(base: str, path: str, body: Any) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def _ask(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
    )
    # An alias is answered under the model's id.
    assert reply.model == {"default": "smol"}.get(model, model)
    return reply.choices[0].message.content or ""


async def _serve(folder: tuple[Path, Path], *extra: str) -> Any:
    root, preset = folder
    args = ["--models-dir", str(root), "--models-preset", str(preset), "--threads", "1", *extra]
    return open_server_process(args)


@pytest.mark.slow
async def test_a_folder_served_by_name_to_unchanged_clients(folder: tuple[Path, Path]) -> None:
    async with await _serve(folder, "--models-max", "2") as server:
        base = f"http://127.0.0.1:{server.port}"

        def clients() -> None:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            listed = [m.id for m in client.models.list()]
            assert listed == ["broken", "smol", "smol-gguf", "smol-bf16"]
            assert "Paris" in _ask(client, "smol")
            # The GGUF is the same weights: the same greedy answer.
            assert _ask(client, "smol-gguf") == _ask(client, "default")
            statuses = {k: v["status"]["value"] for k, v in _models(base).items()}
            assert statuses == {
                "broken": "unloaded",
                "smol": "loaded",
                "smol-bf16": "unloaded",
                "smol-gguf": "loaded",
            }
            # A third model: the least recently used (smol-gguf) makes room.
            assert "Paris" in _ask(client, "smol-bf16")
            statuses = {k: v["status"]["value"] for k, v in _models(base).items()}
            assert statuses["smol-gguf"] == "unloaded" and statuses["smol-bf16"] == "loaded"
            assert _models(base)["smol-bf16"]["context_length"] == 1024
            with pytest.raises(openai.NotFoundError) as missing:
                _ask(client, "../smol")
            assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
            # A model that cannot load is named with why; the others serve on.
            with pytest.raises(openai.InternalServerError) as failed:
                _ask(client, "broken")
            assert "broken" in str(failed.value)
            broken = _models(base)["broken"]["status"]
            assert broken["value"] == "failed" and broken["reason"]
            assert "Paris" in _ask(client, "smol")
            with websockets.sync.client.connect(f"ws://127.0.0.1:{server.port}/") as ws:
                ws.send(json.dumps({"action": "info"}))
                info = json.loads(ws.recv())
                assert {m["id"] for m in info["models"]} == set(listed)
                ws.send(
                    json.dumps(
                        {
                            "action": "infer",
                            "request_id": 1,
                            "model": "default",
                            "text": "The capital of France is",
                            "max_new_tokens": 4,
                            "temperature": 0,
                        }
                    )
                )
                final = json.loads(ws.recv())
                assert "Paris" in final["response"], final

        await trio.to_thread.run_sync(clients)
        assert server.alive
        assert not server.error_lines(), server.error_reports()


@pytest.mark.slow
async def test_an_unload_under_a_long_generation_ends_it_clearly(
    folder: tuple[Path, Path],
) -> None:
    async with await _serve(folder, "--unload-timeout", "0.5") as server:
        base = f"http://127.0.0.1:{server.port}"

        def run() -> None:
            with websockets.sync.client.connect(f"ws://127.0.0.1:{server.port}/") as ws:
                ws.send(
                    json.dumps(
                        {
                            "action": "infer",
                            "request_id": "long",
                            "model": "smol",
                            "text": "Tell me a long story.",
                            "max_new_tokens": 900,
                            "bann_bann": [0, 1, 2],
                            "stream": True,
                        }
                    )
                )
                first = json.loads(ws.recv())
                assert first["response_type"] == "chunk"
                status, body = _post(base, "/models/unload", {"model": "smol"})
                assert status == 200 and body["status"]["value"] == "unloading"
                while True:
                    frame = json.loads(ws.recv(timeout=60))
                    if frame["response_type"] != "chunk":
                        break
                assert frame["response_type"] == "error"
                assert "the model 'smol' was unloaded" in frame["error"]["message"]

        await trio.to_thread.run_sync(run)
        with trio.fail_after(30):
            while _models(base)["smol"]["status"]["value"] != "unloaded":  # noqa: ASYNC110
                await trio.sleep(0.1)
        assert server.alive and not server.error_lines(), server.error_reports()


@pytest.mark.slow
async def test_unloading_hands_the_memory_back(folder: tuple[Path, Path]) -> None:
    """Load and unload the bfloat16 copy (its weights in memory, not mapped)
    a few times: the RSS after each unload stays near the first one's (the
    bench measures 20 cycles against before the first load)."""
    async with await _serve(folder) as server:
        base = f"http://127.0.0.1:{server.port}"
        progresses: list[float] = []
        after_unload: list[int] = []
        for _ in range(4):
            status, _ = _post(base, "/models/load", {"model": "smol-bf16"})
            assert status == 200
            seen = await _until(base, "smol-bf16", "loaded")
            # The load's progress, read by GET /models as the loading thread
            # reports it: from 0 to at most 1, never back.
            assert seen == sorted(seen) and all(0.0 <= f <= 1.0 for f in seen), seen
            progresses.extend(seen)
            loaded = server.rss_bytes()
            _post(base, "/models/unload", {"model": "smol-bf16"})
            await _until(base, "smol-bf16", "unloaded")
            after_unload.append(server.rss_bytes())
            assert after_unload[-1] < loaded
        assert max(after_unload) < after_unload[0] * 1.25, after_unload
        assert any(0.0 < f < 1.0 for f in progresses), progresses


async def _until(base: str, model: str, status: str) -> list[float]:
    """Poll until ``model`` is ``status``; the load progress seen meanwhile."""
    seen: list[float] = []
    with trio.fail_after(60):
        while (now := _models(base)[model]["status"])["value"] != status:
            if "progress" in now:
                seen.append(now["progress"])
            await trio.sleep(0.02)
    return seen


_ = ServerProcess


@pytest.mark.parametrize(
    ("args", "status", "says"),
    [
        (["--model", "x", "--models-dir", "y"], 2, "give one model or a folder of models"),
        (["--models-preset", "p.toml"], 2, "needs --models-dir"),
        (["--models-dir", "/nonexistent/models"], 1, "is not a directory"),
    ],
)
def test_a_models_folder_the_server_cannot_use_is_one_clean_error(
    args: list[str], status: int, says: str, tmp_path: Path
) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "trioserve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == status, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr


def test_an_empty_folder_and_a_bad_preset_are_one_clean_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "empty").mkdir()
    run = [sys.executable, "-m", "trioserve", "--port", "0", "--models-dir"]
    done = subprocess.run(
        [*run, str(tmp_path / "empty")], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 1 and "holds no model" in done.stderr, done.stderr
    (tmp_path / "empty" / "m.gguf").write_bytes(b"GGUF")
    preset = tmp_path / "p.toml"
    preset.write_text("[m]\ncontext_length = 'long'\n")
    done = subprocess.run(
        [*run, str(tmp_path / "empty"), "--models-preset", str(preset)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1 and "[m] context_length" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
