"""GGUF files: which one of a repository's quantizations to load, a file's identity in ember's
cache, its conversion to safetensors for vLLM (once), and its tokenizer for llama.cpp's engine.

The tokenizer of a byte-level BPE vocabulary (Qwen, SmolLM2, Llama 3 and most code models:
``tokenizer.ggml.model`` ``gpt2``) is built from the file's metadata with the ``tokenizers``
library alone (:func:`bpe_tokenizer_json`), as transformers' GGUF loader builds it, token ids
identical; other vocabularies still go through transformers, which the light install lacks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
from pathlib import Path
from typing import Any

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
    cache_dir = cache_dir or default_cache_dir()
    key = gguf_key(gguf)
    target = cache_dir / "tokenizers" / f"{key}.json"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(f".{key}.{os.getpid()}.json")
        converted = cache_dir / "models" / key / "tokenizer.json"  # vLLM's conversion of the same file
        log.info("reading the tokenizer of %s (once)", gguf)
        metadata = read_metadata(gguf, TOKENIZER_KEYS)
        if metadata.get("tokenizer.ggml.model") == "gpt2":
            staged.write_text(json.dumps(bpe_tokenizer_json(metadata)))
        elif converted.is_file():
            shutil.copyfile(converted, staged)
        else:
            try:
                from transformers import AutoTokenizer
            except ImportError as exc:
                kind = metadata.get("tokenizer.ggml.model")
                raise ModelResolutionError(
                    f"{gguf.name}'s tokenizer ({kind!r}, not byte-level BPE) needs transformers: pip install 'ember[cpu]'"
                ) from exc
            AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).backend_tokenizer.save(str(staged))
        staged.rename(target)
    return loaded_tokenizer(str(target))


@functools.lru_cache(maxsize=4)
def loaded_tokenizer(path: str) -> TokenizersTokenizer:
    """The tokenizer JSON at ``path`` (named by the GGUF's content), loaded once per process: a
    restarted engine takes the same one (loaded again, ember's RSS rose 22 MiB at the first restart)."""
    import tokenizers

    return TokenizersTokenizer(tokenizers.Tokenizer.from_file(path))


# ------------------------------------------------------------------------ metadata, tokenizer

TOKENIZER_KEYS = frozenset({
    "general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
})  # fmt: skip
# GGUF's value types: struct formats of the scalars; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_metadata(path: Path, wanted: frozenset[str]) -> dict[str, Any]:
    """The ``wanted`` keys of a GGUF file's key-value header (version 2 or 3, little-endian),
    read without loading any tensor."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ModelResolutionError(f"{path} is not a GGUF file")
        version, _tensors, count = struct.unpack_from("<IQQ", data, 4)
        if version not in (2, 3):
            raise ModelResolutionError(f"{path} is GGUF version {version}; ember reads versions 2 and 3")
        at, found = 24, {}
        for _ in range(count):
            key, at = _string(data, at)
            kind, = struct.unpack_from("<I", data, at)
            value, at = _value(data, at + 4, kind, key in wanted)
            if key in wanted:
                found[key] = value
        return found


def _string(data: mmap.mmap, at: int) -> tuple[str, int]:
    size, = struct.unpack_from("<Q", data, at)
    return data[at + 8 : at + 8 + size].decode("utf-8", "replace"), at + 8 + size


def _value(data: mmap.mmap, at: int, kind: int, keep: bool) -> tuple[Any, int]:
    """One value at ``at`` and where the next begins; an unwanted array is skipped, not decoded."""
    if kind == _STRING:
        return _string(data, at)
    if kind in _SCALARS:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)
    if kind != _ARRAY:
        raise ModelResolutionError(f"unknown GGUF value type {kind}")
    item, n = struct.unpack_from("<IQ", data, at)
    at += 12
    if item in _SCALARS:
        size = struct.calcsize("<" + _SCALARS[item])
        values = list(struct.unpack_from(f"<{n}{_SCALARS[item]}", data, at)) if keep else None
        return values, at + n * size
    items = []
    for _ in range(n):
        value, at = _value(data, at, item, keep)
        if keep:
            items.append(value)
    return (items if keep else None), at


# How text is split before BPE, by ``tokenizer.ggml.pre`` (transformers' GGUF loader's table);
# others split as GPT-2 does.
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (what a byte-level vocabulary's tokens are written in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in spelling:
            spelling[b], extra = chr(256 + extra), extra + 1
    return spelling


def bpe_tokenizer_json(metadata: dict[str, Any]) -> dict[str, Any]:
    """A ``tokenizers`` definition of a byte-level BPE vocabulary from GGUF metadata: the tokens,
    merges and split rule of the file, its control tokens kept whole as special tokens and its
    user-defined ones as added tokens (as transformers' GGUF loader does)."""
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    kinds: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)
    }
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": kind == _CONTROL or t == "<|endoftext|>"}
        for i, (t, kind) in enumerate(zip(tokens, kinds, strict=False))
        if (kind == _CONTROL and set(t) <= alphabet) or kind == _USER_DEFINED or t == "<|endoftext|>"
    ]  # fmt: skip
    split = SPLITS.get(metadata.get("tokenizer.ggml.pre", ""))
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": split is None}
    pre = byte_level if split is None else {
        "type": "Sequence",
        "pretokenizers": [{"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}, byte_level],
    }  # fmt: skip
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": pre, "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "", "end_of_word_suffix": "",
            "fuse_unk": False, "byte_fallback": False, "ignore_merges": False, "vocab": vocab,
            "merges": [m.split(" ", 1) for m in metadata.get("tokenizer.ggml.merges") or ()],
        },
    }  # fmt: skip
