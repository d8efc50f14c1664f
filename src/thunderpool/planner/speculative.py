"""What speculative decoding buys a plan (engine/speculate.py), from the same cost model.

Both steps are priced from the per-step terms of cost.py. A verify step runs the target once
over k+1 positions of one sequence (cost.predict(tokens_per_row=k+1)): a fixed part paid once
(the per-matmul dispatch, every collective), the weights and the sequence's cache read once
(MoE layers: the experts that k+1 tokens touch), and per position its FLOPs and, beyond the
first, row_op_latency_s per matmul and row_read_fraction of the weights' read (fitted on CPU,
assumed 0 on Metal: presets.toml). Before it, the draft runs k times, one token each (the
engine does not overlap drafting with verifying). A plain TP plan shards a separate draft like
the target over its nodes where that is faster (engine/draft_load.py, with the draft on every
node): a draft token is then the draft's own TP decode step, its bytes split over the nodes
plus its collectives. Elsewhere (PP, EP, an MTP draft) the leader drafts while the other ranks
wait: the draft's bytes at the leader's bandwidth plus its own dispatch floor. With per-token
acceptance rate a (independent of position), a verify step emits E = (1 - a^(k+1)) / (1 - a)
tokens on average (Leviathan et al. 2023), so tok/s = E / (k * draft_s + verify_s).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from thunderpool.errors import ThunderpoolError
from thunderpool.planner.cost import Prediction, Stage, predict
from thunderpool.planner.hardware import LinkSpec, NodeSpec
from thunderpool.planner.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class SpecPrediction:
    accept: float
    k: int
    plain_tps: float  # the plan's decode tok/s without speculation
    draft_s: float  # one draft token: on the leader's node, or sharded over a TP plan's
    verify_s: float  # one target forward over k+1 tokens
    tokens_per_step: float

    @property
    def decode_tps(self) -> float:
        return self.tokens_per_step / (self.k * self.draft_s + self.verify_s)

    @property
    def speedup(self) -> float:
        return self.decode_tps / self.plain_tps


def expected_tokens(accept: float, k: int) -> float:
    """Tokens a verify step emits on average: accepted drafts plus the target's own one."""
    if not 0 <= accept <= 1:
        raise ValueError(f"acceptance rate {accept} must be in [0, 1]")
    if accept == 1:
        return k + 1.0
    return (1 - accept ** (k + 1)) / (1 - accept)


# Families whose published checkpoints ship an MTP layer (DeepSeek V3/R1 and V3.2, GLM-4.5
# and GLM-5); the engine drafts with those of deepseek_v3 and glm4_moe (engine/mtp.py).
MTP_FAMILIES = frozenset({"deepseek_v3", "deepseek_v32", "glm4_moe", "glm_moe_dsa"})


def mtp_draft(spec: ModelSpec) -> ModelSpec:
    """The model's own multi-token-prediction layer as its draft (`--draft mtp`, engine/mtp.py):
    one decoder layer like the model's last (DeepSeek V3's and GLM's MTP layers are MoE
    layers), plus eh_proj (2 x hidden -> hidden, stored like the head), the embedding and the
    output head, all read on the leader for each draft token."""
    if spec.model_type not in MTP_FAMILIES:
        raise ThunderpoolError(
            f"--draft mtp prices the model's own multi-token-prediction layer, which "
            f"{spec.model_type} checkpoints do not ship (those of {', '.join(sorted(MTP_FAMILIES))}"
            " do); use --draft NAME for a separate draft model"
        )
    width = (spec.head_bytes or spec.embed_bytes) / (spec.vocab * spec.hidden)
    eh_params = 2 * spec.hidden * spec.hidden
    eh_bytes = int(eh_params * width)

    def last(values: tuple, extra: float = 0) -> tuple:
        return (type(values[-1])(values[-1] + extra),) if values else ()

    draft = replace(
        spec,
        layers=1,
        bytes_per_layer=last(spec.bytes_per_layer, eh_bytes),
        attn_bytes_per_layer=last(spec.attn_bytes_per_layer),
        kv_proj_bytes_per_layer=last(spec.kv_proj_bytes_per_layer),
        expert_bytes_per_layer=last(spec.expert_bytes_per_layer),
        active_params_per_layer=last(spec.active_params_per_layer, eh_params),
        matmuls_per_layer=last(spec.matmuls_per_layer, 1),
        dispatches_per_layer=last(spec.dispatches_per_layer, 1),
        routed_active_per_layer=last(spec.routed_active_per_layer),
        compress_ratios=last(spec.compress_ratios),
    )
    share = draft.total_bytes / spec.total_bytes
    head = spec.vocab * spec.hidden
    return replace(
        draft,
        params=int(spec.params * share),
        active_params=draft.active_params_per_layer[0] + head,
    )


def best_k(accept: float, draft_s: float, verify_s_of, k_max: int = 16) -> int:
    """The draft length with the most tokens per second (`verify_s_of(k)`: a verify's time)."""
    return max(
        range(1, k_max + 1),
        key=lambda k: expected_tokens(accept, k) / (k * draft_s + verify_s_of(k)),
    )


def decode(
    spec: ModelSpec,
    stages,
    nodes: dict[str, NodeSpec],
    links: list[LinkSpec],
    prompt_tokens: int,
    tokens: int = 1,
    kind: str = "tp",
    experts: tuple[int, ...] | None = None,
    compiled: bool = False,
) -> Prediction:
    """A layout's decode step over `tokens` positions of one sequence as the planner prices
    its kind: an EP plan's with whole experts per rank (planner/ep.py), any other with
    cost.predict."""
    if kind == "ep":
        from thunderpool.planner.ep import predict_ep

        counts = list(experts) if experts else None
        return predict_ep(
            spec, stages[0], nodes, links, prompt_tokens, counts=counts, tokens_per_row=tokens
        ).ep
    return predict(
        spec, stages, nodes, links, prompt_tokens, compiled=compiled, tokens_per_row=tokens
    )


def predict_speculative(
    spec: ModelSpec,
    stages: list[Stage] | tuple[Stage, ...],
    nodes: dict[str, NodeSpec],
    links: list[LinkSpec],
    draft: ModelSpec,
    accept: float,
    k: int,
    prompt_tokens: int = 512,
    kind: str = "tp",
    experts: tuple[int, ...] | None = None,
    compiled: bool = False,
    shard_draft: bool = True,
) -> SpecPrediction:
    """A layout's decode with a draft: sharded like a plain TP plan's target where
    `shard_draft` (a separate draft; an MTP draft is the leader's), else on its leader (the
    first stage's first node); `kind`, `experts` and `compiled` as the plan's, so an EP plan
    is priced as EP."""
    how = {"kind": kind, "experts": experts, "compiled": compiled}
    plain = decode(spec, stages, nodes, links, prompt_tokens, **how)
    verify = decode(spec, stages, nodes, links, prompt_tokens, k + 1, **how)
    first = stages[0]
    alone = (Stage((first.nodes[0],), (0, draft.layers), (1.0,)),)
    draft_s = 1 / predict(draft, alone, nodes, links, prompt_tokens, compiled=compiled).decode_tps
    if shard_draft and kind == "tp" and len(stages) == 1 and len(first.nodes) > 1:
        # The engine keeps the shard only where its token is faster (draft_load.py).
        tp = (Stage(first.nodes, (0, draft.layers), first.tp_weights),)
        sharded = predict(draft, tp, nodes, links, prompt_tokens, compiled=compiled)
        draft_s = min(draft_s, 1 / sharded.decode_tps)
    return SpecPrediction(
        accept=accept,
        k=k,
        plain_tps=plain.decode_tps,
        draft_s=draft_s,
        verify_s=1.0 / verify.decode_tps,
        tokens_per_step=expected_tokens(accept, k),
    )


def one_node_tps(spec, plans, nodes, links, prompt_tokens: int) -> float:
    """The best one-node plan's plain decode tok/s (one row) among `plans`; 0: none fits."""
    ones = [p for p in plans if len(p.nodes) == 1]
    return max(
        (
            decode(spec, p.stages, nodes, links, prompt_tokens, compiled=p.compiled).decode_tps
            for p in ones
        ),
        default=0.0,
    )


@dataclass(frozen=True, slots=True)
class SpecRow:
    """One plan of `simulate --spec-accept`: its speculative decode at its k."""

    kind: str
    nodes: int
    spec: SpecPrediction
    baseline_tps: float  # the best one-node plan's plain decode (0: no node holds the model)

    @property
    def vs_one_node(self) -> float | None:
        return self.spec.decode_tps / self.baseline_tps if self.baseline_tps else None


def spec_rows(
    spec, shown, plans, cluster, draft, accept: float, k: int, prompt_tokens: int, shard=True
):
    """Each shown plan with the draft (k=0: the best k per plan; `shard`: predict_speculative's
    shard_draft), against the best one-node plan of all `plans` without speculation, listed
    among `shown` or not."""
    listed, links = cluster.specs()
    nodes = {n.name: n for n in listed}
    base = one_node_tps(spec, plans, nodes, links, prompt_tokens)
    rows = []
    for p in shown:
        how = {"kind": p.kind, "experts": p.experts, "compiled": p.compiled, "shard_draft": shard}

        def verify_s(kk: int, p=p, how=how) -> float:
            kind = {"kind": how["kind"], "experts": how["experts"], "compiled": how["compiled"]}
            v = decode(spec, p.stages, nodes, links, prompt_tokens, kk + 1, **kind)
            return 1.0 / v.decode_tps

        kk = k
        if not kk:
            one = predict_speculative(
                spec, p.stages, nodes, links, draft, accept, 1, prompt_tokens, **how
            )
            kk = best_k(accept, one.draft_s, verify_s)
        s = predict_speculative(
            spec, p.stages, nodes, links, draft, accept, kk, prompt_tokens, **how
        )
        rows.append(SpecRow(p.kind, len(p.nodes), s, base))
    return rows


def spec_table(
    spec, shown, plans, cluster, draft, accept: float, k: int, prompt_tokens: int, shard=True
):
    """`simulate --spec-accept`: each shown plan with and without the draft, and its decode
    against the best one-node plan without speculation (spec_rows)."""
    from rich.table import Table

    rows = spec_rows(spec, shown, plans, cluster, draft, accept, k, prompt_tokens, shard)
    base = rows[0].baseline_tps if rows else 0.0
    table = Table("kind", "nodes", "plain tok/s", "k", "spec tok/s", "speedup", "vs one node")
    table.title = f"speculative decoding, acceptance {accept}" + (
        f"; vs one node: against {base:.1f} tok/s (the best one-node plan, no draft)"
        if base
        else "; no one-node plan holds the model"
    )
    if shard:
        table.caption = (
            "TP plans shard the draft over their nodes where its token is faster so "
            "(with the draft on every node)"
        )
    for r in rows:
        s = r.spec
        table.add_row(
            r.kind,
            str(r.nodes),
            f"{s.plain_tps:.1f}",
            str(s.k),
            f"{s.decode_tps:.1f}",
            f"{s.speedup:.2f}x",
            f"{r.vs_one_node:.2f}x" if r.vs_one_node else "-",
        )
    return table
