"""The coordinator: learns the cluster from an agent, measures links, plans, launches.

It runs wherever the user runs `thunderpool status | plan | generate --cluster | serve
--cluster` and owns the ClusterState for that command. Any node can coordinate: the state
lives in the agents' membership plus fresh probes, so another node takes over by running the
same command there (`--join` any agent of the cluster).
"""

from __future__ import annotations

import math
import random
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from thunderpool.cluster.control.client import AgentClient, AgentError
from thunderpool.cluster.control.messages import (
    Hello,
    Left,
    LinkMeasured,
    ProbeRequest,
)
from thunderpool.cluster.control.state import ClusterState, apply
from thunderpool.cluster.node.thunderbolt import RdmaPlan, rdma_plan
from thunderpool.errors import ThunderpoolError
from thunderpool.planner.hardware import LinkSpec, NodeSpec, pins_cores
from thunderpool.planner.presets import (
    live_collective_overhead_s,
    live_op_latency_s,
    live_row_op_latency_s,
    live_row_read_fraction,
)

RING_PORT_BASE = 29500
RING_PORT_LAST = 32760  # below Linux's ephemeral ports (32768+)
# An agent that does not answer within this is lost: the loss is seen within ~2.5 s.
NODE_TIMEOUT_S = 2.0
# How long a loss waits for the other nodes to report a rank killed by a signal (the cause).
CAUSE_GRACE_S = 1.0


class Coordinator:
    def __init__(self, seeds: list[str], token: str):
        if not seeds:
            raise ThunderpoolError("no node to ask: pass --join HOST:PORT of any cluster node")
        self.seeds, self.token = seeds, token

    def client(self, node_id: str, state: ClusterState) -> AgentClient:
        return AgentClient(state.contacts[node_id], self.token)

    def discover(self) -> ClusterState:
        """The membership every reachable seed knows of, merged."""

        def ask(seed: str) -> ClusterState | str:
            try:
                reply = AgentClient(seed, self.token).call(
                    "GET", "/v1/state", timeout=NODE_TIMEOUT_S
                )
                return ClusterState.model_validate(reply)
            except AgentError as e:
                return str(e)

        with ThreadPoolExecutor(len(self.seeds)) as pool:
            answers = list(pool.map(ask, self.seeds))
        state = ClusterState()
        errors = [a for a in answers if isinstance(a, str)]
        for known in answers:
            if isinstance(known, str):
                continue
            for node_id, node in known.nodes.items():
                state = apply(state, Hello(node=node, contact=known.contacts.get(node_id, "")))
        if not state.nodes:
            raise AgentError("; ".join(errors) or "no nodes found")
        # Remember every member, so a later discovery survives the loss of the first seed.
        self.seeds = list(dict.fromkeys([*self.seeds, *state.contacts.values()]))
        return state

    def alive(self, state: ClusterState) -> tuple[ClusterState, list[str]]:
        """The state without the nodes whose agents do not answer now, and their ids."""

        def answers(node_id: str) -> bool:
            try:
                self.client(node_id, state).call("GET", "/v1/state", timeout=NODE_TIMEOUT_S)
                return True
            except AgentError:
                return False

        ids = list(state.nodes)
        with ThreadPoolExecutor(max(len(ids), 1)) as pool:
            up = dict(zip(ids, pool.map(answers, ids), strict=True))
        dead = [n for n in ids if not up[n]]
        for node_id in dead:
            state = apply(state, Left(node_id=node_id))
        return state, dead

    def probe(self, state: ClusterState) -> ClusterState:
        """Measure every pair of nodes, from the first to each address of the second."""
        for a, b in state.unprobed_pairs():
            target = state.nodes[b]
            addresses = [state.contacts[b].rsplit(":", 1)[0]]
            addresses += [i.address for i in target.interfaces if i.address not in addresses]
            for address in addresses:
                req = ProbeRequest(peer=b, address=address, port=target.port + 1)
                try:
                    link = LinkMeasured.model_validate(
                        self.client(a, state).call("POST", "/v1/probe", req, timeout=60)
                    )
                except AgentError:
                    continue  # that address is not reachable from a
                state = apply(state, link)
        return state


def node_specs(state: ClusterState) -> tuple[list[NodeSpec], list[LinkSpec]]:
    """The planner's view: nodes by id, links with one-way latency (half the measured RTT).

    Measured bandwidths and latencies miss two fixed costs a decode step pays: per weight
    matmul (as the agent measured it on MLX's CPU backend, else calibrated by chip) and per
    collective (calibrated by link kind). Agents that share a machine measured the same bus:
    each gets the lowest of their host bandwidths (a run whose processes did not overlap
    fully reads high, never low)."""
    host_bw: dict[str, float] = {}
    for n in state.nodes.values():
        if n.host_id and n.host_mem_bw_Bps > 0:
            host_bw[n.host_id] = min(host_bw.get(n.host_id, math.inf), n.host_mem_bw_Bps)
    nodes = [
        NodeSpec(
            name=n.node_id,
            memory_bytes=n.memory_total_bytes,
            available_bytes=n.memory_available_bytes,
            mem_bw_Bps=max(n.mem_bw_Bps, 1e9),
            flops=max(n.flops, 1e9),
            host=n.host_id,
            cores=n.cpu_count,
            host_mem_bw_Bps=host_bw.get(n.host_id, n.host_mem_bw_Bps),
            core_mem_bw_Bps=n.core_mem_bw_Bps,
            core_flops=n.core_flops,
            core_op_latency_s=n.core_op_latency_s,
            short_row_mem_bw_Bps=n.short_row_mem_bw_Bps,
            split_mem_bw_Bps=n.split_mem_bw_Bps,
            op_latency_s=n.op_latency_s or live_op_latency_s(n.chip),
            row_op_latency_s=live_row_op_latency_s(n.chip),
            row_read_fraction=live_row_read_fraction(n.chip),
        )
        for n in state.nodes.values()
    ]
    links = []
    for link in state.links.values():
        kind = _kind(state, link)
        links.append(
            LinkSpec(
                a=link.a,
                b=link.b,
                latency_s=max(link.rtt_s / 2, 1e-7),
                bandwidth_Bps=max(link.bandwidth_Bps, 1e6),
                kind=kind,
                overhead_s=live_collective_overhead_s(kind),
            )
        )
    return nodes, links


def _kind(state: ClusterState, link: LinkMeasured) -> str:
    """The link's kind for the planner: "rdma" wherever the two nodes run jaccl over a live
    RDMA cable, whichever TCP path measured fastest (their ranks run jaccl, and jaccl's ring
    mode needs the planner to see every cable of a ring)."""
    a, b = state.nodes.get(link.a), state.nodes.get(link.b)
    if a is not None and b is not None and all("jaccl" in n.backends for n in (a, b)):
        if isinstance(rdma_plan([a, b]), RdmaPlan):
            return "rdma"
    return link.link if link.link != "other" else "ethernet"


_recent_bases: deque[int] = deque(maxlen=32)


def ring_port_base(n: int) -> int:
    """A ring port base for n ranks, below every OS's ephemeral range (so no outgoing
    connection holds it) and unlike the last launches' (whose ports may sit in TIME_WAIT)."""
    slots = (RING_PORT_LAST - RING_PORT_BASE - n) // 8
    while (base := RING_PORT_BASE + 8 * random.randrange(slots)) in _recent_bases:
        pass
    _recent_bases.append(base)
    return base


def ring_hostfile(state: ClusterState, order: list[str], base_port: int) -> str:
    """Each rank listens on its address on the link from the previous rank (MLX ring)."""
    import json

    entries = []
    for i, node in enumerate(order):
        prev = order[i - 1]
        link = state.link(prev, node) if prev != node else None
        if link is None:
            address = state.contacts[node].rsplit(":", 1)[0]
        else:
            address = link.a_address if link.a == node else link.b_address
        entries.append([f"{address}:{base_port + i}"])
    return json.dumps(entries)


def core_assignment(state: ClusterState, order: list[str]) -> dict[int, int]:
    """rank -> core for ranks that share a machine (same host_id), when each can have its own:
    ring ranks busy-poll, so two on one core stall each other's collectives."""
    by_host: dict[str, list[int]] = {}
    for rank, node in enumerate(order):
        host = state.nodes[node].host_id
        if host:
            by_host.setdefault(host, []).append(rank)
    cpus = {}
    for ranks in by_host.values():
        if pins_cores(len(ranks), state.nodes[order[ranks[0]]].cpu_count):
            cpus.update({rank: i for i, rank in enumerate(ranks)})
    return cpus


def handoff_addresses(
    state: ClusterState, order: list[str], groups: tuple[int, ...], base_port: int
) -> tuple[str, ...]:
    """Where each rank of a hybrid plan takes its hand-off: its address on the link from its
    predecessor's node (the fabric between the groups), else its contact address."""
    from thunderpool.parallel.handoff import Topology

    stages = [s for s, n in enumerate(groups) for _ in range(n)]
    firsts = [sum(groups[:s]) for s in stages]
    out = []
    for g, node in enumerate(order):
        prev = order[Topology(groups, stages[g], g - firsts[g]).predecessor()]
        link = state.link(prev, node) if prev != node else None
        if link is None:
            address = state.contacts[node].rsplit(":", 1)[0]
        else:
            address = link.a_address if link.a == node else link.b_address
        out.append(f"{address}:{base_port + g}")
    return tuple(out)
