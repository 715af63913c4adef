"""The file-backed embedding table (trioserve/engine/cpu/mapped.py): the same
values as the table it replaces, written once, rewritten when stale, kept in
memory where the file cannot be used, and the engine's default weights on it."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest
import torch

from trioserve.engine.cpu import llama, quant
from trioserve.engine.cpu.mapped import file_backed
from trioserve.engine.cpu.options import CpuOptions


def _resident_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssFile")


def test_a_table_is_mapped_with_the_same_values_and_not_resident(tmp_path: Path) -> None:
    table = torch.randn(4096, 576).bfloat16()
    path = tmp_path / "t" / "embed.bf16"
    before = _resident_mib()
    mapped = file_backed(path, table)
    # Its check read every page (4.5 MiB); they were let go again.
    assert _resident_mib() - before < 2.0
    assert path.stat().st_size == table.numel() * 2
    assert torch.equal(mapped, table) and mapped.data_ptr() != table.data_ptr()
    # A row read is what it was; a write stays in this process (copy on write).
    assert torch.equal(
        torch.nn.functional.embedding(torch.tensor([7, 4095]), mapped), table[[7, 4095]]
    )
    mapped[0] = 0
    assert torch.equal(file_backed(path, table), table)


def test_a_stale_file_is_rewritten(tmp_path: Path) -> None:
    table = torch.randn(64, 32).bfloat16()
    path = tmp_path / "embed.bf16"
    path.write_bytes(b"\\0" * (64 * 32 * 2))  # the right size, other values
    mapped = file_backed(path, table)
    assert torch.equal(mapped, table) and mapped.data_ptr() != table.data_ptr()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_keeps_the_table_in_memory(tmp_path: Path) -> None:
    table = torch.randn(64, 32).bfloat16()
    tmp_path.chmod(0o500)
    try:
        assert file_backed(tmp_path / "embed.bf16", table) is table
    finally:
        tmp_path.chmod(0o700)


def test_an_unwritable_path_keeps_the_table_in_memory(tmp_path: Path) -> None:
    table = torch.randn(64, 32).bfloat16()
    (tmp_path / "file").write_text("not a directory")
    assert file_backed(tmp_path / "file" / "embed.bf16", table) is table


def test_the_default_weights_map_their_embedding(model_dir: Path) -> None:
    """On every kernel path: the 8-bit projection replaces the bfloat16 one,
    and the table is read a few rows at a time."""
    config = llama.LlamaConfig.from_dir(model_dir)
    weights = llama.LlamaWeights.load(model_dir, config, CpuOptions())
    path = model_dir / llama.EMBED_FILE
    assert path.is_file()
    assert weights.lm_head is weights.embed
    assert weights.embed_mapped
    assert isinstance(weights.projection, quant.QuantizedWeight)
    # The mapped table is not counted among the bytes held in memory.
    held = attrs.evolve(weights, embed_mapped=False).nbytes
    assert weights.nbytes == held - weights.embed.numel() * weights.embed.element_size()
    with open("/proc/self/maps") as f:
        regions = [line.split() for line in f if line.rstrip().endswith(str(path))]
    start = weights.embed.data_ptr()
    assert any(int(r[0].split("-")[0], 16) <= start < int(r[0].split("-")[1], 16) for r in regions)
