"""Weights over the fabric, the coordinator's half: before ranks start, every node that lacks
the model fetches its ranks' shards from a node that has it, over the link the planner measured.

Nodes pull in parallel, each from the source with the fastest measured link to it (RDMA or
Thunderbolt first, as the reducer keeps the fastest path per pair), and first from any peer
whose cache already holds a piece (a node that fetched it for an earlier plan).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from thunderpool.cluster.control.client import AgentClient, AgentError
from thunderpool.cluster.control.state import ClusterState
from thunderpool.cluster.weights.pieces import RankLayout
from thunderpool.cluster.weights.routes import FetchShards, Locate
from thunderpool.engine.job import RankJob
from thunderpool.errors import LaunchError

POLL_S = 0.25
NODE_TIMEOUT_S = 5.0
# A node silent this long is lost; shorter cuts (a cable re-plugged) only pause its fetch,
# which resumes by itself from its last verified chunk.
LOST_S = 60.0


@dataclass(frozen=True, slots=True)
class NodeFetch:
    """One node's fetch as the coordinator last saw it."""

    node: str
    name: str
    snapshot: dict


def rank_layout(job: RankJob, rank: int, world: int) -> RankLayout:
    """What `rank` of `world` reads. Hybrid: `world` is the job's stage group, which reads
    its stage's layers TP-sliced (job.layout.tp_weights: the whole job's, rank by rank)."""
    layout = job.layout
    if layout.parallel == "hybrid":
        from thunderpool.parallel.hybrid import group_weights

        groups = tuple(layout.groups or ())
        weights = group_weights(groups, layout.stage, layout.tp_weights)
        return RankLayout(
            rank=rank,
            world=world,
            parallel="tp",
            tp_weights=tuple(weights) if weights else None,
            layer_split=layout.layer_split,
            stage=layout.stage,
            stages=len(groups),
        )
    return RankLayout(
        rank=rank,
        world=world,
        parallel=layout.parallel,
        tp_weights=layout.tp_weights,
        layer_split=layout.layer_split,
        expert_split=layout.expert_split,
        expert_replicas=layout.expert_replicas,
    )


def source_address(state: ClusterState, source: str, receiver: str) -> str:
    """The source agent's address on its measured link to `receiver` (else its contact)."""
    port = state.contacts[source].rsplit(":", 1)[-1]
    link = state.link(source, receiver)
    if link is None:
        return state.contacts[source]
    return f"{link.a_address if link.a == source else link.b_address}:{port}"


def place_weights(
    client: Callable[[str], AgentClient],
    state: ClusterState,
    order: list[str],
    job: RankJob,
    report: Callable[[list[NodeFetch]], None] | None = None,
) -> dict[int, str]:
    """rank -> local shard directory for the ranks on nodes without the model ({} when every
    node has it). Raises LaunchError when no member has it or a fetch fails."""
    members = sorted(state.nodes)
    model = job.model_dir or None  # "" names the default model, as on the ranks

    identity: dict[str, str] = {}

    def has(node: str, download: bool = False) -> bool:
        try:
            req = Locate(model=model, download=download)
            timeout = 3600.0 if download else 30.0  # a download of the whole model, once
            found = client(node).call("POST", "/v1/weights/locate", req, timeout)
        except AgentError:
            return False
        if found["has"]:
            identity[node] = found.get("identity", "")
        return bool(found["has"])

    with ThreadPoolExecutor(max(len(members), 1)) as pool:
        holders = dict(zip(members, pool.map(has, members), strict=True))
    receivers = sorted({n for n in order if not holders[n]})
    if not receivers:
        return {}
    sources = [n for n in members if holders[n]]
    if not sources and has(order[0], download=True):
        # No member holds it: the leader's node downloads it once, the others fetch from it.
        sources, receivers = [order[0]], [n for n in receivers if n != order[0]]
        if not receivers:
            return {}
    if not sources:
        raise LaunchError(
            f"no node of the cluster has model {job.model_dir or '(default)'}; put it on one "
            "node (a local directory, a .gguf file, or a hub download there)"
        )
    world = len(order)
    cached = _cached_peers(client, [n for n in members if not holders[n]], identity)
    started: dict[str, str] = {}
    for node in receivers:
        ranked = sorted(sources, key=lambda s, n=node: _link_rank(state, s, n))
        peers = sorted(
            (p for p in cached if p != node), key=lambda p, n=node: _link_rank(state, p, n)
        )
        req = FetchShards(
            model=model,
            sources=tuple(source_address(state, s, node) for s in ranked),
            peers=tuple(source_address(state, p, node) for p in peers),
            ranks=tuple(rank_layout(job, r, world) for r, o in enumerate(order) if o == node),
        )
        try:
            started[node] = client(node).call("POST", "/v1/weights/fetch", req)["fetch_id"]
        except AgentError as e:
            raise LaunchError(
                f"cannot start the weight fetch on {_name(state, node)}: {e}"
            ) from None
    return _wait(client, state, started, report)


def _cached_peers(client, nodes: list[str], identity: dict[str, str]) -> list[str]:
    """The nodes whose cache holds a complete shard of this model (same identity as the
    sources report): each serves its pieces to the others (`thunderpool status` lists them)."""
    wanted = set(identity.values())

    def holds(node: str) -> bool:
        try:
            shards = client(node).call("GET", "/v1/weights/cache", timeout=NODE_TIMEOUT_S)["shards"]
        except AgentError:
            return False
        return any(s.get("identity") in wanted for s in shards)

    if not nodes or not wanted:
        return []
    with ThreadPoolExecutor(len(nodes)) as pool:
        return [n for n, ok in zip(nodes, pool.map(holds, nodes), strict=True) if ok]


def _link_rank(state: ClusterState, source: str, receiver: str) -> tuple[float, float]:
    link = state.link(source, receiver)
    return (0.0, -link.bandwidth_Bps) if link is not None else (1.0, 0.0)


def _wait(client, state: ClusterState, started: dict[str, str], report) -> dict[int, str]:
    dirs: dict[int, str] = {}
    pending = dict(started)
    heard = dict.fromkeys(started, time.monotonic())
    while pending:
        seen = []
        for node, fetch_id in list(pending.items()):
            try:
                snap = client(node).call(
                    "GET", f"/v1/weights/fetch/{fetch_id}", timeout=NODE_TIMEOUT_S
                )
                heard[node] = time.monotonic()
            except AgentError as e:
                if time.monotonic() - heard[node] > LOST_S:
                    raise LaunchError(
                        f"lost node {_name(state, node)} while it fetched its weights (no "
                        f"answer for {LOST_S:.0f} s: {e})"
                    ) from None
                continue
            seen.append(NodeFetch(node, _name(state, node), snap))
            if snap["state"] == "failed":
                raise LaunchError(
                    f"node {_name(state, node)} could not fetch its weights: {snap['error']}"
                )
            if snap["state"] == "done":
                dirs.update({int(r): d for r, d in snap["shards"].items()})
                del pending[node]
        if report is not None:
            report(seen)
        if pending:
            time.sleep(POLL_S)
    return dirs


def check_draft(
    client: Callable[[str], AgentClient], state: ClusterState, order: list[str], job: RankJob
) -> None:
    """The draft of speculative decoding runs on the leader (rank 0; sharded over a TP
    group's ranks where every node holds it at the same path): its node must hold
    `job.draft_model` (a hub id it may download once). LaunchError otherwise, before any
    rank starts or any weight moves."""
    if not job.draft_model:
        return
    leader = order[0]
    mtp = job.draft_model == "mtp"  # the model's own MTP layer, read from its whole files
    try:
        req = (
            Locate(model=job.model_dir or None)
            if mtp
            else Locate(model=job.draft_model, download=True)
        )
        has = bool(client(leader).call("POST", "/v1/weights/locate", req, 3600.0)["has"])
    except AgentError:
        has = False
    if not has and mtp:
        raise LaunchError(
            f"--draft-model mtp reads the MTP layer from the model's own files, which the "
            f"leader's node {_name(state, leader)} does not hold (the fabric's shards do not "
            "carry that layer); put the model on that node or run without --draft-model"
        )
    if not has:
        raise LaunchError(
            f"--draft-model {job.draft_model} is not on the leader's node "
            f"{_name(state, leader)}, which runs the draft; put it there (a directory, a .gguf "
            "file, or a hub id that node can download) or run without --draft-model"
        )


def _name(state: ClusterState, node: str) -> str:
    info = state.nodes.get(node)
    return info.name if info else node
