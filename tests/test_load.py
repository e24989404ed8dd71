"""Load and memory: 8 editor sessions over TCP typing at once against one embedded engine, 2,500
completion requests over 100 documents, 4 tokens an answer from a 256-token prompt (bench/load.py
does the typing; this asserts the bounds).

Bounds (measured on a 2-core CPU with the 135M model, see bench/results/load.json):
- every request is answered, none with an error;
- the ember process grows by less than RESIDENT_GROWTH_MIB after the first 10% of requests: its
  caches are bounded (completion cache in bytes, suggestion and typing state in entries, metrics as a
  window of 2,000 requests, which this many requests wraps), so more requests do not mean more
  memory. 32 MiB over 2,250 requests is a leak of 15 KB a request, the same sensitivity as the
  64 MiB over 4,500 requests this test asked before (bench/load.py's default run: 11 MiB growth
  over 5,000 requests);
- ember and its engine processes together (PSS) stay under 4 GiB with a 1 GiB KV cache.
"""

from __future__ import annotations

import pytest

from bench.load import LoadConfig, run_load

RESIDENT_GROWTH_MIB = 32
TOTAL_PSS_MIB = 4096
REQUESTS = 2500


@pytest.mark.slow
async def test_eight_tcp_sessions_2500_requests_nothing_lost_memory_bounded(tmp_path):
    # 4 tokens an answer and a 256-token prompt (64 of them after the cursor): what is asserted (answers,
    # memory) does not depend on their length, since ember's caches hold answers under hashed keys; the
    # engine's work per keystroke (the text after the cursor prefilled again) does.
    config = LoadConfig(sessions=8, documents=100, requests=REQUESTS, max_tokens=4, context_tokens=256, suffix_tokens=64)
    report = await run_load(config, tmp_path / "ember.log")
    summary = report.summary()
    print(summary)  # shown with -s / on failure: p50/p95 latency, memory
    assert report.requests_sent == REQUESTS
    assert not report.errors, report.errors[:5]
    assert summary["lost"] == 0
    # The server saw every request; none was refused by the per-connection rate limit.
    assert sum(summary["server_outcomes"].values()) >= REQUESTS
    assert "rate_limited" not in summary["server_outcomes"], summary["server_outcomes"]
    assert summary["ember_rss_mib"]["growth_after_10pct"] < RESIDENT_GROWTH_MIB, summary["ember_rss_mib"]
    assert summary["total_pss_mib_max"] < TOTAL_PSS_MIB, summary["total_pss_mib_max"]
