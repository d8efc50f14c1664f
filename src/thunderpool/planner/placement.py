"""Placement: (ModelSpec, nodes, links, needs) -> Plans ranked by predicted decode speed.

Pure functions. Candidates are every single node, TP over every fully linked subset (and, for
a MoE model, EP over it: planner/ep.py), PP over node orderings, and hybrids (TP inside
RDMA-joined groups, or without RDMA inside islands of links ISLAND_RATIO times faster than
the slowest, PP between them). A plan is kept
only if every node's weights + KV cache + activations + OS reserve fit its available memory.
A plan whose layout is not verified for the model's family carries the reason (`unverified`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from thunderpool.errors import ShardingError, ThunderpoolError
from thunderpool.models.families import family_of, unverified
from thunderpool.parallel.layout import Layout
from thunderpool.parallel.tensor import proportional_split
from thunderpool.planner.cost import (
    LinkSpec,
    NodeSpec,
    Prediction,
    Stage,
    head_share,
    kv_bytes,
    predict,
    shares,
    weight_bytes,
)
from thunderpool.planner.dispatch import compiles
from thunderpool.planner.groups import (
    _islands,
    _linked,
    _orderings,
    _rdma_groups,
    _reason,
    along_ring,
)
from thunderpool.planner.hardware import link_between
from thunderpool.planner.spec import ModelSpec

GiB = 2**30
PREFILL_CHUNK = 2048  # mlx-lm's prefill step: the activation allowance covers one chunk


class PlacementError(ThunderpoolError):
    """No plan fits the model on these nodes."""


@dataclass(frozen=True, slots=True)
class Plan:
    """A ranked candidate: stages run in order; each stage is TP over its nodes."""

    kind: str  # "single" | "tp" | "ep" | "pp" | "hybrid"
    stages: tuple[Stage, ...]
    memory_used: dict[str, int]  # bytes per node, OS reserve included
    memory_free: dict[str, int]  # available_bytes - memory_used, never negative
    prediction: Prediction
    reason: str
    unverified: str = ""  # why this layout is not verified for the model's family ("" if it is)
    compiled: bool = False  # decode runs the compiled step (planner/dispatch.py: compiles)
    experts: tuple[int, ...] | None = None  # EP: routed experts per rank
    kv_token_bytes: float = 0.0  # KV cache per context token, all ranks (--kv-bits: quantized)

    @property
    def verified(self) -> bool:
        return not self.unverified

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for s in self.stages for n in s.nodes)

    @property
    def tp_weights(self) -> tuple[float, ...] | None:
        return self.stages[0].tp_weights if self.kind in ("tp", "ep") else None

    @property
    def layer_split(self) -> tuple[int, ...] | None:
        return tuple(s.n_layers for s in self.stages) if len(self.stages) > 1 else None

    def layout(self) -> Layout:
        """The layout the ranks load. Hybrid: one TP group per stage, its weights those of its
        nodes, given for every rank in order (parallel/hybrid.py)."""
        match self.kind:
            case "tp":
                return Layout("tp", self.tp_weights)
            case "ep":  # whole experts per rank, as many as the planner priced
                return Layout("ep", self.tp_weights, expert_split=self.experts)
            case "pp":
                return Layout("pp", layer_split=self.layer_split)
            case "hybrid":
                groups = tuple(len(s.nodes) for s in self.stages)
                weights = tuple(w for s in self.stages for w in s.tp_weights)
                return Layout("hybrid", weights, self.layer_split, groups=groups)
        return Layout("tp")


@dataclass(frozen=True, slots=True)
class _Needs:
    context_tokens: int
    concurrency: int
    kv_dtype_bytes: float
    prompt_tokens: int
    prefix_tokens: int = 0  # the prefix cache's budget, in tokens of KV (all nodes together)
    compiled: bool = False  # price the compiled decode step where the engine runs one
    routing: dict | None = None  # EP: measured share of routes per expert, by MoE layer
    draft_bytes: int = 0  # a speculative draft's weights and KV, held by the leader only


def place(
    spec: ModelSpec,
    nodes: list[NodeSpec],
    links: list[LinkSpec],
    context_tokens: int = 4096,
    concurrency: int = 1,
    kv_dtype_bytes: float = 2,
    prompt_tokens: int | None = None,
    prefix_cache_bytes: float = 0,
    compiled: bool = False,
    routing: dict[int, tuple[float, ...]] | None = None,
    draft: ModelSpec | None = None,
) -> list[Plan]:
    """Every plan that fits, fastest predicted decode first; PlacementError if none does.
    `compiled=True` prices the compiled step where the engine runs one (`--compile`, on by
    default in plan and serve).

    Speed is predicted for decode right after a `prompt_tokens` prompt (default: 512 or the
    context, whichever is smaller); memory is reserved for the full context x concurrency,
    plus the prefix cache's `prefix_cache_bytes` of KV, spread over the nodes as the KV is.
    EP plans price `routing` (parallel/routing.py's measured counts) where given, else uniform.
    A speculative `draft` (its weights and its KV for the same context) is reserved on the
    leader, the first node of every plan, which runs it.
    """
    if not nodes:
        raise PlacementError("no nodes to place the model on; start `thunderpool node` on one")
    if context_tokens < 1 or concurrency < 1:
        raise PlacementError(
            f"context_tokens={context_tokens} and concurrency={concurrency} must both be >= 1"
        )
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise PlacementError(f"node names must be unique, got {names}")
    kv_token = spec.kv_bytes_per_token(kv_dtype_bytes)
    prefix = int(prefix_cache_bytes // kv_token) if kv_token and prefix_cache_bytes > 0 else 0
    needs = _Needs(
        context_tokens,
        concurrency,
        kv_dtype_bytes,
        prompt_tokens or min(512, context_tokens),
        prefix,
        compiled,
        routing,
        _draft_bytes(draft, context_tokens * concurrency, kv_dtype_bytes),
    )
    by_name = {n.name: n for n in nodes}
    plans = []
    for kind, stages in _candidates(spec, nodes, links, needs):
        plan = _plan(spec, kind, stages, by_name, links, needs)
        if plan is not None:
            plans.append(plan)
    if not plans:
        raise PlacementError(_refusal(spec, nodes, needs))
    plans.sort(key=lambda p: (-p.prediction.decode_tps, -p.prediction.prefill_tps, len(p.nodes)))
    family = family_of({"model_type": spec.model_type})
    return [
        replace(p, unverified=unverified(family, len(p.nodes), p.kind, _equal(p)) or "")
        for p in plans
    ]


def _equal(plan: Plan) -> bool:
    return plan.kind == "single" or plan.layout().equal_shares


def explain(plans: list[Plan]) -> str:
    """Why the first plan wins, against the best plan of each other kind."""
    if not plans:
        return "no plan fits"
    best = plans[0]
    lines = [f"winner: {best.reason}"]
    seen = {best.kind}
    for other in plans[1:]:
        if other.kind in seen:
            continue
        seen.add(other.kind)
        a, b = best.prediction, other.prediction
        why = []
        d_mem = _work(b) - _work(a)
        d_coll = b.breakdown.collective_s - a.breakdown.collective_s
        if d_mem > 5e-6:
            why.append(f"{d_mem * 1e3:.2f} ms less memory/compute time per token")
        if d_coll > 5e-6:
            why.append(f"{d_coll * 1e3:.2f} ms less time on links per token")
        if not why:
            why.append("the same speed with fewer nodes" if a.decode_tps >= b.decode_tps else "")
        lines.append(
            f"beats {other.reason.split(':')[0]} ({b.decode_tps:.1f} vs "
            f"{a.decode_tps:.1f} tok/s): {', '.join(w for w in why if w)}"
        )
    return "\n".join(lines)


def _work(p: Prediction) -> float:
    """Seconds per token a rank spends on its own work: memory, compute and dispatch."""
    return p.breakdown.memory_s + p.breakdown.compute_s + p.breakdown.dispatch_s


def memory_use(
    spec: ModelSpec, stages: tuple[Stage, ...], by_name: dict[str, NodeSpec], needs: _Needs
) -> dict[str, int]:
    """Bytes each node needs: weights + KV (context x concurrency) + activations + OS reserve."""
    used = {}
    tokens = needs.context_tokens * needs.concurrency + needs.prefix_tokens
    chunk = min(PREFILL_CHUNK, needs.context_tokens)
    for k, stage in enumerate(stages):
        for share in shares(spec, stage):
            node = by_name[share.node]
            # Activations: a prefill chunk's hidden/MLP/attention tensors in fp32, plus logits.
            act = chunk * 4 * (4 * spec.hidden + 2 * spec.intermediate * share.mlp)
            act += needs.concurrency * spec.vocab * 4 if k == 0 else 0
            total = weight_bytes(spec, stage, share, head_share(stages, k, share))
            total += kv_bytes(spec, stage, share, tokens, needs.kv_dtype_bytes)
            used[share.node] = int(total + act) + node.os_reserve_bytes
    leader = stages[0].nodes[0]
    used[leader] += needs.draft_bytes
    return used


def _draft_bytes(draft: ModelSpec | None, tokens: int, kv_dtype_bytes: float) -> int:
    if draft is None:
        return 0
    return int(draft.total_bytes + draft.kv_bytes_per_token(kv_dtype_bytes) * tokens)


def _plan(spec, kind, stages, by_name, links, needs) -> Plan | None:
    try:
        used = memory_use(spec, stages, by_name, needs)
    except ShardingError:
        return None  # heads cannot be split over these weights
    experts = None
    if kind == "ep":  # whole experts instead of channel slices: other bytes, other speed
        from thunderpool.planner.ep import ep_costs

        used, pred, experts = ep_costs(spec, stages[0], by_name, links, needs, used)
    if any(used[n] > by_name[n].available_bytes for n in used):
        return None
    if not _fits_hosts(used, by_name):
        return None
    compiled = needs.compiled and compiles(spec.model_type, kind)
    if kind != "ep":
        pred = predict(
            spec,
            stages,
            by_name,
            links,
            prompt_tokens=needs.prompt_tokens,
            concurrency=needs.concurrency,
            kv_dtype_bytes=needs.kv_dtype_bytes,
            compiled=compiled,
        )
    free = {n: by_name[n].available_bytes - used[n] for n in used}
    reason = _reason(kind, stages, pred, links)
    if experts:
        reason = f"{reason[:-1]}; experts {'+'.join(map(str, experts))})"
    kv_token = spec.kv_bytes_per_token(needs.kv_dtype_bytes)
    return Plan(
        kind,
        stages,
        used,
        free,
        pred,
        reason,
        compiled=compiled,
        experts=experts,
        kv_token_bytes=kv_token,
    )


def _fits_hosts(used: dict[str, int], by_name: dict[str, NodeSpec]) -> bool:
    """Nodes on one machine share its memory and cores: their sum must fit, and no more ranks
    than cores (ranks busy-poll, so an oversubscribed core stalls every collective)."""
    hosts: dict[str, list[str]] = {}
    for n in used:
        if by_name[n].host:
            hosts.setdefault(by_name[n].host, []).append(n)
    for names in hosts.values():
        if len(names) < 2:
            continue
        if sum(used[n] for n in names) > min(by_name[n].available_bytes for n in names):
            return False
        cores = min(by_name[n].cores for n in names)
        if cores and len(names) > cores:
            return False
    return True


def _candidates(spec, nodes, links, needs):
    """(kind, stages) for every layout worth pricing; memory is checked by the caller."""
    by_name = {n.name: n for n in nodes}
    names = [n.name for n in nodes]
    full = (0, spec.layers)
    for n in names:
        yield "single", (Stage((n,), full, (1.0,)),)
    for size in range(2, len(names) + 1):
        for linked in itertools.combinations(names, size):
            if _linked(links, linked):
                group = along_ring(linked, links)  # jaccl's ring mode needs ring order
                weights = tuple(by_name[n].mem_bw_Bps for n in group)
                yield "tp", (Stage(group, full, weights),)
                if spec.experts and size <= spec.experts:
                    yield "ep", (Stage(group, full, weights),)
    roomy = sorted(names, key=lambda n: -by_name[n].available_bytes)
    for order in _orderings(roomy, spec.layers):
        if all(
            link_between(links, a, b) for a, b in zip(order, order[1:] + order[:1], strict=True)
        ):
            groups = [(n,) for n in order]
            stages = _fit_layers(spec, groups, by_name, needs)
            if stages is not None:
                yield "pp", stages
    groups = _rdma_groups(names, links)
    if not any(len(g) > 1 for g in groups):
        groups = _islands(names, links)
    if len(groups) > 1 and any(len(g) > 1 for g in groups):
        for order in itertools.permutations(groups):
            stages = _fit_layers(spec, list(order), by_name, needs)
            if stages is not None:
                yield "hybrid", stages


def _fit_layers(spec, groups, by_name, needs) -> tuple[Stage, ...] | None:
    """Stage sizes by memory bandwidth, then moved from full nodes to nodes with room."""
    if len(groups) > spec.layers:
        return None
    tp = [tuple(by_name[n].mem_bw_Bps for n in g) for g in groups]
    counts = [b - a for a, b in proportional_split(spec.layers, [sum(w) for w in tp])]
    for _ in range(spec.layers * len(groups)):
        stages, start = [], 0
        for g, w, c in zip(groups, tp, counts, strict=True):
            stages.append(Stage(tuple(g), (start, start + c), w))
            start += c
        stages = tuple(stages)
        try:
            used = memory_use(spec, stages, by_name, needs)
        except ShardingError:
            return None
        over = [max(used[n] - by_name[n].available_bytes for n in g) for g in groups]
        worst = max(range(len(groups)), key=over.__getitem__)
        if over[worst] <= 0:
            return stages
        room = min((k for k in range(len(groups)) if k != worst), key=over.__getitem__)
        if counts[worst] == 1 or over[room] >= 0:
            return None
        counts[worst] -= 1
        counts[room] += 1
    return None


def _refusal(spec: ModelSpec, nodes: list[NodeSpec], needs: _Needs) -> str:
    """How much memory is missing and what would make the model fit."""
    gib = lambda x: f"{x / GiB:.1f} GiB"  # noqa: E731
    kv_token = spec.kv_bytes_per_token(needs.kv_dtype_bytes)
    kv = kv_token * (needs.context_tokens * needs.concurrency + needs.prefix_tokens)
    reserve = sum(n.os_reserve_bytes for n in nodes)
    need = spec.total_bytes + kv + reserve + needs.draft_bytes
    have = sum(n.available_bytes for n in nodes)
    missing = need - have
    prefix = f" + prefix cache {gib(kv_token * needs.prefix_tokens)}" if needs.prefix_tokens else ""
    if needs.draft_bytes:
        prefix += f" + the draft on the leader {gib(needs.draft_bytes)}"
    fixes = []
    room = have - spec.total_bytes - reserve - needs.draft_bytes
    if room > 0 and kv_token:
        fit = int(room / (kv_token * needs.concurrency)) // 256 * 256
        if fit >= 256:
            fixes.append(f"a context of at most {fit} tokens (--context {fit})")
    q4 = spec.params * 0.5625  # 4-bit weights plus a 16-bit scale and bias per 64
    if q4 < spec.total_bytes * 0.9:
        fixes.append(f"a 4-bit quantized model (~{gib(q4)} of weights)")
    if missing > 0:
        fixes.append(f"one more node with at least {gib(missing)} free")
        head = f"{gib(missing)} of memory is missing"
    else:
        fixes.append("a node with more free memory, or links between the nodes for TP/PP")
        head = "the memory is there in total but no layout fits it on every node"
    return (
        f"{spec.model_type} does not fit: {head}. It needs {gib(need)} (weights "
        f"{gib(spec.total_bytes)} + KV cache {gib(kv)} for {needs.context_tokens} tokens x "
        f"{needs.concurrency}{prefix} + OS reserve {gib(reserve)}, plus activations) and "
        f"{len(nodes)} node(s) have {gib(have)} available. Use " + ", or ".join(fixes) + "."
    )
