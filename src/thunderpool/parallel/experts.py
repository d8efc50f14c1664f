"""Expert parallelism (EP): each rank holds whole routed experts, a contiguous subset of them.

The router runs on every rank (its weights are replicated), so every rank knows every route.
A rank computes only the routes to its own experts and gives the others zero; the MoE block's
existing all_sum (the one TP uses to add its channel slices) then adds the ranks' parts, so EP
costs the same collective traffic as TP. Attention, dense MLPs and shared experts stay TP
(parallel/tensor.py). Expert weights are stacked (E, out, in), so a rank's experts are rows
[e0, e1) of axis 0 and its routes are the indices in that range, shifted by -e0.

A hot expert may be replicated: other ranks hold a copy too (rows appended after their own).
Each (token, route) to it is still computed by exactly one holder, chosen the same way on
every rank from the routes alone (route_holders), so the all_sum stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from thunderpool.errors import ShardingError
from thunderpool.models import shape
from thunderpool.parallel import blocks, tensor
from thunderpool.parallel.heads import proportional_split
from thunderpool.parallel.tensor import SumAfter, _mlp_of
from thunderpool.parallel.vocab import RowReader

# Where MoE blocks keep their stacked experts: qwen/deepseek/glm/mixtral, gpt-oss.
EXPERT_NAMES = ("switch_mlp", "experts")
# global_scale: nvfp4's one tensor scale per expert (mlx-lm's quantize_model global_scale).
_TENSORS = ("weight", "scales", "biases", "bias", "global_scale")
# config.json's routed-expert count, by family (deepseek/glm, qwen, mixtral/gpt-oss).


def routed_experts(config: dict) -> int:
    """Routed experts per MoE layer as config.json states them; 0 for a dense model."""
    return shape.experts(config)


@dataclass(frozen=True, slots=True)
class ExpertShare:
    """The routed experts [e0, e1) one rank holds."""

    e0: int
    e1: int


def split_experts(
    n_experts: int, weights: list[float], counts: list[int] | None = None
) -> list[ExpertShare]:
    """Contiguous expert ranges: `counts` experts per rank if given, else proportional to
    `weights` (node speed or memory). Every rank holds at least one expert."""
    n = len(weights)
    if counts is not None:
        if len(counts) != n or any(c < 1 for c in counts) or sum(counts) != n_experts:
            raise ShardingError(
                f"--expert-split {','.join(map(str, counts))} must give each of the {n} ranks "
                f"at least one expert and {n_experts} experts in all"
            )
        bounds, start = [], 0
        for c in counts:
            bounds.append((start, start + c))
            start += c
    else:
        if n > n_experts:
            raise ShardingError(
                f"ep={n} exceeds the model's {n_experts} routed experts; use at most "
                f"{n_experts} ranks or --parallel tp"
            )
        bounds = proportional_split(n_experts, weights)
    return [ExpertShare(a, b) for a, b in bounds]


@dataclass(frozen=True, slots=True)
class Holders:
    """One MoE layer's replicated experts as this rank sees them: every expert's holders
    (owner first) and the extra experts this rank holds, in the order of its appended rows."""

    rank: int
    table: np.ndarray  # (E, H) int32: holders of each expert, short rows padded with the owner
    count: np.ndarray  # (E,) holders of each expert
    extra: tuple[int, ...]


def holders(shares: list[ExpertShare], replicas: tuple[tuple[int, int], ...], rank: int) -> Holders:
    """The Holders of a layer whose experts are split as `shares`, with (expert, rank) copies."""
    rows = [[r] for r, s in enumerate(shares) for _ in range(s.e0, s.e1)]
    for e, r in sorted(replicas):
        if r not in rows[e]:
            rows[e].append(r)
    width = max(len(r) for r in rows)
    table = np.array([r + [r[0]] * (width - len(r)) for r in rows], dtype=np.int32)
    mine = shares[rank]
    extra = tuple(e for e, r in sorted(set(replicas)) if r == rank and not mine.e0 <= e < mine.e1)
    return Holders(rank, table, np.array([len(r) for r in rows], dtype=np.int32), extra)


def route_holders(routes: np.ndarray, table: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The rank that computes each route of `routes` (N tokens, k slots): an expert's only
    holder, or of a replicated expert's holders the one with the fewest of this token's routes
    so far (ties rotate with the token's index). Pure: every rank computes the same."""
    n, k = routes.shape
    tok = np.arange(n)
    load = np.zeros((n, int(table.max()) + 1), dtype=np.int32)
    out = np.empty((n, k), dtype=np.int32)
    spread = np.arange(table.shape[1])[None, :]
    for j in range(k):
        e = routes[:, j]
        cand = table[e[:, None], (tok[:, None] + spread) % count[e][:, None]]  # (N, H)
        r = cand[tok, np.argmin(np.take_along_axis(load, cand, axis=1), axis=1)]
        out[:, j] = r
        load[tok, r] += 1
    return out


class LocalExperts(nn.Module):
    """Experts [e0, e1) of a SwitchGLU/SwitchMLP (then any replicated `holders.extra`); routes
    to other ranks' experts give zeros.

    `skip` (default) computes only the local routes: their positions are read on the host, so
    each rank reads only the experts routed to it. Without it, other routes are clamped to a
    local expert and zeroed (no host read, so it can be traced by mx.compile, but every rank
    then computes all k routes of every token); replicas need `skip`."""

    def __init__(
        self, inner: nn.Module, share: ExpertShare, skip: bool = True, held: Holders | None = None
    ):
        super().__init__()
        self.inner = inner
        self.e0, self.n = share.e0, share.e1 - share.e0
        self.skip = skip
        self._held = held
        if held is not None:  # global expert -> row of this rank's stacked weights
            self._slot = np.zeros(len(held.table), dtype=np.int32)
            self._slot[share.e0 : share.e1] = np.arange(self.n)
            self._slot[list(held.extra)] = self.n + np.arange(len(held.extra))

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if not self.skip:
            local = indices - self.e0
            inside = (local >= 0) & (local < self.n)
            y = self.inner(x, mx.where(inside, local, 0))  # (..., k, D)
            return y * inside[..., None].astype(y.dtype)
        k, dim = indices.shape[-1], x.shape[-1]
        # Host read of the routes: which (token, slot) pairs this rank computes.
        routes = np.array(indices.reshape(-1, k)).astype(np.int32)
        if self._held is None:
            local = routes - self.e0
            inside = (local >= 0) & (local < self.n)
        else:
            held = self._held
            inside = route_holders(routes, held.table, held.count) == held.rank
            local = self._slot[routes]
        pos = np.flatnonzero(inside.reshape(-1))
        out = mx.zeros((indices.size, dim), dtype=x.dtype)
        if pos.size:
            pos_mx = mx.array(pos.astype(np.int32))
            tokens = x.reshape(-1, dim)[pos_mx // k]  # (M, D)
            ids = mx.array(local.reshape(-1)[pos].astype(np.int32))[:, None]
            y = self.inner(tokens, ids)  # (M, 1, D)
            out[pos_mx] = y[:, 0].astype(out.dtype)
        return out.reshape(*indices.shape, dim)


def moe_experts(layer: nn.Module) -> tuple[nn.Module, str] | None:
    """(MoE block, the name of its stacked experts) of a layer, or None for a dense layer."""
    mlp = _mlp_of(layer) if ("mlp" in layer or "block_sparse_moe" in layer) else None
    if isinstance(mlp, SumAfter):  # TP's wrapper around a block that cannot sum itself
        mlp = mlp.inner
    found = None
    if mlp is not None:
        found = next(((mlp, n) for n in EXPERT_NAMES if n in mlp and _stacked(mlp[n])), None)
    if found is None and "self_attn" in layer:  # a block of another shape (parallel/blocks.py)
        hidden = next((p["weight"].shape[0] for p in _o_projs(layer)), 0)
        found = blocks.stacked_experts(layer, hidden) if hidden else None
    return found


def _o_projs(layer: nn.Module) -> list[nn.Module]:
    o = layer.self_attn.get("o_proj") if isinstance(layer.self_attn, nn.Module) else None
    o = getattr(o, "inner", o)  # under TP's SumAfter
    return [o] if isinstance(o, nn.Module) and "weight" in o else []


def _stacked(experts: nn.Module) -> bool:
    projs = _projs(experts).values()
    return bool(projs) and all(p["weight"].ndim == 3 for p in projs)


def n_experts(model: nn.Module) -> int:
    """Routed experts per MoE layer; ShardingError for a model without stacked experts."""
    counts = {
        next(iter(_projs(found[0][found[1]]).values()))["weight"].shape[0]
        for layer in model.layers
        if (found := moe_experts(layer)) is not None
    }
    if len(counts) != 1:
        why = "has no routed experts" if not counts else f"mixes expert counts {sorted(counts)}"
        raise ShardingError(
            f"expert parallelism needs a MoE model with stacked experts; this one {why}; "
            "use --parallel tp or pp"
        )
    return counts.pop()


def _projs(experts: nn.Module) -> dict[str, nn.Module]:
    """The projections (children with weights; not the activation)."""
    return {
        k: m for k, m in experts.children().items() if isinstance(m, nn.Module) and "weight" in m
    }


Saved = dict[int, dict[str, dict[str, tuple[str, mx.array]]]]


def originals(model: nn.Module) -> Saved:
    """Each MoE layer's expert tensors before TP slices them, with their parameter names
    (lazy: nothing is read)."""
    names = {id(m): n for n, m in model.named_modules()}
    saved = {}
    for i, layer in enumerate(model.layers):
        if (found := moe_experts(layer)) is not None:
            experts = found[0][found[1]]
            saved[i] = {
                name: {t: (f"{names.get(id(p), '')}.{t}", p[t]) for t in _TENSORS if t in p}
                for name, p in _projs(experts).items()
            }
    return saved


def _slice(_name: str, lazy: mx.array, a: int, b: int) -> mx.array:
    return mx.contiguous(lazy[a:b])


Replicas = dict[int, tuple[tuple[int, int], ...]]  # MoE layer -> (expert, extra holder rank)


def shard_experts(
    model: nn.Module,
    share: ExpertShare,
    saved: Saved,
    skip: bool = True,
    read: RowReader = _slice,
    shares: list[ExpertShare] | None = None,
    rank: int = 0,
    replicas: Replicas | None = None,
) -> None:
    """Give every MoE layer the rows [e0, e1) of its saved (unsliced) expert tensors, then the
    rows of the experts `replicas` copies onto this `rank` (of `shares`), and wrap its experts
    so that routes to other ranks' experts give zeros. `read` may read the rows straight from
    the file (stored_rows.StoredRows.rows, for checkpoints that store experts stacked);
    slicing the lazy array reads a layer's experts whole, then drops the rest."""
    replicas = replicas or {}
    for i, layer in enumerate(model.layers):
        found = moe_experts(layer)
        if found is None:
            if i in saved:  # TP replaced the block with something this module cannot see into
                raise ShardingError(f"layer {i}'s MoE block lost its experts while sharding")
            continue
        block, name = found
        experts = block[name]
        held = holders(shares, replicas[i], rank) if replicas.get(i) and shares else None
        if held is not None and not skip:
            raise ShardingError("replicated experts need the host-read routes (skip=True)")
        for proj_name, tensors in saved[i].items():
            proj = experts[proj_name]
            for t, (param, full) in tensors.items():
                rows = [read(param, full, share.e0, share.e1)]
                rows += [read(param, full, e, e + 1) for e in (held.extra if held else ())]
                proj[t] = rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0)
        block[name] = LocalExperts(experts, share, skip, held)


def check(
    model: nn.Module,
    n: int,
    weights: list[float] | None = None,
    counts: list[int] | None = None,
    replicas: tuple[tuple[int, int, int], ...] | None = None,
) -> list[ExpertShare]:
    """Every rank's experts; ShardingError where attention, dense MLPs and shared experts
    cannot be split as TP over n ranks, the experts not as asked, or a (layer, expert, rank)
    replica names no MoE layer, expert or rank."""
    weights = list(weights or [1.0] * n)
    tensor.check(model, n, weights, routed=False)
    shares = split_experts(n_experts(model), weights, counts)
    moe = {i for i, layer in enumerate(model.layers) if moe_experts(layer) is not None}
    for layer, e, r in replicas or ():
        if layer not in moe or not 0 <= e < shares[-1].e1 or not 0 <= r < n:
            raise ShardingError(
                f"expert replica (layer {layer}, expert {e}, rank {r}) is not a MoE layer, "
                f"expert and rank of this model on {n} ranks; measure the routing again "
                "(`thunderpool route-counts`) or drop --replicate-experts"
            )
    return shares


def by_layer(replicas: tuple[tuple[int, int, int], ...] | None) -> Replicas:
    """(layer, expert, rank) triples grouped by layer."""
    out: dict[int, list[tuple[int, int]]] = {}
    for layer, e, r in replicas or ():
        out.setdefault(layer, []).append((e, r))
    return {k: tuple(v) for k, v in out.items()}


def shard(
    model: nn.Module,
    group: mx.distributed.Group,
    weights: list[float] | None = None,
    counts: list[int] | None = None,
    skip: bool = True,
    read: RowReader = _slice,
    replicas: tuple[tuple[int, int, int], ...] | None = None,
) -> ExpertShare:
    """Shard `model` in place for this rank: TP for attention, dense MLPs and shared experts,
    EP for routed experts (plus any (layer, expert, rank) replicas). Returns this rank's
    experts."""
    n, rank = group.size(), group.rank()
    shares = check(model, n, weights, counts, replicas)
    saved = originals(model)
    # TP splits the rest; mlx-lm's even shard() also slices the experts' channels (lazily):
    # those slices are dropped unread below.
    tensor.shard(model, group, weights, routed=False)
    shard_experts(model, shares[rank], saved, skip, read, shares, rank, by_layer(replicas))
    return shares[rank]


def unwrap(block: nn.Module, name: str) -> nn.Module:
    """The stacked experts under a LocalExperts wrapper (or the experts themselves)."""
    experts = block[name]
    return experts.inner if isinstance(experts, LocalExperts) else experts
