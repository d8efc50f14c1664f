"""One planned instance across the cluster: each node's agent starts its ranks (weights fetched
first where a node lacks them); events stream back; leaving the context stops every rank."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from thunderpool.cluster.control.client import AgentError
from thunderpool.cluster.control.coordinator import (
    CAUSE_GRACE_S,
    NODE_TIMEOUT_S,
    Coordinator,
    core_assignment,
    handoff_addresses,
    ring_hostfile,
    ring_port_base,
)
from thunderpool.cluster.control.jaccl import (
    agents_reach,
    explain_rank_error,
    jaccl_config,
    pick_coordinator,
)
from thunderpool.cluster.control.messages import (
    NodeInfo,
    RankSpec,
    StartRanks,
    StopInstance,
)
from thunderpool.cluster.control.state import ClusterState
from thunderpool.cluster.weights.fabric import check_draft, place_weights
from thunderpool.engine.job import RankJob
from thunderpool.errors import LaunchError
from thunderpool.launch.local import RankEvent


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
        name = self._name(node)
        return LaunchError(
            f"rank {rank} on {name} exited with code {code}: {explain_rank_error(cause, name)}; "
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
