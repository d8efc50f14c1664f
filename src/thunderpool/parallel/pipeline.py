"""Pipeline parallelism: each rank keeps one contiguous stage of an mlx-lm model's layers.

Rank 0 holds the embedding, its layers and the output head; the last rank holds the final norm.
A forward runs recv -> local layers -> send around the ring: 0 -> 1 -> ... -> N-1 -> 0, so the
logits end up on the leader (rank 0).
"""

from __future__ import annotations

import inspect

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from thunderpool.errors import ShardingError


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
        from thunderpool.parallel.tensor import proportional_split

        return proportional_split(n_layers, [float(s) for s in split])
    bounds, start = [], 0
    for s in split:
        bounds.append((start, start + s))
        start += s
    return bounds


class _Identity(nn.Module):
    def __call__(self, x: mx.array) -> mx.array:
        return x


class PipelineStage:
    """Cuts `model` to this rank's stage and runs the stage's part of a forward."""

    def __init__(
        self, model: nn.Module, group: mx.distributed.Group, bounds: list[tuple[int, int]]
    ):
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
            raise ShardingError(
                f"{type(model).__module__} has no model.layers/embed_tokens; pipeline "
                "parallelism needs an mlx-lm model with a layers list"
            )
        if "input_embeddings" not in inspect.signature(inner.__call__).parameters:
            raise ShardingError(
                f"{type(inner).__name__} does not accept input_embeddings, which pipeline "
                "stages after the first need; use --parallel tp for this model"
            )
        self.model, self.inner, self.group = model, inner, group
        self.rank, self.size = group.rank(), group.size()
        self.bounds = bounds
        start, end = bounds[self.rank]
        # Dropping modules before any weight is evaluated means they are never read from disk.
        inner.layers = inner.layers[start:end]
        if self.rank != 0:
            inner.embed_tokens = None
            if hasattr(model, "lm_head"):
                model.lm_head = None
        if self.rank != self.size - 1:
            inner.norm = _Identity()
        self.hidden = model.args.hidden_size
        self.dtype = _float_dtype(inner.layers[0])

    def forward(self, tokens: mx.array, cache: list) -> mx.array | None:
        """Runs this stage; returns the final hidden state of the last position on rank 0."""
        B, L = tokens.shape
        embeddings = None
        if self.rank > 0:
            embeddings = mx.distributed.recv(
                (B, L, self.hidden), self.dtype, self.rank - 1, group=self.group
            )
        h = self.inner(tokens, cache=cache, input_embeddings=embeddings)
        if self.size == 1:
            return h[:, -1:, :]
        if self.rank < self.size - 1:
            mx.eval(mx.distributed.send(h.astype(self.dtype), self.rank + 1, group=self.group))
        else:
            last = h[:, -1:, :].astype(self.dtype)
            mx.eval(mx.distributed.send(last, 0, group=self.group))
        if self.rank == 0:
            return mx.distributed.recv(
                (B, 1, self.hidden), self.dtype, self.size - 1, group=self.group
            )
        return None


def _float_dtype(module: nn.Module) -> mx.Dtype:
    """The activation dtype: that of the first floating parameter (scales, for quantized)."""
    for _, v in tree_flatten(module.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return v.dtype
    return mx.float32
