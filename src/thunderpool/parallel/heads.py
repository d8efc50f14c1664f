"""How TP splits a layer's heads and rows over ranks of unequal speed: largest-remainder shares
of whole heads (or head units) and of whole row groups."""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

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


def split_heads(n_heads: int, n_kv: int, weights: list[float], unit: int = 1) -> list[HeadShare]:
    """Assign query heads to ranks so that each rank holds whole GQA groups or part of one.

    With fewer ranks than KV heads, ranks get whole groups; with more, each rank gets part of
    one group and that KV head is replicated on the ranks sharing it. Shares start on
    multiples of `unit` query heads (a quantized o_proj is cut on whole groups and words only):
    an uneven share moves to the nearest such boundary, or the split is refused.
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
        kv_unit = unit // gcd(unit, group)  # KV groups per cut
        if n_kv % kv_unit or n > n_kv // kv_unit:
            raise _unit_error(n, n_heads, unit)
        bounds = proportional_split(n_kv, weights, kv_unit)
        return [HeadShare(a * group, b * group, a, b) for a, b in bounds]
    # Ranks per KV group, then each group's query heads split among its ranks.
    per_group = [len(r) for r in _chunks(list(range(n)), n_kv)]
    if group % unit or max(per_group) > group // unit:
        raise _unit_error(n, n_heads, unit)
    shares, rank = [], 0
    for kv, count in enumerate(per_group):
        ranks_w = weights[rank : rank + count]
        for a, b in proportional_split(group, ranks_w, unit):
            shares.append(HeadShare(kv * group + a, kv * group + b, kv, kv + 1))
        rank += count
    return shares


def _unit_error(n: int, n_heads: int, unit: int) -> ShardingError:
    return ShardingError(
        f"tp={n} cannot give each rank whole runs of {unit} of the {n_heads} query heads "
        "(a quantized o_proj is cut only on whole groups and packed words)"
    )


def _chunks(items: list, k: int) -> list[list]:
    """Split items into k contiguous chunks whose sizes differ by at most one."""
    q, r = divmod(len(items), k)
    out, start = [], 0
    for i in range(k):
        size = q + (1 if i < r else 0)
        out.append(items[start : start + size])
        start += size
    return out
