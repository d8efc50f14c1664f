"""Prometheus text exposition: the engine's counters and gauges, the API's latency histograms
and its HTTP counts.

Written by hand (the format is a few lines of text) so the API needs no metrics library.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

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
    # Speculative decoding (--draft-model): engine/speculate.py.
    "spec_verify_steps_total": ("counter", "Speculative verify steps run."),
    "spec_draft_tokens_total": ("counter", "Draft tokens proposed for verification."),
    "spec_accepted_tokens_total": ("counter", "Draft tokens the model accepted."),
    "spec_acceptance_rate": ("gauge", "Accepted / proposed draft tokens since start."),
    "spec_tokens_per_step": ("gauge", "Tokens emitted per speculative verify step."),
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
    # `labels` is a label set, or for a histogram the series suffix and its labels.
    lines = [f"# HELP {PREFIX}{name} {help}", f"# TYPE {PREFIX}{name} {kind}"]
    return lines + [f"{PREFIX}{name}{labels} {_value(v)}" for labels, v in samples]


@dataclass(slots=True)
class Histogram:
    """A Prometheus histogram: `counts[i]` observations fell in (bounds[i-1], bounds[i]]; the
    last count is the +Inf bucket's own."""

    name: str
    help: str
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        assert list(self.bounds) == sorted(set(self.bounds)), "bounds must increase"
        self.counts = [0] * (len(self.bounds) + 1)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += value

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for n in self.counts:
            total += n
            out.append(total)
        return out

    def lines(self) -> list[str]:
        les = [*(_value(b) for b in self.bounds), "+Inf"]
        cumulative = zip(les, self.cumulative(), strict=True)
        samples = [(f'_bucket{{le="{le}"}}', n) for le, n in cumulative]
        samples += [("_sum", self.sum), ("_count", self.count)]
        return _family(self.name, "histogram", self.help, samples)


def quantile(bounds: Sequence[float], counts: Sequence[int], q: float) -> float | None:
    """Like PromQL's histogram_quantile: linear within the bucket that holds the q-th
    observation; the +Inf bucket answers its lower bound. None without observations."""
    total = sum(counts)
    if total == 0:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i == len(bounds):
                return float(bounds[-1])
            low = bounds[i - 1] if i else 0.0
            return low + (bounds[i] - low) * (rank - seen) / n
        seen += n
    return float(bounds[-1])


def render(
    engine: Mapping[str, float],
    http: Mapping[tuple[str, int], int],
    histograms: Iterable[Histogram] = (),
) -> str:
    """The /metrics body: engine metrics, per-rank memory, the API's latency histograms, then
    HTTP responses by status."""
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
    for h in histograms:
        lines += h.lines()
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
