"""What /v1/cluster and the dashboard say about the running instance: each rank's host and
memory, the links between its nodes, and which layers and heads each rank holds.

Built in the serve process from first-hand sources: on a cluster, the coordinator's measured
ClusterState (hosts, node memory, each link's kind, RTT and bandwidth, once per pair); on one
host, loopback and this machine. What a rank holds comes from its own reports: the "loaded"
event (parameters, peak RSS, layers), "memory" events (RSS and peak while it serves) and the
"runtime" event (its BLAS and collective backend).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from thunderpool.cluster.control.state import ClusterState
from thunderpool.engine.loader import Layout, describe_layout

GB = 1e9  # link bandwidth in GB/s, as `thunderpool status` prints it


@dataclass(frozen=True, slots=True)
class RankReport:
    """A rank's memory in its own words."""

    param_bytes: int | None = None
    rss_bytes: int | None = None
    peak_rss_bytes: int | None = None
    method: str | None = None
    # "BLIS", "OpenBLAS", "Accelerate", "reference", or "Metal"/"CUDA" on a GPU (launch/blas.py)
    blas: str | None = None
    blas_path: str | None = None
    backend: str | None = None  # "ring", "jaccl", "mpi"; None for a single rank


@dataclass(frozen=True, slots=True)
class Seat:
    """Where a rank runs: a cluster node, or this machine."""

    name: str
    host: str
    node_id: str | None = None
    memory_total_bytes: int | None = None
    mem_bw_Bps: float | None = None


class ClusterView:
    """The cluster fields of /v1/cluster for the current instance, kept up to date from its
    events. `begin` starts over for a new instance; `observe` returns the fields that changed
    (None when an event changes nothing shown)."""

    def __init__(self, config: dict):
        self.config = config
        self.seats: list[Seat] = []
        self.reports: list[RankReport] = []
        self.links: list[dict] = []
        self.layout = Layout("tp")

    def begin(self, instance) -> dict:
        job = getattr(instance, "job", None)
        world = job.world_size if job else 1
        state, order = getattr(instance, "state", None), getattr(instance, "order", None)
        if isinstance(state, ClusterState) and order:
            self.seats, self.links = cluster_seats(state, order), cluster_links(state, order)
        else:
            self.seats, self.links = local_seats(world), local_links(world)
        self.reports = [RankReport()] * world
        if job is not None:
            self.layout = job.layout
        return self.fields()

    def observe(self, rank: int, event: dict) -> dict | None:
        if not 0 <= rank < len(self.reports):
            return None
        old = self.reports[rank]
        match event.get("kind"):
            case "loaded":
                new = replace(
                    old,
                    param_bytes=event["param_bytes"],
                    peak_rss_bytes=event["peak_rss_bytes"],
                    method=event.get("method"),
                )
            case "memory":
                rss, peak = event["rss_bytes"], event["peak_rss_bytes"]
                new = replace(old, rss_bytes=rss, peak_rss_bytes=peak)
            case "runtime":
                new = replace(
                    old,
                    blas=event.get("blas"),
                    blas_path=event.get("blas_path"),
                    backend=event.get("backend"),
                )
            case _:
                return None
        self.reports[rank] = new
        return self.fields() if new != old else None

    def fields(self) -> dict:
        pairs = enumerate(zip(self.seats, self.reports, strict=True))
        nodes = [node_entry(rank, seat, memory) for rank, (seat, memory) in pairs]
        placement = describe_layout(self.config, self.layout, len(self.seats))
        methods = {m.method for m in self.reports if m.method}
        if len(methods) == 1:
            placement["method"] = methods.pop()
        return {"nodes": nodes, "links": self.links, "placement": placement}


def node_entry(rank: int, seat: Seat, memory: RankReport) -> dict:
    # Until the first memory report, the peak at load is the best figure for what is in use.
    rss = memory.rss_bytes if memory.rss_bytes is not None else memory.peak_rss_bytes
    bw = seat.mem_bw_Bps / GB if seat.mem_bw_Bps else None
    return {
        "name": seat.name,
        "rank": rank,
        "host": seat.host,
        "node_id": seat.node_id,
        "memory_total_bytes": seat.memory_total_bytes,
        "memory_used_bytes": rss,
        "rss_bytes": memory.rss_bytes,
        "param_bytes": memory.param_bytes,
        "peak_rss_bytes": memory.peak_rss_bytes,
        "speed": {"mem_bw_gbps": bw},
        "blas": memory.blas,
        "blas_path": memory.blas_path,
        "backend": memory.backend,
    }


def cluster_seats(state: ClusterState, order: list[str]) -> list[Seat]:
    names = display_names(state)
    return [
        Seat(
            name=names[n],
            host=host_of(state, n),
            node_id=n,
            memory_total_bytes=state.nodes[n].memory_total_bytes,
            mem_bw_Bps=state.nodes[n].mem_bw_Bps or None,
        )
        for n in order
    ]


def cluster_links(state: ClusterState, order: list[str]) -> list[dict]:
    """Each measured link between the instance's nodes, once per pair."""
    names, ids = display_names(state), sorted(set(order), key=order.index)
    out = []
    for i, a in enumerate(ids):
        for b in ids[i + 1 :]:
            if (link := state.link(a, b)) is None:
                continue
            out.append(
                {
                    "a": names[link.a],
                    "b": names[link.b],
                    "a_address": link.a_address,
                    "b_address": link.b_address,
                    "rtt_ms": link.rtt_s * 1e3,
                    "bandwidth_gbps": link.bandwidth_Bps / GB,
                    "kind": link.link,
                }
            )
    return out


def display_names(state: ClusterState) -> dict[str, str]:
    """node_id -> its hostname, with the address added where hostnames repeat (agents in
    network namespaces or containers of one machine share a hostname)."""
    seen: dict[str, int] = {}
    for n in state.nodes.values():
        seen[n.name] = seen.get(n.name, 0) + 1
    return {
        k: n.name if seen[n.name] == 1 else f"{n.name}@{host_of(state, k)}"
        for k, n in state.nodes.items()
    }


def host_of(state: ClusterState, node_id: str) -> str:
    return state.contacts.get(node_id, "").rsplit(":", 1)[0]


def local_seats(world: int) -> list[Seat]:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return [Seat(name=f"rank{r}", host="127.0.0.1", memory_total_bytes=total) for r in range(world)]


def local_links(world: int) -> list[dict]:
    """The ring's neighbours over loopback, each pair once; nothing measured them."""
    pairs = sorted({tuple(sorted((r, (r + 1) % world))) for r in range(world) if world > 1})
    unmeasured = {"rtt_ms": None, "bandwidth_gbps": None, "kind": "loopback"}
    return [{"a": f"rank{a}", "b": f"rank{b}", **unmeasured} for a, b in pairs]
