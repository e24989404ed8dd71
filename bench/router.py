"""Behind vllm-router, does ember keep its prompts' cache hits and lose no request when a replica dies?
ember behind the vLLM project's router, in front of real vLLM replicas.

    .venv/bin/python bench/router.py [--configs cache_aware,round_robin,consistent_hash,kv_aware,ember]
                                     [--replicas 2] [--files 4] [--bodies 2] [--requests 48]
                                     [--kill-at 0.5] [--model bundled] [--max-tokens 16]
    .venv/bin/python bench/router.py --serve [--replicas 2] [--policy cache_aware]

Each configuration starts its own replicas (``python -m vllm.entrypoints.openai.api_server`` with
prefix caching, as the README's recipe; on one CPU machine each on its own share of the cores, and
warmed up with unrelated prompts, whose counts are subtracted), so that the cached tokens counted
belong to it alone:
``cache_aware``, ``round_robin``, ``consistent_hash`` and ``kv_aware`` put vllm-router with that
policy in front and give ember the router's one URL; ``ember`` gives ember every replica's URL and
lets its own routing (rendezvous hashing on the prefix key) choose. ``kv_aware`` follows the
replicas' KV-cache events (ZMQ, ``--kv-events-config``) and tokenizes through their render
endpoint (``--enable-scale-out``).

One ember (``--stdio --daemon off``) per configuration replays a developer typing through
``--files`` documents opened side by side: bodies are deleted and typed back with
``bench/replay.py``'s typing model, one body per document in turn, so the router sees the prompts
of several documents interleaved. When ``--kill-at`` of the requests are done, the last replica is
killed (SIGKILL, whatever it is doing); its counters are read just before. The replay starts once
the warm-ups ember sends when the documents open have finished (the user opens the files, then types).

Per configuration: prompt tokens and cached prompt tokens from the replicas' own counters
(``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``), ember's ``ttft_ms`` and
``latency_ms`` (p50/p95), and requests lost: an error (``outcome: error``), an engine ember
could not reach (``loading``) or a deadline passed with nothing to show. A late answer is not
lost; an empty answer the model chose (``empty``, ``hidden``) is counted on its own line.
Writes bench/results/router.json.

``--serve`` runs the README's recipe and waits: replicas, vllm-router, and the ember command to
point an editor at it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bootstrap  # noqa: F401 - python bench/X.py: the checkout on sys.path
import httpx

from bench.harness import RESULTS, Ember, ember_command, fmt, percentile, plain, write_results
from tests.load_driver import free_port
from bench.prompt_stability import read_sources
from bench.replay import SOURCES, Body, Editor, Record, pick_bodies, replayed, type_body
from engine.routing import metric_sum, parse_prometheus

POLICIES = ("cache_aware", "round_robin", "consistent_hash", "power_of_two", "kv_aware")
SERVED_NAME = "ember-model"
LOST = ("error", "loading")


# ------------------------------------------------------------------------------ the processes


def replica_command(model: str, port: int, kv_events_port: int | None = None) -> list[str]:
    """The README's replica: vLLM's OpenAI server with prefix caching and cached-token usage."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--max-model-len", "2048",
        "--block-size", "32", "--enforce-eager",
    ]  # fmt: skip
    if kv_events_port is not None:
        endpoint = f"tcp://127.0.0.1:{kv_events_port}"
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
        cmd += ["--kv-events-config", json.dumps(config), "--enable-scale-out"]
    return cmd


def router_command(policy: str, workers: list[str], port: int, kv_sources: dict[str, int]) -> list[str]:
    """The README's router: health checks every 2 s (vllm-router's default is a minute)."""
    cmd = [
        str(Path(sys.executable).with_name("vllm-router")), "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *workers, "--policy", policy, "--prometheus-port", str(free_port()),
        "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
    ]  # fmt: skip
    if policy == "kv_aware":
        for url, events in kv_sources.items():
            cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{events}"]
        cmd += ["--kv-event-block-size", "32", "--kv-event-model", SERVED_NAME]
    return cmd


@dataclass
class Process:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=20)


def launch(name: str, cmd: list[str], url: str, logs: Path, cores: str | None = None) -> Process:
    env = dict(os.environ)
    cpus = os.cpu_count() or 1
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Replicas on one CPU machine each get their own cores, so that two vLLMs do not bind their
    # OpenMP threads to the same ones.
    env["VLLM_CPU_OMP_THREADS_BIND"] = cores or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{cpus - 1}")
    # Eager replicas on the CPU: no inductor compile of the log-probability rank on the first
    # request (3-4 s on 2 cores: engine/embedded.py:prestart), as ember's embedded engine.
    env.setdefault("TORCH_COMPILE_DISABLE", "1")
    log_path = logs / f"{name}.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Process(name, url, proc, log_path)


async def wait_healthy(process: Process, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process.proc.poll() is not None:
                raise RuntimeError(f"{process.name} exited:\n{process.log_path.read_text(errors='replace')[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{process.url}/health")).status_code == 200:
                    return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{process.name} not healthy after {timeout} s")


async def warm(url: str) -> None:
    """A few prompts of several lengths straight to a fresh replica, so that its first-use costs
    (the CPU kernels' set-up for new shapes) are not charged to the configuration; the text shares
    nothing with the replayed files."""
    async with httpx.AsyncClient(timeout=120.0) as client:
        for words in (30, 150, 300, 500):  # up to about 1,500 tokens
            prompt = " ".join(f"w{(i * 7919) % 1000}" for i in range(words))
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 4, "logprobs": 0}
            (await client.post(f"{url}/v1/completions", json=body)).raise_for_status()


async def counters(url: str) -> dict[str, float]:
    """A replica's own prompt and prefix-cache counters (tokens)."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        samples = parse_prometheus((await client.get(f"{url}/metrics")).text)
    return {
        "prompt_tokens": metric_sum(samples, "vllm:prompt_tokens_total") or 0.0,
        "cached_tokens": metric_sum(samples, "vllm:prefix_cache_hits_total") or 0.0,
        "queried_tokens": metric_sum(samples, "vllm:prefix_cache_queries_total") or 0.0,
    }


def replica_cores(index: int, count: int) -> str:
    """The cores of replica ``index`` of ``count`` on this machine: an equal share of them (one
    each on 2 cores), or all of them shared when there are more replicas than cores."""
    cpus = os.cpu_count() or 1
    if count > cpus:
        return f"0-{cpus - 1}"
    share = cpus // count
    return f"{index * share}-{index * share + share - 1}" if share > 1 else str(index * share)


async def settle(replicas: list[Process], timeout: float = 180.0) -> None:
    """Until no replica runs or queues a request (vllm:num_requests_running / _waiting)."""
    deadline = time.monotonic() + timeout
    await asyncio.sleep(1.0)
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            busy = 0.0
            for replica in replicas:
                samples = parse_prometheus((await client.get(f"{replica.url}/metrics")).text)
                busy += (metric_sum(samples, "vllm:num_requests_running") or 0) + (metric_sum(samples, "vllm:num_requests_waiting") or 0)
            if not busy:
                return
            await asyncio.sleep(0.5)


def since(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in now.items()}


@dataclass
class Stack:
    replicas: list[Process]
    router: Process | None
    kv_sources: dict[str, int] = field(default_factory=dict)

    @property
    def engine_urls(self) -> list[str]:
        return [self.router.url] if self.router else [r.url for r in self.replicas]

    def stop(self) -> None:
        for p in [*([self.router] if self.router else []), *self.replicas]:
            p.kill()


async def start_stack(config: str, args: argparse.Namespace, logs: Path) -> Stack:
    kv = config == "kv_aware"
    replicas, kv_sources = [], {}
    for i in range(args.replicas):
        port = free_port()
        events = free_port() if kv else None
        url = f"http://127.0.0.1:{port}"
        cores = replica_cores(i, args.replicas)
        replicas.append(launch(f"{config}-replica{i}", replica_command(args.model_path, port, events), url, logs, cores))
        if events is not None:
            kv_sources[url] = events
    await asyncio.gather(*(wait_healthy(r) for r in replicas))
    await asyncio.gather(*(warm(r.url) for r in replicas))
    router = None
    if config in POLICIES:
        port = free_port()
        cmd = router_command(config, [r.url for r in replicas], port, kv_sources)
        router = launch(f"{config}-router", cmd, f"http://127.0.0.1:{port}", logs)
        await wait_healthy(router, 60.0)
    return Stack(replicas, router, kv_sources)


# ------------------------------------------------------------------------------ the replay


class DocumentEditor(Editor):
    """replay.py's Editor, reading each request's metrics as ``ember/stats`` ``last_for_uri``: the
    replay asks for one document at a time, so that is exactly this request's (a failed request
    included, which replay.py's count of all requests cannot tell from a superseded one)."""

    async def last_metrics(self) -> dict[str, Any]:
        stats = await self.client.protocol.send_request_async("ember/stats", {"uri": self.uri})
        return plain(stats.last_for_uri) if stats.last_for_uri is not None else {"outcome": "unrecorded"}


@dataclass
class Run:
    config: str
    records: list[Record] = field(default_factory=list)
    killed_at_request: int | None = None
    killed_replica: str | None = None
    counters: dict[str, dict[str, float]] = field(default_factory=dict)  # replica url -> counters, the replay's
    baseline: dict[str, dict[str, float]] = field(default_factory=dict)  # replica url -> counters after the warm-up
    engine_stats: dict[str, Any] = field(default_factory=dict)
    start_s: float = 0.0
    replay_s: float = 0.0


async def start_ember(urls: list[str], args: argparse.Namespace, logs: Path, config: str) -> Ember:
    remote = [flag for url in urls for flag in ("--engine-url", url)]
    command = ember_command(SERVED_NAME, None, (), "--log-file", str(logs / f"{config}-ember.log"), *remote, log_level=None)
    # A late answer is not a lost one: the deadline is far beyond what co-located CPU replicas need.
    options = {"maxTokens": args.max_tokens, "crossFile": False, "timeoutMs": args.timeout_ms}
    ember = Ember(command, options, name="ember-router-bench")
    await ember.start()
    return ember


async def run_config(config: str, files: list[tuple[str, str, list[Body]]], args: argparse.Namespace, logs: Path) -> Run:
    run = Run(config)
    started = time.perf_counter()
    stack = await start_stack(config, args, logs)
    ember = None
    try:
        for replica in stack.replicas:
            run.baseline[replica.url] = await counters(replica.url)
        ember = await start_ember(stack.engine_urls, args, logs, config)
        client = ember.client
        run.start_s = time.perf_counter() - started
        print(f"[{config}] up in {run.start_s:.0f} s: ember -> {', '.join(stack.engine_urls)}", flush=True)
        editors = [DocumentEditor(client, f"file:///bench/router/{path}", text, config, args) for path, text, _ in files]
        for editor in editors:
            editor.open()
        # The user opens the files, then starts typing: the warm-ups ember sends on open (one
        # prefill per document, a minute in all on one core per replica here) settle first.
        await settle(stack.replicas)
        victim = stack.replicas[-1]
        kill_after = round(args.requests * args.kill_at) if args.kill_at > 0 else None
        budget = [args.requests]
        replay_started = time.perf_counter()

        async def killer() -> None:
            while kill_after is not None and sum(len(e.records) for e in editors) < kill_after:
                await asyncio.sleep(0.05)
            run.counters[victim.url] = since(await counters(victim.url), run.baseline[victim.url])
            victim.kill()
            run.killed_at_request = sum(len(e.records) for e in editors)
            run.killed_replica = victim.url
            print(f"[{config}] killed {victim.url} after {run.killed_at_request} requests", flush=True)

        kill_task = asyncio.create_task(killer()) if kill_after is not None else None
        rounds = max(len(bodies) for _, _, bodies in files)
        for i in range(rounds):
            for editor, (_, _, bodies) in zip(editors, files, strict=True):
                if i >= len(bodies) or budget[0] <= 0:
                    continue
                await type_body(editor, bodies[i], args, budget)
        run.replay_s = time.perf_counter() - replay_started
        if kill_task is not None:
            if not kill_task.done():
                kill_task.cancel()
            await asyncio.gather(kill_task, return_exceptions=True)
        for replica in stack.replicas:
            if replica.url not in run.counters:
                run.counters[replica.url] = since(await counters(replica.url), run.baseline[replica.url])
        run.engine_stats = (await ember.stats())["engine"]["stats"]
        run.records = [r for e in editors for r in e.records]
    finally:
        if ember is not None:
            await ember.stop()
        stack.stop()
    return run


# ------------------------------------------------------------------------------ report



def summarize(run: Run) -> dict[str, Any]:
    ms = [r.metrics for r in run.records if r.metrics.get("outcome") != "unrecorded"]
    outcomes: dict[str, int] = {}
    for m in ms:
        outcomes[m.get("outcome", "?")] = outcomes.get(m.get("outcome", "?"), 0) + 1
    lost = [
        r for r in run.records
        if r.metrics.get("outcome") in LOST or (r.metrics.get("outcome") in ("timeout", "unrecorded") and not r.suggestion)
    ]
    after_kill = run.records[run.killed_at_request :] if run.killed_at_request is not None else []
    ttft = [m["ttft_ms"] for m in ms if m.get("ttft_ms") is not None]
    latency = [m["latency_ms"] for m in ms if m.get("latency_ms") is not None]
    # Hits over lookups: vLLM counts an aborted request's lookups and hits but not its prompt in
    # vllm:prompt_tokens_total, and ember aborts superseded requests.
    prompt = sum(c["queried_tokens"] for c in run.counters.values())
    cached = sum(c["cached_tokens"] for c in run.counters.values())
    return {
        "requests": len(run.records),
        "start_s": run.start_s,
        "replay_s": run.replay_s,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else None,
        "per_replica": run.counters,
        "ttft_ms": {"p50": percentile(ttft, 0.5), "p95": percentile(ttft, 0.95), "n": len(ttft)},
        "latency_ms": {"p50": percentile(latency, 0.5), "p95": percentile(latency, 0.95), "n": len(latency)},
        "lost": len(lost),
        "lost_after_kill": sum(1 for r in after_kill if r in lost),
        "requests_after_kill": len(after_kill),
        "empty_by_model": sum(1 for r in run.records if r.metrics.get("outcome") in ("empty", "hidden")),
        "outcomes": outcomes,
        "killed_replica": run.killed_replica,
        "killed_at_request": run.killed_at_request,
        "resumed": run.engine_stats.get("resumed"),
        "retried": run.engine_stats.get("retried"),
    }


def print_table(summaries: dict[str, dict[str, Any]]) -> None:
    rows = [
        ("requests (after the kill)", lambda s: f"{s['requests']} ({s['requests_after_kill']})"),
        ("prompt tokens looked up", lambda s: fmt(s["prompt_tokens"])),
        ("cached prompt tokens", lambda s: fmt(s["cached_tokens"])),
        ("cached share", lambda s: fmt(s["cached_share"], ".3f")),
        ("ttft_ms p50 / p95", lambda s: f"{fmt(s['ttft_ms']['p50'])} / {fmt(s['ttft_ms']['p95'])}"),
        ("latency_ms p50 / p95", lambda s: f"{fmt(s['latency_ms']['p50'])} / {fmt(s['latency_ms']['p95'])}"),
        ("lost (after the kill)", lambda s: f"{s['lost']} ({s['lost_after_kill']})"),
        ("empty by the model", lambda s: str(s["empty_by_model"])),
        ("resumed / retried rounds", lambda s: f"{s['resumed']} / {s['retried']}"),
    ]
    names = list(summaries)
    width = max(len(r[0]) for r in rows) + 2
    print("\n" + "".ljust(width) + "".join(n.rjust(18) for n in names))
    for label, get in rows:
        print(label.ljust(width) + "".join(get(summaries[n]).rjust(18) for n in names))


# ------------------------------------------------------------------------------ main


def replay_args(args: argparse.Namespace) -> argparse.Namespace:
    """bench/replay.py's typing model with its defaults."""
    for name, value in {
        "key_ms": (40.0, 90.0), "debounce_ms": 100.0, "pause_prob": 0.35, "along_prob": 0.7, "type_chars": 220,
    }.items():  # fmt: skip
        setattr(args, name, value)
    return args


async def serve(args: argparse.Namespace, logs: Path) -> int:
    stack = await start_stack(args.policy, args, logs)
    url = stack.engine_urls[0]
    print(f"replicas: {', '.join(r.url for r in stack.replicas)}\nrouter ({args.policy}): {url}")
    print(f"point editors at: ember --stdio --engine-url {url} --model {SERVED_NAME}\n(logs in {logs}; Ctrl-C stops)")
    try:
        while True:
            await asyncio.sleep(3600)
    finally:
        stack.stop()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="cache_aware,round_robin,consistent_hash,kv_aware,ember")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--files", type=int, default=4, help="documents typed in, side by side")
    parser.add_argument("--bodies", type=int, default=2, help="function bodies retyped per document")
    parser.add_argument("--requests", type=int, default=48, help="completion requests per configuration")
    parser.add_argument("--kill-at", type=float, default=0.5, help="kill the last replica after this share of the requests (0: never)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout-ms", type=int, default=60000, help="ember's timeoutMs (default 60000: late is not lost)")
    parser.add_argument("--model", default="bundled", help="a model folder, or bundled (SmolLM2-135M)")
    parser.add_argument("--serve", action="store_true", help="run the README's recipe and wait")
    parser.add_argument("--policy", default="cache_aware", choices=POLICIES, help="with --serve")
    parser.add_argument("--out", default=str(RESULTS / "router.json"))
    args = replay_args(parser.parse_args())
    if args.model == "bundled":
        from engine.models import resolve_bundled

        args.model_path = resolve_bundled().path
    else:
        args.model_path = args.model
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"ember-router-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    if args.serve:
        return await serve(args, logs)

    sources = [s for s in SOURCES if s[1].endswith(".py")][: args.files]
    files = []
    for spec, wanted in sources:
        for path, text in read_sources(spec, (wanted,)):
            files.append((path, text, pick_bodies(path, text, args.bodies, args.seed)))
    runs: dict[str, Run] = {}
    for config in args.configs.split(","):
        runs[config] = await run_config(config, files, args, logs)
        print(f"[{config}] {len(runs[config].records)} requests in {runs[config].replay_s:.0f} s", flush=True)
    summaries = {name: summarize(run) for name, run in runs.items()}
    print_table(summaries)
    out = write_results(Path(args.out), {
        "summary": summaries, "engine_stats": {name: run.engine_stats for name, run in runs.items()},
        **replayed(files, {name: run.records for name, run in runs.items()}),
    }, args)  # fmt: skip
    print(f"\nwrote {out} (logs in {logs})")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
