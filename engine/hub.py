"""The Hugging Face hub: a model's snapshot or one GGUF file of a repository, from the cache
without asking when it is there, else downloaded with progress; a hub that does not answer within
:data:`HUB_TIMEOUT_S` is :class:`engine.loading.HubUnreachable` (ember then falls back)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from engine.gguf import pick_gguf
from engine.loading import HubUnreachable, LoadProgress, ModelResolutionError

log = logging.getLogger(__name__)

# How long the first question to the hub may take before ember falls back (or, for a model the
# user named, gives up): long enough for a slow link, short enough that an editor does not hang.
HUB_TIMEOUT_S = 4.0


# What vLLM needs from a hub repo: config, tokenizer and safetensors weights (no other formats).
HUB_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")


PROGRESS_POLL_S = 0.25


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
