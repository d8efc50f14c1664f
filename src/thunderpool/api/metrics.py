"""Prometheus text exposition: the engine's counters and gauges plus the API's HTTP counts.

Written by hand (the format is a few lines of text) so the API needs no metrics library.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "thunderpool_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (type, help) for the engine's keys; unknown keys are exported as untyped gauges.
ENGINE_METRICS: dict[str, tuple[str, str]] = {
    "requests_total": ("counter", "Requests the engine has accepted."),
    "tokens_generated_total": ("counter", "Completion tokens generated."),
    "prompt_tokens_total": ("counter", "Prompt tokens prefilled."),
    "ttft_seconds": ("gauge", "Time to first token of the most recent request."),
    "decode_tokens_per_second": ("gauge", "Recent aggregate decode throughput."),
    "queue_depth": ("gauge", "Requests waiting to join the running batch."),
    "active_requests": ("gauge", "Requests in the running batch."),
    "prefix_cache_hit_tokens_total": ("counter", "Prompt tokens reused from the prefix cache."),
}
_RANK_MEMORY = re.compile(r"rank(\d+)_memory_bytes")
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _value(v: float) -> str:
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def _escape(label: str) -> str:
    return label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(name: str, kind: str, help: str, samples: Iterable[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP {PREFIX}{name} {help}", f"# TYPE {PREFIX}{name} {kind}"]
    return lines + [f"{PREFIX}{name}{labels} {_value(v)}" for labels, v in samples]


def render(engine: Mapping[str, float], http: Mapping[tuple[str, int], int]) -> str:
    """The /metrics body: engine metrics, per-rank memory, then HTTP responses by status."""
    lines: list[str] = []
    ranks: list[tuple[int, float]] = []
    for key, v in engine.items():
        if m := _RANK_MEMORY.fullmatch(key):
            ranks.append((int(m.group(1)), v))
        elif key in ENGINE_METRICS:
            kind, help = ENGINE_METRICS[key]
            lines += _family(key, kind, help, [("", v)])
        elif _NAME.fullmatch(key):
            lines += _family(key, "gauge", "Reported by the engine.", [("", v)])
    if ranks:
        samples = [(f'{{rank="{r}"}}', v) for r, v in sorted(ranks)]
        lines += _family("rank_memory_bytes", "gauge", "Memory in use on each rank.", samples)
    samples = [
        (f'{{path="{_escape(path)}",status="{status}"}}', n)
        for (path, status), n in sorted(http.items())
    ]
    lines += _family(
        "http_responses_total", "counter", "HTTP responses by path and status.", samples
    )
    return "\n".join(lines) + "\n"


class HTTPCounter:
    """ASGI middleware counting responses by route path and status code.

    Paths outside `known` count as "other", so scanners cannot grow the label set.
    """

    def __init__(self, app: ASGIApp, known: frozenset[str], counts: Counter):
        self.app, self.known, self.counts = app, known, counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in self.known else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counts[(path, message["status"])] += 1
            await send(message)

        await self.app(scope, receive, counting_send)
