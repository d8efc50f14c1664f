"""`thunderpool cache ls|rm`: the model shards each node fetched over the fabric; and the
terminal's progress bars while nodes fetch them."""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from thunderpool.cluster.control.client import AgentError
from thunderpool.cluster.control.state import ClusterState
from thunderpool.cluster.weights.fabric import NodeFetch
from thunderpool.cluster.weights.routes import RemoveShards


def add_cache_parser(sub) -> None:
    from thunderpool.cli.connect import add_cluster_args

    p = sub.add_parser(
        "cache", help="the model shards each node received over the fabric: list or remove"
    )
    p.add_argument("action", choices=["ls", "rm"], help="list, or remove (all, or --model/--key)")
    p.add_argument("--model", default="", help="rm: only this model (as `cache ls` names it)")
    p.add_argument("--key", default="", help="rm: only this shard of it")
    p.add_argument("--node", default="", help="only this node (name or id)")
    add_cluster_args(p)


def node_caches(coord, state: ClusterState) -> dict[str, dict | str]:
    """node id -> its /v1/weights/cache answer, or the error that stood in the way."""

    def ask(node: str) -> dict | str:
        try:
            return coord.client(node, state).call("GET", "/v1/weights/cache", timeout=10)
        except AgentError as e:
            return str(e)

    ids = sorted(state.nodes)
    with ThreadPoolExecutor(max(len(ids), 1)) as pool:
        return dict(zip(ids, pool.map(ask, ids), strict=True))


def shards_table(coord, state: ClusterState) -> Table:
    table = Table("node", "model", "shard", "size", "path", title="cached shards")
    for node, answer in node_caches(coord, state).items():
        name = state.nodes[node].name
        if isinstance(answer, str):
            table.add_row(name, f"[red]{answer}[/]", "", "", "")
            continue
        for s in answer["shards"]:
            table.add_row(name, s["model"], s["key"], f"{s['bytes'] / 2**20:,.1f} MiB", s["path"])
        if not answer["shards"]:
            table.add_row(name, "[dim](none)[/]", "", "", "")
    return table


def cache_main(args: argparse.Namespace) -> int:
    from thunderpool.cli.connect import coordinator

    coord = coordinator(args)
    state = coord.discover()
    console = Console()
    if args.action == "ls":
        console.print(shards_table(coord, state))
        return 0
    for node in sorted(state.nodes):
        if args.node and args.node not in (node, state.nodes[node].name):
            continue
        req = RemoveShards(model=args.model, key=args.key)
        removed = coord.client(node, state).call("POST", "/v1/weights/cache/rm", req)["removed"]
        console.print(f"{state.nodes[node].name}: removed {len(removed)} shard(s)")
    return 0


class FetchBars:
    """Rich progress bars, one per node fetching weights (bytes, rate, ETA)."""

    def __init__(self, console: Console):
        self.console = console
        self.progress: Progress | None = None
        self.tasks: dict[str, int] = {}

    def __call__(self, fetches: list[NodeFetch]) -> None:
        if self.progress is None:
            self.progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.progress.start()
        for f in fetches:
            snap = f.snapshot
            if f.node not in self.tasks:
                self.tasks[f.node] = self.progress.add_task(
                    f"weights -> {f.name}", total=max(snap["total_bytes"], 1)
                )
            self.progress.update(
                self.tasks[f.node],
                total=max(snap["total_bytes"], 1),
                completed=snap["done_bytes"] if snap["total_bytes"] else 1,
            )
        if all(f.snapshot["state"] in ("done", "failed") for f in fetches):
            self.progress.stop()
            self.progress, self.tasks = None, {}


def health_listener(gateway):
    """/health while nodes fetch weights: `fetch`, one entry per node (bytes done and total,
    rate, ETA; the dashboard's fetch.js draws a bar for each), the overall fraction, and a
    detail line "fetching weights: NAME DONE/TOTAL MiB at RATE MiB/s, ETA S s; ..."."""

    def show(fetches: list[NodeFetch]) -> None:
        total = sum(f.snapshot["total_bytes"] for f in fetches)
        done = sum(f.snapshot["done_bytes"] for f in fetches)
        parts = []
        for f in fetches:
            s = f.snapshot
            eta = f"{s['eta_s']:.0f} s" if s.get("eta_s") is not None else "-"
            parts.append(
                f"{f.name} {s['done_bytes'] / 2**20:.1f}/{s['total_bytes'] / 2**20:.1f} MiB "
                f"at {s['rate_Bps'] / 2**20:.1f} MiB/s, ETA {eta}"
            )
        phase = gateway.state if gateway.state in ("loading", "recovering") else "loading"
        nodes = tuple(
            {
                "node": f.name,
                "bytes_done": f.snapshot["done_bytes"],
                "bytes_total": f.snapshot["total_bytes"],
                "rate_Bps": f.snapshot["rate_Bps"],
                "eta_s": f.snapshot.get("eta_s"),
            }
            for f in fetches
        )
        fraction = done / total if total else 1.0
        gateway.loading(fraction, "fetching weights: " + "; ".join(parts), phase, nodes)

    return show
