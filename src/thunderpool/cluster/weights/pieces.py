"""Which pieces of a model one rank loads (rank_pieces): its stage's tensors (PP), its heads' and
channels' slices (TP), or those plus its whole experts (EP), as the loader cuts them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from thunderpool.cluster.weights.shards import (
    _ATTENTION,
    _EXPERT,
    _GLU,
    _LAYER,
    _MLP,
    _PLAIN_EMBEDDING,
    ModelIndex,
    Piece,
)
from thunderpool.errors import ShardingError
from thunderpool.models import shape
from thunderpool.parallel.experts import ExpertShare, routed_experts, split_experts
from thunderpool.parallel.heads import proportional_split, split_heads
from thunderpool.parallel.packing import Packing, from_config, head_unit
from thunderpool.parallel.pipeline import split_layers


class RankLayout(BaseModel):
    """The layout one rank loads, as engine.job.RankJob states it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rank: int
    world: int
    parallel: str = "tp"
    tp_weights: tuple[float, ...] | None = None
    layer_split: tuple[int, ...] | None = None
    expert_split: tuple[int, ...] | None = None  # EP: routed experts per rank
    expert_replicas: tuple[tuple[int, int, int], ...] | None = None  # EP: (layer, expert, rank)
    # Hybrid TP×PP: this TP rank's stage of `stages` (layers cut by layer_split), or None.
    stage: int | None = Field(None, ge=0)
    stages: int = Field(1, ge=1)


def rank_pieces(index: ModelIndex, layout: RankLayout) -> list[Piece]:
    """Exactly what this rank's loader reads: its stage's tensors (PP), its heads' and
    channels' slices (TP), or those plus its whole experts (EP), and every non-weight file."""
    files = [Piece(name=f"file:{f}") for f in index.files]
    names = sorted(index.tensors)
    if layout.stage is not None:  # hybrid: the stage's tensors, TP-sliced over its group
        stage = layout.stage, layout.stages
        names = [n for n in names if _in_stage(n, index.config, layout, *stage)]
    if layout.world == 1:
        return files + [Piece(name=n) for n in names]
    if layout.parallel == "pp":
        stage = layout.rank, layout.world
        return files + [Piece(name=n) for n in names if _in_stage(n, index.config, layout, *stage)]
    if layout.parallel == "ep":
        share = expert_share(index.config, layout)
        extra: dict[int, set[int]] = {}  # layer -> replicated experts this rank also holds
        for layer, e, r in layout.expert_replicas or ():
            if r == layout.rank:
                extra.setdefault(layer, set()).add(e)
        return files + [_ep_piece(n, index, layout, share, extra) for n in names]
    return files + [_tp_piece(n, index, layout) for n in names]


def expert_share(config: dict, layout: RankLayout) -> ExpertShare:
    """The routed experts this EP rank holds, split as parallel/experts.py splits them."""
    n = routed_experts(config)
    if not n:
        raise ShardingError(
            f"--parallel ep needs a MoE model; {config.get('model_type')} has no routed experts"
        )
    weights = list(layout.tp_weights or [1.0] * layout.world)
    counts = list(layout.expert_split) if layout.expert_split else None
    return split_experts(n, weights, counts)[layout.rank]


def _ep_piece(
    name: str, index: ModelIndex, layout: RankLayout, share: ExpertShare, extra: dict
) -> Piece:
    """The rows of stacked experts this rank holds, its own per-expert tensors whole and the
    others' as empty slices; everything else as TP slices it. A layer with replicated experts
    on this rank gets the one row range that covers them too (a piece is one range)."""
    config, t = index.config, index.tensors[name]
    m = _LAYER.search(name)
    e = _EXPERT.match(name[m.end() :]) if m else None
    if e is None or ("quantization_config" in config and "quantization" not in config):
        return _tp_piece(name, index, layout)
    copies = extra.get(int(m.group(1)), set())
    if e["e"] is not None:
        mine = share.e0 <= int(e["e"]) < share.e1 or int(e["e"]) in copies
        return Piece(name=name) if mine or not t.shape else Piece(name=name, axis=0, a=0, b=0)
    if t.shape and t.shape[0] == routed_experts(config):
        a, b = min([share.e0, *copies]), max([share.e1, *(c + 1 for c in copies)])
        return Piece(name=name, axis=0, a=a, b=b)
    return Piece(name=name)


def _in_stage(name: str, config: dict, layout: RankLayout, stage: int, stages: int) -> bool:
    """Whether stage `stage` of `stages` (a PP rank, or a hybrid group) reads `name`."""
    n_layers = shape.n_layers(config)
    bounds = split_layers(n_layers, stages, list(layout.layer_split or []) or None)
    start, end = bounds[stage]
    if m := _LAYER.search(name):
        return start <= int(m.group(1)) < end
    if "embed_tokens" in name or name.startswith("lm_head"):
        return stage == 0  # the leader's stage embeds and projects (pipeline.py, hybrid.py)
    if name in ("model.norm.weight", "model.norm.bias"):
        return stage == stages - 1
    return True  # a tensor we cannot place is sent whole rather than missed


def _tp_piece(name: str, index: ModelIndex, layout: RankLayout) -> Piece:
    """The slice tensor.shard / vocab.split_head keep of `name` on this rank; whole where
    the slicing is not a plain range of this one tensor (fused or MLA projections, unknown)."""
    config, t = index.config, index.tensors[name]
    whole = Piece(name=name)
    if "quantization_config" in config and "quantization" not in config:
        return whole  # a hub format mlx-lm converts on load: its stored layout is not ours
    weights = list(layout.tp_weights or [1.0] * layout.world)
    module, kind = name.rsplit(".", 1) if "." in name else (name, "")
    if module == "lm_head" or (
        module == "model.embed_tokens"
        and _splits_embedding()
        and config.get("model_type") in _PLAIN_EMBEDDING
    ):
        if len(t.shape) != 2 or kind == "bias":
            return whole
        a, b = proportional_split(t.shape[0], weights)[layout.rank]  # parallel/vocab.py
        return Piece(name=name, axis=0, a=a, b=b)
    m = _LAYER.search(name)
    if m is None:
        return whole
    prefix = name[: m.end()]  # "model.layers.3."
    features = _split_features(index, prefix, module[m.end() :], weights, layout.rank)
    if features is None:
        return whole
    (a, b), by_rows = features
    quant = _quantization(index, module)
    if quant == "unknown":
        return whole
    if by_rows:  # output features: rows of weight, scales, biases; the bias's last axis
        if kind not in ("weight", "scales", "biases", "bias") or len(t.shape) < 1:
            return whole
        axis = len(t.shape) - 1 if kind == "bias" else len(t.shape) - 2
        return Piece(name=name, axis=axis, a=a, b=b) if axis >= 0 else whole
    if kind not in ("weight", "scales", "biases") or len(t.shape) < 2:
        return whole  # a column-split bias is added once, after the all_sum: whole
    if quant is not None:  # input groups: packed words of weight, groups of scales/biases
        if a % quant.step or b % quant.step:
            return whole
        g = quant.group_size
        a, b = (quant.words(a), quant.words(b)) if kind == "weight" else (a // g, b // g)
    return Piece(name=name, axis=len(t.shape) - 1, a=a, b=b)


def _split_features(
    index: ModelIndex, prefix: str, module: str, weights: list[float], rank: int
) -> tuple[tuple[int, int], bool] | None:
    """This rank's output or input feature range [a, b) of the projection `module` of the
    layer at `prefix`, and whether it is a row (output) split; None: it is kept whole."""
    config = index.config
    if module.startswith("self_attn."):
        proj = module.removeprefix("self_attn.")
        if (
            proj not in _ATTENTION
            or f"{prefix}self_attn.kv_a_proj_with_mqa.weight" in index.tensors
        ):
            return None  # MLA attention splits through mlx-lm's own shard(): whole
        heads, kv, head_dim = shape.heads(config), shape.kv_heads(config), shape.head_dim(config)
        if not _config_heads(index, prefix, heads, kv, head_dim):
            return None  # a layer of its own head counts or widths (MiMo-V2's sliding ones)
        try:
            share = split_heads(heads, kv, weights, _head_unit(index, head_dim))[rank]
        except ShardingError:
            return None  # the rank refuses this split itself, with its own message
        if proj in ("k_proj", "v_proj"):
            return (share.kv0 * head_dim, share.kv1 * head_dim), True
        return (share.q0 * head_dim, share.q1 * head_dim), _ATTENTION[proj]
    m = _MLP.match(module)
    if m is None or m["proj"] not in _GLU:
        return None
    block = m["block"]
    gate_name = "w1" if m["proj"].startswith("w") else "gate_proj"
    if gate_name == "w1" and not block.startswith("block_sparse_moe.experts."):
        return None  # w1/w2/w3 are Mixtral's expert names only (elsewhere they mean others)
    # The channel split _shard_glu takes: the gate's rows, in steps of quantization groups.
    gate = index.tensors.get(f"{prefix}{block}.{gate_name}.weight")
    if gate is None or len(gate.shape) < 2:
        return None
    siblings = [
        f"{prefix}{block}.{p}" for p in (("w1", "w2", "w3") if gate_name == "w1" else
                                         ("gate_proj", "up_proj", "down_proj"))
    ]  # fmt: skip
    quants = [_quantization(index, s) for s in siblings]
    if "unknown" in quants:
        return None
    down = quants[1]  # only the down projection is cut along its (packed) input
    align = down.step if down else 1
    try:
        span = proportional_split(gate.shape[-2], weights, align)[rank]
    except ShardingError:
        return None  # the rank refuses this split itself, with its own message
    return span, _GLU[m["proj"]]


def _config_heads(index: ModelIndex, prefix: str, heads: int, kv: int, head_dim: int) -> bool:
    """Whether the layer's stored q/k/v rows are config.json's head counts x head_dim, so that
    the config's head split is the one the rank's loader takes for this layer."""
    for proj, n in (("q_proj", heads), ("k_proj", kv), ("v_proj", kv)):
        t = index.tensors.get(f"{prefix}self_attn.{proj}.weight")
        if t is None or len(t.shape) < 2 or t.shape[-2] != n * head_dim:
            return False
    return True


def _quantization(index: ModelIndex, module: str) -> Packing | str | None:
    """How a projection is quantized as config.json states it (any width, affine or mx/nv),
    None for a plain one, "unknown" where the stored shapes do not match the config."""
    if f"{module}.scales" not in index.tensors:
        return None
    q = index.config.get("quantization") or {}
    p = from_config(q.get(module) if isinstance(q.get(module), dict) else q)
    w, s = index.tensors.get(f"{module}.weight"), index.tensors[f"{module}.scales"]
    if p is None or w is None or w.dtype != "U32" or not w.shape or not s.shape:
        return "unknown"
    if w.shape[-1] * 32 % p.bits or w.shape[-1] * 32 // p.bits != s.shape[-1] * p.group_size:
        return "unknown"
    if p.has_biases != (f"{module}.biases" in index.tensors):
        return "unknown"
    return p


def _head_unit(index: ModelIndex, head_dim: int) -> int:
    """Whole query heads per cut, as parallel/tensor.py computes it from the loaded o_projs."""
    steps = []
    for name in index.tensors:
        if name.endswith(".self_attn.o_proj.scales"):
            p = _quantization(index, name.removesuffix(".scales"))
            if isinstance(p, Packing):
                steps.append(p.step)
    return head_unit(head_dim, steps)


def _splits_embedding() -> bool:
    """True where TP ranks keep only their rows of the embedding (parallel/vocab.split_vocab),
    else every rank needs all of it for the lookup."""
    from thunderpool.parallel import vocab

    return hasattr(vocab, "split_vocab")
