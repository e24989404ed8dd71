"""Settings from the command line, ``initializationOptions`` and ``workspace/didChangeConfiguration``.

Clients send camelCase keys (``maxTokens``); the CLI uses ``--max-tokens``; both land in
:class:`Settings`. Wrong values raise :class:`ConfigError` whose message names the key and what
was expected, so the editor can show it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    model: str | None = None
    engine_url: tuple[str, ...] = ()
    max_tokens: int = 64
    temperature: float = 0.0
    debounce_ms: int = 0
    context_tokens: int = 1024
    suffix_tokens: int = 256
    timeout_ms: int = 15000
    # Multi-line completions: after this long, answer with the lines complete so far and let the
    # engine finish into the cache (accepting them then shows the rest at once). 0 = wait for all.
    early_answer_ms: int = 400
    fim_template: str | None = None
    max_document_bytes: int = 10_000_000
    # Per connection; editors ask at most a few times a second, so this only stops a runaway client
    # from starving the other editors sharing the engine. 0 = no limit.
    max_requests_per_second: float = 20.0
    cross_file: bool = True
    # Switches for benchmarks that measure what each idea buys (all on for users).
    prompt_strategy: str = "ast"  # "ast": anchored syntax-aware window; "naive": last N lines + next N
    reuse: bool = True  # completion cache, typed-through reuse, attaching to in-flight generations
    warmup: bool = True  # prefill the stable prompt part when a document opens or typing pauses
    prefix_cache: bool = True  # the embedded engine's KV prefix cache (read when the engine starts)
    # "syntax": block ends, indentation, brackets and repeats handled by the tree; "plain": the
    # model's text cut at line breaks only (the baseline that syntax_ok is measured against).
    postprocess: str = "syntax"


# key -> (type, lower bound, upper bound)
_LIMITS: dict[str, tuple[type, float | None, float | None]] = {
    "max_tokens": (int, 1, 4096),
    "temperature": (float, 0.0, 2.0),
    "debounce_ms": (int, 0, 5000),
    "context_tokens": (int, 16, 131072),
    "suffix_tokens": (int, 0, 131072),
    "timeout_ms": (int, 100, 600000),
    "early_answer_ms": (int, 0, 600000),
    "max_document_bytes": (int, 1024, 1 << 31),
    "max_requests_per_second": (float, 0.0, 10000.0),
}

_CHOICES: dict[str, tuple[str, ...]] = {"prompt_strategy": ("ast", "naive"), "postprocess": ("syntax", "plain")}

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
        changes[key] = _validate(key, value, source, raw_key)
    return dataclasses.replace(base, **changes)


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
