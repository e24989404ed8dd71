"""Which replica serves a request: rendezvous hashing on the prefix key, bent by load and health.

Pure functions and plain state, no I/O, so the policy is testable without servers. The HTTP side
(``engine.remote``, ``engine.attempt``, ``engine.replicas``) updates :class:`Replica` from requests,
probes and ``/metrics`` polls; :class:`RemoteConfig` is how it reaches them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit


@dataclass
class Replica:
    """One OpenAI-compatible server and what we last learned about it."""

    url: str  # base URL: scheme://host:port[/path], without a trailing /v1
    name: str  # url without credentials: the only form that goes into logs and errors
    up: bool = True
    failures: int = 0  # consecutive failures; reset by a successful request
    next_probe: float = 0.0  # loop time at which a down replica is probed again
    last_error: str | None = None
    inflight: int = 0  # requests this process is streaming from it now
    waiting: float | None = None  # vllm:num_requests_waiting (None: unknown)
    running: float | None = None  # vllm:num_requests_running
    kv_usage: float | None = None  # vllm:kv_cache_usage_perc, 0..1
    has_metrics: bool = True  # False once /metrics answered 404: stop asking
    silent_polls: int = 0  # /metrics polls in a row that got no answer
    metrics_due: float = 0.0
    # A router in front of workers of its own (vllm-router, SGLang's gateway: their /workers
    # lists them): (healthy, total) workers; None for a plain server.
    router_workers: tuple[int, int] | None = None
    # False for a vLLM server that has not yet answered a request with log-probabilities: its
    # first such request compiles a kernel (14 s on 2 cores with a cold compile cache), so it is
    # asked for none until ember's own one-token request has paid for that (RemoteEngine).
    logprobs_ready: bool = True


def normalize_url(url: str) -> str:
    """Accept ``host:port``, ``http://host:port`` or an OpenAI-style ``.../v1`` base URL."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def redact_url(url: str) -> str:
    """Drop ``user:password@`` so a URL can be logged."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def session_id(routing_key: str) -> str:
    """The ``X-Session-ID`` header for a routing key: routers with session affinity
    (vllm-router's ``consistent_hash``) keep a document's prefix on one worker with it; a digest,
    so that file paths do not reach the router's logs."""
    return hashlib.blake2b(routing_key.encode(), digest_size=12).hexdigest()


def router_workers(answer: object) -> tuple[int, int] | None:
    """(healthy, total) from a router's ``/workers`` answer; None when it is not one."""
    if not isinstance(answer, dict) or not isinstance(answer.get("workers"), list):
        return None
    workers = [w for w in answer["workers"] if isinstance(w, dict)]
    return sum(1 for w in workers if w.get("is_healthy", True)), len(workers)


def hrw_score(key: str, replica_id: str) -> int:
    """Rendezvous weight: every ember process computes the same order for the same key and URLs, so
    documents stay on their replica across editor sessions and restarts."""
    digest = hashlib.blake2b(f"{replica_id}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(key: str, replicas: Sequence[Replica]) -> list[Replica]:
    """Replicas by preference for ``key``; removing one replica only moves the keys it owned."""
    return sorted(replicas, key=lambda r: hrw_score(key, r.url), reverse=True)


@dataclass(frozen=True)
class LoadPolicy:
    """When a replica counts as too busy to get new work while others are not."""

    max_waiting: float = 4.0  # queued requests (vllm:num_requests_waiting)
    max_kv_usage: float = 0.95  # fraction of KV blocks in use: beyond it, cached prefixes get evicted


@dataclass(frozen=True)
class RemoteConfig:
    """How the remote engine reaches its replicas (``engine.remote.RemoteEngine``).

    ``connect_timeout``: TCP/TLS connect. ``first_token_timeout``: request sent -> first text
    (queueing and prefill included); past it the replica counts as failed and the next one is
    tried (a request without ``failover``, a warm-up, waits on its replica that long once per
    replica instead). ``read_timeout``: the longest gap between two events once text flows.
    ``probe_*``: backoff of the background probe that brings a down replica back.
    ``metrics_interval``: how often live replicas' /metrics are read (only with several replicas);
    ``silent_polls_down`` polls in a row without an answer take a replica out. ``verify``: TLS
    verification: True (system CAs), False, or a CA bundle's path. ``max_resumes``: how often a
    stream that broke mid-way is resumed elsewhere. ``retry_backoff``: pauses before repeating a
    round in which every replica answered 5xx. ``uds``: reach the server over this Unix socket (the
    URL then names no host that is dialled). ``keepalive_expiry``: how long an idle pooled
    connection is kept: under the 5 s after which vLLM (uvicorn) closes one, as httpx's default of
    the same 5 s was not; a request sent on a connection the server is closing fails (``Server
    disconnected``) and takes the replica out for a second. 0 keeps none.
    ``tokenizer_path``: a folder whose tokenizer counts tokens (else the model's, when the server
    names a local folder)."""

    urls: tuple[str, ...]
    model: str | None = None
    api_key_env: str = "EMBER_API_KEY"
    connect_timeout: float = 3.0
    first_token_timeout: float = 5.0
    read_timeout: float = 10.0
    probe_timeout: float = 3.0
    probe_initial: float = 1.0
    probe_max: float = 30.0
    metrics_interval: float = 2.0
    silent_polls_down: int = 2
    load_policy: LoadPolicy = LoadPolicy()
    tokenizer_path: str | None = None
    default_max_model_len: int = 2048
    max_connections: int = 64
    keepalive_expiry: float = 4.0
    verify: bool | str = True
    max_resumes: int = 2
    retry_backoff: tuple[float, ...] = (0.25, 0.5, 1.0)
    uds: str | None = None


def overloaded(replica: Replica, policy: LoadPolicy) -> bool:
    if replica.waiting is not None and replica.waiting >= policy.max_waiting:
        return True
    return replica.kv_usage is not None and replica.kv_usage >= policy.max_kv_usage


def load(replica: Replica) -> float:
    """Queued and running work; the local in-flight count stands in when /metrics is missing."""
    remote = (replica.waiting or 0.0) * 2 + (replica.running or 0.0)
    return max(remote, float(replica.inflight))


def order(
    replicas: Sequence[Replica],
    routing_key: str | None,
    tiebreak: str,
    policy: LoadPolicy = LoadPolicy(),
) -> list[Replica]:
    """The replicas a request tries, in turn.

    Healthy replicas first: with a key, in rendezvous order (the KV blocks of that prefix live on
    the first) except that overloaded ones move behind the others, since a queue costs more than a
    re-prefill; without a key, the least loaded first. Down replicas come last, in the same order,
    as a last resort when everything looks down (the probe may simply not have run yet).
    """
    ranked = rank(routing_key, replicas) if routing_key is not None else sorted(rank(tiebreak, replicas), key=load)
    up = [r for r in ranked if r.up]
    down = [r for r in ranked if not r.up]
    calm = [r for r in up if not overloaded(r, policy)]
    busy = [r for r in up if overloaded(r, policy)]
    return calm + busy + down


def probe_delay(failures: int, initial: float, maximum: float) -> float:
    """Exponential backoff between probes of a down replica."""
    return min(maximum, initial * 2 ** max(0, failures - 1))


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    value: float = math.nan


def _parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    i = 0
    while i < len(text):
        eq = text.find("=", i)
        if eq < 0:
            break
        name = text[i:eq].strip().lstrip(",").strip()
        if eq + 1 >= len(text) or text[eq + 1] != '"':
            break
        j = eq + 2
        value = []
        while j < len(text) and text[j] != '"':
            if text[j] == "\\" and j + 1 < len(text):
                j += 1
                value.append({"n": "\n"}.get(text[j], text[j]))
            else:
                value.append(text[j])
            j += 1
        labels[name] = "".join(value)
        i = j + 1
    return labels


def _label_end(line: str, start: int) -> int:
    """Index of the ``}`` closing the label set opened at ``start`` (quotes may hold braces)."""
    quoted = False
    i = start + 1
    while i < len(line):
        c = line[i]
        if quoted and c == "\\":
            i += 2
            continue
        if c == '"':
            quoted = not quoted
        elif c == "}" and not quoted:
            return i
        i += 1
    return -1


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of the Prometheus text format; malformed lines are skipped, not fatal."""
    samples: list[Sample] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        labels: dict[str, str] = {}
        if brace >= 0 and (space < 0 or brace < space):
            end = _label_end(line, brace)
            if end < 0:
                continue
            name = line[:brace]
            labels = _parse_labels(line[brace + 1 : end])
            rest = line[end + 1 :].split()
        else:
            name, *rest = line.split()
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        samples.append(Sample(name, labels, value))
    return samples


def metric_sum(samples: Iterable[Sample], name: str, exclude: dict[str, str] | None = None) -> float | None:
    """Sum of a metric over its label sets (``None`` if the server does not export it);
    ``exclude`` drops samples whose label has the given value (e.g. finished_reason=abort)."""
    total: float | None = None
    for s in samples:
        if s.name != name or math.isnan(s.value):
            continue
        if exclude and any(s.labels.get(k) == v for k, v in exclude.items()):
            continue
        total = (total or 0.0) + s.value
    return total
