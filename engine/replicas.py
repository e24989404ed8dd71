"""What the remote engine knows of its replicas' health, and the requests that find it out.

:class:`ReplicaHealth` takes a replica out when it fails, probes it back in with backoff, polls
live replicas' ``/metrics`` for load (only with several), reads a router's ``/workers``, lists the
models a replica serves, and pays for a fresh vLLM's first answer with log-probabilities before a
user's completion has to. The request path (:mod:`engine.remote`, :mod:`engine.attempt`) reads and
updates the same :class:`engine.routing.Replica` objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import httpx

from engine.routing import (
    RemoteConfig,
    Replica,
    Sample,
    metric_sum,
    normalize_url,
    parse_prometheus,
    probe_delay,
    router_workers,
)

log = logging.getLogger(__name__)

# How long start() waits for fresh vLLM servers' first answer with log-probabilities (see
# Replica.logprobs_ready); a slower one goes on in the background.
LOGPROBS_WARMUP_WAIT_S = 60.0


def describe(exc: BaseException) -> str:
    """``ReadTimeout`` or ``ConnectError: [Errno 111] ...``: httpx messages are often empty."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class ReplicaHealth:
    """The replicas' state kept true: down when they fail, back when a probe answers, their load."""

    def __init__(
        self, replicas: list[Replica], config: RemoteConfig, client: Callable[[], httpx.AsyncClient], scrub: Callable[[str], str]
    ) -> None:
        self.replicas = replicas
        self.config = config
        self._client = client
        self._scrub = scrub
        self.wake = asyncio.Event()  # a replica went down: the watcher plans its probe
        self.vllm = False  # the servers are vLLM's (/v1/models: owned_by "vllm")
        self.model_name = ""  # what the log-probability warm-ups ask for
        self._logprobs_warmups: dict[str, asyncio.Task[None]] = {}  # replica url -> its warm-up
        self.marked_down = 0  # times a replica that was up was taken out

    def mark_down(self, replica: Replica, reason: str) -> None:
        replica.failures += 1
        replica.last_error = reason
        delay = probe_delay(replica.failures, self.config.probe_initial, self.config.probe_max)
        replica.next_probe = asyncio.get_running_loop().time() + delay
        if replica.up:
            self.marked_down += 1
            log.warning("engine replica %s is down (%s); probing again in %.1f s", replica.name, reason, delay)
        replica.up = False
        self.wake.set()

    def timeouts(self) -> httpx.Timeout:
        return httpx.Timeout(self.config.probe_timeout, connect=self.config.connect_timeout)

    async def list_models(self, replica: Replica) -> list[dict[str, Any]] | None:
        """``/v1/models`` entries, [] for a live server that does not list models, None if down."""
        try:
            response = await self._client().get(f"{replica.url}/v1/models", timeout=self.timeouts())
        except httpx.HTTPError as exc:
            self.mark_down(replica, self._scrub(f"cannot reach {replica.name} ({describe(exc)})"))
            return None
        if response.status_code == 404:
            return []
        if response.status_code >= 400:
            self.mark_down(replica, self._scrub(f"{replica.name} answered HTTP {response.status_code} on /v1/models"))
            return None
        try:
            data = response.json().get("data") or []
        except (ValueError, AttributeError):
            data = []
        return [d for d in data if isinstance(d, dict)]

    async def probe(self, replica: Replica) -> None:
        """Bring a down replica back when it answers /health (vLLM) or /v1/models (others)."""
        client = self._client()
        try:
            response = await client.get(f"{replica.url}/health", timeout=self.timeouts())
            if response.status_code in (404, 405):
                response = await client.get(f"{replica.url}/v1/models", timeout=self.timeouts())
            healthy = response.status_code < 400
            reason = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            healthy = False
            reason = describe(exc)
        if healthy:
            log.warning("engine replica %s is back", replica.name)
            replica.up = True
            replica.silent_polls = 0
            replica.metrics_due = 0.0
            await self.prepare_logprobs([replica], wait_s=0.0)  # it may be a fresh server
            return
        self.mark_down(replica, self._scrub(f"probe of {replica.name} failed ({reason})"))

    async def prepare_logprobs(self, replicas: list[Replica], wait_s: float = LOGPROBS_WARMUP_WAIT_S) -> None:
        """Ask each vLLM replica for one token with log-probabilities and wait up to ``wait_s``
        for the answers: a fresh vLLM compiles a kernel on its first such request, and the user's
        first completion should not be the one that waits for it (it ran past the 15 s deadline
        on a 2-core CPU). Until a replica has answered, requests to it ask for no
        log-probabilities (their suggestions carry no confidence)."""
        if not self.vllm:
            return
        for replica in replicas:
            if replica.url not in self._logprobs_warmups:
                replica.logprobs_ready = False
                warmup = asyncio.create_task(self._warm_logprobs(replica), name=f"ember-logprobs-{replica.name}")
                self._logprobs_warmups[replica.url] = warmup
                warmup.add_done_callback(functools.partial(self._warmup_done, replica.url))
        pending = [self._logprobs_warmups[r.url] for r in replicas if r.url in self._logprobs_warmups]
        if pending and wait_s > 0:
            log.info("asking %d engine server(s) for a first answer with log-probabilities", len(pending))
            _, slow = await asyncio.wait(pending, timeout=wait_s)
            if slow:
                log.warning(
                    "%d engine server(s) gave no answer with log-probabilities in %.0f s: asking them for none until they do",
                    len(slow), wait_s,
                )

    def _warmup_done(self, url: str, _: asyncio.Task[None]) -> None:
        self._logprobs_warmups.pop(url, None)

    async def _warm_logprobs(self, replica: Replica) -> None:
        body = {"model": self.model_name, "prompt": "def", "max_tokens": 1, "temperature": 0.0, "logprobs": 0}
        started = asyncio.get_running_loop().time()
        timeout = httpx.Timeout(600.0, connect=self.config.connect_timeout)
        try:
            response = await self._client().post(f"{replica.url}/v1/completions", json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            log.info("%s: no first answer with log-probabilities (%s); asked again when it is back", replica.name, describe(exc))
            return
        # An error answer is the request path's to report: the warm-up changes nothing then.
        replica.logprobs_ready = True
        took = asyncio.get_running_loop().time() - started
        log.info("%s answered with log-probabilities (HTTP %d) after %.1f s", replica.name, response.status_code, took)

    async def read_workers(self, replica: Replica) -> None:
        """Notes whether ``replica`` is a router (its ``/workers`` lists workers) and how many of
        them are healthy; a plain vLLM server answers 404."""
        try:
            response = await self._client().get(f"{replica.url}/workers", timeout=self.timeouts())
            replica.router_workers = router_workers(response.json()) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            pass  # unknown this time: keep what was known

    async def poll_metrics(self, replica: Replica) -> None:
        loop = asyncio.get_running_loop()
        replica.metrics_due = loop.time() + self.config.metrics_interval
        try:
            response = await self._client().get(f"{replica.url}/metrics", timeout=self.timeouts())
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # Refused: the server is gone. A slow answer is not enough: a busy CPU server is slow.
            self.mark_down(replica, self._scrub(f"cannot connect to {replica.name} ({type(exc).__name__})"))
            return
        except httpx.HTTPError as exc:
            # A busy vLLM still answers /metrics (its API server is not the engine core), so
            # repeated silence means a frozen host; requests that a caller cancels before their
            # first-token deadline would never reveal it.
            replica.silent_polls += 1
            if replica.silent_polls >= self.config.silent_polls_down:
                silence = f"{replica.name} did not answer /metrics {replica.silent_polls} times ({type(exc).__name__})"
                self.mark_down(replica, self._scrub(silence))
            return
        replica.silent_polls = 0
        if response.status_code == 404:
            replica.has_metrics = False  # not vLLM: routing falls back to local in-flight counts
            return
        if response.status_code >= 400:
            return
        samples = parse_prometheus(response.text)
        replica.waiting = metric_sum(samples, "vllm:num_requests_waiting")
        replica.running = metric_sum(samples, "vllm:num_requests_running")
        replica.kv_usage = metric_sum(samples, "vllm:kv_cache_usage_perc")

    async def watch(self) -> None:
        """Probe down replicas when their backoff expires and poll /metrics of live ones."""
        loop = asyncio.get_running_loop()
        multi = len(self.replicas) > 1
        while True:
            now = loop.time()
            jobs = []
            for r in self.replicas:
                if not r.up and now >= r.next_probe:
                    jobs.append(self.probe(r))
                elif r.up and r.router_workers is not None and now >= r.metrics_due:
                    r.metrics_due = now + self.config.metrics_interval
                    jobs.append(self.read_workers(r))
                elif r.up and multi and r.has_metrics and now >= r.metrics_due:
                    jobs.append(self.poll_metrics(r))
            if jobs:
                await asyncio.gather(*jobs, return_exceptions=True)
            now = loop.time()
            dues = [r.next_probe for r in self.replicas if not r.up]
            dues += [r.metrics_due for r in self.replicas if r.up and ((multi and r.has_metrics) or r.router_workers is not None)]
            delay = min(dues, default=now + 60.0) - now
            self.wake.clear()
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.05, delay)):
                    await self.wake.wait()

    def close(self) -> None:
        for warmup in self._logprobs_warmups.values():
            warmup.cancel()


async def fetch_metrics(
    url: str, client: httpx.AsyncClient | None = None, timeout: float = 5.0  # noqa: ASYNC109 - httpx's request timeout
) -> list[Sample]:
    """The Prometheus samples of one server's /metrics ([] when it has none)."""
    base = normalize_url(url)
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=timeout))
        response = await client.get(f"{base}/metrics", timeout=timeout)
        if response.status_code >= 400:
            return []
        return parse_prometheus(response.text)


async def prefix_cache_hits(url: str, client: httpx.AsyncClient | None = None) -> float | None:
    """vLLM's prefix-cache hit counter (tokens) on one server; None if the server does not export it."""
    return metric_sum(await fetch_metrics(url, client), "vllm:prefix_cache_hits_total")


async def finished_requests(url: str, client: httpx.AsyncClient | None = None) -> float | None:
    """Requests one vLLM server finished, aborted ones left out."""
    samples = await fetch_metrics(url, client)
    return metric_sum(samples, "vllm:request_success_total", exclude={"finished_reason": "abort"})
