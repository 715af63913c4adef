"""The models folder and its presets (trioserve/engine/catalog.py): what is a
model and under which id, what a preset may say, and that no name a client
or a preset gives reaches outside the folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trioserve.engine import EngineOptions
from trioserve.engine.catalog import Catalog, valid_model_id
from trioserve.errors import ConfigError

pytestmark = pytest.mark.unit


def _hf(where: Path, quant: str | None = None) -> Path:
    where.mkdir(parents=True)
    config: dict[str, object] = {"architectures": ["LlamaForCausalLM"]}
    if quant is not None:
        config["quantization_config"] = {"quant_method": quant}
    (where / "config.json").write_text(json.dumps(config))
    (where / "tokenizer.json").write_text("{}")
    (where / "model.safetensors").write_bytes(b"\0" * 8)
    return where


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    (root / "small.Q4_1.gguf").write_bytes(b"GGUF")
    _hf(root / "llama-hf")
    _hf(root / "qwen-exl2", quant="exl2")
    _hf(root / "mistral-gptq", quant="gptq")
    (root / "packed").mkdir()
    (root / "packed" / "weights.gguf").write_bytes(b"GGUF")
    (root / "notes.txt").write_text("not a model")
    (root / "empty").mkdir()
    (root / ".hidden.gguf").write_bytes(b"GGUF")
    return root


def test_every_kind_of_model_in_the_folder_gets_its_id(folder: Path) -> None:
    catalog = Catalog.scan(folder)
    formats = {entry.id: entry.format for entry in catalog.entries}
    assert formats == {
        "llama-hf": "hf",
        "mistral-gptq": "gptq",
        "packed": "gguf",
        "qwen-exl2": "exl2",
        "small.Q4_1": "gguf",
    }
    packed = catalog.find("packed")
    assert packed is not None and packed.path == folder.resolve() / "packed" / "weights.gguf"


def test_a_symlink_out_of_the_folder_is_left_out(folder: Path, tmp_path: Path) -> None:
    outside = _hf(tmp_path / "secret-model")
    (folder / "escape").symlink_to(outside)
    (tmp_path / "elsewhere.gguf").write_bytes(b"GGUF")
    (folder / "link.gguf").symlink_to(tmp_path / "elsewhere.gguf")
    (folder / "inside.gguf").symlink_to(folder / "small.Q4_1.gguf")
    catalog = Catalog.scan(folder)
    assert "escape" not in catalog.ids and "link" not in catalog.ids
    assert "inside" in catalog.ids  # a link that stays inside is a model


@pytest.mark.parametrize(
    "name",
    [
        "../llama-hf",
        "llama-hf/",
        "/etc/passwd",
        str(Path.cwd()),
        "LLAMA-HF",
        "llama-hf\x00",
        " llama-hf",
        "",
        ".",
        "..",
        "small.Q4_1.gguf",
        "packed/weights",
    ],
)
def test_a_name_that_is_not_an_id_or_alias_finds_nothing(folder: Path, name: str) -> None:
    assert Catalog.scan(folder).find(name) is None


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("SmolLM2-135M-Instruct", True),
        ("a", True),
        ("x" * 128, True),
        ("x" * 129, False),
        ("..", False),
        (".hidden", False),
        ("-option", False),
        ("a/b", False),
        ("a\\b", False),
        ("a b", False),
        ("é", False),
        ("", False),
        (None, False),
        (42, False),
    ],
)
def test_model_ids_are_names(name: object, valid: bool) -> None:
    assert valid_model_id(name) is valid


def test_a_preset_sets_options_aliases_a_template_and_another_path(
    folder: Path, tmp_path: Path
) -> None:
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "chat.jinja").write_text("{{ messages }}")
    preset = tmp_path / "presets.toml"
    preset.write_text(
        """
[llama-hf]
alias = ["default", "llama"]
context_length = 2048
chat_template = "templates/chat.jinja"

[exl2-big]
path = "qwen-exl2"
engine = "exllamav2"
cache_size = 16384
gpu_split = [20, 24.5]
"""
    )
    catalog = Catalog.scan(folder, preset, base=EngineOptions())
    llama = catalog.find("default")
    assert llama is not None and llama.id == "llama-hf" and catalog.find("llama") is llama
    assert llama.chat_template == (tmp_path / "templates" / "chat.jinja").resolve()
    assert llama.engine_options(EngineOptions()).context_length == 2048
    big = catalog.find("exl2-big")
    assert big is not None and big.format == "exl2"
    options = big.engine_options(EngineOptions(threads=1))
    assert (options.engine, options.cache_size, options.gpu_split) == (
        "exllamav2",
        16384,
        (20.0, 24.5),
    )
    assert options.model == folder.resolve() / "qwen-exl2" and options.threads == 1


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[llama-hf]\npath = "../outside"\n', "not inside --models-dir"),
        ('[llama-hf]\npath = "/etc"\n', "must be a name inside"),
        ('[llama-hf]\npath = "notes.txt"\n', "holds no model"),
        ('[llama-hf]\nchat_template = "../../../etc/passwd"\n', "not a file beside"),
        ('[llama-hf]\nchat_template = "/etc/passwd"\n', "relative file name"),
        ("[llama-hf]\nmodel = 'x'\n", "model is not a preset option"),
        ("[llama-hf]\ncontext_length = '2048'\n", "wrong type"),
        ("[llama-hf]\ncontext_length = true\n", "wrong type"),
        ("[llama-hf]\ncontext_length = -5\n", "[llama-hf]"),
        ("[llama-hf]\nengine = 'vllm'\n", "engine must be one of"),
        ("[llama-hf]\ngpu_split = ['a']\n", "gpu_split must be numbers"),
        ('[llama-hf]\nalias = ["../x"]\n', "alias must be model ids"),
        ('[llama-hf]\nalias = ["qwen-exl2"]\n', "names both"),
        ('["../etc"]\npath = "llama-hf"\n', "not a usable model id"),
        ("[nothing-here]\nthreads = 1\n", "no model 'nothing-here'"),
        ("llama-hf = 3\n", "must be a table"),
        ("[llama-hf\n", "not TOML"),
    ],
)
def test_a_bad_preset_stops_the_start_naming_what_is_wrong(
    folder: Path, tmp_path: Path, text: str, says: str
) -> None:
    preset = tmp_path / "presets.toml"
    preset.write_text(text)
    with pytest.raises(ConfigError) as raised:
        Catalog.scan(folder, preset, base=EngineOptions())
    assert says in str(raised.value)


def test_a_preset_file_that_cannot_be_read_or_decoded(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        Catalog.scan(folder, tmp_path / "missing.toml")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[x]")
    with pytest.raises(ConfigError, match="not TOML"):
        Catalog.scan(folder, binary)


def test_not_a_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a directory"):
        Catalog.scan(tmp_path / "none")


def test_two_models_with_one_id_stop_the_start(folder: Path) -> None:
    (folder / "llama-hf.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="names both"):
        Catalog.scan(folder)


def test_a_file_name_that_is_no_id_is_left_out_and_a_preset_can_name_it(
    folder: Path, tmp_path: Path
) -> None:
    (folder / "my model.gguf").write_bytes(b"GGUF")
    assert "my model" not in Catalog.scan(folder).ids
    preset = tmp_path / "p.toml"
    preset.write_text('[my-model]\npath = "my model.gguf"\n')
    entry = Catalog.scan(folder, preset).find("my-model")
    assert entry is not None and entry.path.name == "my model.gguf"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every directory")
def test_an_unreadable_model_directory_is_not_a_model(folder: Path) -> None:
    locked = _hf(folder / "locked")
    locked.chmod(0)
    try:
        assert "locked" not in Catalog.scan(folder).ids
    finally:
        locked.chmod(0o755)
