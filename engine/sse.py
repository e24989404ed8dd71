"""The wire format of OpenAI-compatible completion streams: server-sent events, usage, choices.

Servers differ in the details (vLLM, llama.cpp's server, Ollama): these functions accept what
each of them sends and raise :class:`Malformed` for anything that is not such a stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any


class Malformed(Exception):
    """The server sent something that is not an OpenAI completion stream."""


DONE = object()  # the `data: [DONE]` sentinel


@dataclass
class Usage:
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None


def int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def parse_usage(usage: Any) -> Usage | None:
    """Servers differ: vLLM sends prompt_tokens_details.cached_tokens (with
    --enable-prompt-tokens-details), llama.cpp and Ollama may send less or nothing."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=int_or_none(usage.get("prompt_tokens")),
        cached_tokens=int_or_none(cached),
        completion_tokens=int_or_none(usage.get("completion_tokens")),
    )


def prompt_timings(timings: Any) -> Usage | None:
    """llama.cpp's per-event ``timings`` (with ``timings_per_token``): the prompt's tokens taken
    from the cache (``cache_n``) and processed (``prompt_n``)."""
    if not isinstance(timings, dict):
        return None
    cached, processed = int_or_none(timings.get("cache_n")), int_or_none(timings.get("prompt_n"))
    if cached is None or processed is None:
        return None
    return Usage(prompt_tokens=cached + processed, cached_tokens=cached)


def choice_text(choice: dict[str, Any]) -> str:
    """``text`` for completions; ``delta.content`` tolerated for servers that answer chat-style."""
    text = choice.get("text")
    if isinstance(text, str):
        return text
    delta = choice.get("delta")
    if isinstance(delta, dict) and isinstance(delta.get("content"), str):
        return delta["content"]
    return ""


def choice_logprobs(choice: dict[str, Any]) -> tuple[float, ...]:
    """The sampled tokens' log-probabilities of a completions choice: OpenAI's and vLLM's
    ``logprobs.token_logprobs``, or llama.cpp's ``logprobs.content[].logprob`` (a server that sent
    none, or nulls, gives what it has)."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return ()
    values = logprobs.get("token_logprobs")
    if not isinstance(values, list):
        content = logprobs.get("content")
        values = [entry.get("logprob") for entry in content if isinstance(entry, dict)] if isinstance(content, list) else []
    return tuple(float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool))


def _sse_data(line: str) -> str | None:
    """The payload of a ``data:`` line; other SSE fields, comments and keepalives give None."""
    if not line.startswith("data:"):
        return None
    data = line[5:]
    return data[1:] if data.startswith(" ") else data


def decode_event(data: str) -> dict[str, Any] | object:
    if data.strip() == "[DONE]":
        return DONE
    try:
        event = json.loads(data)
    except ValueError as exc:
        raise Malformed(f"invalid JSON in the event stream: {data[:80]!r}") from exc
    if not isinstance(event, dict):
        raise Malformed(f"unexpected event in the stream: {data[:80]!r}")
    return event


async def events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any] | object]:
    """SSE events from lines. A data line that is complete JSON is dispatched at once (some servers
    omit the blank line between events); multi-line data is joined at the blank line."""
    pending: list[str] = []
    async for line in lines:
        if not line:
            if pending:
                yield decode_event("\n".join(pending))
                pending = []
            continue
        data = _sse_data(line)
        if data is None:
            continue
        if not pending:
            try:
                yield decode_event(data)
                continue
            except Malformed:
                pass
        pending.append(data)
    if pending:
        yield decode_event("\n".join(pending))
