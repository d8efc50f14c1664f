"""Tensor parallelism for Gated DeltaNet linear attention (Qwen3-Next) without mlx-lm's shard().

A DeltaNet head's recurrence reads only its own q, k, v, gate and decay, so heads split like
attention heads. Qwen3-Next's fused projections group their rows by key head (each key head's
q, k, then its share of value heads' v and z; then b and a likewise), so a rank's whole key
heads are one run of rows. The depthwise conv runs over [q | k | v] channels, each its own
run; the decay parameters are per value head; out_proj keeps the rank's value columns and sums.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from thunderpool.errors import ShardingError
from thunderpool.parallel.blocks import SumAfter
from thunderpool.parallel.heads import proportional_split
from thunderpool.parallel.slicing import slice_cols, slice_rows

_PARTS = ("in_proj_qkvz", "in_proj_ba", "conv1d", "out_proj", "A_log", "dt_bias")


def is_gated_deltanet(attn: nn.Module) -> bool:
    return all(p in attn for p in _PARTS) and hasattr(attn, "num_k_heads")


def split(attn: nn.Module, weights: list[float]) -> list[tuple[int, int]]:
    """Each rank's key heads [k0, k1); ShardingError where some rank would get none."""
    nk = attn.num_k_heads
    try:
        return proportional_split(nk, weights)
    except ShardingError:
        raise ShardingError(
            f"tp={len(weights)} cannot give every rank whole key heads of a Gated DeltaNet "
            f"layer's {nk}; use tp of at most {nk} or --parallel pp"
        ) from None


def shard(attn: nn.Module, weights: list[float], rank: int, group) -> None:
    """Keep this rank's key heads (and their value heads) of one Gated DeltaNet layer."""
    k0, k1 = split(attn, weights)[rank]
    nk, nv, dk, dv = attn.num_k_heads, attn.num_v_heads, attn.head_k_dim, attn.head_v_dim
    per = nv // nk  # value heads per key head
    group_rows = 2 * dk + 2 * per * dv  # one key head's q, k, v, z rows
    slice_rows(attn.in_proj_qkvz, k0 * group_rows, k1 * group_rows)
    slice_rows(attn.in_proj_ba, k0 * 2 * per, k1 * 2 * per)
    v0, v1 = k0 * per, k1 * per
    w = attn.conv1d.weight  # (channels, kernel, 1): [q | k | v]
    key_dim, parts = nk * dk, []
    for start, a, b in ((0, k0 * dk, k1 * dk), (key_dim, k0 * dk, k1 * dk),
                        (2 * key_dim, v0 * dv, v1 * dv)):
        parts.append(w[start + a : start + b])
    attn.conv1d.weight = mx.contiguous(mx.concatenate(parts, axis=0))
    attn.A_log = mx.contiguous(attn.A_log[v0:v1])
    attn.dt_bias = mx.contiguous(attn.dt_bias[v0:v1])
    slice_cols(attn.out_proj, v0 * dv, v1 * dv)
    attn.out_proj = SumAfter(attn.out_proj, group)
    attn.num_k_heads, attn.num_v_heads = k1 - k0, v1 - v0
    attn.key_dim, attn.value_dim = (k1 - k0) * dk, (v1 - v0) * dv
    attn.conv_dim = 2 * attn.key_dim + attn.value_dim
    attn.conv1d.groups = attn.conv_dim
