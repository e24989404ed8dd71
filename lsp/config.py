"""Settings from the command line, ``initializationOptions`` and ``workspace/didChangeConfiguration``.

Clients send camelCase keys (``maxTokens``); the CLI uses ``--max-tokens``; both land in
:class:`Settings`. Wrong values raise :class:`ConfigError` whose message names the key and what
was expected, so the editor can show it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from context.prompt.builder import PromptBudget


class ConfigError(ValueError):
    pass


# The vLLM engine arguments worth knowing for completion; any field of vLLM's AsyncEngineArgs is
# accepted (``--help`` and the README list these).
USEFUL_ENGINE_ARGS: dict[str, str] = {
    "max_model_len": "context length; prompt budgets follow it (ember: 2048 on CPU, up to 8192 on GPU)",
    "gpu_memory_utilization": "share of GPU memory vLLM may take (ember: 0.5, room for other tools)",
    "tensor_parallel_size": "split the model over N GPUs",
    "kv_cache_dtype": 'e.g. "fp8": twice the KV cache in the same memory',
    "enable_chunked_prefill": "interleave long prefills with decoding",
    "speculative_config": 'e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}',
    "quantization": 'e.g. "fp8", "awq", "gptq" (the checkpoint decides what works)',
    "enforce_eager": "true: no CUDA graphs / torch.compile (faster start, slower decode)",
}


@dataclass(frozen=True)
class Settings:
    model: str | None = None
    # The embedded engine: "auto" (vLLM on a CUDA GPU, else llama.cpp; engine.models.choose_engine),
    # "vllm" or "llamacpp". Not read with engine_url (the remote server is the engine).
    engine: str = "auto"
    engine_url: tuple[str, ...] = ()
    max_tokens: int = 64
    temperature: float = 0.0
    debounce_ms: int = 0
    # Prompt budgets; None: a share of the engine's max_model_len (context.prompt.builder.PromptBudget.for_model:
    # 1024 and 256 at 2048 tokens; crossFileTokens: the context from other files, 256).
    context_tokens: int | None = None
    suffix_tokens: int | None = None
    cross_file_tokens: int | None = None
    timeout_ms: int = 15000
    # Multi-line completions: after this long, answer with the lines complete so far and let the
    # engine finish into the cache (accepting them then shows the rest at once). 0 = wait for all.
    early_answer_ms: int = 400
    fim_template: str | None = None
    # Engine arguments over ember's defaults (start-up only, embedded engine only: vLLM's
    # AsyncEngineArgs fields, or llama-server's flags with underscores for llama.cpp), as
    # (key, JSON text) pairs sorted by key so that Settings stays hashable: see engine_arg_dict().
    engine_args: tuple[tuple[str, str], ...] = ()
    max_document_bytes: int = 10_000_000
    # Per connection; editors ask at most a few times a second, so this only stops a runaway client
    # from starving the other editors sharing the engine. 0 = no limit.
    max_requests_per_second: float = 20.0
    # Context from other files: "workspace" (the workspace folders' files, open documents
    # included, ranked for the cursor), "open" (open documents only) or "off".
    cross_file: str = "workspace"
    # Switches for benchmarks that measure what each idea buys (all on for users).
    prompt_strategy: str = "ast"  # "ast": anchored syntax-aware window; "naive": last N lines + next N
    # Where a prefix-suffix-middle model's prompt puts the text before the cursor: "append" (the
    # cursor's lines after the middle token, so typing only appends and the suffix stays cached)
    # or "classic" (all of it before the suffix). context/prompt/builder.py's docstring.
    fim_layout: str = "append"
    reuse: bool = True  # completion cache, typed-through reuse, attaching to in-flight generations
    warmup: bool = True  # prefill the stable prompt part when a document opens or typing pauses
    prefix_cache: bool = True  # the embedded engine's KV prefix cache (read when the engine starts)
    # "syntax": block ends, indentation, brackets and repeats handled by the tree; "plain": the
    # model's text cut at line breaks only (the baseline that syntax_ok is measured against).
    postprocess: str = "syntax"
    # Hide a suggestion whose confidence (the model family's calibrated probability that it is
    # exactly right; context.cut.confidence) is below this; 0 shows everything but degenerate
    # repetition; None: the model family's calibrated default (0 for a model without one).
    min_confidence: float | None = None

    def budget_for(self, max_model_len: int) -> PromptBudget:
        """The prompt's token budgets for a model with ``max_model_len`` tokens of context."""
        from context.prompt.builder import PromptBudget  # not on the stdio forwarder's way: 20 ms of its start

        return PromptBudget.for_model(
            max_model_len,
            self.max_tokens,
            prefix_tokens=self.context_tokens,
            suffix_tokens=self.suffix_tokens,
            snippet_tokens=self.cross_file_tokens,
            workspace=self.cross_file == "workspace",
        )

    def engine_arg_dict(self) -> dict[str, Any]:
        """The engine arguments as vLLM takes them."""
        return {key: json.loads(text) for key, text in self.engine_args}


# The settings read once, when the engine starts: camelCase name -> field.
STARTUP_SETTINGS = {"model": "model", "engine": "engine", "engineUrl": "engine_url", "engineArgs": "engine_args"}


def startup_changes(old: Settings, new: Settings) -> list[str]:
    """The start-up settings (camelCase) whose values differ between ``old`` and ``new``."""
    return [name for name, key in STARTUP_SETTINGS.items() if getattr(old, key) != getattr(new, key)]


# key -> (type, lower bound, upper bound)
_LIMITS: dict[str, tuple[type, float | None, float | None]] = {
    "max_tokens": (int, 1, 4096),
    "temperature": (float, 0.0, 2.0),
    "debounce_ms": (int, 0, 5000),
    "context_tokens": (int, 16, 131072),
    "suffix_tokens": (int, 0, 131072),
    "cross_file_tokens": (int, 0, 131072),
    "timeout_ms": (int, 100, 600000),
    "early_answer_ms": (int, 0, 600000),
    "max_document_bytes": (int, 1024, 1 << 31),
    "max_requests_per_second": (float, 0.0, 10000.0),
    "min_confidence": (float, 0.0, 1.0),
}

_CHOICES: dict[str, tuple[str, ...]] = {
    "prompt_strategy": ("ast", "naive"),
    "fim_layout": ("append", "classic"),
    "postprocess": ("syntax", "plain"),
    "cross_file": ("off", "open", "workspace"),
    "engine": ("auto", "vllm", "llamacpp"),
}
# Values that older settings used, read as today's.
_ALIASES: dict[str, dict[bool, str]] = {"cross_file": {True: "workspace", False: "off"}}

_FIELDS = {f.name for f in dataclasses.fields(Settings)}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}


def snake_case(key: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower().replace("-", "_")


def merge_settings(base: Settings, options: Any, *, source: str = "settings") -> Settings:
    """``base`` updated with the keys in ``options`` (a dict from JSON); unknown keys are errors,
    so a typo does not silently do nothing. ``token`` is accepted and ignored here (the TCP
    listener checks it)."""
    if options is None:
        return base
    if not isinstance(options, dict):
        raise ConfigError(f"{source} must be an object, got {type(options).__name__}")
    changes: dict[str, Any] = {}
    for raw_key, value in options.items():
        key = snake_case(str(raw_key))
        if key == "token":
            continue
        if key not in _FIELDS:
            known = ", ".join(sorted(_camel(f) for f in _FIELDS))
            raise ConfigError(f"{source}: unknown setting {raw_key!r} (known: {known})")
        if key == "engine_args":
            # Key by key over the arguments already set (the command line's, then the editor's).
            merged = dict(base.engine_args)
            merged.update(_engine_args(value, f"{source}: {raw_key}"))
            changes[key] = tuple(sorted(merged.items()))
            continue
        changes[key] = _validate(key, value, source, raw_key)
    return dataclasses.replace(base, **changes)


def parse_engine_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` from the command line: VALUE is JSON when it parses (numbers, true/false,
    objects), else the string itself (``kv_cache_dtype=fp8``)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--engine-arg expects KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


def vllm_flags(engine_args: dict[str, Any]) -> str:
    """The same arguments as ``vllm serve`` flags, for users of a remote server."""
    flags = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, (dict, list)):
            flags.append(f"{flag} '{json.dumps(value)}'")
        else:
            flags.append(f"{flag} {value}")
    return " ".join(flags)


def _engine_args(value: Any, where: str) -> dict[str, str]:
    """An object of vLLM engine arguments (or (key, value) pairs) as key -> JSON text. Keys may be
    spelled as vLLM's flags (``max-model-len``); whether vLLM knows them is checked when the engine
    starts, where vLLM itself can say."""
    if value is None:
        return {}
    pairs = value.items() if isinstance(value, dict) else value
    if not isinstance(value, (dict, list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise ConfigError(f"{where} must be an object of vLLM engine arguments, e.g. {{\"max_model_len\": 4096}}")
    found: dict[str, str] = {}
    for raw_key, item in pairs:
        key = str(raw_key).strip().lstrip("-").replace("-", "_")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"{where}: {raw_key!r} is not a vLLM engine argument name")
        if key in ("model", "served_model_name", "tokenizer"):
            raise ConfigError(f"{where}: {key} is ember's to set (use the model setting or --model)")
        try:
            found[key] = json.dumps(item, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {raw_key} has a value that is not JSON ({exc})") from exc
    return found


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _validate(key: str, value: Any, source: str, raw_key: str) -> Any:
    where = f"{source}: {raw_key}"
    if key == "engine_url":
        urls = [value] if isinstance(value, str) else value
        if value is None:
            return ()
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise ConfigError(f"{where} must be a URL or a list of URLs")
        for url in urls:
            if not re.match(r"^https?://[^\s/]+", url):
                raise ConfigError(f"{where}: {url!r} is not an http(s) URL")
        return tuple(urls)
    if key in _ALIASES and isinstance(value, bool):
        return _ALIASES[key][value]
    if key in ("context_tokens", "suffix_tokens", "cross_file_tokens", "min_confidence") and value is None:
        return None  # back to the default that follows the model
    if key in ("model", "fim_template"):
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{where} must be a string")
        return value or None
    if key in _CHOICES:
        if value not in _CHOICES[key]:
            choices = " or ".join(f'"{c}"' for c in _CHOICES[key])
            raise ConfigError(f"{where} must be {choices}, got {value!r}")
        return value
    if isinstance(_DEFAULTS.get(key), bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false")
        return value
    kind, low, high = _LIMITS[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if kind is int and float(value) != int(value):
        raise ConfigError(f"{where} must be a whole number, got {value!r}")
    value = kind(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ConfigError(f"{where} must be between {low} and {high}, got {value!r}")
    return value
