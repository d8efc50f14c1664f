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

import math
from dataclasses import dataclass, replace
from typing import Literal

from thunderpool.errors import ThunderpoolError
from thunderpool.parallel.tensor import split_heads
from thunderpool.planner import dispatch
from thunderpool.planner.spec import ModelSpec

LinkKind = Literal["rdma", "thunderbolt", "ethernet", "wifi", "loopback"]
LINK_KINDS = ("rdma", "thunderbolt", "ethernet", "wifi", "loopback")


# Weight rows (floats) of the two GEMVs agents time. CPU BLASes stream short rows slower (BLIS
# here: 14 GB/s at 576, 25 at 2048 and 4096); rows of FULL_ROW or more stream at the full rate.
SHORT_ROW, FULL_ROW, LONG_ROW = 512, 2048, 4096
CONTROL_BYTES = 512  # engine/control.py's header: one per decode step on >1 rank
# Unfused attention (head widths MLX's fused decode kernel lacks, e.g. MLA's 576) writes and
# reads 2-byte scores per head per cached token ~8 times: QK, mask, softmax, PV.
SCORE_BYTES = 16
# Prefill runs in chunks of PREFILL_CHUNK tokens (mlx-lm's prefill_step_size, which every
# published prefill figure used); a routed expert sees chunk x k / E of them, and a matmul
# over m rows reaches m / (m + EXPERT_ROWS_HALF) of the rate dense matmuls over a whole chunk
# reach (flops_efficiency). Fitted on mlx-lm's Qwen3-30B-A3B prefill ladder (docs/simulator.md).
PREFILL_CHUNK = 2048
EXPERT_ROWS_HALF = 52.0


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A machine: memory (bytes), sustained memory bandwidth (B/s) and matmul FLOP/s.

    A plan's use of a node (weights + KV + activations + os_reserve_bytes) must stay within
    available_bytes, the memory the agent reports free for models.
    """

    name: str
    memory_bytes: int
    available_bytes: int
    mem_bw_Bps: float
    flops: float
    os_reserve_bytes: int = 0
    # Seconds a decode step pays per weight matmul whatever its size (launch + sync).
    op_latency_s: float = 0.0
    # And per matmul for each row (or verified position) beyond the first: the host and
    # kernel work a batched step repeats per row besides its products (presets.toml).
    row_op_latency_s: float = 0.0
    # Each such row also re-pays this fraction of the weights' read time: a few-row CPU
    # product streams its weights slower than a one-row one (presets.toml).
    row_read_fraction: float = 0.0
    # Nodes with the same non-empty `host` share one machine (e.g. several agents on one box):
    # its memory, its `cores`, and `host_mem_bw_Bps`, the bandwidth all its cores reach together.
    host: str = ""
    cores: int = 0
    host_mem_bw_Bps: float = 0.0
    # A rank pinned to one core (see pins_cores) streams and computes at these rates instead.
    core_mem_bw_Bps: float = 0.0
    core_flops: float = 0.0
    core_op_latency_s: float = 0.0  # 0: op_latency_s
    # mem_bw_Bps is measured with weight rows of LONG_ROW floats; this with SHORT_ROW (0: the
    # same). A model whose rows are shorter than FULL_ROW streams between the two (row_rate).
    short_row_mem_bw_Bps: float = 0.0
    # An unpinned rank's compiled decode step splits each product over the cores
    # (engine/rowsplit.py) and streams at this rate instead (0: not measured, no split).
    split_mem_bw_Bps: float = 0.0

    def __post_init__(self):
        if self.mem_bw_Bps <= 0 or self.flops <= 0:
            raise ThunderpoolError(
                f"node {self.name!r} has mem_bw_Bps={self.mem_bw_Bps} and flops={self.flops}; "
                "both must be positive (measure them with `thunderpool node`)"
            )
        if self.available_bytes > self.memory_bytes:
            raise ThunderpoolError(
                f"node {self.name!r} reports {self.available_bytes} bytes available but only "
                f"{self.memory_bytes} in total; fix available_bytes"
            )


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """A link between nodes a and b; latency_s is one-way (half the measured RTT).

    overhead_s is the fixed software cost of one collective over it (the backend call and
    the GPU/CPU stream sync around it), paid once per all-reduce or hop.
    """

    a: str
    b: str
    latency_s: float
    bandwidth_Bps: float
    kind: LinkKind
    overhead_s: float = 0.0

    def __post_init__(self):
        if self.kind not in LINK_KINDS:
            raise ThunderpoolError(
                f"link {self.a}-{self.b} has kind {self.kind!r}; use one of {', '.join(LINK_KINDS)}"
            )
        if self.latency_s < 0 or self.bandwidth_Bps <= 0:
            raise ThunderpoolError(
                f"link {self.a}-{self.b} has latency {self.latency_s} s and bandwidth "
                f"{self.bandwidth_Bps} B/s; latency must be >= 0 and bandwidth > 0"
            )

    def hop_s(self, nbytes: float) -> float:
        """One point-to-point message."""
        return self.overhead_s + self.latency_s + nbytes / self.bandwidth_Bps

    def all_gather_s(self, nbytes: float, n: int) -> float:
        """All-gather of nbytes in all, each of n ranks contributing nbytes / n: one latency
        over RDMA's mesh, n - 1 ring steps over TCP."""
        moved = (n - 1) / n * nbytes / self.bandwidth_Bps
        steps = 1 if self.kind == "rdma" else n - 1
        return self.overhead_s + steps * self.latency_s + moved

    def all_reduce_s(self, nbytes: float, n: int) -> float:
        """All-reduce of nbytes over n ranks.

        RDMA (MLX jaccl's mesh) sends the whole buffer to every peer at once: one latency,
        but each rank sends and sums n-1 copies (jaccl's mesh all_reduce), priced here as
        moving at one link's rate together: priced as parallel, exo's GLM-5 TP4 prefill of
        123 MB all_sums came out 28% fast (TP2 +9%). Ring (TCP): 2(n-1) steps of nbytes/n.
        """
        if self.kind == "rdma":
            return self.overhead_s + self.latency_s + (n - 1) * nbytes / self.bandwidth_Bps
        ring = 2 * (n - 1) / n * nbytes / self.bandwidth_Bps + 2 * (n - 1) * self.latency_s
        return self.overhead_s + ring


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
        # Prefill: one prompt, compute-bound; attention covers half the square on average.
        prefill += max(
            max(
                _prefill_time(
                    spec,
                    stage,
                    s,
                    _as_run(nodes, stages, stage, s.node, hidden),
                    head_share(stages, k, s),
                    prompt_tokens,
                )
            )
            for s in ranks
        )
        if len(ranks) > 1:
            # Each message on the group's slowest link for its size: a small all-reduce waits
            # on latency, the logits' gather on bandwidth, which two different links may set.
            n, step, prompt = len(ranks), batch * hidden * act_bytes, prompt_tokens * hidden
            link = _slowest(links, stage.nodes, step)
            long = _slowest(links, stage.nodes, prompt * act_bytes)
            n_reduce = 2 * stage.n_layers
            collective += n_reduce * link.all_reduce_s(step, n)
            prefill += n_reduce * long.all_reduce_s(prompt * act_bytes, n)
            n_coll += n_reduce
            if len(stages) == 1:
                # The split vocabulary (parallel/vocab.py): the embedding's all_sum of the
                # looked-up rows, and the logits gathered once per forward.
                collective += link.all_reduce_s(step, n)
                prefill += long.all_reduce_s(prompt * act_bytes, n)
                logits = spec.vocab * act_bytes
                wide = _slowest(links, stage.nodes, batch * logits)
                collective += wide.all_gather_s(batch * logits, n)
                prefill += _slowest(links, stage.nodes, logits).all_gather_s(logits, n)
                n_coll += 2
    everyone = tuple(n for s in stages for n in s.nodes)
    if len(everyone) > 1:
        # The leader's per-step command: one small all_sum around the ring of all ranks.
        ring = zip(everyone, everyone[1:] + everyone[:1], strict=True)
        hops = [_fastest(links, (a,), (b,), CONTROL_BYTES) for a, b in ring if a != b]
        control = max(hops, key=lambda x: x.all_reduce_s(CONTROL_BYTES, len(everyone)))
        collective += control.all_reduce_s(CONTROL_BYTES, len(everyone))
        n_coll += 1
    if len(stages) > 1:
        for k, stage in enumerate(stages):
            nxt = stages[(k + 1) % len(stages)]
            link = _fastest(links, stage.nodes, nxt.nodes, batch * hidden * act_bytes)
            collective += link.hop_s(batch * hidden * act_bytes)
            prefill += link.hop_s(prompt_tokens * hidden * act_bytes)
            n_coll += 1
    step = compute + memory + collective + dispatch
    return Prediction(
        decode_tps=1.0 / step,
        batch_tps=concurrency / step,
        prefill_tps=prompt_tokens / prefill,
        ttft_s=prefill,
        breakdown=Breakdown(compute, memory, collective, dispatch),
        collectives_per_token=n_coll,
    )


def pins_cores(ranks_on_host: int, cores: int) -> bool:
    """Ranks sharing a machine each get a core of their own when there are enough: ring ranks
    busy-poll, so two on one core stall each other's collectives (coordinator.core_assignment)."""
    return 1 < ranks_on_host <= cores


def row_rate(node: NodeSpec, row: int) -> float:
    """The share of its long-row GEMV rate the node reaches on weight rows of `row` floats:
    geometric between the two measured lengths up to FULL_ROW; 1 if only one was measured."""
    if node.short_row_mem_bw_Bps <= 0 or row >= FULL_ROW:
        return 1.0
    ratio = min(1.0, node.short_row_mem_bw_Bps / node.mem_bw_Bps)
    t = max(0.0, math.log(row / SHORT_ROW) / math.log(FULL_ROW / SHORT_ROW))
    return ratio ** (1.0 - t)


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


def link_between(links: list[LinkSpec], a: str, b: str) -> list[LinkSpec]:
    """Every link joining a and b, in either direction."""
    return [x for x in links if {x.a, x.b} == {a, b}]


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


def _slowest(links: list[LinkSpec], group: tuple[str, ...], nbytes: float) -> LinkSpec:
    """The slowest of the best links between every pair of a TP group."""
    pairs = [(a, b) for i, a in enumerate(group) for b in group[i + 1 :]]
    best = [_fastest(links, (a,), (b,), nbytes) for a, b in pairs]
    return max(best, key=lambda x: x.all_reduce_s(nbytes, len(group)))


def _fastest(
    links: list[LinkSpec], left: tuple[str, ...], right: tuple[str, ...], nbytes: float
) -> LinkSpec:
    """The quickest link for an nbytes message between any node of `left` and of `right`."""
    found = [x for a in left for b in right for x in link_between(links, a, b)]
    if not found:
        raise ThunderpoolError(
            f"no link between {', '.join(left)} and {', '.join(right)}; probe the links "
            "(`thunderpool status`) or plan without one of these nodes"
        )
    return min(found, key=lambda x: x.hop_s(nbytes))
