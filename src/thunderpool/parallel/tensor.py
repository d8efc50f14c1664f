"""Tensor parallelism: split attention heads and MLP channels of an mlx-lm model over a group.

Even splits use mlx-lm's own `Model.shard()`. Uneven splits (head counts that do not divide,
speed-weighted shares, more ranks than KV heads) slice the projections here. Column-sliced
projections all_sum their partial products, so every layer costs two all-reduces.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from thunderpool.errors import ShardingError


@dataclass(frozen=True, slots=True)
class HeadShare:
    """The query heads [q0, q1) and KV heads [kv0, kv1) one rank computes."""

    q0: int
    q1: int
    kv0: int
    kv1: int


def proportional_split(total: int, weights: list[float], align: int = 1) -> list[tuple[int, int]]:
    """Split `total` units into contiguous ranges proportional to `weights`, in steps of `align`.

    Largest-remainder rounding; every part gets at least one step.
    """
    if total % align:
        raise ShardingError(f"cannot split {total} in steps of {align}")
    steps, n = total // align, len(weights)
    if n > steps:
        raise ShardingError(f"cannot split {total} into {n} parts of at least {align}")
    if any(w <= 0 for w in weights):
        raise ShardingError(f"split weights must be positive, got {weights}")
    # One step each first, then share the rest by weight.
    rest = steps - n
    ideal = [rest * w / sum(weights) for w in weights]
    counts = [1 + int(x) for x in ideal]
    order = sorted(range(n), key=lambda i: int(ideal[i]) - ideal[i])
    for i in order[: steps - sum(counts)]:
        counts[i] += 1
    bounds, start = [], 0
    for c in counts:
        bounds.append((start * align, (start + c) * align))
        start += c
    return bounds


def split_heads(n_heads: int, n_kv: int, weights: list[float]) -> list[HeadShare]:
    """Assign query heads to ranks so that each rank holds whole GQA groups or part of one.

    With fewer ranks than KV heads, ranks get whole groups; with more, each rank gets part of
    one group and that KV head is replicated on the ranks sharing it.
    """
    n = len(weights)
    if n_heads % n_kv:
        raise ShardingError(f"{n_heads} query heads are not a multiple of {n_kv} KV heads")
    if n > n_heads:
        raise ShardingError(
            f"tp={n} exceeds the {n_heads} attention heads; use at most {n_heads} ranks for TP "
            "or pipeline parallelism (--parallel pp)"
        )
    group = n_heads // n_kv
    if n <= n_kv:
        return [HeadShare(a * group, b * group, a, b) for a, b in proportional_split(n_kv, weights)]
    # Ranks per KV group, then each group's query heads split among its ranks.
    per_group = [len(r) for r in _chunks(list(range(n)), n_kv)]
    shares, rank = [], 0
    for kv, count in enumerate(per_group):
        ranks_w = weights[rank : rank + count]
        for a, b in proportional_split(group, ranks_w):
            shares.append(HeadShare(kv * group + a, kv * group + b, kv, kv + 1))
        rank += count
    return shares


def _chunks(items: list, k: int) -> list[list]:
    """Split items into k contiguous chunks whose sizes differ by at most one."""
    q, r = divmod(len(items), k)
    out, start = [], 0
    for i in range(k):
        size = q + (1 if i < r else 0)
        out.append(items[start : start + size])
        start += size
    return out


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


def _quant(module: nn.Module) -> tuple[int, int] | None:
    """(bits, group_size) of a quantized projection, or None for a plain one."""
    if "scales" in module:
        return module.bits, module.group_size
    return None


def slice_rows(module: nn.Module, a: int, b: int) -> None:
    """Keep output features [a, b) of a (possibly quantized, possibly per-expert) projection."""
    for name in ("weight", "scales", "biases", "bias"):
        if name in module:
            w = module[name]
            axis = w.ndim - 1 if name == "bias" else w.ndim - 2
            module[name] = mx.contiguous(_take(w, axis, a, b))


def slice_cols(module: nn.Module, a: int, b: int) -> None:
    """Keep input features [a, b) of a (possibly quantized, possibly per-expert) projection."""
    q = _quant(module)
    if q is None:
        module["weight"] = mx.contiguous(_take(module["weight"], -1, a, b))
        return
    bits, gs = q
    if a % gs or b % gs:
        raise ShardingError(
            f"cannot slice input features [{a}, {b}) of a {bits}-bit projection with group "
            f"size {gs}; use an even split or a non-quantized model"
        )
    per_word = 32 // bits
    module["weight"] = mx.contiguous(_take(module["weight"], -1, a // per_word, b // per_word))
    for name in ("scales", "biases"):
        module[name] = mx.contiguous(_take(module[name], -1, a // gs, b // gs))


def _take(w: mx.array, axis: int, a: int, b: int) -> mx.array:
    index = [slice(None)] * w.ndim
    index[axis] = slice(a, b)
    return w[tuple(index)]


def _align(*modules: nn.Module) -> int:
    """Channel step that keeps quantization groups whole."""
    steps = [q[1] for m in modules if (q := _quant(m))]
    return max(steps, default=1)


def shard_attention(attn: nn.Module, share: HeadShare, group: mx.distributed.Group) -> None:
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "n_heads", "n_kv_heads"):
        if not hasattr(attn, name):
            raise ShardingError(
                f"attention module {type(attn).__name__} has no '{name}'; tensor parallelism "
                "needs standard q/k/v/o projections; use --parallel pp for this model"
            )
    head_dim = attn.q_proj.weight.shape[-2] // attn.n_heads
    slice_rows(attn.q_proj, share.q0 * head_dim, share.q1 * head_dim)
    slice_rows(attn.k_proj, share.kv0 * head_dim, share.kv1 * head_dim)
    slice_rows(attn.v_proj, share.kv0 * head_dim, share.kv1 * head_dim)
    slice_cols(attn.o_proj, share.q0 * head_dim, share.q1 * head_dim)
    attn.o_proj = SumAfter(attn.o_proj, group)
    attn.n_heads = share.q1 - share.q0
    attn.n_kv_heads = share.kv1 - share.kv0


def shard_mlp(mlp: nn.Module, weights: list[float], rank: int, group) -> None:
    """Split a dense SwiGLU MLP or a SwitchGLU MoE along its intermediate channels."""
    if hasattr(mlp, "switch_mlp"):
        if not hasattr(mlp, "sharding_group"):
            raise ShardingError(
                f"MoE block {type(mlp).__name__} cannot all_sum its experts; use --parallel pp"
            )
        experts = mlp.switch_mlp
        _shard_glu(experts.gate_proj, experts.up_proj, experts.down_proj, weights, rank)
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
    hidden = gate.weight.shape[-2]
    a, b = proportional_split(hidden, weights, _align(gate, up, down))[rank]
    slice_rows(gate, a, b)
    slice_rows(up, a, b)
    slice_cols(down, a, b)


def _even(model: nn.Module, n: int, weights: list[float]) -> bool:
    """True where mlx-lm's own shard() applies: equal shares that divide every split dimension."""
    if len(set(weights)) > 1 or not hasattr(model, "shard"):
        return False
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "n_heads", 1) % n or getattr(attn, "n_kv_heads", 1) % n:
            return False
        experts = getattr(mlp, "switch_mlp", mlp)
        gate = getattr(experts, "gate_proj", None)
        if gate is None or gate.weight.shape[-2] % (n * _align(gate)):
            return False
    return True


def check(model: nn.Module, n: int, weights: list[float] | None = None) -> None:
    """Raise ShardingError if `model` cannot be split over n ranks with these weights."""
    weights = list(weights or [1.0] * n)
    if len(weights) != n:
        raise ShardingError(f"--tp-weights has {len(weights)} parts for {n} ranks")
    if _even(model, n, weights):
        return
    attn = model.layers[0].self_attn
    if not hasattr(attn, "n_heads") or not hasattr(attn, "n_kv_heads"):
        raise ShardingError(
            f"{type(model).__module__} has no standard attention; use --parallel pp for this model"
        )
    split_heads(attn.n_heads, attn.n_kv_heads, weights)


def shard(model: nn.Module, group: mx.distributed.Group, weights: list[float] | None = None) -> str:
    """Shard `model` in place for this rank of `group`; returns which method was used."""
    n, rank = group.size(), group.rank()
    weights = list(weights or [1.0] * n)
    if len(weights) != n:
        raise ShardingError(f"--tp-weights has {len(weights)} parts for {n} ranks")
    if n == 1:
        return "none"
    if _even(model, n, weights):
        model.shard(group)
        return "mlx-lm"
    layers = model.layers
    first = layers[0].self_attn
    if not hasattr(first, "n_heads"):
        raise ShardingError(
            f"{type(model).__module__} has no standard attention; use --parallel pp for this model"
        )
    shares = split_heads(first.n_heads, first.n_kv_heads, weights)
    for layer in layers:
        shard_attention(layer.self_attn, shares[rank], group)
        shard_mlp(layer.mlp, weights, rank, group)
    return "uneven"
