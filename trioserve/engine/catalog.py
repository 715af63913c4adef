"""The models a server may serve: a folder of models and its presets.

``--models-dir DIR`` makes every model in ``DIR`` servable under an id:

* a GGUF file, ``NAME.gguf``: id ``NAME``;
* a directory ``NAME/`` holding a Hugging Face Llama-family model
  (:data:`~trioserve.engine.models.MODEL_DIR_CONTENTS`), or an EXL2 or GPTQ
  one for ExLlamaV2: id ``NAME``;
* a directory ``NAME/`` holding exactly one ``*.gguf`` file: id ``NAME``.

``--models-preset FILE`` (TOML) gives models their options, one table per id::

    [SmolLM2-135M-Instruct]
    alias = ["smol"]
    context_length = 2048
    chat_template = "templates/chatml.jinja"   # relative to the preset file

    [qwen-exl2]
    path = "Qwen2.5-7B-exl2-4.0bpw"          # a name in the folder, if not the id
    engine = "exllamav2"
    cache_size = 16384

Ids and aliases are names, never paths: a request names a model by one of
them and is matched against this catalog by string equality; nothing a
client sends is joined to a path. Everything the catalog points at lies
inside the folder (a symlink that leads out of it is left out, with a
warning), and a preset's ``path`` and ``chat_template`` must stay inside the
folder and the preset file's directory respectively.

Pure: reads the folder and the preset file when built, no torch, no trio.
"""

from __future__ import annotations

import json
import logging
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs

from trioserve.errors import ConfigError

from .models import missing_model_files

if TYPE_CHECKING:
    from . import EngineOptions

__all__ = [
    "MODEL_ID",
    "PRESET_OPTIONS",
    "Catalog",
    "CatalogEntry",
    "valid_model_id",
]

log = logging.getLogger("trioserve.engine")

#: A model's id or alias: letters, digits, ``.``, ``_``, ``-``; at most 128
#: characters, not starting with a dot or a dash (so never ``..``, a hidden
#: file or an option).
MODEL_ID: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")

#: What a preset may set, beside ``path``, ``alias`` and ``chat_template``:
#: the engine options (:class:`~trioserve.engine.EngineOptions`' fields of
#: the same names) and the type each takes.
PRESET_OPTIONS: Final[Mapping[str, type | tuple[type, ...]]] = {
    "engine": str,
    "context_length": int,
    "max_batch": int,
    "dtype": str,
    "threads": int,
    "weights": str,
    "vocab_projection": str,
    "cpu_kernels": str,
    "prefix_cache_mib": int,
    "prefill_share": (int, float),
    "speculative": str,
    "draft_tokens": int,
    "kv_cache_dtype": str,
    "cache_type": str,
    "cache_size": int,
    "gpu_split": list,
    "tensor_parallel": bool,
}

_PRESET_KEYS: Final = frozenset({"path", "alias", "chat_template", *PRESET_OPTIONS})


def valid_model_id(name: object) -> bool:
    """Whether ``name`` may be a model's id or alias (:data:`MODEL_ID`)."""
    return isinstance(name, str) and MODEL_ID.fullmatch(name) is not None


@attrs.frozen(kw_only=True)
class CatalogEntry:
    """One servable model."""

    id: str
    #: The GGUF file or model directory, inside the folder.
    path: Path
    #: ``gguf``, ``hf`` (a Hugging Face directory), ``exl2`` or ``gptq``.
    format: str
    aliases: tuple[str, ...] = ()
    #: The preset's engine options (:data:`PRESET_OPTIONS`), as given.
    options: Mapping[str, Any] = attrs.field(factory=dict)
    #: The preset's chat template file, resolved.
    chat_template: Path | None = None
    #: ``path`` relative to the folder (what clients are shown).
    shown_path: str = ""

    def engine_options(self, base: EngineOptions) -> EngineOptions:
        """``base`` (the command line's) with this model and its preset's
        options. A GGUF file is converted when the model loads.

        Raises:
            ConfigError: a preset value the engine options refuse.
        """
        return attrs.evolve(
            base, model=self.path, models_dir=None, models_preset=None, **self.options
        )

    def describe(self) -> dict[str, Any]:
        """What ``GET /models`` shows of it (besides its status): its path
        inside the folder, not where the folder is."""
        return {
            "id": self.id,
            "path": self.shown_path,
            "format": self.format,
            "aliases": list(self.aliases),
        }


@attrs.frozen
class Catalog:
    """The servable models, by id, in the folder's order."""

    root: Path
    entries: tuple[CatalogEntry, ...]

    @classmethod
    def scan(
        cls, root: Path, preset_file: Path | None = None, base: EngineOptions | None = None
    ) -> Catalog:
        """The models in ``root`` with the presets of ``preset_file``; with
        ``base``, each preset's options are checked against it now.

        Raises:
            ConfigError: ``root`` is not a directory; the preset file cannot
                be read, or names an option, id, alias or path it may not; two
                models would have the same id or alias.
        """
        if not root.is_dir():
            raise ConfigError(f"--models-dir {str(root)!r} is not a directory")
        root = root.resolve()
        found: dict[str, tuple[Path, str]] = {}
        for model_id, at in _scan(root):
            if model_id in found:
                raise ConfigError(
                    f"models: {model_id!r} names both {found[model_id][0].name!r} and "
                    f"{at[0].relative_to(root)!s}"
                )
            found[model_id] = at
        presets = _read_presets(preset_file) if preset_file is not None else {}
        entries: dict[str, CatalogEntry] = {}
        for model_id, (path, fmt) in found.items():
            entries[model_id] = CatalogEntry(id=model_id, path=path, format=fmt)
        for model_id, preset in presets.items():
            entries[model_id] = _apply_preset(
                root, model_id, preset, entries.get(model_id), preset_file
            )
        shown = [
            attrs.evolve(e, shown_path=str(e.path.relative_to(root))) for e in entries.values()
        ]
        catalog = cls(root, tuple(shown))
        catalog._check_names()
        if base is not None:
            for entry in catalog.entries:
                try:
                    entry.engine_options(base)
                except ConfigError as exc:
                    raise ConfigError(f"--models-preset [{entry.id}]: {exc}") from None
        return catalog

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(entry.id for entry in self.entries)

    def find(self, name: str) -> CatalogEntry | None:
        """The model whose id or alias is ``name``, else ``None``. Only string
        equality: ``name`` (a client's) never reaches the filesystem."""
        for entry in self.entries:
            if name == entry.id or name in entry.aliases:
                return entry
        return None

    def _check_names(self) -> None:
        seen: dict[str, str] = {}
        for entry in self.entries:
            for name in (entry.id, *entry.aliases):
                if name in seen:
                    raise ConfigError(
                        f"models: {name!r} names both {seen[name]!r} and {entry.id!r}"
                    )
                seen[name] = entry.id


def _inside(root: Path, path: Path) -> bool:
    try:
        path.resolve().relative_to(root)
    except (ValueError, OSError, RuntimeError):
        return False
    return True


def _scan(root: Path) -> Iterable[tuple[str, tuple[Path, str]]]:
    """(id, (path, format)) for each model in ``root``, by name."""
    for path in sorted(root.iterdir()):
        name = path.name
        if name.startswith("."):
            continue
        if not _inside(root, path):
            log.warning("models: %s leads out of %s: left out", name, root)
            continue
        found = _model_at(path)
        if found is None:
            log.debug("models: %s is not a model: left out", name)
            continue
        model_id = path.stem if path.is_file() else name
        if not valid_model_id(model_id):
            log.warning(
                "models: %r is not a usable id (letters, digits, '.', '_', '-'; at most 128): "
                "left out (name it in a preset's path)",
                model_id,
            )
            continue
        yield model_id, found


def _model_at(path: Path) -> tuple[Path, str] | None:
    """The model at ``path`` and its format, or None when it holds none."""
    if path.is_file():
        return (path, "gguf") if path.suffix == ".gguf" else None
    if not path.is_dir():
        return None
    if not missing_model_files(path):
        return path, _directory_format(path)
    ggufs = [p for p in path.glob("*.gguf") if p.is_file() and _inside(path, p)]
    if len(ggufs) == 1:
        return ggufs[0], "gguf"
    return None


def _directory_format(path: Path) -> str:
    """``exl2`` or ``gptq`` where config.json's quantization says so, else ``hf``."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "hf"
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    return method if method in ("exl2", "gptq") else "hf"


def _read_presets(preset_file: Path) -> dict[str, dict[str, Any]]:
    where = f"--models-preset {str(preset_file)!r}"
    try:
        data = tomllib.loads(preset_file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{where}: not TOML: {exc}") from None
    presets: dict[str, dict[str, Any]] = {}
    for model_id, table in data.items():
        if not valid_model_id(model_id):
            raise ConfigError(f"{where}: [{model_id}] is not a usable model id")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: {model_id} must be a table ([{model_id}])")
        for key, value in table.items():
            if key not in _PRESET_KEYS:
                raise ConfigError(
                    f"{where}: [{model_id}] {key} is not a preset option "
                    f"(one of: {', '.join(sorted(_PRESET_KEYS))})"
                )
            expected = PRESET_OPTIONS.get(key)
            bad_type = expected is not None and (
                not isinstance(value, expected) or (expected is int and isinstance(value, bool))
            )
            if bad_type:
                raise ConfigError(f"{where}: [{model_id}] {key} has the wrong type: {value!r}")
        presets[model_id] = table
    return presets


def _apply_preset(
    root: Path,
    model_id: str,
    preset: Mapping[str, Any],
    found: CatalogEntry | None,
    preset_file: Path | None,
) -> CatalogEntry:
    where = f"--models-preset [{model_id}]"
    if "path" in preset:
        name = preset["path"]
        if not isinstance(name, str) or not name or Path(name).is_absolute():
            raise ConfigError(f"{where} path must be a name inside --models-dir, got {name!r}")
        target = root / name
        if not _inside(root, target) or not target.exists():
            raise ConfigError(f"{where} path {name!r} is not inside --models-dir {str(root)!r}")
        at = _model_at(target)
        if at is None:
            raise ConfigError(f"{where} path {name!r} holds no model")
        path, fmt = at
    elif found is not None:
        path, fmt = found.path, found.format
    else:
        raise ConfigError(f"{where}: no model {model_id!r} in --models-dir (give it a path)")
    aliases = preset.get("alias", [])
    if isinstance(aliases, str):
        aliases = [aliases]
    if not isinstance(aliases, list) or not all(valid_model_id(a) for a in aliases):
        raise ConfigError(f"{where} alias must be model ids (a name or a list), got {aliases!r}")
    template = None
    if "chat_template" in preset:
        name = preset["chat_template"]
        base = (preset_file or root).resolve().parent
        if not isinstance(name, str) or not name or Path(name).is_absolute():
            raise ConfigError(f"{where} chat_template must be a relative file name, got {name!r}")
        template = (base / name).resolve()
        if not _inside(base, template) or not template.is_file():
            raise ConfigError(
                f"{where} chat_template {name!r} is not a file beside the preset file"
            )
    options = {key: value for key, value in preset.items() if key in PRESET_OPTIONS}
    if "gpu_split" in options:
        split = options["gpu_split"]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in split):
            raise ConfigError(f"{where} gpu_split must be numbers (GB per device), got {split!r}")
        options["gpu_split"] = tuple(float(v) for v in split)
    return CatalogEntry(
        id=model_id,
        path=path,
        format=fmt,
        aliases=tuple(aliases),
        options=options,
        chat_template=template,
    )
