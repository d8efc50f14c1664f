"""Cluster state and its pure reducer: `apply(state, message) -> state`.

The coordinator owns the one state; agents and the CLI only send messages. Being pure, the
reducer is tested without sockets, and any node can rebuild the state by replaying messages.
"""

from __future__ import annotations

from pydantic import Field

from thunderpool.cluster.messages import (
    Hello,
    Left,
    LinkMeasured,
    Message,
    NodeInfo,
    RankExited,
    StartRanks,
    StopInstance,
    Wire,
)


class Instance(Wire):
    instance_id: str
    ranks: dict[int, str]  # rank -> node_id
    state: str = "starting"  # starting | running | stopped | failed
    error: str = ""


class ClusterState(Wire):
    nodes: dict[str, NodeInfo] = Field(default_factory=dict)
    contacts: dict[str, str] = Field(default_factory=dict)  # node_id -> agent host:port
    links: dict[str, LinkMeasured] = Field(default_factory=dict)  # "a|b" (sorted) -> best
    instances: dict[str, Instance] = Field(default_factory=dict)
    epoch: int = 0  # bumped on membership change, so links get re-probed

    def link(self, a: str, b: str) -> LinkMeasured | None:
        return self.links.get(link_key(a, b))

    def unprobed_pairs(self) -> list[tuple[str, str]]:
        ids = sorted(self.nodes)
        return [(a, b) for i, a in enumerate(ids) for b in ids[i + 1 :] if not self.link(a, b)]


def link_key(a: str, b: str) -> str:
    return "|".join(sorted((a, b)))


def apply(state: ClusterState, msg: Message) -> ClusterState:
    match msg:
        case Hello(node=node, contact=contact):
            known = state.nodes.get(node.node_id)
            nodes = {**state.nodes, node.node_id: node}
            contact = contact or state.contacts.get(node.node_id, "")
            update = {"nodes": nodes, "contacts": {**state.contacts, node.node_id: contact}}
            if known is not None and known.interfaces == node.interfaces:
                return state.model_copy(update=update)
            # A new node or new addresses: links through it must be measured again.
            links = {k: v for k, v in state.links.items() if node.node_id not in (v.a, v.b)}
            return state.model_copy(update=update | {"links": links, "epoch": state.epoch + 1})
        case Left(node_id=node_id):
            if node_id not in state.nodes:
                return state
            nodes = {k: v for k, v in state.nodes.items() if k != node_id}
            contacts = {k: v for k, v in state.contacts.items() if k != node_id}
            links = {k: v for k, v in state.links.items() if node_id not in (v.a, v.b)}
            update = {"nodes": nodes, "contacts": contacts, "links": links}
            return state.model_copy(update=update | {"epoch": state.epoch + 1})
        case LinkMeasured(a=a, b=b):
            if a not in state.nodes or b not in state.nodes:
                return state
            key = link_key(a, b)
            best = state.links.get(key)
            # Keep the fastest measured path between two nodes (e.g. Thunderbolt over Wi-Fi).
            if (
                best is None
                or _better(msg, best)
                or (best.a_address, best.b_address) == (msg.a_address, msg.b_address)
            ):
                return state.model_copy(update={"links": {**state.links, key: msg}})
            return state
        case StartRanks(ranks=ranks) if ranks:
            iid = ranks[0].instance_id
            inst = state.instances.get(iid) or Instance(instance_id=iid, ranks={})
            inst = inst.model_copy(
                update={
                    "ranks": {
                        **inst.ranks,
                        **{r.rank: r.env.get("THUNDERPOOL_NODE", "") for r in ranks},
                    }
                }
            )
            return state.model_copy(update={"instances": {**state.instances, iid: inst}})
        case StopInstance(instance_id=iid, reason=reason):
            inst = state.instances.get(iid)
            if inst is None:
                return state
            inst = inst.model_copy(update={"state": "stopped", "error": reason})
            return state.model_copy(update={"instances": {**state.instances, iid: inst}})
        case RankExited(instance_id=iid, code=code, rank=rank, last_error=err):
            inst = state.instances.get(iid)
            if inst is None or code == 0:
                return state
            inst = inst.model_copy(
                update={"state": "failed", "error": f"rank {rank} exited with {code}: {err}"}
            )
            return state.model_copy(update={"instances": {**state.instances, iid: inst}})
    return state


def _better(new: LinkMeasured, old: LinkMeasured) -> bool:
    """Lower latency wins; bandwidth breaks near-ties."""
    if new.rtt_s < old.rtt_s * 0.8:
        return True
    return new.rtt_s <= old.rtt_s * 1.2 and new.bandwidth_Bps > old.bandwidth_Bps
