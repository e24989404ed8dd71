"""OpenAI-compatible completion servers over HTTP (vLLM, llama.cpp server, Ollama), one or many.

Each request streams ``/v1/completions`` (SSE) from one replica, chosen by rendezvous hashing on
the prompt's prefix key so that a document keeps hitting the replica that holds its KV blocks
(``engine.routing``). A replica that fails before the first token is taken out and the request
moves on to the next one; a stream that breaks after text reached the caller is resumed on
another. One attempt on one replica is :mod:`engine.attempt`'s; the replicas' health (probes,
``/metrics``, a router's workers, a fresh vLLM's first answer with log-probabilities) is
:mod:`engine.replicas`'.

Token counts for prompt budgets: when the model (its served name, or the ``root`` folder that vLLM
reports) is a local folder with tokenizer files, its own tokenizer counts; otherwise
:class:`ApproxTokenizer` estimates 1 token per 3.5 characters (about right for code with BPE
vocabularies; budgets should keep a margin).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import ssl
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from engine.attempt import AttemptFailed, Attempts, Broken
from engine.base import (
    Chunk,
    EngineCounters,
    EngineError,
    EngineNotReady,
    EngineStats,
    GenerationParams,
    ModelInfo,
    Tokenizer,
    counted,
)  # fmt: skip
from engine.replicas import ReplicaHealth
from engine.routing import RemoteConfig, Replica, normalize_url, order, redact_url, session_id
from engine.sse import int_or_none
from engine.token_counts import ApproxTokenizer, HFTokenizer

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class ReplicaStatus:
    """A snapshot of one replica for stats and tests (credentials removed from the URL)."""

    name: str
    up: bool
    failures: int
    inflight: int
    waiting: float | None
    running: float | None
    kv_usage: float | None
    last_error: str | None
    router_workers: tuple[int, int] | None  # (healthy, total) when it is a router


class RemoteEngine:
    """One or more OpenAI-compatible servers serving the same model (replicas).

    ``tokenizer``: counts tokens, instead of a tokenizer found for the model (llama.cpp's)."""

    def __init__(self, config: RemoteConfig, tokenizer: Tokenizer | None = None) -> None:
        if not config.urls:
            raise ValueError("RemoteEngine needs at least one URL")
        self.config = config
        self.replicas = [Replica(url=u, name=redact_url(u)) for u in dict.fromkeys(normalize_url(u) for u in config.urls)]
        self._api_key = os.environ.get(config.api_key_env) or None
        self._client: httpx.AsyncClient | None = None
        self._model: ModelInfo | None = None
        self._given_tokenizer = tokenizer
        self._tokenizer: Tokenizer | None = None
        self.health = ReplicaHealth(self.replicas, config, self._http, self._scrub)
        self.attempts = Attempts(config, self._http, self.health, self._scrub)
        # The server is llama.cpp's (its /v1/models entries carry `meta`): it reports sampled
        # tokens' log-probabilities only when asked with its own field, n_probs.
        self.llama_cpp = False
        self.engine_args: dict[str, Any] = {}  # the servers were started with their own
        self.warning: str | None = None
        self._streams: set[str] = set()  # request ids whose stream() runs
        self._aborted: set[str] = set()  # of those, aborted between two attempts
        self.counters = EngineCounters()  # requests, errors, resumes and 5xx rounds repeated
        self._monitor: asyncio.Task[None] | None = None

    # -- Engine protocol -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._model is not None and self._client is not None

    @property
    def dead(self) -> bool:
        return False  # a replica that fails is taken out and probed back in

    @property
    def model(self) -> ModelInfo:
        if self._model is None:
            raise EngineNotReady("not connected to the engine server yet")
        return self._model

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise EngineNotReady("not connected to the engine server yet")
        return self._tokenizer

    async def start(self) -> None:
        """Ask every replica for its models; the first that answers names the model. Replicas that
        do not answer start out down and are probed in the background."""
        self._client = self._client or self._make_client()
        answers = await asyncio.gather(*(self.health.list_models(r) for r in self.replicas))
        alive = [(r, models) for r, models in zip(self.replicas, answers, strict=True) if models is not None]
        if not alive:
            reasons = "; ".join(f"{r.name}: {r.last_error}" for r in self.replicas)
            raise EngineError(self._scrub(f"no engine server answered ({reasons})"))
        await asyncio.gather(*(self.health.read_workers(r) for r, _ in alive))
        name, lengths, roots = pick_model(self.config.model, alive)
        self.llama_cpp = any(isinstance(m.get("meta"), dict) for _, models in alive for m in models)
        self.health.vllm = any(m.get("owned_by") == "vllm" for _, models in alive for m in models)
        self.health.model_name = name
        special: frozenset[str] = frozenset()
        if self._given_tokenizer is not None:
            self._tokenizer = self._given_tokenizer
        elif (hf_tok := await self._load_tokenizer(name, roots)) is not None:
            vocab = hf_tok.get_vocab() if hasattr(hf_tok, "get_vocab") else {}
            special = frozenset(t for t in vocab if t.startswith(("<", "[", "▁<")))
            self._tokenizer = HFTokenizer(hf_tok)
        else:
            self._tokenizer = ApproxTokenizer()
        max_len = min(lengths) if lengths else self.config.default_max_model_len
        self._model = ModelInfo(name=name, max_model_len=max_len, special_tokens=special, origins=tuple(dict.fromkeys(roots)))
        if self._monitor is None:
            self._monitor = asyncio.create_task(self.health.watch(), name="ember-remote-monitor")
        await self.health.prepare_logprobs([r for r, _ in alive])
        log.info(
            "remote engine: model %s (max_model_len %d) on %d of %d replicas: %s",
            name, max_len, len(alive), len(self.replicas), ", ".join(r.name for r, _ in alive),
        )
        for r, _ in alive:
            if r.router_workers is not None:
                log.info("%s is a router with %d of %d workers healthy", r.name, *r.router_workers)

    def stream(
        self, prompt: str, params: GenerationParams, request_id: str, *, routing_key: str | None = None,
        fields: dict[str, Any] | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """Chunks of the completion (see :meth:`_serve` for the choice of replica). A stream that
        breaks after text has been yielded is resumed: the prompt plus the text so far, for the
        tokens left, on the next replica (or through the same router, on another worker), up to
        ``max_resumes`` times; with greedy decoding it goes on as the broken stream would have.
        ``fields``: more of the request's body (llama.cpp's ``id_slot``)."""
        return counted(self._stream(prompt, params, request_id, routing_key, fields), self.counters)

    async def _stream(
        self, prompt: str, params: GenerationParams, request_id: str, routing_key: str | None, fields: dict[str, Any] | None
    ) -> AsyncGenerator[Chunk, None]:
        if not self.ready:
            raise EngineNotReady("not connected to the engine server yet")
        sent, tokens, broken = "", 0, ""
        # Without failover a request may wait on its replica as long as it would over all of them.
        first_token_s = self.config.first_token_timeout * (1 if params.failover else len(self.replicas))
        self._streams.add(request_id)
        try:
            for resumes in range(self.config.max_resumes + 1):
                if tokens >= params.max_tokens:  # it broke after the last token
                    yield Chunk(text="", finish_reason="length")
                    return
                left = replace(params, max_tokens=params.max_tokens - tokens)
                try:
                    body = {**self._body(prompt + sent, left), **(fields or {})}
                    served = self._serve(body, request_id, routing_key, first_token_s)
                    async with contextlib.aclosing(served) as chunks:
                        async for chunk in chunks:
                            sent += chunk.text
                            tokens += chunk.token_count
                            yield chunk
                    return
                except Broken as exc:
                    broken = self._scrub(str(exc))
                    if resumes == self.config.max_resumes:
                        raise EngineError(broken) from exc
                    self.counters.resumed += 1
                    log.warning("request %s: %s; resuming after %d tokens", request_id, broken, tokens)
                except EngineError as exc:
                    if not broken:
                        raise
                    raise EngineError(f"{broken}; resuming it failed: {exc}") from exc
        finally:
            self._streams.discard(request_id)
            self._aborted.discard(request_id)

    async def _serve(
        self, body: dict[str, Any], request_id: str, routing_key: str | None, first_token_s: float
    ) -> AsyncGenerator[Chunk, None]:
        """Chunks from the first replica (in :func:`order`) that serves ``body``. A failure before
        the first token moves on to the next replica; when every replica failed and a moment may
        cure it (HTTP 5xx: a router whose worker just died answers 500 until its health check
        notices), the round is repeated after a backoff while the first-token deadline allows.
        Raises :class:`Broken` when the stream breaks after text was yielded."""
        headers = {"X-Session-ID": session_id(routing_key)} if routing_key is not None else {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + first_token_s
        failures: list[str] = []
        for backoff in (*self.config.retry_backoff, None):
            retry = False
            for replica in order(self.replicas, routing_key, request_id, self.config.load_policy):
                if request_id in self._aborted:
                    return
                try:
                    attempt = self.attempts.stream(replica, body, request_id, headers, first_token_s)
                    async with contextlib.aclosing(attempt) as chunks:
                        async for chunk in chunks:
                            yield chunk
                    replica.failures = 0
                    return
                except AttemptFailed as exc:
                    message = self._scrub(str(exc))
                    failures.append(message)
                    retry = retry or exc.retry
                    if exc.mark_down:
                        self.health.mark_down(replica, message)
                    log.info("request %s: %s; trying the next replica", request_id, message)
            if not retry or backoff is None or loop.time() + backoff >= deadline:
                break
            self.counters.retried += 1
            await asyncio.sleep(backoff)
        raise EngineError(self._scrub("no engine server could serve the request: " + "; ".join(failures)))

    async def abort(self, request_id: str) -> None:
        """Stops a request; one already finished is no error (as vLLM's abort of an unknown id)."""
        if not await self.attempts.abort(request_id) and request_id in self._streams:
            self._aborted.add(request_id)  # between two attempts: start no other

    async def close(self) -> None:
        self.attempts.cancel_all()
        self.health.close()
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
            self._monitor = None
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    # -- introspection ----------------------------------------------------------------------------

    def replica_status(self) -> list[ReplicaStatus]:
        return [
            ReplicaStatus(
                r.name, r.up, r.failures, r.inflight, r.waiting, r.running, r.kv_usage, r.last_error, r.router_workers
            )
            for r in self.replicas
        ]

    @property
    def behind_router(self) -> bool:
        """Whether a router (vllm-router, SGLang's gateway) stands between ember and the engines."""
        return any(r.router_workers is not None for r in self.replicas)

    def engine_stats(self) -> EngineStats:
        """For ``ember/stats`` and Prometheus: the counters, the connections checked out, the
        replicas, whether a router is in front and how many of its workers are healthy."""
        workers = [r.router_workers for r in self.replicas if r.router_workers is not None]
        counters = replace(self.counters, reconnected=self.attempts.reconnected, marked_down=self.health.marked_down)
        detail = {
            "replicas": [dataclasses.asdict(s) for s in self.replica_status()],
            "router": self.behind_router,
            "router_workers_healthy": sum(h for h, _ in workers) if workers else None,
            "router_workers": sum(t for _, t in workers) if workers else None,
        }
        in_use = connections_in_use(self._client) if self._client is not None else None
        return EngineStats("remote", counters, in_use, detail)

    def route(self, routing_key: str | None, request_id: str = "") -> list[str]:
        """The replicas (redacted URLs) a request with this key would try now, in order."""
        return [r.name for r in order(self.replicas, routing_key, request_id, self.config.load_policy)]

    # -- plumbing ----------------------------------------------------------------------------------

    def _body(self, prompt: str, params: GenerationParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model.name,
            "prompt": prompt,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "stream": True,
            # The final event then carries usage (vLLM: with prompt_tokens_details.cached_tokens).
            "stream_options": {"include_usage": True},
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.logprobs:
            body["logprobs"] = 0  # the sampled tokens' own, no alternatives
            if self.llama_cpp:
                body["n_probs"] = 1  # llama.cpp: the sampled token's (and the top one's)
        if self.llama_cpp:
            # Every event then carries the prompt's processed and cached token counts: usage comes
            # only after the last token, which a caller that stops early never reads.
            body["timings_per_token"] = True
        return body

    async def _load_tokenizer(self, name: str, roots: list[str]) -> Any:
        for candidate in (self.config.tokenizer_path, name, *roots):
            path = _local_tokenizer_dir(candidate)
            if path is None:
                continue
            try:
                return await asyncio.to_thread(_load_hf_tokenizer, path)
            except Exception as exc:  # noqa: BLE001 - any unloadable tokenizer: estimate instead
                log.warning("could not load the tokenizer in %s (%s); estimating token counts", path, exc)
        log.info("no local tokenizer for %s: estimating 1 token per %.1f characters", name, ApproxTokenizer.chars_per_token)
        return None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            raise EngineNotReady("not connected to the engine server yet")
        return self._client

    def _make_client(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            import h2  # noqa: F401  (httpx needs it for HTTP/2)

            http2 = True
        except ImportError:
            http2 = False
        config = self.config
        limits = httpx.Limits(
            max_connections=config.max_connections,
            max_keepalive_connections=config.max_connections,
            keepalive_expiry=config.keepalive_expiry,
        )
        return httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=config.uds, limits=limits) if config.uds else None,
            # HTTP/2 is negotiated over TLS when the server offers it; vLLM speaks HTTP/1.1, where
            # keep-alive pooling saves a connect per request.
            http2=http2,
            verify=ssl.create_default_context(cafile=config.verify) if isinstance(config.verify, str) else config.verify,
            headers=headers,
            # No httpx read timeout: first-token and between-token deadlines are enforced per
            # request, where a timeout can move the request to another replica.
            timeout=httpx.Timeout(
                connect=config.connect_timeout, read=None, write=config.connect_timeout, pool=config.connect_timeout
            ),
            limits=limits,
        )

    def _scrub(self, message: str) -> str:
        """The API key never appears in messages, even if a server echoes it back."""
        if self._api_key:
            message = message.replace(self._api_key, "***")
        return message


def pick_model(requested: str | None, alive: list[tuple[Replica, list[dict[str, Any]]]]) -> tuple[str, list[int], list[str]]:
    """The model's name (the requested one, else the first a replica lists), the context lengths
    the replicas report for it, and the folders (vLLM's ``root``) it was loaded from."""
    name = requested
    if name is None:
        for _, models in alive:
            if models and isinstance(models[0].get("id"), str):
                name = models[0]["id"]
                break
    if name is None:
        raise EngineError("the engine server does not list its models (/v1/models): name the model with --model")
    lengths: list[int] = []
    roots: list[str] = []
    for replica, models in alive:
        entry = next((m for m in models if m.get("id") == name), None)
        if entry is None:
            if models:
                listed = ", ".join(str(m.get("id")) for m in models)
                log.warning("replica %s does not list model %s (it lists: %s)", replica.name, name, listed)
            continue
        length = int_or_none(entry.get("max_model_len"))
        meta = entry.get("meta")
        if length is None and isinstance(meta, dict):  # llama.cpp reports its context in meta
            length = int_or_none(meta.get("n_ctx")) or int_or_none(meta.get("n_ctx_train"))
        if length:
            lengths.append(length)
        if isinstance(entry.get("root"), str):
            roots.append(entry["root"])
    return name, lengths, roots


def _local_tokenizer_dir(candidate: str | None) -> str | None:
    if not candidate:
        return None
    path = Path(os.path.expanduser(candidate))
    if path.is_dir() and any((path / name).is_file() for name in _TOKENIZER_FILES):
        return str(path)
    return None


def _load_hf_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def connections_in_use(client: httpx.AsyncClient) -> int:
    """Connections of ``client``'s pool that are not idle: requests streaming now, or connections
    a response never gave back (the leak that stopped ember after 64 completions). httpcore's
    pool is reached through httpx's private ``_transport._pool``: the one place ember touches
    httpx's internals, pinned by tests/test_remote.py."""
    pool = getattr(getattr(client, "_transport", None), "_pool", None)
    connections = getattr(pool, "connections", None)
    if connections is None:
        raise RuntimeError("httpx's client no longer has _transport._pool.connections: update connections_in_use")
    return sum(1 for connection in connections if not connection.is_idle() and not connection.is_closed())
