"""Planner accuracy: predicted against measured decode tok/s for the cluster's best plans."""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table

from thunderpool.cluster.control.coordinator import Coordinator
from thunderpool.cluster.control.instance import ClusterInstance
from thunderpool.cluster.control.state import ClusterState
from thunderpool.engine.job import BenchTask, RankJob
from thunderpool.models.families import warn_untested


def planner_accuracy(
    coord: Coordinator,
    state: ClusterState,
    plans: list,
    model: str,
    task: BenchTask,
    allow: bool = False,
    console: Console | None = None,
) -> list[dict]:
    """Run the best plan of each kind (single, tp, pp) and compare with its prediction."""
    console = console or Console()
    picked = {}
    for p in plans:
        if p.verified or allow:  # an unverified layout only with --allow-untested
            picked.setdefault((p.kind, len(p.nodes)), p)
    for p in picked.values():
        if not p.verified:
            warn_untested(p.unverified, console)
    names = {k: n.name for k, n in state.nodes.items()}
    rows = []
    for (kind, n), plan in sorted(picked.items()):
        job = RankJob(model_dir=model, world_size=n, task=task, layout=plan.layout())
        bench = None
        with console.status(f"{kind} over {n} node(s)"):
            with ClusterInstance(coord, state, list(plan.nodes), job, timeout=600) as inst:
                for ev in inst.events():
                    if ev.event["kind"] == "bench":
                        bench = ev.event
        measured = (
            bench["decode_tps"]["median"]
            if isinstance(bench["decode_tps"], dict)
            else bench["decode_tps"]
        )
        predicted = plan.prediction.decode_tps
        rows.append(
            {
                "kind": kind,
                "nodes": [names[x] for x in plan.nodes],
                "predicted_tps": predicted,
                "measured_tps": measured,
                "error": (predicted - measured) / measured,
                "verified": plan.verified,
                **_step_split(plan.prediction.breakdown, bench.get("breakdown", {})),
            }
        )
    table = Table(
        "plan",
        "nodes",
        "predicted tok/s",
        "measured tok/s",
        "error",
        title="planner accuracy: decode (goal within ±25%)",
    )
    for r in rows:
        table.add_row(
            r["kind"],
            " > ".join(r["nodes"]),
            f"{r['predicted_tps']:.2f}",
            f"{r['measured_tps']:.2f}",
            f"{r['error']:+.0%}",
        )
    console.print(table)
    split = Table(
        "plan",
        "step ms",
        "compute ms",
        "step - compute ms",
        "probed collectives ms",
        title="a decode step, predicted / measured (compute: alone, the slowest rank)",
    )
    for r in rows:
        split.add_row(
            r["kind"],
            *(f"{r[f'predicted_{k}']:.1f} / {r[f'measured_{k}']:.1f}" for k in SPLIT),
            f"{r['measured_collective_ms']:.1f}",
        )
    console.print(split)
    errors = [abs(r["error"]) for r in rows]
    console.print(f"median |error| {statistics.median(errors):.0%}, max {max(errors):.0%}")
    return rows


SPLIT = ("step_ms", "compute_ms", "outside_ms")


def _step_split(predicted, measured: dict) -> dict:
    """Where a step goes, both ways: the planner's compute is its memory, FLOP and per-matmul
    terms; outside it are its collectives. bench's compute is each rank alone (breakdown.py),
    and everything else in its step is outside: its collectives at their probed latency,
    and waiting."""
    compute = predicted.compute_s + predicted.memory_s + predicted.dispatch_s
    step = measured.get("step_ms", 0.0)
    alone = measured.get("compute_ms", step)
    return {
        "predicted_step_ms": (compute + predicted.collective_s) * 1e3,
        "predicted_compute_ms": compute * 1e3,
        "predicted_outside_ms": predicted.collective_s * 1e3,
        "measured_step_ms": step,
        "measured_compute_ms": alone,
        "measured_outside_ms": max(step - alone, 0.0),
        "measured_collective_ms": measured.get("collective_ms", 0.0),
    }
