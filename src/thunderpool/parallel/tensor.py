"""Tensor parallelism: split attention heads and MLP channels of an mlx-lm model over a group.

Even splits use mlx-lm's own `Model.shard()`. Uneven splits (head counts that do not divide,
speed-weighted shares, more ranks than KV heads) slice the projections here. Column-sliced
projections all_sum their partial products, so every layer costs two all-reduces.

A fused qkv_proj keeps each rank's q, k and v rows, a fused gate_up_proj each rank's rows
of both halves: one fused projection of the rank's own share. Output gates on the heads
(tp_reading.gate_rows) are cut with the query heads; layers of different head counts get
each their own share, in equal shares only; a q/k RMSNorm over every head at once sums its
squares over the ranks (wide_norm.py). Families whose layers this module cannot slice
(MLA, attention sinks: even splits through mlx-lm only; others: none) are refused by `check`
and `shard` with a message naming the family, the layer and what works
(tests/parallel/test_all_families.py).
"""

from __future__ import annotations

from math import lcm

import mlx.core as mx
import mlx.nn as nn

from thunderpool.errors import ShardingError
from thunderpool.parallel import blocks, linear_attn
from thunderpool.parallel.blocks import SumAfter, _mlp_of, _mlp_refusal
from thunderpool.parallel.heads import HeadShare, proportional_split, split_heads
from thunderpool.parallel.packing import head_unit
from thunderpool.parallel.slicing import keep_rows, packing_of, slice_cols, slice_rows, step_of
from thunderpool.parallel.tp_reading import (
    _even_only,
    _family,
    _first_attn,
    _head_names,
    _heads,
    _hidden,
    _structural,
    gate_rows,
    head_counts,
    kv_reuse,
    o_name,
    per_layer_refusal,
    qkv_rows,
    wide_k_refusal,
)
from thunderpool.parallel.wide_norm import SplitRMSNorm, wide_norms


def head_step(model: nn.Module) -> tuple[int, str]:
    """Input features per allowed cut of every layer's o_proj (1: plain), and the formats
    that ask for it, for messages."""
    steps, names = [1], []
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None)
        o = getattr(attn, o_name(attn), None) if attn is not None else None
        if o is not None and (p := packing_of(o)) is not None:
            steps.append(p.step)
            names.append(str(p))
    return lcm(*steps), ", ".join(dict.fromkeys(names))


def _o_in(attn: nn.Module) -> int:
    """Input features of the attention's o_proj (heads x the width of each head's output)."""
    o = getattr(attn, o_name(attn), None)
    if o is None or "weight" not in o:
        return 0
    p = packing_of(o)
    cols = o.weight.shape[-1]
    return cols * 32 // p.bits if p is not None else cols


def _head_unit(model: nn.Module, attn: nn.Module | None = None) -> int:
    """Whole query heads per cut, so that o_proj is cut on its quantization boundaries."""
    attn = _first_attn(model) if attn is None else attn
    heads, o_in = _heads(attn)[0], _o_in(attn)
    if not heads or not o_in:
        return 1
    return head_unit(o_in // heads, [head_step(model)[0]])


# How families name their head counts: llama/qwen/gemma, mixtral, gpt-oss.
def shard_attention(attn: nn.Module, share: HeadShare, group: mx.distributed.Group) -> None:
    names = _head_names(attn)
    rows = qkv_rows(attn) if names is not None and o_name(attn) in attn else None
    if rows is None:
        raise ShardingError(
            f"attention module {type(attn).__name__} has no q/k/v (or fused qkv_proj) and "
            "o_proj projections or head counts we read; use --parallel pp for this model"
        )
    q_name, kv_name = names
    # Each projection's own rows per head: Qwen3-Next's q_proj carries a gate per head too.
    heads, kv = getattr(attn, q_name), getattr(attn, kv_name)
    q_dim, o_dim = rows[0] // heads, _o_in(attn) // heads
    k_dim, v_dim = rows[1] // kv, rows[2] // kv
    q, k, v = (share.q0 * q_dim, share.q1 * q_dim), (share.kv0 * k_dim, share.kv1 * k_dim), (
        share.kv0 * v_dim, share.kv1 * v_dim)
    if "qkv_proj" in attn:  # one fused projection of this rank's q, k and v rows, in that order
        k_at, v_at = rows[0], rows[0] + rows[1]
        keep_rows(attn.qkv_proj, [q, (k_at + k[0], k_at + k[1]), (v_at + v[0], v_at + v[1])])
        if isinstance(getattr(attn.qkv_proj, "indices", None), list):  # where it splits them
            attn.qkv_proj.indices = [q[1] - q[0], q[1] - q[0] + k[1] - k[0]]
    else:
        slice_rows(attn.q_proj, *q)
        slice_rows(attn.k_proj, *k)
        slice_rows(attn.v_proj, *v)
    gates = {name: r for name in attn if (r := gate_rows(attn, name)) is not None}
    for name, r in gates.items():  # output gates: r rows per query head
        slice_rows(attn[name], share.q0 * r, share.q1 * r)
    for name, part in (wide_norms(attn, heads, kv, rows) or {}).items():  # OLMo 2's q/k norms
        attn[name] = SplitRMSNorm(attn[name], *(q if part == "q" else k), group)
    o = o_name(attn)
    slice_cols(attn[o], share.q0 * o_dim, share.q1 * o_dim)
    attn[o] = SumAfter(attn[o], group)
    for name, value in list(attn.items()):  # per-head parameters: sinks, sink biases
        if isinstance(value, mx.array) and value.ndim == 1 and value.shape[0] == heads:
            attn[name] = mx.contiguous(value[share.q0 : share.q1])
    setattr(attn, q_name, share.q1 - share.q0)
    setattr(attn, kv_name, share.kv1 - share.kv0)


def shard_reuse(attn: nn.Module, share: HeadShare, group: mx.distributed.Group) -> None:
    """AFM's KV-reuse attention: the query heads of `share`, whose KV heads are those the
    layer it reads keeps (the same share of the same counts)."""
    heads, o = attn.n_heads, o_name(attn)
    q_dim, o_dim = attn.q_proj.weight.shape[-2] // heads, _o_in(attn) // heads
    slice_rows(attn.q_proj, share.q0 * q_dim, share.q1 * q_dim)
    slice_cols(attn[o], share.q0 * o_dim, share.q1 * o_dim)
    attn[o] = SumAfter(attn[o], group)
    attn.n_heads = share.q1 - share.q0


def shard_mlp(mlp: nn.Module, weights: list[float], rank: int, group, routed: bool = True) -> None:
    """Split a dense SwiGLU MLP or a SwitchGLU MoE along its intermediate channels (not the
    routed experts' where `routed` is False: expert parallelism gives them whole)."""
    if hasattr(mlp, "switch_mlp"):
        if not hasattr(mlp, "sharding_group"):
            raise ShardingError(
                f"MoE block {type(mlp).__name__} cannot all_sum its experts; use --parallel pp"
            )
        experts = mlp.switch_mlp
        if routed:
            _shard_glu(experts.gate_proj, experts.up_proj, experts.down_proj, weights, rank)
        # Shared experts add into the routed output before the block's all_sum: split them too.
        for name in ("shared_experts", "shared_expert"):
            if hasattr(mlp, name):
                shared = getattr(mlp, name)
                _shard_glu(shared.gate_proj, shared.up_proj, shared.down_proj, weights, rank)
        mlp.sharding_group = group
        return
    for name in ("gate_proj", "up_proj", "down_proj"):
        if not hasattr(mlp, name):
            raise ShardingError(
                f"MLP module {type(mlp).__name__} has no '{name}'; tensor parallelism needs "
                "gate/up/down projections; use --parallel pp for this model"
            )
    _shard_glu(mlp.gate_proj, mlp.up_proj, mlp.down_proj, weights, rank)
    mlp.down_proj = SumAfter(mlp.down_proj, group)


def _shard_glu(gate, up, down, weights: list[float], rank: int) -> None:
    a, b = glu_split(gate, down, weights)[rank]
    slice_rows(gate, a, b)
    slice_rows(up, a, b)
    slice_cols(down, a, b)


def glu_split(
    gate: nn.Module, down: nn.Module, weights: list[float], experts: bool = False
) -> list[tuple[int, int]]:
    """Each rank's channels of a gated MLP: gate/up keep rows (any cut), down_proj keeps
    input columns, cut only on its quantization step (parallel/packing.py)."""
    channels, step = gate.weight.shape[-2], step_of(down)
    try:
        return proportional_split(channels, weights, step)
    except ShardingError:
        what = "routed experts'" if experts else "MLP's"
        ep = ", --parallel ep (whole experts)" if experts else ""
        raise ShardingError(
            f"tp={len(weights)} with weights {weights} cannot split the {what} {channels} "
            f"channels on the boundaries of their {packing_of(down)} down_proj (every {step}); "
            f"use tp of at most {channels // step} in equal shares{ep} or --parallel pp"
        ) from None


def _glus(layer: nn.Module, routed: bool = True) -> list[tuple[nn.Module, nn.Module, bool]]:
    """(gate_proj, down_proj, are they routed experts) of each gated MLP TP splits in a
    layer: dense, experts (where `routed`), shared."""
    mlp = _mlp_of(layer)
    switch = "switch_mlp" in mlp
    blocks = [(getattr(mlp, "switch_mlp", mlp), switch)] if routed or not switch else []
    blocks += [(getattr(mlp, s), False) for s in ("shared_experts", "shared_expert") if s in mlp]
    return [(b.gate_proj, b.down_proj, e) for b, e in blocks if hasattr(b, "gate_proj")]


def own_shard(model: nn.Module, n: int, weights: list[float]) -> bool:
    """Whether mlx-lm's own shard() splits this model where our slicing cannot read it:
    equal shares of a family that has one (its divisibility is mlx-lm's to check)."""
    if n <= 1 or not hasattr(model, "shard") or len(set(weights)) > 1:
        return False
    # An even-only family (MLA, sinks) whose o_proj we cannot read (DeepSeek V4.1's grouped
    # o_a/o_b): mlx-lm's shard() checks its own divisibility.
    unread = _even_only(model) is not None and any(
        "o_proj" not in layer.self_attn for layer in model.layers if "self_attn" in layer
    )
    return unread or _structural(model, n) is not None or len(head_counts(model)) > 1


def _refusal(model: nn.Module, n: int, weights: list[float]) -> str | None:
    """Why `model` cannot be split over n ranks with these weights at all, or None."""
    if own_shard(model, n, weights):
        return None
    if (why := _structural(model, n)) is not None:
        return why
    family = _family(model)
    if (why := per_layer_refusal(model, n, weights) or wide_k_refusal(model, n)) is not None:
        return why
    why = _even_only(model)
    if why is None or _even(model, n, weights):
        return None
    heads = _heads(_first_attn(model))[0]
    if not hasattr(model, "shard"):
        return (
            f"{family} ({why}): only mlx-lm's own shard() splits it, and mlx-lm has none for "
            f"this family; use --parallel pp"
        )
    ok = [d for d in range(2, heads + 1) if _even(model, d, [1.0] * d)]
    fix = f"use tp in {ok} with equal weights" if ok else "no equal split of it works"
    return (
        f"{family} ({why}) splits only into equal shares that divide its {heads} heads and "
        f"every MLP, through mlx-lm's own shard(): tp={n} with weights {weights} cannot; {fix}"
    )


def _even(model: nn.Module, n: int, weights: list[float]) -> bool:
    """True where mlx-lm's own shard() applies: equal shares that divide every split dimension."""
    if len(set(weights)) > 1 or not hasattr(model, "shard"):
        return False
    if any("global_scale" in m for _, m in model.named_modules()):
        return False  # mlx's shard_linear would split nvfp4's per-expert scales as channels
    step = head_step(model)[0]
    for layer in model.layers:
        if "self_attn" not in layer:
            return False
        heads, kv = _heads(layer.self_attn)
        if not heads or heads % n or kv % n:
            return False
        if _o_in(layer.self_attn) // n % step:
            return False  # o_proj's equal input shares would cut a group or a word
        mlp = _mlp_of(layer)
        blocks = [getattr(mlp, "switch_mlp", None) or getattr(mlp, "experts", None) or mlp]
        blocks += [getattr(mlp, s) for s in ("shared_experts", "shared_expert") if s in mlp]
        for block in blocks:
            gate = getattr(block, "gate_proj", None)
            down = getattr(block, "down_proj", None)
            if gate is None or gate.weight.shape[-2] % (n * step_of(gate, down or gate)):
                return False
    return True


def check(
    model: nn.Module, n: int, weights: list[float] | None = None, routed: bool = True
) -> None:
    """Raise ShardingError if `model` cannot be split over n ranks with these weights (its
    routed experts' channels too, unless `routed` is False: EP keeps them whole)."""
    weights = list(weights or [1.0] * n)
    if len(weights) != n:
        raise ShardingError(f"--tp-weights has {len(weights)} parts for {n} ranks")
    if n == 1:
        return
    if (why := _refusal(model, n, weights)) is not None:
        raise ShardingError(why)
    if own_shard(model, n, weights) or _even(model, n, weights):
        return
    _layer_shares(model, n, weights)
    for layer in model.layers:
        if "linear_attn" in layer and "self_attn" not in layer:
            linear_attn.split(layer.linear_attn, weights)
        if blocks.fused_glu(layer) is not None:
            blocks.fused_split(blocks.fused_glu(layer), weights)
        if _mlp_refusal(layer) is not None:
            continue  # blocks.shard_ffn (or shard_fused_glu) splits it
        for gate, down, experts in _glus(layer, routed):
            glu_split(gate, down, weights, experts)


def _layer_shares(model: nn.Module, n: int, weights: list[float]) -> dict:
    """{(query, KV) head counts: each rank's heads} for every count the layers have."""
    firsts = {}
    for layer in model.layers:
        if "self_attn" in layer and not kv_reuse(layer.self_attn):
            firsts.setdefault(_heads(layer.self_attn), layer.self_attn)
    return {c: _shares(model, n, weights, a) for c, a in firsts.items()} or {
        _heads(_first_attn(model)): _shares(model, n, weights)
    }


def _shares(
    model: nn.Module, n: int, weights: list[float], attn: nn.Module | None = None
) -> list[HeadShare]:
    """Each rank's heads on our uneven path, or a one-line refusal naming the format."""
    heads, kv = _heads(_first_attn(model) if attn is None else attn)
    unit = _head_unit(model, attn)
    try:
        return split_heads(heads, kv, weights, unit)
    except ShardingError:
        if unit == 1:
            raise
        ok = [d for d in range(2, heads + 1) if _splits(model, d, heads, kv, unit)]
        step, formats = head_step(model)
        fix = f"use tp in {ok} (equal weights) or --parallel pp" if ok else "use --parallel pp"
        raise ShardingError(
            f"{_family(model)} quantized as {formats}: tp={n} with weights {weights} cannot "
            f"give each rank whole runs of {unit} of the {heads} query heads (o_proj is cut only "
            f"on whole groups and packed words, every {step} inputs); {fix}"
        ) from None


def _splits(model: nn.Module, n: int, heads: int, kv: int, unit: int) -> bool:
    if _even(model, n, [1.0] * n):
        return True
    try:
        split_heads(heads, kv, [1.0] * n, unit)
    except ShardingError:
        return False
    return True


def shard(
    model: nn.Module,
    group: mx.distributed.Group,
    weights: list[float] | None = None,
    routed: bool = True,
) -> str:
    """Shard `model` in place for this rank of `group`; returns which method was used.
    `routed` False leaves the routed experts' channels whole (expert parallelism)."""
    n, rank = group.size(), group.rank()
    weights = list(weights or [1.0] * n)
    check(model, n, weights, routed)
    if n == 1:
        return "none"
    if own_shard(model, n, weights) or _even(model, n, weights):
        model.shard(group)
        return "mlx-lm"
    shares = _layer_shares(model, n, weights)
    hidden = _hidden(model)
    for layer in model.layers:
        if kv_reuse(layer.get("self_attn")):  # the last KV layer's share (one head count)
            shard_reuse(layer.self_attn, next(iter(shares.values()))[rank], group)
        elif "self_attn" in layer:
            shard_attention(layer.self_attn, shares[_heads(layer.self_attn)][rank], group)
        else:
            linear_attn.shard(layer.linear_attn, weights, rank, group)
        if (fused := blocks.fused_glu(layer)) is not None:
            blocks.shard_fused_glu(fused, weights, rank, group)
        elif _mlp_refusal(layer) is not None:
            blocks.shard_ffn(layer, hidden, weights, rank, group, routed)
        elif "mlp" in layer:
            shard_mlp(layer.mlp, weights, rank, group, routed)
        else:
            # A MoE block that cannot all_sum itself (Mixtral): split its experts' channels
            # and sum the whole block's partial output.
            moe = layer.block_sparse_moe
            experts = moe.switch_mlp
            if routed:
                _shard_glu(experts.gate_proj, experts.up_proj, experts.down_proj, weights, rank)
            layer.block_sparse_moe = SumAfter(moe, group)
    return "uneven"
