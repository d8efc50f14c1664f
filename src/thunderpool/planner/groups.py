"""Which nodes may form a TP group or a PP order: links measured both ways, islands of fast links
(hybrid's stages), RDMA meshes, the orderings PP tries; and the reason a plan states."""

from __future__ import annotations

import itertools

from thunderpool.planner.cost import LinkSpec, Prediction
from thunderpool.planner.hardware import link_between

MAX_ORDERINGS = 5000  # beyond this, PP tries one ordering per subset (most memory first)


def _orderings(names: list[str], n_layers: int):
    """Node orders for PP: all of them while few, else one per subset."""
    sizes = range(2, min(len(names), n_layers) + 1)
    total = sum(len(list(itertools.permutations(range(len(names)), k))) for k in sizes)
    for k in sizes:
        if total <= MAX_ORDERINGS:
            yield from (list(p) for p in itertools.permutations(names, k))
        else:
            yield from (list(c) for c in itertools.combinations(names, k))


def _linked(links: list[LinkSpec], group: tuple[str, ...]) -> bool:
    return all(link_between(links, a, b) for a, b in itertools.combinations(group, 2))


def along_ring(group: tuple[str, ...], links: list[LinkSpec]) -> tuple[str, ...]:
    """`group` reordered so each node is RDMA-linked to the next and the last to the first,
    from group[0] on, where its RDMA links form such a ring but not a full mesh: jaccl's ring
    mode runs only with the ranks in ring order (a cabled ring of 4 Macs). Else unchanged."""
    rdma = [x for x in links if x.kind == "rdma"]
    if len(group) < 4 or len(group) > 9 or _linked(rdma, group):
        return group
    pairs = {frozenset((x.a, x.b)) for x in rdma}
    for rest in itertools.permutations(group[1:]):
        order = (group[0], *rest)
        if all(frozenset((order[k - 1], order[k])) in pairs for k in range(len(order))):
            return order
    return group


# Without RDMA, links this many times faster than the slowest join an island (TP inside it):
# e.g. 10 GbE pairs joined by 1 GbE, or a Mac pair over Thunderbolt beside a Linux box.
ISLAND_RATIO = 4.0


def _islands(names: list[str], links: list[LinkSpec]) -> list[tuple[str, ...]]:
    """Groups of nodes joined by links far faster than the slowest one (none: one class)."""
    slowest = min((x.bandwidth_Bps for x in links), default=0.0)
    fast = [x for x in links if slowest > 0 and x.bandwidth_Bps >= ISLAND_RATIO * slowest]
    return _rdma_groups(names, fast, kinds=None)


def _rdma_groups(
    names: list[str], links: list[LinkSpec], kinds: tuple[str, ...] | None = ("rdma",)
) -> list[tuple[str, ...]]:
    """Connected components of the RDMA graph (of `links` of any kind, with kinds None); a
    component that is not a full mesh is split."""
    rdma = [x for x in links if kinds is None or x.kind in kinds]
    groups, seen = [], set()
    for n in names:
        if n in seen:
            continue
        comp, todo = [], [n]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            comp.append(m)
            todo += [x.b if x.a == m else x.a for x in rdma if m in (x.a, x.b)]
        comp = [m for m in names if m in comp]
        if _linked(rdma, tuple(comp)):
            groups.append(tuple(comp))
        else:
            groups += [(m,) for m in comp]
    return groups


def _links_of(links, group):
    return [x for a, b in itertools.combinations(group, 2) for x in link_between(links, a, b)]


def _reason(kind, stages, pred: Prediction, links) -> str:
    b = pred.breakdown
    who = " | ".join(",".join(s.nodes) for s in stages)
    text = f"{kind} over {who}: {pred.decode_tps:.1f} tok/s decode"
    text += f" ({b.memory_s * 1e3:.2f} ms memory, {b.compute_s * 1e3:.2f} ms compute"
    if b.dispatch_s:
        text += f", {b.dispatch_s * 1e3:.2f} ms dispatch"
    if pred.collectives_per_token:
        nodes = tuple(n for s in stages for n in s.nodes)
        kinds = sorted({x.kind for x in _links_of(links, nodes)})
        text += (
            f", {pred.collectives_per_token} collectives per token cost "
            f"{b.collective_s * 1e3:.2f} ms on {'/'.join(kinds) or 'links'}"
        )
    if len(stages) > 1:
        text += f"; layers {'+'.join(str(s.n_layers) for s in stages)}"
    if any(len(s.nodes) > 1 for s in stages):
        shares_txt = ", ".join(
            ":".join(f"{w / min(s.tp_weights):.2g}" for w in s.tp_weights)
            for s in stages
            if len(s.nodes) > 1
        )
        text += f"; TP weights {shares_txt}"
    return text + ")"
