"""Tokens reach the client as they are made (issue 28 item 6): the SSE chunks' arrival times of
one 700-token greedy stream, and the rule on their gaps. Shapes, not times: no gap after the
first decode step may exceed 3x the median gap plus 100 ms."""

from __future__ import annotations

import statistics
import time

import httpx

TOKENS = 700
PROMPT = "Write a very long story about a dragon and a knight, with many chapters."


def chunk_times(url: str) -> list[float]:
    """Arrival times of the content chunks of one greedy streamed chat answer."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                times.append(time.perf_counter())
    return times


def assert_on_time(times: list[float]) -> None:
    assert len(times) > TOKENS // 2, f"only {len(times)} chunks"
    # From the second decode step on: the first one also compiles the step (~0.13 s here),
    # a token made late rather than delivered late.
    gaps = [b - a for a, b in zip(times[1:], times[2:], strict=False)]
    median = statistics.median(gaps)
    # (chunk index, gap): a late step recurs at a place (a buffer's growth), a stall anywhere.
    worst = sorted(((i + 2, round(g, 3)) for i, g in enumerate(gaps)), key=lambda ig: ig[1])[-3:]
    print(f"{len(times)} chunks, median gap {median:.3f} s, worst {worst}")
    assert max(gaps) <= 3 * median + 0.1, f"median gap {median:.3f} s, worst (chunk, gap) {worst}"
