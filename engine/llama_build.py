"""Where ember's ``llama-server`` comes from: built once per machine from the llama.cpp sources that
PyPI's llama-cpp-python sdist carries, and cached outside the clone under a key of its version and
build flags, so that a second set-up (another clone, CI on the same machine) skips the build.

ember runs only the binary it built (or the one ``$EMBER_LLAMA_SERVER`` names): never some other
``llama-server`` found on PATH, whose version and flags nobody checked.

``python -m engine.llama_build`` builds it (the README's set-up calls it; ~12-16 min on 2 cores).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from engine.loading import default_cache_dir

# The sdist carries llama.cpp at 0c1e57098 (tools/server included).
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SERVER_ENV = "EMBER_LLAMA_SERVER"  # a llama-server binary the user built themselves

# x86-64: AVX2/FMA/F16C (most laptops of the last decade) and no -march=native; AMX off: a
# native AMX build crashed here once and AMX segfaults on Q4_K_M are reported upstream (llama.cpp
# #20824). No web UI (the build would download it), no TLS, no curl: the server only loads local
# files and listens on a Unix socket. Static, so that the binary needs nothing beside it.
COMMON_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
X86_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AMX_INT8=OFF")
# The AVX512 extensions ggml has kernels for, by /proc/cpuinfo's name: used where the CPU has them
# (a 1,448-token prefill of Qwen2.5-Coder-0.5B Q4_K_M on 2 cores: 9.2 s with AVX2 alone, 6.3 s with
# AVX512/VNNI/BF16/VBMI; decoding 35-36 tokens/s either way).
AVX512_FLAGS = {
    "avx512f": "-DGGML_AVX512=ON",
    "avx512_vnni": "-DGGML_AVX512_VNNI=ON",
    "avx512_bf16": "-DGGML_AVX512_BF16=ON",
    "avx512vbmi": "-DGGML_AVX512_VBMI=ON",
    "avx_vnni": "-DGGML_AVX_VNNI=ON",
}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_flags(machine: str | None = None, flags: set[str] | None = None) -> tuple[str, ...]:
    """CMake flags for this machine: on x86 AVX2/FMA/F16C and the AVX512 extensions this CPU has
    (a binary built here runs on this CPU; another CPU gets another cache key, so another build);
    elsewhere (Apple silicon, Arm) the defaults llama.cpp picks for the platform (Metal on macOS),
    untouched."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return COMMON_FLAGS
    have = cpu_flags() if flags is None else flags
    extra = tuple(flag for name, flag in AVX512_FLAGS.items() if name in have and ("avx512f" in have or name == "avx_vnni"))
    return COMMON_FLAGS + X86_FLAGS + extra


def build_key(flags: tuple[str, ...] | None = None) -> str:
    """The cache folder's name: the source version and a hash of the flags and platform."""
    flags = flags or build_flags()
    digest = hashlib.sha256("\n".join((LLAMA_CPP_PYTHON, sys.platform, platform.machine(), *flags)).encode())
    return f"{LLAMA_CPP_PYTHON.split('==')[1]}-{digest.hexdigest()[:12]}"


def cached_server(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "llama.cpp" / build_key() / "llama-server"


def server_binary() -> Path | None:
    """The llama-server ember runs: ``$EMBER_LLAMA_SERVER``, else the cached build; None when
    neither exists."""
    named = os.environ.get(SERVER_ENV)
    if named:
        return Path(named) if Path(named).is_file() else None
    path = cached_server()
    return path if path.is_file() and os.access(path, os.X_OK) else None


def build(cache_dir: Path | None = None, jobs: int | None = None) -> Path:
    """Download the sdist, build the ``llama-server`` target alone, and install the binary into the
    cache (atomically: a half-built binary is never found). Returns the binary's path."""
    target = cached_server(cache_dir)
    if target.is_file():
        print(f"llama-server: cached at {target}", flush=True)
        return target
    flags = build_flags()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ember-llama-build-") as tmp:
        work = Path(tmp)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(work), LLAMA_CPP_PYTHON]
        subprocess.run([*pip, "-q", "--disable-pip-version-check"], check=True)
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        (source,) = work.glob("llama_cpp_python-*/vendor/llama.cpp")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        configure = ["cmake", "-S", str(source), "-B", str(work / "build"), *generator, *flags]
        subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
        jobs = jobs or os.cpu_count() or 2
        subprocess.run(["cmake", "--build", str(work / "build"), "--target", "llama-server", "-j", str(jobs)], check=True)
        (built,) = (work / "build").glob("**/bin/llama-server")
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(f".llama-server.{os.getpid()}")
        shutil.copy2(built, staged)
        staged.rename(target)
    print(f"llama-server: built in {time.monotonic() - started:.0f} s into {target}", flush=True)
    return target


if __name__ == "__main__":
    build()
