"""Expert parallelism's cost beside TP's (parallel/experts.py runs it).

A TP rank reads its channel share of every routed expert a step touches; an EP rank reads the
whole experts it holds that the step's tokens are routed to. Both pay the same all_sum per MoE
block. Each MoE layer waits for its slowest rank, and with EP that is the rank the routes
happened to favour: the expected maximum over ranks, drawn here by sampling uniform top-k
routes (seeded, so a prediction is repeatable). Real routers have hot experts, so this
imbalance is a floor. An EP rank also reads the route mask on the host once per MoE layer
(LocalExperts' skip), one dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from thunderpool.parallel.experts import route_holders, split_experts
from thunderpool.planner import cost
from thunderpool.planner.cost import Prediction, Stage
from thunderpool.planner.hardware import LinkSpec, NodeSpec
from thunderpool.planner.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class EPPrediction:
    """EP over one TP stage's nodes, beside TP's prediction for the same nodes."""

    tp: Prediction
    ep: Prediction
    experts: tuple[int, ...]  # routed experts per rank
    imbalance: float  # decode: expected slowest rank's expert time / the mean rank's
    tp_weight_bytes: tuple[float, ...]  # per rank
    ep_weight_bytes: tuple[float, ...]


def expert_load(
    n_experts: int,
    k: int,
    counts: list[int],
    batch: int,
    rates: list[float],
    samples: int = 0,
    seed: int = 0,
    popularity: tuple[float, ...] | None = None,
    replicas: tuple[tuple[int, int], ...] = (),
) -> tuple[float, float]:
    """(expected max over ranks, mean over ranks) of experts touched / rate, for `batch` tokens
    each routed to k distinct experts; rank r holds counts[r] experts. Routes are drawn in
    proportion to `popularity` (measured routing counts; default uniform); `replicas` are extra
    (expert, rank) holders, which split the expert's tokens by position as LocalExperts does."""
    pop = tuple(float(x) for x in popularity) if popularity is not None else None
    return _expert_load(
        n_experts, k, tuple(counts), batch, tuple(rates), samples, seed, pop, tuple(replicas)
    )


@lru_cache(maxsize=4096)  # the planner prices many node groups of the same shape
def _expert_load(
    n_experts, k, counts, batch, rates, samples, seed, popularity, replicas
) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    n_ranks = len(counts)
    table, h = _holders(counts, replicas)  # (E, H) ranks holding each expert, and how many
    w = np.ones(n_experts) if popularity is None else np.asarray(popularity, dtype=np.float64)
    w = w / w.sum()
    rate = np.asarray(rates, dtype=np.float64)
    if batch * n_experts > 1 << 15:
        # Large batches: each holder of e is touched when any of its ~batch/h tokens routes to
        # e; per-token inclusion k*w (capped), independently per expert (a tiny error here).
        pi = np.minimum(1.0, k * w)
        q = 1.0 - (1.0 - pi[:, None]) ** (batch / h[:, None])  # (E, 1)
        valid = np.arange(table.shape[1])[None, :] < h[:, None]  # (E, H)
        samples = samples or 256
        hit = (rng.random((samples, *table.shape)) < q) & valid  # (S, E, H)
        onehot = np.eye(n_ranks)[table]  # (E, H, R)
        per_rank = np.einsum("seh,ehr->sr", hit.astype(np.float64), onehot) / rate
        return float(per_rank.max(1).mean()), float(per_rank.mean())
    samples = samples or max(64, min(2000, 400_000 // max(1, batch * n_experts)))
    worst = mean = 0.0
    logw = np.log(np.where(w > 0, w, 1.0))
    step = max(1, (1 << 22) // (batch * n_experts))  # samples drawn at once
    for first in range(0, samples, step):
        m = min(step, samples - first)
        # k distinct experts per token, weighted (Efraimidis-Spirakis: the k largest keys).
        keys = np.log(rng.random((m, batch, n_experts))) / np.exp(logw)
        keys[..., w <= 0] = -np.inf
        routes = np.argpartition(-keys, k - 1, axis=2)[..., :k]  # (m, batch, k)
        if replicas:  # the holder LocalExperts picks, from the routes alone
            flat = routes.reshape(-1, k)
            ranks = route_holders(flat, table, h).reshape(routes.shape)
        else:
            ranks = table[routes, 0]
        touched = np.zeros((m, n_experts * n_ranks), dtype=bool)
        np.put_along_axis(touched, (routes * n_ranks + ranks).reshape(m, -1), True, axis=1)
        per_rank = touched.reshape(m, n_experts, n_ranks).sum(1) / rate
        worst += per_rank.max(1).sum()
        mean += per_rank.mean(1).sum()
    return float(worst / samples), float(mean / samples)


def _holders(counts, replicas) -> tuple[np.ndarray, np.ndarray]:
    """(E, H) table of the ranks holding each expert (its owner first; short rows padded with
    the owner) and each expert's number of holders."""
    owner = np.repeat(np.arange(len(counts)), counts)
    rows = [[int(o)] for o in owner]
    for e, r in replicas:
        if r not in rows[e]:
            rows[e].append(int(r))
    width = max(len(r) for r in rows)
    table = np.array([r + [r[0]] * (width - len(r)) for r in rows])
    return table, np.array([len(r) for r in rows])


def route_shares(
    counts: list[int],
    popularity: tuple[float, ...] | None = None,
    replicas: tuple[tuple[int, int], ...] = (),
) -> np.ndarray:
    """Each rank's expected share of all routes (its compute share under EP)."""
    table, h = _holders(counts, replicas)
    w = np.ones(len(table)) if popularity is None else np.asarray(popularity, dtype=np.float64)
    w = w / w.sum()
    out = np.zeros(len(counts))
    for e in range(len(table)):
        for j in range(h[e]):
            out[table[e, j]] += w[e] / h[e]
    return out


@dataclass(frozen=True, slots=True)
class _ExpertTimes:
    """Seconds of one forward's routed experts on a stage, under TP and under EP."""

    spec: ModelSpec
    shares: list
    runs: list
    experts: list[int]  # routed experts per rank (EP)
    moe: list[int]  # the stage's MoE layers
    per_expert: float  # bytes of one expert, all layers
    per_param: float  # bytes per parameter
    pops: dict  # each MoE layer's measured route shares, or None
    reps: dict  # each MoE layer's (expert, rank) copies

    def __call__(self, batch: int) -> tuple[float, float, float]:
        """(TP's, EP's expected, EP's mean-rank) seconds of routed experts in one forward."""
        spec, shares, runs, experts = self.spec, self.shares, self.runs, self.experts
        per_expert, per_param = self.per_expert, self.per_param
        if any(self.pops.values()) or any(self.reps.values()):
            return self.measured(batch)
        touched = spec.experts * (1 - (1 - spec.experts_per_tok / spec.experts) ** batch)
        flops = 2 * batch * spec.experts_per_tok * per_expert / per_param  # all ranks together
        tp_s = max(
            max(s.mlp * touched * per_expert / r.mem_bw_Bps, s.mlp * flops / r.flops)
            for s, r in zip(shares, runs, strict=True)
        )
        # Memory-bound: the experts touched on the slowest rank; compute: its share of routes.
        worst, mean = expert_load(
            spec.experts,
            spec.experts_per_tok,
            experts,
            batch,
            [r.mem_bw_Bps / per_expert for r in runs],
        )
        flop_s = max(n / spec.experts * flops / r.flops for n, r in zip(experts, runs, strict=True))
        return tp_s, max(worst, flop_s), max(mean, flop_s)

    def measured(self, batch: int) -> tuple[float, float, float]:
        """The same, layer by layer: each waits for its own slowest rank."""
        spec, shares, runs, experts = self.spec, self.shares, self.runs, self.experts
        per_expert, per_param, moe = self.per_expert, self.per_param, self.moe
        pops, reps = self.pops, self.reps
        k, n_moe = spec.experts_per_tok, max(1, len(moe))
        flops = 2 * batch * k * per_expert / per_param
        tp_bytes = worst = mean = 0.0
        routes = np.zeros(len(runs))
        for i in moe:
            size = spec.expert_bytes_per_layer[i] / spec.experts
            w = np.asarray(pops[i] or [1.0] * spec.experts, dtype=np.float64)
            w = w / w.sum()
            tp_bytes += size * float(np.sum(1 - (1 - np.minimum(1.0, k * w)) ** batch))
            rates = [r.mem_bw_Bps / size for r in runs]
            load = expert_load(spec.experts, k, experts, batch, rates, 256, 0, pops[i], reps[i])
            worst, mean = worst + load[0], mean + load[1]
            routes += route_shares(experts, pops[i], reps[i]) / n_moe
        tp_s = max(
            max(s.mlp * tp_bytes / r.mem_bw_Bps, s.mlp * flops / r.flops)
            for s, r in zip(shares, runs, strict=True)
        )
        flop_s = max(x * flops / r.flops for x, r in zip(routes, runs, strict=True))
        return tp_s, max(worst, flop_s), max(mean, flop_s)


def predict_ep(
    spec: ModelSpec,
    stage: Stage,
    nodes: dict[str, NodeSpec] | list[NodeSpec],
    links: list[LinkSpec],
    prompt_tokens: int = 512,
    concurrency: int = 1,
    kv_dtype_bytes: float = 2.0,
    act_bytes: float = 2.0,
    counts: list[int] | None = None,
    routing: dict[int, tuple[float, ...]] | None = None,
    replicas: tuple[tuple[int, int, int], ...] = (),
    tokens_per_row: int = 1,
) -> EPPrediction:
    """TP and EP over one stage's nodes: attention, dense MLPs and shared experts split as TP
    in both; EP holds whole routed experts (`counts` per rank, default by the TP weights).
    `routing`: each MoE layer's measured share of routes per expert (parallel/routing.py;
    default uniform); `replicas`: (layer, expert, rank) copies of hot experts;
    `tokens_per_row` as cost.predict's (a speculative verify)."""
    if not isinstance(nodes, dict):
        nodes = {n.name: n for n in nodes}
    tp = cost.predict(
        spec,
        [stage],
        nodes,
        links,
        prompt_tokens,
        concurrency,
        kv_dtype_bytes,
        act_bytes,
        tokens_per_row=tokens_per_row,
    )
    weights = list(stage.tp_weights)
    experts = [s.e1 - s.e0 for s in split_experts(spec.experts, weights, counts)]
    shares = cost.shares(spec, stage)
    runs = [cost._as_run(nodes, [stage], stage, s.node, spec.hidden) for s in shares]
    moe = [i for i in range(*stage.layers) if spec.expert_bytes_per_layer[i]]
    per_expert = sum(spec.expert_bytes_per_layer[i] for i in moe) / spec.experts  # all layers
    per_param = spec.total_bytes / spec.params if spec.params else 1.0
    pops = {i: (routing or {}).get(i) for i in moe}
    reps = {i: tuple((e, r) for layer, e, r in replicas if layer == i) for i in moe}

    expert_s = _ExpertTimes(spec, shares, runs, experts, moe, per_expert, per_param, pops, reps)
    tp_dec, ep_dec, ep_mean = expert_s(concurrency * tokens_per_row)
    tp_pre, ep_pre, _ = expert_s(prompt_tokens)
    sync = len(moe) * max(r.op_latency_s for r in runs)
    b = tp.breakdown
    step = b.compute_s + b.memory_s + b.collective_s + b.dispatch_s - tp_dec + ep_dec + sync
    ttft = tp.ttft_s - tp_pre + ep_pre
    ep = Prediction(
        decode_tps=1.0 / step,
        batch_tps=concurrency / step,
        prefill_tps=prompt_tokens / ttft,
        ttft_s=ttft,
        breakdown=_moved(b, ep_dec - tp_dec, sync),
        collectives_per_token=tp.collectives_per_token,
    )
    routed = sum(spec.expert_bytes_per_layer[i] for i in range(*stage.layers))
    head = [cost.head_share([stage], 0, s) for s in shares]
    tp_bytes = [cost.weight_bytes(spec, stage, s, h) for s, h in zip(shares, head, strict=True)]
    ep_bytes = [
        b - s.mlp * routed + n / spec.experts * routed
        for b, s, n in zip(tp_bytes, shares, experts, strict=True)
    ]
    for layer, _, r in replicas:  # each copy is one more expert of that layer on rank r
        if layer in pops:
            ep_bytes[r] += spec.expert_bytes_per_layer[layer] / spec.experts
    return EPPrediction(
        tp=tp,
        ep=ep,
        experts=tuple(experts),
        imbalance=ep_dec / ep_mean if ep_mean else 1.0,
        tp_weight_bytes=tuple(tp_bytes),
        ep_weight_bytes=tuple(ep_bytes),
    )


def ep_costs(spec: ModelSpec, stage: Stage, by_name: dict, links: list, needs, tp_used: dict):
    """(bytes per node, prediction, experts per rank) of EP over a TP stage's nodes, from the
    TP plan's memory use (`needs`: placement's _Needs, with any measured `routing`)."""
    routing = getattr(needs, "routing", None)
    e = predict_ep(
        spec,
        stage,
        by_name,
        links,
        needs.prompt_tokens,
        needs.concurrency,
        needs.kv_dtype_bytes,
        routing=routing,
    )
    used = dict(tp_used)
    for s, tp_b, ep_b in zip(
        cost.shares(spec, stage), e.tp_weight_bytes, e.ep_weight_bytes, strict=True
    ):
        used[s.node] = int(used[s.node] - tp_b + ep_b)
    return used, e.ep, e.experts


def _moved(b: cost.Breakdown, extra_s: float, sync_s: float) -> cost.Breakdown:
    """TP's breakdown with EP's extra expert seconds on its bound (memory or compute)."""
    dispatch = b.dispatch_s + sync_s
    if b.memory_s >= b.compute_s:
        return cost.Breakdown(b.compute_s, b.memory_s + extra_s, b.collective_s, dispatch)
    return cost.Breakdown(b.compute_s + extra_s, b.memory_s, b.collective_s, dispatch)


def ep_rows(spec: ModelSpec, plans: list, cluster, prompt_tokens: int, concurrency: int) -> list:
    """(plan, EPPrediction) for each single-stage TP plan of a MoE model, fastest TP first."""
    if not spec.experts:
        return []
    nodes, links = cluster.specs()
    rows = []
    for p in plans:
        if p.kind == "tp" and len(p.stages) == 1 and len(p.nodes) <= spec.experts:
            stage = p.stages[0]
            rows.append((p, predict_ep(spec, stage, nodes, links, prompt_tokens, concurrency)))
    return rows


def ep_table(rows: list, gb: float):
    """TP against EP over the same nodes: decode, prefill, imbalance and weights per rank."""
    from rich.table import Table

    table = Table(
        "ranks",
        "decode TP",
        "decode EP",
        "EP wait",
        "prefill TP",
        "prefill EP",
        "experts",
        "GB/rank TP / EP",
        title="expert parallelism (--parallel ep) beside TP on the same nodes, tok/s; EP wait: "
        "the slowest rank's expert time over the mean rank's (uniform routing)",
    )
    for p, e in rows:
        table.add_row(
            str(len(p.nodes)),
            f"{e.tp.decode_tps:.1f}",
            f"{e.ep.decode_tps:.1f}",
            f"x{e.imbalance:.2f}",
            f"{e.tp.prefill_tps:.0f}",
            f"{e.ep.prefill_tps:.0f}",
            "+".join(map(str, e.experts)),
            f"{max(e.tp_weight_bytes) / gb:.0f} / {max(e.ep_weight_bytes) / gb:.0f} GB",
        )
    return table


def ep_json(rows: list) -> list[dict]:
    return [
        {
            "nodes": list(p.nodes),
            "tp_decode_tps": e.tp.decode_tps,
            "ep_decode_tps": e.ep.decode_tps,
            "ep_imbalance": e.imbalance,
            "tp_prefill_tps": e.tp.prefill_tps,
            "ep_prefill_tps": e.ep.prefill_tps,
            "experts_per_rank": list(e.experts),
            "tp_weight_bytes": list(e.tp_weight_bytes),
            "ep_weight_bytes": list(e.ep_weight_bytes),
        }
        for p, e in rows
    ]
