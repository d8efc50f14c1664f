"""MLX jaccl (RDMA over Thunderbolt) settings for one world of ranks, as `mlx.launch` sets them.

MLX_IBV_DEVICES names, for every ordered pair of ranks, the RDMA device of the cable between
them (cluster/node/thunderbolt.py); MLX_JACCL_COORDINATOR is an address of rank 0 that every rank
can route to: its LAN address where it has one (mlx.launch takes rank 0's en0), never a
cable's /30, which only the Mac at the cable's other end reaches. The coordinator's address is
checked from every rank's node before launch.
"""

from __future__ import annotations

import errno
import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from thunderpool.cluster.control.client import AgentClient, AgentError
from thunderpool.cluster.control.messages import ProbeRequest
from thunderpool.cluster.control.state import ClusterState
from thunderpool.cluster.node.thunderbolt import RdmaPlan, coordinator_candidates, rdma_plan
from thunderpool.errors import LaunchError


def _wrong_answerer(state: ClusterState, leader: str, asker: str, answered: str, address: str):
    def name(n: str) -> str:
        return f"{state.nodes[n].name} ({n})" if n in state.nodes else f"node {n}"

    return (
        f"{address} is {name(leader)}'s (rank 0), but from {name(asker)} it is "
        f"{name(answered)} that answers there: two machines hold {address}, likely a "
        "Thunderbolt cable numbered into the LAN; run `thunderpool doctor --fix` on every Mac "
        "(it moves each cable's /30 clear of every network), then launch again"
    )


# jaccl's errors carry the errno ("[jaccl] Changing queue pair to RTR failed with errno 16");
# EBUSY there means an RDMA device of that Mac is still held, often by a rank of an earlier run.
_HELD = re.compile(rf"\[jaccl\].*(errno\W*{errno.EBUSY}\b|EBUSY|resource busy)", re.I)


def explain_rank_error(cause: str, node: str) -> str:
    """A rank's last error as the launch error says it: jaccl's EBUSY points to the fix."""
    if not _HELD.search(cause):
        return cause
    return (
        f"{cause} (EBUSY: an RDMA device on {node} is still held, most often by a process left "
        f"from an earlier run; run `thunderpool doctor` on {node}: it names the process holding "
        "it and the fix)"
    )


@dataclass(frozen=True, slots=True)
class JacclConfig:
    devices: list  # MLX_IBV_DEVICES
    ring: bool  # MLX_JACCL_RING: only neighbouring ranks are cabled
    candidates: tuple[str, ...]  # rank 0's addresses for the coordinator, best first
    port: int

    @property
    def coordinator(self) -> str:
        return f"{self.candidates[0]}:{self.port}"

    def files(self) -> dict[str, str]:
        return {"MLX_IBV_DEVICES": json.dumps(self.devices)}

    def env(self, coordinator: str | None = None) -> dict[str, str]:
        env = {"MLX_JACCL_COORDINATOR": coordinator or self.coordinator}
        return env | ({"MLX_JACCL_RING": "1"} if self.ring else {})


def jaccl_config(state: ClusterState, order: list[str], port: int) -> JacclConfig | None:
    """jaccl settings where every rank's node runs jaccl and every pair of ranks (or, in ring
    mode, every pair of neighbours) has a Thunderbolt cable with an RDMA device; else None
    (the world runs `ring` over TCP)."""
    if len(order) < 2 or len(set(order)) < len(order):
        return None
    if not all("jaccl" in state.nodes[n].backends for n in order):
        return None
    plan = rdma_plan([state.nodes[n] for n in order])
    if not isinstance(plan, RdmaPlan):
        return None
    contact = state.contacts[order[0]].rsplit(":", 1)[0]
    candidates = coordinator_candidates(state.nodes[order[0]], contact)
    return JacclConfig(plan.devices, plan.ring, tuple(candidates), port)


# (node, address, port) -> the id of the node that answered there, from `node`; None: no answer.
Reach = Callable[[str, str, int], str | None]


def agents_reach(state: ClusterState, token: str) -> Reach:
    """Ask each node's agent to connect (its `/v1/reach`) and say which node answered: the
    probe server there proves its node id with the cluster token."""

    def reach(node: str, address: str, port: int) -> str | None:
        req = ProbeRequest(peer=node, address=address, port=port)
        try:
            reply = AgentClient(state.contacts[node], token).call(
                "POST", "/v1/reach", req, timeout=5
            )
        except AgentError:
            return None
        return str(reply.get("node") or "") or None

    return reach


def pick_coordinator(state: ClusterState, order: list[str], cfg: JacclConfig, reach: Reach) -> str:
    """The first of rank 0's candidate addresses at which every other rank's node reaches
    rank 0's node (its agent's probe port stands in for the coordinator's), as host:port. An
    address where another node answers is two Macs holding one address: a LaunchError naming
    both, never a coordinator some ranks would find on the wrong Mac."""
    leader = state.nodes[order[0]]
    others = sorted(set(order[1:]))
    for address in cfg.candidates:
        with ThreadPoolExecutor(len(others)) as pool:
            seen = list(pool.map(lambda n, a=address: reach(n, a, leader.port + 1), others))
        for node, answered in zip(others, seen, strict=True):
            if answered not in (None, leader.node_id):
                raise LaunchError(_wrong_answerer(state, leader.node_id, node, answered, address))
        if all(answered == leader.node_id for answered in seen):
            return f"{address}:{cfg.port}"
    names = ", ".join(state.nodes[n].name for n in others)
    raise LaunchError(
        f"no address of {leader.name} (rank 0: {', '.join(cfg.candidates)}) is reachable from "
        f"every other rank's node ({names}); jaccl's coordinator must be: join every Mac to one "
        "LAN (Ethernet or Wi-Fi) as well as the Thunderbolt cables"
    )
