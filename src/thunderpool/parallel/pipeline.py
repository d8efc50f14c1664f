"""Pipeline parallelism: each rank keeps one contiguous stage of an mlx-lm model's layers.

Rank 0 holds the embedding, its layers and the output head; the last rank holds the final norm.
A forward runs recv -> local layers -> send around the ring: 0 -> 1 -> ... -> N-1 -> 0, so the
logits end up on the leader (rank 0).

A stage runs the model's own forward over the WHOLE layer list, so masks, cache types and
layer indices are those of the whole model (Gemma 3's sliding/global pattern, gpt-oss's
alternating windows, Qwen3-Next's linear layers). Layers of other stages are weightless
pass-throughs whose caches advance by zero-size keys (offsets move, nothing is held); the
layer just before the stage hands in the received hidden state, so whatever the embedding
path computed (a zeros stand-in on later stages, then e.g. Gemma's sqrt(hidden) scaling) is
discarded rather than relied upon.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from thunderpool.errors import ShardingError
from thunderpool.parallel.anatomy import NORMS, anatomy, width


def split_layers(
    n_layers: int, n_stages: int, split: list[int] | None = None
) -> list[tuple[int, int]]:
    """Stage bounds [start, end) per rank; `split` gives per-rank weights (e.g. 20,10)."""
    if n_stages > n_layers:
        raise ShardingError(
            f"--nodes {n_stages} is more than the {n_layers} layers of this model; pipeline "
            f"parallelism needs at least one layer per node: use --nodes <= {n_layers} or "
            "--parallel tp"
        )
    split = list(split or [1] * n_stages)
    if len(split) != n_stages:
        raise ShardingError(f"--layer-split has {len(split)} parts for {n_stages} nodes")
    if any(s <= 0 for s in split):
        raise ShardingError(f"--layer-split parts must be positive, got {split}")
    if sum(split) != n_layers:
        # Weights, not counts: scale to the layer count, at least one layer each.
        from thunderpool.parallel.heads import proportional_split

        return proportional_split(n_layers, [float(s) for s in split])
    bounds, start = [], 0
    for s in split:
        bounds.append((start, start + s))
        start += s
    return bounds


class _Identity(nn.Module):
    def __call__(self, x: mx.array) -> mx.array:
        return x


class _ZeroEmbedding(nn.Module):
    """Stands in for the embedding on later stages: no weights read, its output discarded."""

    def __init__(self, hidden: int, dtype: mx.Dtype):
        super().__init__()
        self.hidden, self.dtype = hidden, dtype

    def __call__(self, tokens: mx.array, *args, **kwargs) -> mx.array:
        return mx.zeros((*tokens.shape, self.hidden), self.dtype)


class _Shell(nn.Module):
    """A weightless copy of a module's plain attributes (and its children's): what a model's
    forward reads of another stage's layer to pick a mask (layer.self_attn.is_sliding)."""

    def __init__(self, module: nn.Module, depth: int = 2):
        super().__init__()
        plain = dict(vars(module))
        for name, attr in vars(type(module)).items():
            if isinstance(attr, property) and not name.startswith("_"):
                try:  # spark2_5's layer.is_sliding reads its attention's flag
                    plain[name] = getattr(module, name)
                except Exception:  # noqa: BLE001 - a property that needs more than flags
                    continue
        for name, value in plain.items():
            if not name.startswith("_") and isinstance(value, bool | int | float | str):
                object.__setattr__(self, name, value)
        for name, child in module.items():
            if depth > 0 and isinstance(child, nn.Module):
                self[name] = _Shell(child, depth - 1)


class _Skip(_Shell):
    """Another stage's layer: returns its input, or the received hidden state on the layer
    just before this stage. Keeps the layer's plain attributes (use_sliding, is_linear, ...),
    its children's too, that model forwards read to pick a mask."""

    def __init__(self, layer: nn.Module):
        super().__init__(layer)
        self.hand(None)

    def hand(self, h: mx.array | None) -> None:
        # A plain attribute, not a module entry: an array set on a Module becomes a parameter.
        object.__setattr__(self, "received", h)

    def __call__(self, *args, **kwargs) -> mx.array:
        if self.received is not None:
            return self.received
        # The hidden state: the first argument, or the first array passed by keyword.
        if args:
            return args[0]
        return next(v for v in kwargs.values() if isinstance(v, mx.array))


def _parts(model: nn.Module) -> tuple:
    """(decoder, (embedding name, module), final norm's name, the layer list's owner, its
    attribute): where a stage cuts, or a ShardingError saying why this model cannot be cut."""
    body = anatomy(model)
    inner, embedding, norm = body.decoder, body.embedding(), body.norm()
    if embedding is None or norm is None:
        what = "token embedding" if embedding is None else f"final norm ({', '.join(NORMS)})"
        raise ShardingError(
            f"{type(model).__module__}: its decoder ({body.path}) has no {what} this "
            "pipeline can hand over at; use --parallel tp or --nodes 1"
        )
    if (head := body.head_inside()) is not None:
        raise ShardingError(
            f"{type(model).__module__}: its decoder ({body.path}) applies the output head "
            f"({head}) itself, so no stage hands over a hidden state at its end; use "
            "--parallel tp or --nodes 1"
        )
    *owner_path, attr = body.layers_attr.split(".")
    owner = inner
    for name in owner_path:
        owner = owner[name]
    if len(owner[attr]) != len(model.layers):
        raise ShardingError(
            f"{type(model).__module__}: its {len(model.layers)} layers live in more than one "
            f"list ({body.path}.{body.layers_attr} holds {len(owner[attr])}); pipeline "
            "parallelism cuts one list: use --parallel tp or --nodes 1"
        )
    return inner, embedding, norm, owner, attr


def check(model: nn.Module, n_stages: int, split: list[int] | None = None) -> None:
    """Raise ShardingError where this model cannot be cut into `n_stages` stages."""
    split_layers(len(model.layers), n_stages, split)
    _parts(model)


class PipelineStage:
    """Cuts `model` to this rank's stage and runs the stage's part of a forward."""

    def __init__(
        self,
        model: nn.Module,
        group: mx.distributed.Group,
        bounds: list[tuple[int, int]],
        stage: int | None = None,
        parts: tuple | None = None,
    ):
        """`stage`: this rank's stage when it is not its rank in `group` (hybrid); `parts`:
        _parts(model) read before TP replaced its embedding (hybrid)."""
        inner, embedding, norm, owner, attr = parts or _parts(model)
        self.model, self.inner, self.group = model, inner, group
        # The stage index and count (PP: the rank and the world; hybrid: its group's stage).
        self.rank = group.rank() if stage is None else stage
        self.size = len(bounds)
        self.leads = self.rank == 0  # holds the embedding and head; hybrid: see HybridStage
        self.bounds = bounds
        self.start, self.end = bounds[self.rank]
        layers = owner[attr]
        if len(layers) != bounds[-1][1]:
            raise ShardingError(f"stages {bounds} do not cover the {len(layers)} layers")
        self.hidden = width(embedding[1])[1]
        self.dtype = _float_dtype(layers[self.start])
        # Replacing modules before any weight is evaluated means they are never read from disk.
        self.local = range(self.start, self.end)
        owner[attr] = [
            layer if i in self.local else _Skip(layer) for i, layer in enumerate(layers)
        ]
        self.layers = owner[attr]
        self.handoff = self.layers[self.start - 1] if self.start > 0 else None
        if self.rank != 0:
            inner[embedding[0]] = _ZeroEmbedding(self.hidden, self.dtype)
            if hasattr(model, "lm_head"):
                model.lm_head = None
        if self.rank != self.size - 1:
            inner[norm] = _Identity()

    def forward(self, tokens: mx.array, cache: list, last_only: bool = True) -> mx.array | None:
        """Runs this stage; returns the final hidden state of the last position on rank 0
        (of every position when not `last_only`: a speculative verify step)."""
        B, L = tokens.shape
        if self.handoff is not None:
            self.handoff.hand(self._receive((B, L, self.hidden)))
        try:
            h = self.inner(tokens, cache=cache)
        finally:
            if self.handoff is not None:
                self.handoff.hand(None)
        _advance_others(cache, self.local, B, L, self.dtype, len(self.layers))
        return self._pass_on(h, B, 1 if last_only else L)

    def decode(self, tokens: mx.array, cache: list, local: Callable) -> mx.array | None:
        """`forward` of a one-token step whose own layers (and final norm) run as
        `local(h, their caches)`, a compiled graph, instead of the model's forward."""
        B, L = tokens.shape
        if self.start > 0:
            h = self._receive((B, L, self.hidden))
        else:
            h = self.inner.embed_tokens(tokens)
        h = local(h, cache[self.start : self.end])
        _advance_others(cache, self.local, B, L, self.dtype, len(self.layers))
        return self._pass_on(h, B, 1)

    def _receive(self, shape: tuple[int, ...]) -> mx.array:
        """The previous stage's hidden state."""
        return mx.distributed.recv(shape, self.dtype, self.rank - 1, group=self.group)

    def _pass_on(self, h: mx.array, B: int, kept: int) -> mx.array | None:
        """Sends the stage's output on; rank 0 returns the last stage's last `kept` positions."""
        if self.size == 1:
            return h[:, -kept:, :]
        if self.rank < self.size - 1:
            mx.eval(mx.distributed.send(h.astype(self.dtype), self.rank + 1, group=self.group))
        else:
            last = h[:, -kept:, :].astype(self.dtype)
            mx.eval(mx.distributed.send(last, 0, group=self.group))
        if self.rank == 0:
            return mx.distributed.recv(
                (B, kept, self.hidden), self.dtype, self.size - 1, group=self.group
            )
        return None


def _advance_others(
    cache: list, local: range, B: int, L: int, dtype: mx.Dtype, n_layers: int | None = None
) -> None:
    """Move the caches of other stages' layers on by L tokens, as their layers would have:
    keys of zero heads and zero width keep offsets, rotation and batch padding exact (so
    masks built from any layer's cache are right) and hold no memory. Recurrent state
    caches (ArraysCache) carry no position and stay empty; a CacheList (DeepSeek V3.2's
    latent and indexer caches) advances each of its caches."""
    empty = mx.zeros((B, 0, L, 0), dtype)
    aligned = len(cache) == n_layers
    for i, c in enumerate(cache):
        # Nemotron-H keeps caches for its mamba and attention layers only, so a cache's index
        # is no layer's: there, a cache another stage owns is one that holds no entries.
        if (i not in local) if aligned else not _holds(c):
            for part in getattr(c, "caches", (c,)):
                if hasattr(part, "update_and_fetch"):
                    part.update_and_fetch(empty, empty)


def _holds(c) -> bool:
    """Whether a cache holds this stage's entries (keys of some heads)."""
    for part in getattr(c, "caches", (c,)):
        keys = getattr(part, "keys", None)
        keys = keys[0] if isinstance(keys, tuple | list) else keys
        if isinstance(keys, mx.array) and keys.ndim >= 2 and keys.shape[1] > 0:
            return True
        if getattr(part, "cache", None) is not None and not hasattr(part, "keys"):
            return any(x is not None for x in part.cache)  # a state cache of this stage
    return False


def _float_dtype(module: nn.Module) -> mx.Dtype:
    """The activation dtype: that of the first floating parameter (scales, for quantized)."""
    for _, v in tree_flatten(module.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return v.dtype
    return mx.float32
