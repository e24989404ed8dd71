"""What every engine offers: an abortable async stream of text for a prompt.

``lsp`` talks to engines only through :class:`Engine`, and reads nothing of an engine that the
protocol does not declare; embedded vLLM, embedded llama.cpp and the remote OpenAI-compatible
client implement it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol, runtime_checkable


class EngineError(RuntimeError):
    """The engine cannot serve a request (not loaded, down, died mid-stream). The message says why."""


class EngineNotReady(EngineError):
    """The model is still loading."""


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 64
    temperature: float = 0.0
    stop: tuple[str, ...] = ()
    # Report the log-probability of every sampled token (Chunk.logprobs): what a suggestion's
    # confidence is made of.
    logprobs: bool = False
    # False for a request that is only worth it on the replica chosen for it (a warm-up filling
    # that replica's prefix cache): a slow first token does not move it to another replica.
    failover: bool = True
    # Only to fill the engine's prefix cache (a warm-up, max_tokens 1): an engine that knows the
    # prompt is cached already may end it at once without generating.
    warm_up: bool = False


@dataclass
class Chunk:
    """A piece of generated text with what the engine reported about the prompt.

    ``prompt_tokens`` and ``cached_tokens`` are set on the first chunk when the engine knows them
    (vLLM's ``num_cached_tokens``: prefix-cache hits). ``logprobs``: the natural-log probabilities
    of the tokens this chunk's text came from, when :class:`GenerationParams` asked for them.
    """

    text: str
    token_count: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    """What the prompt builder needs to know about the loaded model."""

    name: str
    max_model_len: int
    special_tokens: frozenset[str] = field(default_factory=frozenset)
    # Where a server says it loaded the weights from (vLLM's ``root``: a hub id or a folder) when it
    # serves them under another name: the model family is told from these too.
    origins: tuple[str, ...] = ()


@dataclass
class EngineCounters:
    """What every engine counts, under the same names: ``requests`` streamed, ``errors`` (those that
    ended in an :class:`EngineError`), streams ``resumed`` after a break, rounds ``retried`` after
    an HTTP 5xx, requests sent again on a fresh connection after a reused one was found closed
    (``reconnected``), and replicas ``marked_down``. An engine without a part (vLLM in process has
    no connections) keeps its count at 0."""

    requests: int = 0
    errors: int = 0
    resumed: int = 0
    retried: int = 0
    reconnected: int = 0
    marked_down: int = 0

    def __add__(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


@dataclass
class EngineStats:
    """What ``ember/stats`` and Prometheus show of an engine. ``connections_in_use``: HTTP
    connections checked out of the engine client's pool now (None for an engine without one);
    ``detail``: what only this kind of engine has (its process, replicas, vLLM's metrics)."""

    engine: str  # "vllm", "llama.cpp" or "remote"
    counters: EngineCounters = field(default_factory=EngineCounters)
    connections_in_use: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Flat, as ``ember/stats`` answers it: the counters beside the engine's own keys."""
        return {"engine": self.engine, **asdict(self.counters), "connections_in_use": self.connections_in_use, **self.detail}


async def counted(stream: AsyncGenerator[Chunk, None], counters: EngineCounters) -> AsyncGenerator[Chunk, None]:
    """``stream`` with its request counted, and its error when it ends in an :class:`EngineError`."""
    counters.requests += 1
    try:
        async with contextlib.aclosing(stream) as chunks:
            async for chunk in chunks:
                yield chunk
    except EngineError:
        counters.errors += 1
        raise


@runtime_checkable
class Tokenizer(Protocol):
    def count(self, text: str) -> int: ...


@runtime_checkable
class Engine(Protocol):
    """An abortable source of completions."""

    # The arguments the engine runs with (vLLM's AsyncEngineArgs, llama-server's flags; {} for a
    # remote server), and why the user's were not applied (None when they were).
    engine_args: dict[str, Any]
    warning: str | None

    @property
    def ready(self) -> bool: ...

    @property
    def dead(self) -> bool:
        """The engine's process ended (killed, crashed): a new engine must be started. A remote
        engine never is: its replicas are probed back in."""
        ...

    @property
    def model(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    async def start(self) -> None:
        """Load the model (or connect); may take a while. Raises EngineError on failure."""

    def stream(
        self, prompt: str, params: GenerationParams, request_id: str, *, routing_key: str | None = None
    ) -> AsyncGenerator[Chunk, None]:
        """Generate for ``prompt``; cancelling the consuming task, ``aclose()`` or :meth:`abort` stops it.

        ``routing_key`` (the prompt's prefix key) lets an engine with several replicas send prompts
        that share a prefix to the replica that already holds its KV blocks."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def close(self) -> None: ...

    def engine_stats(self) -> EngineStats:
        """What ``ember/stats`` and Prometheus show of the engine: its counters, the connections it
        holds, and its own details (its process, replicas, router)."""
        ...
