"""TP of an RMSNorm over every head's channels at once (OLMo 2/3's and OLMoE's q_norm and
k_norm, applied to the whole q_proj/k_proj output before the heads are split): each rank
normalises its own channels with the sum of squares of all of them, its partial sum plus the
other ranks' through one all_sum."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class SplitRMSNorm(nn.Module):
    """An nn.RMSNorm of `width` features of which this rank holds [a, b)."""

    def __init__(self, norm: nn.RMSNorm, a: int, b: int, group: mx.distributed.Group):
        super().__init__()
        self.weight = mx.contiguous(norm.weight[a:b])
        self.eps, self.width, self.group = norm.eps, norm.weight.shape[0], group

    def __call__(self, x: mx.array) -> mx.array:
        x32 = x.astype(mx.float32)  # mx.fast.rms_norm accumulates in fp32 too
        squares = mx.sum(x32 * x32, axis=-1, keepdims=True)
        squares = mx.distributed.all_sum(squares, group=self.group)
        return (x32 * mx.rsqrt(squares / self.width + self.eps)).astype(x.dtype) * self.weight


def wide_norms(attn: nn.Module, heads: int, kv: int, rows: tuple[int, ...]) -> dict | None:
    """{name: "q" or "k"} of the attention's norms over every query (or KV) head's channels at
    once, from the q and k rows; None where one is not an RMSNorm named q_*/k_* of that width."""
    found = {}
    for name, m in attn.items():
        w = m.get("weight") if isinstance(m, nn.Module) and "norm" in name else None
        if not isinstance(w, mx.array) or w.ndim != 1:
            continue
        if not ((w.shape[0] == rows[0] and heads > 1) or (w.shape[0] == rows[1] and kv > 1)):
            continue  # per head (Qwen3's), or of a single head: nothing to split
        part = name[0]
        if not isinstance(m, nn.RMSNorm) or part not in "qk":
            return None
        if w.shape[0] != rows["qk".index(part)]:
            return None
        found[name] = part
    return found
