"""Tensor parallelism for feed-forward blocks of any shape: found by their projections' widths.

A feed-forward is some projections from the hidden width to I channels, an elementwise
activation, and one projection back. Splitting the I channels and summing the partial outputs
is exact whatever the names (up/down without a gate, fc1/fc2, w1/w2/w3) and whatever the
block does with its parts, as long as it adds them linearly: shared experts beside routed
ones, stacked (E, I, D) experts, coefficients from the input. The router and any other
projection that does not read or write the I channels stays whole on every rank. What a block
adds that is not split (an identity expert's input, a bias) would be counted once per rank:
the family matrix (tests/parallel/test_all_families.py) is what says a family is split right.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from thunderpool.errors import ShardingError
from thunderpool.parallel.heads import proportional_split
from thunderpool.parallel.packing import Packing
from thunderpool.parallel.slicing import keep_rows, packing_of, slice_cols, slice_rows, step_of


class SumAfter(nn.Module):
    """A column-sliced projection followed by an all_sum; the bias is added once, after it."""

    def __init__(self, inner: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.inner = inner
        self.group = group
        if "bias" in inner:
            self.bias = inner.pop("bias")

    def __call__(self, x: mx.array, *args) -> mx.array:
        y = mx.distributed.all_sum(self.inner(x, *args), group=self.group)
        return y + self.bias if "bias" in self else y


def _mlp_of(layer: nn.Module) -> nn.Module:
    """The feed-forward block of a layer (Mixtral calls its MoE block_sparse_moe)."""
    return layer["mlp"] if "mlp" in layer else layer["block_sparse_moe"]


def _mlp_of_or_none(layer: nn.Module) -> nn.Module | None:
    return _mlp_of(layer) if ("mlp" in layer or "block_sparse_moe" in layer) else None


def _mlp_refusal(layer: nn.Module) -> str | None:
    """Why shard_mlp cannot split this layer's MLP, or None."""
    mlp = _mlp_of_or_none(layer)
    if mlp is None:
        return "no mlp or block_sparse_moe"
    if "switch_mlp" in mlp:
        experts = mlp.switch_mlp
        if "mlp" in layer and not hasattr(mlp, "sharding_group"):
            return f"{type(mlp).__name__} cannot all_sum its experts"
        if not all(p in experts for p in ("gate_proj", "up_proj", "down_proj")):
            return f"{type(experts).__name__} has no gate/up/down projections"
        return None
    if not all(p in mlp for p in ("gate_proj", "up_proj", "down_proj")):
        return f"{type(mlp).__name__} has no gate/up/down projections"
    return None


def fused_glu(layer: nn.Module) -> nn.Module | None:
    """The layer's dense MLP where it fuses gate and up into one gate_up_proj whose two halves
    its __call__ splits (Phi-3, GLM, GLM-4), or None."""
    mlp = _mlp_of_or_none(layer)
    if mlp is None or "gate_up_proj" not in mlp or "down_proj" not in mlp:
        return None
    fused, down = _dims(mlp["gate_up_proj"]), _dims(mlp["down_proj"])
    return mlp if fused and down and fused[0] == 2 * down[1] else None


def fused_split(mlp: nn.Module, weights: list[float]) -> list[tuple[int, int]]:
    """Each rank's channels of a fused gate_up MLP, cut on its down_proj's packing step."""
    channels, step = _dims(mlp.down_proj)[1], step_of(mlp.down_proj)
    try:
        return proportional_split(channels, weights, step)
    except ShardingError:
        raise ShardingError(
            f"tp={len(weights)} with weights {weights} cannot split the fused gate_up MLP's "
            f"{channels} channels in steps of {step}; use tp of at most {channels // step} in "
            "equal shares or --parallel pp"
        ) from None


def shard_fused_glu(mlp: nn.Module, weights: list[float], rank: int, group) -> None:
    """Keep this rank's channels of both halves of gate_up_proj (one fused projection of its
    own share, still split in two halves by the MLP) and of down_proj's input; sum after."""
    channels = _dims(mlp.down_proj)[1]
    a, b = fused_split(mlp, weights)[rank]
    keep_rows(mlp.gate_up_proj, [(a, b), (channels + a, channels + b)])
    slice_cols(mlp.down_proj, a, b)
    mlp.down_proj = SumAfter(mlp.down_proj, group)


_SKIP = ("self_attn", "attention", "attn", "mixer", "linear_attn")


def _dims(m: nn.Module) -> tuple[int, int] | None:
    """(out, in) features of a projection (per expert for stacked ones), or None."""
    w = m.get("weight") if isinstance(m, nn.Module) else None
    if not isinstance(w, mx.array) or w.ndim not in (2, 3) or "Linear" not in type(m).__name__:
        return None
    p: Packing | None = packing_of(m)
    return w.shape[-2], (w.shape[-1] * 32 // p.bits if p is not None else w.shape[-1])


def projection(m) -> bool:
    return isinstance(m, nn.Module) and _dims(m) is not None


def feed_forwards(block: nn.Module, hidden: int) -> list[tuple[list[nn.Module], nn.Module]]:
    """(in projections, out projection) of each feed-forward inside `block`."""
    found = []
    for _, m in block.named_modules():
        projs = [c for c in m.values() if isinstance(c, nn.Module) and _dims(c) is not None]
        outs = [c for c in projs if _dims(c)[0] == hidden and _dims(c)[1] != hidden]
        if len(outs) != 1:
            continue
        width = _dims(outs[0])[1]
        ins = [c for c in projs if _dims(c) == (width, hidden)]
        if ins:
            found.append((ins, outs[0]))
    return found


def stacked_experts(layer: nn.Module, hidden: int) -> tuple[nn.Module, str] | None:
    """(parent, name) of the routed experts stacked (E, out, in) in the layer's block."""
    name = ffn_child(layer, hidden)
    if name is None:
        return None
    for _, m in layer[name].named_modules():
        for key, child in m.items():
            if not isinstance(child, nn.Module) or "Linear" in type(child).__name__:
                continue
            projs = [c for c in child.values() if projection(c)]
            if len(projs) >= 2 and all(p["weight"].ndim == 3 for p in projs):
                return m, key
    return None


def ffn_child(layer: nn.Module, hidden: int) -> str | None:
    """The layer's feed-forward child (not its attention) that `feed_forwards` can split."""
    for name, child in layer.items():
        if name in _SKIP or not isinstance(child, nn.Module):
            continue
        if feed_forwards(child, hidden):
            return name
    return None


def shard_ffn(
    layer: nn.Module, hidden: int, weights: list[float], rank: int, group, routed: bool = True
) -> None:
    """Split every feed-forward of the layer's block on its channels (not stacked routed
    experts where `routed` is False: expert parallelism gives them whole); sum the block."""
    name = ffn_child(layer, hidden)
    if name is None:
        raise ShardingError(f"{type(layer).__name__} has no feed-forward block to split")
    for ins, out in feed_forwards(layer[name], hidden):
        if not routed and out["weight"].ndim == 3:
            continue
        channels = _dims(out)[1]
        a, b = proportional_split(channels, weights, step_of(out, *ins))[rank]
        for proj in ins:
            slice_rows(proj, a, b)
        slice_cols(out, a, b)
        if "bias" in out and rank != 0:  # added once, by rank 0, into the sum
            out["bias"] = mx.zeros_like(out["bias"])
    layer[name] = SumAfter(layer[name], group)
