"""Tokens reach the client as they are made (issue 28 item 6): the SSE chunks' arrival times of
one 200-token greedy stream, and the rule on their gaps. Shapes, not times: no gap may exceed 3x
the median gap plus 100 ms, unless the leader made a token that late itself (a slow step: the
host took a core, a new buffer size retraced). What the rule catches is text made on time and
delivered late: a stall in delivery while the leader's own gaps stayed short."""

from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import dataclass

import httpx

from thunderpool.api.metrics import PREFIX

# 200 tokens (700 once): the delays the rule has caught were steady (MPI ranks starving the
# gateway), on the first steps (CPU kernels compiled) or recurring within a second (the agent
# polls, serve's garbage collections), so a few seconds of stream meet each of them.
TOKENS = 200
PROMPT = "Write a very long story about a dragon and a knight, with many chapters."
LEADER_LATE_S = 0.1  # a leader's gap over this excuses one late chunk (ITL histogram bound)
_BUCKET = re.compile(rf'^{PREFIX}inter_token_latency_seconds_bucket{{le="([^"]+)"}} (\d+)$', re.M)


@dataclass(frozen=True)
class Stream:
    times: list[float]  # each text chunk's arrival, on this clock
    late: list[float]  # for each token the leader made over LEADER_LATE_S after the previous:
    # the upper bound of its histogram bucket (inf for the last bucket)


def _itl_buckets(url: str) -> list[tuple[float, int]]:
    """The leader-measured inter-token histogram on /metrics: (upper bound, cumulative count)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    buckets = [(float(le.replace("+Inf", "inf")), int(n)) for le, n in _BUCKET.findall(text)]
    assert buckets, f"no inter-token histogram on {url}/metrics"
    return buckets


def _late(before: list[tuple[float, int]], after: list[tuple[float, int]]) -> list[float]:
    counts = dict(before)
    late, below = [], 0
    for bound, cumulative in after:
        new = cumulative - counts.get(bound, 0)
        if bound > LEADER_LATE_S:
            late += [bound] * (new - below)
        below = new
    return late


def _text(chunk: dict) -> str:
    return "".join(c.get("delta", {}).get("content") or "" for c in chunk.get("choices", []))


def chunk_times(url: str) -> Stream:
    """Arrival times of the text chunks of one greedy streamed chat answer, and the leader's
    own late tokens during it."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    before = _itl_buckets(url)
    times = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            # Text only: the first chunk, which names the role, leaves before the prefill.
            if line.startswith("data: {") and _text(json.loads(line[6:])):
                times.append(time.perf_counter())
    return Stream(times, _late(before, _itl_buckets(url)))


def assert_on_time(stream: Stream) -> None:
    times = stream.times
    assert len(times) > TOKENS // 2, f"only {len(times)} chunks"
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    median = statistics.median(gaps)
    limit = 3 * median + 0.1
    # (chunk index, gap): a late step recurs at a place (a buffer's growth), a stall anywhere.
    over = sorted(
        ((i + 1, round(g, 3)) for i, g in enumerate(gaps) if g > limit), key=lambda x: -x[1]
    )
    excuses = sorted(stream.late, reverse=True)
    print(f"{len(times)} chunks, median gap {median:.3f} s, over {limit:.3f} s: {over}")
    print(f"tokens the leader made over {LEADER_LATE_S} s late (bucket bounds): {excuses}")
    # The largest late chunks pair with the leader's largest late tokens; each must fit.
    unexplained = [
        (i, g) for k, (i, g) in enumerate(over) if k >= len(excuses) or g > excuses[k] + 0.1
    ]
    assert not unexplained, (
        f"median gap {median:.3f} s; delivered late, though made on time: {unexplained}"
    )
