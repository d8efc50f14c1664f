"""The coordinator: learns the cluster from an agent, measures links, plans, launches.

It runs wherever the user runs `thunderpool status | plan | generate --cluster | serve
--cluster` and owns the ClusterState for that command. Any node can coordinate: the state
lives in the agents' membership plus fresh probes, so another node takes over by running the
same command there (`--join` any agent of the cluster).
"""

from __future__ import annotations

import math
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from thunderpool.cluster.control.client import AgentClient, AgentError
from thunderpool.cluster.control.jaccl import agents_reach, jaccl_config, pick_coordinator
from thunderpool.cluster.control.messages import (
    Hello,
    Left,
    LinkMeasured,
    NodeInfo,
    ProbeRequest,
    RankSpec,
    StartRanks,
    StopInstance,
)
from thunderpool.cluster.control.state import ClusterState, apply
from thunderpool.cluster.weights.fabric import check_draft, place_weights
from thunderpool.engine.job import RankJob
from thunderpool.errors import LaunchError, ThunderpoolError
from thunderpool.launch.local import RankEvent
from thunderpool.planner.cost import LinkSpec, NodeSpec, pins_cores
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
    links = [
        LinkSpec(
            a=link.a,
            b=link.b,
            latency_s=max(link.rtt_s / 2, 1e-7),
            bandwidth_Bps=max(link.bandwidth_Bps, 1e6),
            kind=link.link if link.link != "other" else "ethernet",
            overhead_s=live_collective_overhead_s(link.link),
        )
        for link in state.links.values()
    ]
    return nodes, links


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


class ClusterInstance:
    """One job's ranks across the cluster's agents; the same interface as LocalInstance."""

    def __init__(
        self,
        coordinator: Coordinator,
        state: ClusterState,
        order: list[str],
        job: RankJob,
        timeout: float | None = 600.0,
        on_fetch=None,
    ):
        self.coordinator, self.state, self.order = coordinator, state, order
        self.job, self.timeout = job, timeout
        self.on_fetch = on_fetch  # called with each round of weight-fetch progress
        self.instance_id = uuid.uuid4().hex[:10]
        self.nodes = sorted(set(order))
        self.leader_host = state.contacts[order[0]].rsplit(":", 1)[0]
        self._interrupted = threading.Event()

    def interrupt(self) -> None:
        """Make `events()` return at its next check."""
        self._interrupted.set()

    def __enter__(self) -> ClusterInstance:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def _world(self, job: RankJob, order: list[str]) -> list[tuple[RankJob, dict, dict]]:
        """(job, files, env) of each rank of one MLX world over `order`."""
        n = len(order)
        port = ring_port_base(n)
        files, env = {}, {}
        jaccl = jaccl_config(self.state, order, port)
        if jaccl is not None:
            # RDMA between every pair (or neighbours): MLX's jaccl backend instead of TCP ring.
            reach = agents_reach(self.state, self.coordinator.token)
            files |= jaccl.files()
            env |= jaccl.env(pick_coordinator(self.state, order, jaccl, reach))
            job = job.model_copy(update={"backend": "jaccl"})
        elif n > 1:
            files["MLX_HOSTFILE"] = ring_hostfile(self.state, order, port)
        return [(job, files, env)] * n

    def _hybrid(self, fetch) -> tuple[list[tuple[RankJob, dict, dict]], dict[int, str]]:
        """Each stage its own MLX world (jaccl where its nodes are RDMA-joined), every rank
        told the hand-off addresses; and the shards of nodes without the model, fetched per
        stage: its layers' TP slices over its group (fabric.rank_layout)."""
        job, groups = self.job, tuple(self.job.layout.groups or ())
        handoff = handoff_addresses(self.state, self.order, groups, ring_port_base(len(self.order)))
        seats: list[tuple[RankJob, dict, dict]] = []
        shards: dict[int, str] = {}
        for s, n in enumerate(groups):
            first = sum(groups[:s])
            order = self.order[first : first + n]
            staged = job.at_stage(s, handoff)
            world = self._world(staged, order)
            seats += [(j, f, {**e, "MLX_RANK": str(r)}) for r, (j, f, e) in enumerate(world)]
            shards |= {first + r: d for r, d in fetch(order, staged).items()}
        return seats, shards

    def start(self) -> None:
        def fetch(order: list[str], job: RankJob) -> dict[int, str]:
            # Nodes without the model first fetch their ranks' shards from one that has it.
            return place_weights(
                client,
                self.state,
                order,
                job,
                self.on_fetch,
            )

        client = lambda node: self.coordinator.client(node, self.state)  # noqa: E731
        check_draft(client, self.state, self.order, self.job)
        n = len(self.order)
        if self.job.layout.groups:
            seats, shards = self._hybrid(fetch)
        else:
            seats = self._world(self.job, self.order)
            shards = fetch(self.order, seats[0][0])
        self.backend = seats[0][0].backend
        cpus = core_assignment(self.state, self.order)

        def start_on(node: str) -> None:
            specs = tuple(
                RankSpec(
                    instance_id=self.instance_id,
                    rank=r,
                    world_size=n,
                    job=(
                        seats[r][0].model_copy(update={"model_dir": shards[r]})
                        if r in shards
                        else seats[r][0]
                    ).model_dump_json(),
                    files=seats[r][1],
                    cpu=cpus.get(r),
                    env=seats[r][2] | {"THUNDERPOOL_NODE": node},
                )
                for r, owner in enumerate(self.order)
                if owner == node
            )
            self.coordinator.client(node, self.state).call(
                "POST", "/v1/start", StartRanks(ranks=specs)
            )

        # All nodes at once: a node started first must not outwait its lease (LEASE_S without
        # a poll) while the others spawn their ranks.
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(start_on, self.nodes))

    def events(self) -> Iterator[RankEvent]:
        """Every rank's events until all exit 0; LaunchError at the first loss, at once (the
        context manager's exit then stops the ranks, which may take a lost node's timeout)."""
        seen = dict.fromkeys(self.nodes, 0)
        limit = self.timeout if self.timeout is not None else float("inf")
        deadline = time.monotonic() + limit
        while not self._interrupted.is_set():
            progressed, exits, failed = False, {}, []
            for node in self.nodes:
                # Long-poll the leader's node; glance at the others.
                reply = self._poll(node, seen[node], 0.5 if node == self.order[0] else 0.0)
                for item in reply["events"]:
                    yield RankEvent(item["rank"], item["event"])
                    progressed = True
                seen[node] += len(reply["events"])
                exits.update(self._exits(node, reply, failed))
            if failed:
                raise self._lost(failed, seen)
            if len(exits) == len(self.order) and all(c == 0 for c in exits.values()):
                return
            if progressed:
                deadline = time.monotonic() + limit
            elif time.monotonic() > deadline:
                raise LaunchError(
                    f"no progress from the ranks for {self.timeout:.0f}s; stopped every rank"
                )
            else:
                time.sleep(0.01)  # the leader's long-poll already waited; this bounds a spin

    def _poll(self, node: str, after: int, wait: float) -> dict:
        """One poll of a node's ranks; each poll also renews the agent's lease on the
        instance, which it stops when polls cease."""
        try:
            reply = self.coordinator.client(node, self.state).call(
                "GET",
                f"/v1/instances/{self.instance_id}?after={after}&wait={wait}",
                timeout=wait + NODE_TIMEOUT_S,
            )
        except AgentError as e:
            raise LaunchError(
                f"lost node {self._name(node)} (no answer within "
                f"{NODE_TIMEOUT_S:.0f} s: {e}); stopped every rank"
            ) from None
        if not reply.get("known", True):
            raise LaunchError(
                f"node {self._name(node)} no longer runs this instance (it restarted, "
                "or stopped the ranks when polls ceased); stopped every rank"
            )
        return reply

    @staticmethod
    def _exits(node: str, reply: dict, failed: list) -> dict[int, int | None]:
        """The reply's exit codes by rank; failures are added to `failed`."""
        exits = {}
        for rank, code in reply["exits"].items():
            exits[int(rank)] = code
            if code not in (None, 0):
                cause = reply["errors"].get(rank) or reply["errors"].get(str(rank), "")
                failed.append((int(rank), code, node, cause))
        return exits

    def _lost(self, failed: list, seen: dict[str, int]) -> LaunchError:
        """The error naming the cause of a loss. A rank killed by a signal is the cause: its
        peers then fail in their collectives. A peer may notice before the killed rank's exit
        is seen (a socket closes before the process is reaped, or its node was polled just
        before), so the other nodes are asked again for up to CAUSE_GRACE_S."""
        until = time.monotonic() + CAUSE_GRACE_S
        while not any(code < 0 for _, code, _, _ in failed) and time.monotonic() < until:
            time.sleep(0.05)
            for node in self.nodes:
                try:
                    self._exits(node, self._poll(node, seen[node], 0.0), failed)
                except LaunchError:
                    continue  # a node lost now: the failures already seen say enough
            failed = list({f[0]: f for f in failed}.values())
        rank, code, node, cause = min(failed, key=lambda f: (f[1] >= 0, f[0]))
        return LaunchError(
            f"rank {rank} on {self._name(node)} exited with code {code}: {cause}; "
            f"stopped all {len(self.order)} ranks"
        )

    def _name(self, node: str) -> str:
        info: NodeInfo | None = self.state.nodes.get(node)
        return info.name if info else node

    def kill(self) -> None:
        """Stop the ranks on every node at once; an unreachable node's agent stops its own
        when the coordinator's polls cease (its lease), or its ranks died with it."""

        def stop(node: str) -> None:
            try:
                self.coordinator.client(node, self.state).call(
                    "POST",
                    "/v1/stop",
                    StopInstance(instance_id=self.instance_id),
                    timeout=NODE_TIMEOUT_S,
                )
            except AgentError:
                pass

        with ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(stop, self.nodes))
