"""--replicate-experts: copies of each MoE layer's hottest experts on ranks besides their owners,
planned from measured routing counts (parallel/routing.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from thunderpool.errors import ModelError
from thunderpool.parallel.experts import split_experts
from thunderpool.planner.ep import _holders, route_shares


def plan_replicas(
    routing: dict[int, tuple[float, ...]], counts: list[int], copies: int
) -> tuple[tuple[int, int, int], ...]:
    """(layer, expert, rank): each MoE layer's `copies` hottest experts (measured `routing`
    shares) get one more holder each, the rank with the smallest expected share of that
    layer's routes so far."""
    out = []
    for layer, pop in sorted(routing.items()):
        mine: list[tuple[int, int]] = []
        for e in np.argsort(-np.asarray(pop), kind="stable")[:copies]:
            table, h = _holders(counts, tuple(mine))
            held = set(table[e, : h[e]].tolist())
            load = route_shares(counts, pop, tuple(mine))
            free = [r for r in range(len(counts)) if r not in held]
            if free:
                mine.append((int(e), min(free, key=lambda r: (load[r], r))))
        out += [(layer, e, r) for e, r in mine]
    return tuple(out)


def expert_replicas(
    model_dir: Path,
    world: int,
    copies: int,
    routing_file: str | Path | None = None,
    weights: list[float] | None = None,
    counts: list[int] | None = None,
) -> tuple[tuple[int, int, int], ...]:
    """--replicate-experts N: (layer, expert, rank) copies of each MoE layer's N hottest
    experts, by the counts in `routing_file` (default: the JSON next to the model)."""
    from thunderpool.parallel.experts import routed_experts
    from thunderpool.parallel.routing import ROUTING_FILE, RoutingCounts

    path = Path(routing_file) if routing_file else Path(model_dir) / ROUTING_FILE
    if not path.is_file():
        raise ModelError(
            f"--replicate-experts needs routing counts and {path} does not exist; measure them "
            f"with `thunderpool route-counts --model {model_dir}` or pass --routing FILE"
        )
    routing = RoutingCounts.read(path)
    n = routed_experts(json.loads((Path(model_dir) / "config.json").read_text()))
    if routing.experts != n:
        raise ModelError(
            f"{path} counts {routing.experts} experts but the model has {n}; measure this "
            "model's routing with `thunderpool route-counts`"
        )
    shares = split_experts(n, list(weights or [1.0] * world), counts)
    popularity = {i: routing.popularity(i) for i in routing.layers}
    return plan_replicas(popularity, [s.e1 - s.e0 for s in shares], copies)
