"""The tokenizer on the real default model's ``tokenizer.json``."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trioserve.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def test_special_ids_of_the_default_model(tokenizer: Tokenizer) -> None:
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.vocab_size == 49152
    assert {0, 1, 2} <= tokenizer.special_ids


def test_encode_adds_no_bos_and_reads_special_token_strings(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1
    assert ids[-1] == 2
    assert ids.count(1) == 1
    assert tokenizer.encode("Hi") == ids[3:-1]
    assert tokenizer.encode("") == []


def test_decode_writes_special_tokens_as_text(tokenizer: Tokenizer) -> None:
    assert tokenizer.decode([1, 2]) == "<|im_start|><|im_end|>"


def test_a_skipping_decoder_leaves_out_special_tokens_but_the_kept_ones(
    tokenizer: Tokenizer,
) -> None:
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|> there")
    assert tokenizer.decoder()(ids) == tokenizer.decode(ids)
    assert tokenizer.decoder(tokenizer.skipped_special())(ids) == "user\nHi there"
    # Kept: a marker itself, or a special token within a stop string.
    kept = tokenizer.skipped_special({"<|im_end|>", "not a token"})
    assert tokenizer.decoder(kept)(ids) == "user\nHi<|im_end|> there"
    within = tokenizer.skipped_special({"x<|im_start|>y"})
    assert tokenizer.decoder(within)(ids) == "<|im_start|>user\nHi there"
    assert 1 not in within and {0, 2} <= within
    # An ordinary token whose text names a special one is text, never skipped.
    plain = tokenizer.encode("<|im_end|") + tokenizer.encode(">")
    assert tokenizer.decoder(tokenizer.skipped_special())(plain) == "<|im_end|>"


# SmolLM2's byte-level vocabulary lacks a few bytes (six control characters
# and the UTF-8 lead bytes 0xF1/0xF2 of planes 4-11); text made of them encodes
# to the unknown token, as with the reference tokenizer. Everything else
# round-trips.
MISSING_CONTROL = "\x04\x06\x13\x14\x16\x1d"
ENCODABLE = st.characters(codec="utf-8", max_codepoint=0x3FFFF, exclude_characters=MISSING_CONTROL)


@given(st.text(ENCODABLE, max_size=60))
def test_round_trip_and_token_bytes(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert 0 not in ids  # the unknown token
    assert tokenizer.decode(ids) == text
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8")


@given(st.binary(min_size=1, max_size=3) | st.sampled_from([b" Fra", b"straw", b"\xe4\xbd", b"0"]))
def test_ids_with_prefix_are_exactly_the_ordinary_tokens_with_that_prefix(
    tokenizer: Tokenizer, prefix: bytes
) -> None:
    found = tokenizer.ids_with_prefix(prefix)
    expected = [
        i
        for i in range(tokenizer.vocab_size)
        if tokenizer.token_bytes(i).startswith(prefix) and i not in tokenizer.special_ids
    ]
    assert sorted(found) == expected


def test_every_eos_id_is_collected(model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7, "bos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.eos_token_ids == frozenset({2, 7, 9})
    assert tokenizer.bos_token_id == 1


def test_is_usable_from_many_threads(tokenizer: Tokenizer) -> None:
    texts = [f"<|im_start|>user\nquestion number {n} 你好 🙂<|im_end|>" * 20 for n in range(16)]
    expected = [tokenizer.encode(t) for t in texts]
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(tokenizer.encode, texts * 4))
        decoded = list(pool.map(tokenizer.decode, expected * 4))
    assert got == expected * 4
    assert decoded == texts * 4


def test_the_same_files_give_the_same_tokenizer_without_parsing_again(
    model_dir: Path, tmp_path: Path
) -> None:
    """A model unloaded and loaded again (or a second id of the same
    weights) reuses its tokenizer; a changed file is read anew."""
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        shutil.copy(model_dir / name, copy / name)
    first = Tokenizer.from_dir(copy)
    assert Tokenizer.from_dir(copy) is first
    assert Tokenizer.from_dir(model_dir) is not first  # tokenizer_config.json there: other files
    config = json.loads((copy / "config.json").read_text())
    config["eos_token_id"] = 7
    (copy / "config.json").write_text(json.dumps(config))
    changed = Tokenizer.from_dir(copy)
    assert changed is not first and 7 in changed.eos_token_ids and 7 not in first.eos_token_ids
