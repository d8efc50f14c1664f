"""The API's view of the models a server knows: their names, and per request the engine of the
one its `model` field names (a registry may load it first). Every engine handed out counts
its generations into the shared latencies (observe.RecordingEngine).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from thunderpool.api.errors import RETRY_AFTER_S
from thunderpool.api.observe import Latencies, RecordingEngine
from thunderpool.engine.service import EngineClient, ModelEntry, ModelRegistry

# Engine figures that add up over instances (the History chart's and /metrics' totals).
SUMMED = (
    "requests_total",
    "tokens_generated_total",
    "prompt_tokens_total",
    "prefix_cache_hit_tokens_total",
    "decode_tokens_per_second",
    "queue_depth",
    "active_requests",
    "gateway_requests_waiting",
)


class One:
    """A ModelRegistry of one engine that is always there (in-process engines, tests):
    nothing to load, so a keep_alive changes nothing."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def names(self) -> list[str]:
        return [self.engine.info.model]

    def client(self, name: str) -> EngineClient:
        return self.engine

    async def acquire(self, name: str, keep_alive: float | None = None) -> EngineClient:
        return self.engine

    def keep(self, name: str, keep_alive: float) -> None:
        pass

    def entries(self) -> list[ModelEntry]:
        s = self.engine.status()
        info = self.engine.info
        return [ModelEntry(info.model, s.state, s.progress, s.detail, cluster=info.cluster)]


class Served:
    """What the routes use: a registry's models behind RecordingEngines."""

    def __init__(self, registry: ModelRegistry, latencies: Latencies, log_prompts: bool):
        self.registry, self.latencies, self.log_prompts = registry, latencies, log_prompts

    def names(self) -> list[str]:
        return self.registry.names()

    def _recorded(self, engine: EngineClient) -> EngineClient:
        return RecordingEngine(engine, self.latencies, self.log_prompts)  # type: ignore[return-value]

    @property
    def default(self) -> EngineClient:
        return self.client(self.names()[0])

    def client(self, name: str) -> EngineClient:
        """The engine of `name` (a known name) without loading it: for info and tokenizer."""
        return self._recorded(self.registry.client(name))

    async def acquire(self, name: str, keep_alive: float | None = None) -> EngineClient:
        return self._recorded(await self.registry.acquire(name, keep_alive))

    def keep(self, name: str, keep_alive: float) -> None:
        self.registry.keep(name, keep_alive)

    def entries(self) -> list[ModelEntry]:
        return self.registry.entries()

    def metrics(self) -> dict[str, float]:
        """One model: its engine's figures. Several: the totals over the loaded ones (each
        instance's per-rank memory is in /v1/cluster and /api/ps, not here)."""
        names = self.names()
        if len(names) == 1:
            return self.registry.client(names[0]).metrics()
        total = dict.fromkeys(SUMMED, 0.0)
        for e in self.entries():
            if e.state == "unloaded":
                continue
            values = self.registry.client(e.name).metrics()
            for key in SUMMED:
                total[key] += float(values.get(key) or 0.0)
        return total


def instance(entry: ModelEntry, metrics: Mapping[str, float]) -> dict[str, Any]:
    """One model's line in /v1/cluster's `instances` and the dashboard's instance table."""
    c = entry.cluster
    return {
        "model": entry.name,
        "state": entry.state,
        "progress": round(entry.progress, 4),
        "detail": entry.detail,
        "in_flight": entry.in_flight,
        "expires_at": entry.expires_at,
        "memory_bytes": entry.memory_bytes,
        "placement": c.get("placement"),
        "nodes": [n.get("name") for n in c.get("nodes") or []],
        "instance": c.get("instance"),
        "decode_tokens_per_second": metrics.get("decode_tokens_per_second"),
        "queue_depth": metrics.get("queue_depth"),
        "active_requests": metrics.get("active_requests"),
    }


def health(served: Served) -> tuple[dict[str, Any], int]:
    """/health: one model as ever (200 when ready, else 503 with its progress); several:
    200 while at least one serves, each model's state listed."""
    entries = served.entries()
    ready = [e for e in entries if e.state == "ready"]
    body: dict[str, Any] = {"status": "ok"}
    if not ready:
        s = served.default.status()
        body = {"status": s.state, "progress": round(s.progress, 4), "detail": s.detail}
        if s.fetch:  # weights moving over the fabric: each node's bytes, rate and ETA
            body["fetch"] = list(s.fetch)
    if len(entries) > 1:
        body["models"] = [
            {"model": e.name, "state": e.state, "progress": round(e.progress, 4),
             "detail": e.detail}
            for e in entries
        ]  # fmt: skip
    return body, 200 if ready else 503


RETRY_HEADERS = {"Retry-After": str(RETRY_AFTER_S)}
