"""Roofline cost model: predicted decode and prefill speed of a layout over nodes and links.

Each rank's decode time is max(bytes read / memory bandwidth, FLOPs / compute) plus a fixed
dispatch cost per weight matmul (kernel launch and sync: it does not shrink when TP splits the
matmul), plus, for a step of several rows (a batch, or a verify's positions), a cost per
matmul and a fraction of the weights' read for each row beyond the first. A TP stage runs
its ranks in parallel (the slowest rank sets the pace) and pays 2 all-reduces per layer; a
pure TP layout also splits the vocabulary over its ranks: one all-reduce of the embedded
tokens and one gather of the logits per step (parallel/vocab.py).
PP stages run one after another for a single stream and pay one hop per stage boundary, plus
the hop that returns the last hidden state to rank 0 (which holds the embedding and output
head). Every collective also pays its link's fixed software overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from thunderpool.parallel.heads import split_heads
from thunderpool.planner import dispatch
from thunderpool.planner.collectives import step_links, tp_collectives
from thunderpool.planner.hardware import (
    EXPERT_ROWS_HALF,
    PREFILL_CHUNK,
    SCORE_BYTES,
    LinkSpec,
    NodeSpec,
    pins_cores,
    row_rate,
)
from thunderpool.planner.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class Stage:
    """Layers [start, end) run by `nodes` in TP with `tp_weights` (one node: no TP)."""

    nodes: tuple[str, ...]
    layers: tuple[int, int]
    tp_weights: tuple[float, ...]

    @property
    def n_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True, slots=True)
class Share:
    """The fraction of one stage a rank holds: query heads, KV heads, MLP channels."""

    node: str
    q: float
    kv: float  # a KV head replicated over ranks counts fully on each
    mlp: float


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Seconds per decode step on the critical path; the four add up to the step time."""

    compute_s: float
    memory_s: float
    collective_s: float
    dispatch_s: float = 0.0  # per-matmul launch/sync floor (NodeSpec.op_latency_s)


@dataclass(frozen=True, slots=True)
class Prediction:
    """decode_tps is per stream; batch_tps counts all `concurrency` streams of a step."""

    decode_tps: float
    batch_tps: float
    prefill_tps: float
    ttft_s: float
    breakdown: Breakdown
    collectives_per_token: int


def shares(spec: ModelSpec, stage: Stage) -> list[Share]:
    """Each rank's share of a stage; raises ShardingError where split_heads would."""
    if len(stage.nodes) == 1:
        return [Share(stage.nodes[0], 1.0, 1.0, 1.0)]
    weights = list(stage.tp_weights)
    heads = split_heads(spec.heads, spec.kv_heads, weights, spec.head_unit)
    total = sum(weights)
    return [
        Share(node, (h.q1 - h.q0) / spec.heads, (h.kv1 - h.kv0) / spec.kv_heads, w / total)
        for node, h, w in zip(stage.nodes, heads, weights, strict=True)
    ]


def head_share(stages: tuple[Stage, ...] | list[Stage], k: int, share: Share) -> float:
    """The fraction of the output head a rank of stage k runs: every rank of the first stage
    runs it whole, except in a pure TP layout, which splits it by the ranks' weights."""
    if k:
        return 0.0
    return share.mlp if len(stages) == 1 and len(stages[0].nodes) > 1 else 1.0


def weight_bytes(spec: ModelSpec, stage: Stage, share: Share, head: float) -> float:
    """Bytes of weights a rank holds (`head`: see head_share). A split vocabulary keeps its
    rows of the embedding and of an untied head (a tied head is those same rows)."""
    io = 0.0
    if head == 1.0:
        io = _io_bytes(spec)
    elif head:
        io = (spec.embed_bytes + spec.head_bytes) * head + spec.norm_bytes
    return _layer_bytes(spec, stage, share, batch=None) + io


def read_bytes(spec: ModelSpec, stage: Stage, share: Share, head: float, batch: int) -> float:
    """Weight bytes a rank reads in one forward of `batch` tokens (MoE: experts touched)."""
    out = spec.output_bytes * head + spec.norm_bytes if head else 0
    return _layer_bytes(spec, stage, share, batch) + out


def kv_bytes(spec: ModelSpec, stage: Stage, share: Share, tokens: int, kv_dtype_bytes: float):
    """KV-cache bytes a rank holds for `tokens` cached tokens (all sequences together)."""
    per_layer = spec.kv_bytes_per_token_per_layer * kv_dtype_bytes / spec.kv_dtype_bytes
    return tokens * per_layer * stage.n_layers * share.kv


def kv_read_bytes(
    spec, stage, share, batch: int, kv_len: float, kv_dtype_bytes: float, rows: int = 0
) -> float:
    """Bytes one decode step of `batch` tokens in `rows` sequences (0: one each) moves over the
    cache: one pass per sequence when MLX's fused kernel takes the head width; else separate K
    and V passes (MLA's K and V are the same latent) plus each token's scores."""
    cache = kv_bytes(spec, stage, share, (rows or batch) * kv_len, kv_dtype_bytes)
    if spec.attn_fused:
        return cache
    scores = SCORE_BYTES * spec.heads * share.q * batch * kv_len * stage.n_layers
    return 2 * cache + scores


def predict(
    spec: ModelSpec,
    stages: list[Stage] | tuple[Stage, ...],
    nodes: dict[str, NodeSpec],
    links: list[LinkSpec],
    prompt_tokens: int = 512,
    concurrency: int = 1,
    kv_dtype_bytes: float = 2.0,
    act_bytes: float = 2.0,
    compiled: bool = False,
    tokens_per_row: int = 1,
) -> Prediction:
    """Predict a layout's speed; decode is measured right after a `prompt_tokens` prompt.
    `compiled`: decode steps run the compiled, fused step (its kernels: planner/dispatch.py)
    where the family has one. `tokens_per_row`: positions each row runs in the step (a
    speculative verify: k+1 of one sequence, which read its cache once)."""
    batch, hidden = concurrency * tokens_per_row, spec.hidden
    compute = memory = collective = dispatch = 0.0
    n_coll = 0
    prefill = 0.0
    for k, stage in enumerate(stages):
        ranks = shares(spec, stage)
        # Decode: batch tokens, each attending over prompt_tokens cached tokens.
        times = [
            _rank_time(
                spec,
                stage,
                s,
                _as_run(nodes, stages, stage, s.node, hidden, compiled),
                head_share(stages, k, s),
                batch,
                prompt_tokens,
                kv_dtype_bytes,
                compiled,
                concurrency,
            )
            for s in ranks
        ]
        mem_s, flop_s, disp_s = max(times, key=lambda t: max(t[:2]) + t[2])
        memory += mem_s if mem_s >= flop_s else 0.0
        compute += flop_s if flop_s > mem_s else 0.0
        dispatch += disp_s
        prefill += _stage_prefill(spec, stages, k, ranks, nodes, prompt_tokens)
        if len(ranks) > 1:
            decode_terms, prefill_terms = tp_collectives(
                spec,
                stage.nodes,
                stage.n_layers,
                links,
                len(ranks),
                batch,
                prompt_tokens,
                act_bytes,
                len(stages) == 1,
            )
            for t in decode_terms:
                collective += t
            for t in prefill_terms:
                prefill += t
            n_coll += 2 * stage.n_layers + (2 if len(stages) == 1 else 0)
    decode_terms, prefill_terms = step_links(
        stages, links, batch * hidden, prompt_tokens * hidden, act_bytes
    )
    for t in decode_terms:
        collective += t
    for t in prefill_terms:
        prefill += t
    n_coll += len(decode_terms)
    step = compute + memory + collective + dispatch
    return Prediction(
        decode_tps=1.0 / step,
        batch_tps=concurrency / step,
        prefill_tps=prompt_tokens / prefill,
        ttft_s=prefill,
        breakdown=Breakdown(compute, memory, collective, dispatch),
        collectives_per_token=n_coll,
    )


def _stage_prefill(spec: ModelSpec, stages, k: int, ranks, nodes, prompt_tokens: int) -> float:
    """Stage k's prefill of one prompt, its slowest rank's: compute-bound; attention covers
    half the square on average."""
    stage = stages[k]
    return max(
        max(
            _prefill_time(
                spec,
                stage,
                s,
                _as_run(nodes, stages, stage, s.node, spec.hidden),
                head_share(stages, k, s),
                prompt_tokens,
            )
        )
        for s in ranks
    )


def _as_run(
    nodes: dict[str, NodeSpec],
    stages: tuple[Stage, ...] | list[Stage],
    stage: Stage,
    name: str,
    row: int,
    compiled: bool = False,
) -> NodeSpec:
    """The node as its rank in this plan sees it: streaming rows of `row` floats, pinned to
    one core when the plan puts several ranks on its machine, else (`compiled` decode) with
    each product split over its cores, and sharing the machine's bandwidth with co-located
    peers of its TP stage, which run at the same time (PP stages take turns)."""
    node = nodes[name]
    rate = row_rate(node, row)
    if rate < 1.0:
        node = replace(
            node,
            mem_bw_Bps=node.mem_bw_Bps * rate,
            core_mem_bw_Bps=node.core_mem_bw_Bps * rate,
            host_mem_bw_Bps=node.host_mem_bw_Bps * rate,
            split_mem_bw_Bps=node.split_mem_bw_Bps * rate,
        )
    on_host = sum(1 for s in stages for n in s.nodes if node.host and nodes[n].host == node.host)
    pinned = pins_cores(on_host, node.cores) and node.core_mem_bw_Bps > 0
    if compiled and not pinned and node.split_mem_bw_Bps > node.mem_bw_Bps:
        node = replace(node, mem_bw_Bps=node.split_mem_bw_Bps)
    if not node.host:
        return node
    if pinned:
        flops = node.core_flops or node.flops
        op = node.core_op_latency_s or node.op_latency_s
        node = replace(node, mem_bw_Bps=node.core_mem_bw_Bps, flops=flops, op_latency_s=op)
    k = sum(1 for n in stage.nodes if nodes[n].host == node.host)
    if k <= 1 or node.host_mem_bw_Bps <= 0:
        return node
    return replace(node, mem_bw_Bps=min(node.mem_bw_Bps, node.host_mem_bw_Bps / k))


def _layer_bytes(spec: ModelSpec, stage: Stage, share: Share, batch: int | None) -> float:
    total = 0.0
    for i in range(*stage.layers):
        attn, kvp = spec.attn_bytes_per_layer[i], spec.kv_proj_bytes_per_layer[i]
        layer = spec.bytes_per_layer[i] if batch is None else spec.layer_read_bytes(i, batch)
        total += (attn - kvp) * share.q + kvp * share.kv + (layer - attn) * share.mlp
    return total


def _io_bytes(spec: ModelSpec) -> int:
    return spec.embed_bytes + spec.head_bytes + spec.norm_bytes


def _flops(spec: ModelSpec, stage: Stage, share: Share, head: float, kv_len: float) -> float:
    """FLOPs of one token on this rank: 2 per active parameter, plus QK and AV over kv_len.

    Projections TP replicates (kv_proj bytes, at the model's mean bytes per parameter) run
    whole on every rank, like their bytes.
    """
    per_param = spec.total_bytes / spec.params if spec.params else 1.0
    params = 0.0
    for i in range(*stage.layers):
        whole = min(spec.kv_proj_bytes_per_layer[i] / per_param, spec.active_params_per_layer[i])
        params += (spec.active_params_per_layer[i] - whole) * share.mlp + whole * share.kv
    width = spec.attn_dim or 2 * spec.head_dim
    attended = sum(spec.attended(i, kv_len) for i in range(*stage.layers))
    attn = 2 * spec.heads * width * attended
    return 2 * params + attn * share.q + 2 * spec.vocab * spec.hidden * head


def _matmuls(spec: ModelSpec, stage: Stage, head: float, compiled: bool = False) -> float:
    """A decode step's kernels on a rank of this stage, in llama-matmul units (planner/
    dispatch.py; +1 for the output head): what op_latency_s is paid per. `compiled`: those
    of the compiled step, on the families that have one."""
    per_layer = spec.dispatches_per_layer or spec.matmuls_per_layer
    if compiled and spec.model_type in dispatch.COMPILED_FAMILIES:
        routed = spec.expert_bytes_per_layer or (0,) * spec.layers
        tp = len(stage.nodes) > 1
        per_layer = [dispatch.compiled_layer_kernels(spec.model_type, r > 0, tp) for r in routed]
    return sum(per_layer[i] for i in range(*stage.layers)) + (head > 0) if per_layer else 0


def _rank_time(
    spec, stage, share, node, head, batch, kv_len, kv_dtype_bytes, compiled=False, rows=0
):
    """(memory seconds, compute seconds, dispatch seconds) of one decode step of `batch` tokens
    in `rows` sequences (0: one each) on one rank."""
    extra_reads = (batch - 1) * node.row_read_fraction
    nbytes = read_bytes(spec, stage, share, head, batch) * (1 + extra_reads)
    nbytes += kv_read_bytes(spec, stage, share, batch, kv_len, kv_dtype_bytes, rows)
    flops = batch * _flops(spec, stage, share, head, kv_len)
    per_matmul = node.op_latency_s + (batch - 1) * node.row_op_latency_s
    return (
        nbytes / node.mem_bw_Bps,
        flops / node.flops,
        _matmuls(spec, stage, head, compiled) * per_matmul,
    )


def _prefill_time(spec, stage, share, node, head, tokens):
    """(memory seconds, compute seconds) of a `tokens`-long prompt on one rank; the routed
    experts' FLOPs run at expert_efficiency."""
    nbytes = read_bytes(spec, stage, share, head, tokens)
    flops = tokens * _flops(spec, stage, share, head, tokens / 2)
    routed = spec.routed_active_per_layer
    experts = 2 * tokens * share.mlp * sum(routed[i] for i in range(*stage.layers)) if routed else 0
    slow = experts / expert_efficiency(spec, tokens) - experts
    return nbytes / node.mem_bw_Bps, (flops + slow) / node.flops


def expert_efficiency(spec: ModelSpec, tokens: int) -> float:
    """The rate of a routed expert's prefill matmul against a dense one over the whole chunk:
    each expert sees m = chunk x k / E rows (see EXPERT_ROWS_HALF)."""
    if not spec.experts or EXPERT_ROWS_HALF <= 0:
        return 1.0
    chunk = min(tokens, PREFILL_CHUNK)
    m = chunk * spec.experts_per_tok / spec.experts
    return (m / (m + EXPERT_ROWS_HALF)) / (chunk / (chunk + EXPERT_ROWS_HALF))
