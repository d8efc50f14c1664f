"""The dashboard's server-side history: a ring buffer of points sampled every few seconds, so a
page opened later shows the past and not only what happened since it opened.

Each point holds the engine's gauges at that time and, from the latency histograms' growth
since the previous point, the TTFT and latency of the requests seen in between.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping

from thunderpool.api.metrics import Histogram, quantile
from thunderpool.api.observe import Latencies

log = logging.getLogger("thunderpool.api")
EVERY_S = 2.0
POINTS = 1800  # an hour at EVERY_S

# Engine gauges and counters a point carries, under the point's own short names.
GAUGES = {
    "tok_s": "decode_tokens_per_second",
    "active": "active_requests",
    "queue": "queue_depth",
    "requests": "requests_total",
    "tokens": "tokens_generated_total",
}


def _window(h: Histogram, before: list[int], sum_before: float) -> tuple[list[int], float]:
    """The observations since `before` (a histogram's counts then)."""
    return [a - b for a, b in zip(h.counts, before, strict=True)], h.sum - sum_before


class History:
    """Points `{"t": unix seconds, "tok_s", "active", "queue", "requests", "tokens",
    "ttft_s", "ttft_p95_s", "latency_s", "latency_p95_s", "itl_s", "queue_s"}`, oldest first;
    a latency field is None when no request reported one in its interval."""

    def __init__(
        self,
        metrics: Callable[[], Mapping[str, float]],
        latencies: Latencies,
        size: int = POINTS,
        clock: Callable[[], float] = time.time,
    ):
        self.metrics, self.latencies, self.clock = metrics, latencies, clock
        self.points: deque[dict] = deque(maxlen=size)
        self._seen = {id(h): (list(h.counts), h.sum) for h in latencies.all()}

    def sample(self) -> dict:
        values = self.metrics()
        point: dict = {"t": self.clock()}
        for key, name in GAUGES.items():
            v = values.get(name)
            point[key] = float(v) if v is not None else None
        lat = self.latencies
        for key, h in (("ttft", lat.ttft), ("latency", lat.e2e), ("itl", lat.itl)):
            counts, total = _window(h, *self._seen[id(h)])
            n = sum(counts)
            point[f"{key}_s"] = total / n if n else None
            if key != "itl":
                point[f"{key}_p95_s"] = quantile(h.bounds, counts, 0.95)
        counts, total = _window(lat.queue, *self._seen[id(lat.queue)])
        point["queue_s"] = total / sum(counts) if sum(counts) else None
        self._seen = {id(h): (list(h.counts), h.sum) for h in lat.all()}
        self.points.append(point)
        return point

    def since(self, t: float | None = None) -> list[dict]:
        return [p for p in self.points if t is None or p["t"] > t]

    async def run(self, every_s: float = EVERY_S) -> None:
        """Samples until cancelled; a failing engine read skips one point, never the loop."""
        while True:
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - the next point may succeed
                log.debug("history: no point this time", exc_info=True)
            await asyncio.sleep(every_s)
