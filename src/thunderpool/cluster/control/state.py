"""Cluster state and its pure reducer: `apply(state, message) -> state`.

The coordinator owns the one state; agents and the CLI only send messages. Being pure, the
reducer is tested without sockets, and any node can rebuild the state by replaying messages.
One small function per message, behind `match` (the shape of exo's shared/apply.py).
"""

from __future__ import annotations

from pydantic import Field

from thunderpool.cluster.control.messages import Hello, Left, LinkMeasured, Message, NodeInfo, Wire


class ClusterState(Wire):
    nodes: dict[str, NodeInfo] = Field(default_factory=dict)
    contacts: dict[str, str] = Field(default_factory=dict)  # node_id -> agent host:port
    links: dict[str, LinkMeasured] = Field(default_factory=dict)  # "a|b" (sorted) -> best
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
        case Hello():
            return _hello(state, msg)
        case Left():
            return _left(state, msg)
        case LinkMeasured():
            return _link_measured(state, msg)
    raise TypeError(f"no reducer for {type(msg).__name__}")


def _hello(state: ClusterState, msg: Hello) -> ClusterState:
    node = msg.node
    known = state.nodes.get(node.node_id)
    if known is not None and node.revision < known.revision:
        node = known  # a peer's stale copy of what that node has since re-reported
    contact = msg.contact or state.contacts.get(node.node_id, "")
    update = {
        "nodes": {**state.nodes, node.node_id: node},
        "contacts": {**state.contacts, node.node_id: contact},
    }
    if known is not None and known.interfaces == node.interfaces:
        return state.model_copy(update=update)
    # A new node or new addresses: links through it must be measured again.
    links = _without(state.links, node.node_id)
    return state.model_copy(update=update | {"links": links, "epoch": state.epoch + 1})


def _left(state: ClusterState, msg: Left) -> ClusterState:
    gone = msg.node_id
    if gone not in state.nodes:
        return state
    update = {
        "nodes": {k: v for k, v in state.nodes.items() if k != gone},
        "contacts": {k: v for k, v in state.contacts.items() if k != gone},
        "links": _without(state.links, gone),
        "epoch": state.epoch + 1,
    }
    return state.model_copy(update=update)


def _link_measured(state: ClusterState, msg: LinkMeasured) -> ClusterState:
    if msg.a not in state.nodes or msg.b not in state.nodes:
        return state
    key = link_key(msg.a, msg.b)
    best = state.links.get(key)
    # Keep the fastest measured path between two nodes (e.g. Thunderbolt over Wi-Fi); a new
    # measurement of the same pair of addresses replaces the old one.
    same_path = best is not None and (best.a_address, best.b_address) == (
        msg.a_address,
        msg.b_address,
    )
    if best is None or same_path or _better(msg, best):
        return state.model_copy(update={"links": {**state.links, key: msg}})
    return state


def _without(links: dict[str, LinkMeasured], node_id: str) -> dict[str, LinkMeasured]:
    return {k: v for k, v in links.items() if node_id not in (v.a, v.b)}


def _better(new: LinkMeasured, old: LinkMeasured) -> bool:
    """Lower latency wins; bandwidth breaks near-ties."""
    if new.rtt_s < old.rtt_s * 0.8:
        return True
    return new.rtt_s <= old.rtt_s * 1.2 and new.bandwidth_Bps > old.bandwidth_Bps
