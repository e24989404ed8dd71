"""GGUF files: which one of a repository's quantizations to load, a file's identity in ember's
cache, its conversion to safetensors for vLLM (once), and its tokenizer for llama.cpp's engine."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from engine.loading import ModelResolutionError, default_cache_dir
from engine.token_counts import TokenizersTokenizer

log = logging.getLogger(__name__)

# Which GGUF file of a repo or folder that holds several (quantizations) llama.cpp loads.
GGUF_PREFERENCE = ("q4_k_m", "q8_0", "q5_k_m", "q4_0")


def pick_gguf(names: list[str]) -> str | None:
    """The GGUF file to load of several (a repo or folder of quantizations), by GGUF_PREFERENCE."""
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf") and "mmproj" not in n.lower())
    for quant in GGUF_PREFERENCE:
        for name in ggufs:
            if quant in name.lower():
                return name
    return ggufs[0] if ggufs else None


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


def gguf_key(gguf: Path) -> str:
    """What names a GGUF file's derived files in the cache (its conversion, its tokenizer)."""
    return f"{gguf.stem}-{_file_digest(gguf)}"


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF file into a bf16 safetensors folder once; later calls reuse it."""
    target = cache_dir / "models" / gguf_key(gguf)
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


def gguf_tokenizer(gguf: Path, cache_dir: Path | None = None) -> TokenizersTokenizer:
    """The GGUF file's tokenizer, written once as ``tokenizer.json`` into the cache (transformers
    reads it from the GGUF metadata in ~10 s; the ``tokenizers`` library loads the JSON in ~0.2 s).
    Blocking: run it in a worker thread."""
    import tokenizers

    cache_dir = cache_dir or default_cache_dir()
    key = gguf_key(gguf)
    target = cache_dir / "tokenizers" / f"{key}.json"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(f".{key}.{os.getpid()}.json")
        converted = cache_dir / "models" / key / "tokenizer.json"  # vLLM's conversion of the same file
        if converted.is_file():
            shutil.copyfile(converted, staged)
        else:
            log.info("reading the tokenizer of %s (once)", gguf)
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).backend_tokenizer.save(str(staged))
        staged.rename(target)
    return TokenizersTokenizer(tokenizers.Tokenizer.from_file(str(target)))
