"""Where ember's ``llama-server`` comes from, in this order (:func:`find_server`):

1. ``$EMBER_LLAMA_SERVER``, a binary the user names (run as it is);
2. ember's own build, made once per machine from the llama.cpp sources that PyPI's
   llama-cpp-python sdist carries and cached outside the clone under a key of its version and
   build flags (a second set-up, another clone, CI on the same machine skip the build);
3. a ``llama-server`` on PATH (brew, winget, a distribution), used only when it is one ember knows:
   its ``--version`` names the llama.cpp commit of ember's sources (:data:`KNOWN_COMMIT`; a build
   number means nothing across source builds) and its ``--help`` lists every flag ember passes.
   Another is refused, and the message says what does not match.

``ember setup`` (or ``python -m engine.llama_build``) builds it: cmake and a C++ compiler checked
first, the sdist fetched with httpx (no pip needed), a line per build step, and a lock so that two
ember processes never build at once (~8 min on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.loading import default_cache_dir

# The sdist carries llama.cpp at 0c1e57098 (tools/server included).
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
KNOWN_COMMIT = "0c1e570"  # what its llama-server's --version prints
SERVER_ENV = "EMBER_LLAMA_SERVER"  # a llama-server binary the user built themselves
PYPI_ENV = "EMBER_PYPI_URL"  # a package index (simple API) to fetch the sdist from (default PyPI's)
# The flags of engine.llamacpp.server_flags that an older or trimmed llama-server may lack.
NEEDED_FLAGS = (
    "--alias", "--threads-batch", "--parallel", "--no-kv-unified", "--no-cache-idle-slots", "--cache-ram",
    "--batch-size", "--ubatch-size", "--no-webui", "--metrics",
)  # fmt: skip
SETUP_COMMAND = "ember setup"

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


@dataclass(frozen=True)
class ServerChoice:
    """The llama-server ember runs (None: none it may run) and why, for ember/stats and errors."""

    path: Path | None
    why: str


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_server() -> ServerChoice:
    """The llama-server ember runs, in the module's order. Blocking (a PATH candidate is asked
    for its ``--version``): call it off the event loop."""
    notes: list[str] = []
    named = os.environ.get(SERVER_ENV)
    if named:
        if _executable(Path(named)):
            return ServerChoice(Path(named), f"${SERVER_ENV} names it (run as it is, unchecked)")
        notes.append(f"${SERVER_ENV} names {named}, which is not an executable file")
    cached = cached_server()
    if _executable(cached):
        return ServerChoice(cached, "; ".join([*notes, f"ember's own build of llama.cpp {KNOWN_COMMIT} ({LLAMA_CPP_PYTHON})"]))
    on_path = shutil.which("llama-server")
    if on_path:
        problem = server_problem(Path(on_path))
        if problem is None:
            why = f"on PATH: llama.cpp {KNOWN_COMMIT}, with every flag ember passes"
            return ServerChoice(Path(on_path), "; ".join([*notes, why]))
        notes.append(f"the llama-server on PATH ({on_path}) is refused: {problem}")
    notes.append(f"llama.cpp's server is not built on this machine: run `{SETUP_COMMAND}` (or set {SERVER_ENV})")
    return ServerChoice(None, "; ".join(notes))


def server_problem(binary: Path) -> str | None:
    """Why ember will not run this llama-server (None: it is one ember knows)."""
    try:
        version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=20)
        usage = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"it did not run: {exc}"
    found = re.search(r"commit ([0-9a-f]{7,40})", version.stdout + version.stderr)
    if found is None:
        return "its --version names no llama.cpp commit"
    if not (found[1].startswith(KNOWN_COMMIT) or KNOWN_COMMIT.startswith(found[1])):
        return f"it is llama.cpp {found[1]}, ember runs {KNOWN_COMMIT} (another commit may differ in flags and output)"
    listed = usage.stdout + usage.stderr
    missing = [flag for flag in NEEDED_FLAGS if not re.search(rf"{re.escape(flag)}\b", listed)]
    return f"its --help lacks {', '.join(missing)}" if missing else None


def server_binary() -> Path | None:
    return find_server().path


# ------------------------------------------------------------------------------ the build


class SetupError(RuntimeError):
    """The build cannot start or failed; the message says what to do."""


def missing_tools() -> list[str]:
    """What the build needs that this machine lacks, each with how to get it."""
    missing = []
    if shutil.which("cmake") is None:
        missing.append("cmake (`pip install cmake ninja`, `apt install cmake`, `brew install cmake`)")
    compilers = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
    if not any(c and shutil.which(c.split()[0]) for c in compilers):
        missing.append("a C++ compiler (`apt install g++`, `xcode-select --install` on macOS, or set CXX)")
    return missing


@contextlib.contextmanager
def build_lock(cache_dir: Path | None = None, said: Callable[[str], None] = print) -> Iterator[None]:
    """Held while building: a second ember that wants the build waits for the first's."""
    path = (cache_dir or default_cache_dir()) / "llama.cpp" / ".build.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            said("llama-server: another ember is building it; waiting for that build")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def fetch_sdist(folder: Path) -> Path:
    """The sdist from the package index's JSON simple API (PEP 691: PyPI and the mirrors that
    pip uses; ``$EMBER_PYPI_URL`` names one), its sha256 checked."""
    name, version = LLAMA_CPP_PYTHON.split("==")
    index = os.environ.get(PYPI_ENV, "https://pypi.org/simple").rstrip("/")
    filename = f"{name.replace('-', '_')}-{version}.tar.gz"
    try:
        with httpx.Client(timeout=httpx.Timeout(60.0, connect=10.0), follow_redirects=True) as http:
            listing = http.get(f"{index}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
            listing.raise_for_status()
            (sdist,) = [f for f in listing.json()["files"] if f["filename"] == filename]
            target = folder / filename
            digest = hashlib.sha256()
            with http.stream("GET", httpx.URL(f"{index}/{name}/").join(sdist["url"])) as download, target.open("wb") as out:
                download.raise_for_status()
                for block in download.iter_bytes(1 << 20):
                    digest.update(block)
                    out.write(block)
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise SetupError(f"could not fetch {filename} from {index}: {exc} (or pass --sdist FILE)") from exc
    if digest.hexdigest() != sdist["hashes"]["sha256"]:
        raise SetupError(f"{filename} does not match the index's sha256")
    return target


# One step of a build's output: ninja's "[12/345] ..." or make's "[ 12%] ...".
_STEP = re.compile(r"^\[\s*(\d+)(?:/(\d+)|%)\]\s*(.*)")


def build(
    cache_dir: Path | None = None, jobs: int | None = None, sdist: Path | None = None, said: Callable[[str], None] = print,
) -> Path:
    """Build the ``llama-server`` target alone from the sdist and install the binary into the cache
    (atomically: a half-built binary is never found), ``said`` getting a line per step. Returns
    the binary's path."""
    target = cached_server(cache_dir)
    if _executable(target):
        said(f"llama-server: cached at {target}")
        return target
    missing = missing_tools()
    if missing:
        raise SetupError("building llama-server needs " + " and ".join(missing))
    with build_lock(cache_dir, said):
        if _executable(target):  # built by the ember that held the lock
            said(f"llama-server: built meanwhile at {target}")
            return target
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="ember-llama-build-") as tmp:
            work = Path(tmp)
            if sdist is None:
                said(f"llama-server: fetching {LLAMA_CPP_PYTHON}'s sources")
                sdist = fetch_sdist(work)
            with tarfile.open(sdist) as archive:
                archive.extractall(work, filter="data")
            (source,) = work.glob("llama_cpp_python-*/vendor/llama.cpp")
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            said("llama-server: configuring (cmake)")
            _run(["cmake", "-S", str(source), "-B", str(work / "build"), *generator, *build_flags()], said, steps=False)
            jobs = jobs or os.cpu_count() or 2
            _run(["cmake", "--build", str(work / "build"), "--target", "llama-server", "-j", str(jobs)], said, steps=True)
            (built,) = (work / "build").glob("**/bin/llama-server")
            target.parent.mkdir(parents=True, exist_ok=True)
            staged = target.with_name(f".llama-server.{os.getpid()}")
            shutil.copy2(built, staged)
            staged.rename(target)
        said(f"llama-server: built in {time.monotonic() - started:.0f} s into {target}")
    return target


def _run(command: list[str], said: Callable[[str], None], *, steps: bool) -> None:
    """A build command; with ``steps`` a line per build step, else quiet. Its last lines go into
    the error when it fails."""
    tail: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace") as run:
        assert run.stdout is not None
        for line in run.stdout:
            tail = [*tail[-19:], line.rstrip()]
            step = _STEP.match(line) if steps else None
            if step:
                done, total, what = step.groups()
                where = f"step {done}/{total}" if total else f"{done}%"
                said(f"llama-server: {where} {what.strip()[:100]}")
    if run.returncode != 0:
        raise SetupError(f"{' '.join(command[:2])} failed (exit {run.returncode}):\n" + "\n".join(tail))


def setup_main(argv: list[str]) -> int:
    """``ember setup``: build the llama-server that ember's llama.cpp engine runs."""
    parser = argparse.ArgumentParser(prog=SETUP_COMMAND, description=setup_main.__doc__)
    parser.add_argument("--sdist", type=Path, help=f"build from this {LLAMA_CPP_PYTHON} sdist instead of fetching it")
    parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: every core)")
    args = parser.parse_args(argv)
    chosen = find_server()
    if chosen.path is not None and chosen.path != cached_server():
        print(f"llama-server: {chosen.path} serves ({chosen.why}); building ember's own anyway", flush=True)
    try:
        build(jobs=args.jobs, sdist=args.sdist, said=lambda line: print(line, flush=True))
    except SetupError as exc:
        print(f"ember setup: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(setup_main(sys.argv[1:]))
