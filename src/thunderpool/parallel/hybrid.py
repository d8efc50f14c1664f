"""Hybrid TP×PP: pipeline stages, each a TP group in its own MLX world, joined by handoff.py.

A rank first TP-shards the whole (still lazy) model over its group, then cuts it to its
stage's layers as PP does (pipeline.py), so only its stage's slices are ever read. Stage 0
holds the embedding and the output head, their rows split over group 0 (parallel/vocab.py);
the last stage holds the final norm. A forward runs: stage 0 embeds and runs its layers, every
rank sends the hidden state to its successors (handoff.Topology), each later stage runs its
layers on what it received and passes it on, and the last stage sends the last positions back
to stage 0, whose ranks project them together. Each step is eager: a rank evaluates its stage
before it sends, so nothing overlaps across stages yet.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from thunderpool.errors import ShardingError
from thunderpool.models import shape
from thunderpool.parallel import tensor, vocab
from thunderpool.parallel.handoff import HandoffError, Link, Topology, check_groups
from thunderpool.parallel.packing import config_head_unit
from thunderpool.parallel.pipeline import PipelineStage, _parts, split_layers
from thunderpool.parallel.vocab import RowReader


def group_weights(
    groups: tuple[int, ...], stage: int, tp_weights: tuple[float, ...] | None
) -> list[float] | None:
    """This stage's part of --tp-weights, which names every rank in order (stage by stage)."""
    if not tp_weights:
        return None
    if len(tp_weights) != sum(groups):
        raise ShardingError(
            f"--tp-weights has {len(tp_weights)} parts for the {sum(groups)} ranks of --groups "
            f"{','.join(map(str, groups))}; give one weight per rank, stage by stage"
        )
    start = sum(groups[:stage])
    return list(tp_weights[start : start + groups[stage]])


def check(
    model: nn.Module,
    groups: tuple[int, ...],
    tp_weights: tuple[float, ...] | None,
    layer_split: tuple[int, ...] | None,
) -> list[tuple[int, int]]:
    """Raise where the model cannot take this layout; returns the stage bounds."""
    check_groups(groups)
    bounds = split_layers(len(model.layers), len(groups), list(layer_split or []) or None)
    for s, n in enumerate(groups):
        tensor.check(model, n, group_weights(groups, s, tp_weights))
    return bounds


class HybridStage(PipelineStage):
    """This rank's stage: its layers TP-sharded over `group`, the hand-off over `link`."""

    def __init__(
        self,
        model: nn.Module,
        group: mx.distributed.Group,
        bounds: list[tuple[int, int]],
        link: Link,
        weights: list[float] | None,
        read: RowReader,
    ):
        topo = link.topo
        if group.size() != topo.groups[topo.stage]:
            raise ShardingError(
                f"stage {topo.stage}'s MLX world has {group.size()} ranks, expected "
                f"{topo.groups[topo.stage]}"
            )
        parts = _parts(model)  # where to cut, read before TP splits the embedding
        self.method = tensor.shard(model, group, weights) if group.size() > 1 else "none"
        if topo.stage == 0 and group.size() > 1:
            vocab.split_vocab(model, group, weights, read)
        super().__init__(model, group, bounds, stage=topo.stage, parts=parts)
        self.link, self.topo = link, topo
        self.leads = topo.stage == 0 and topo.rank == 0

    # PipelineStage.forward runs the stage; these two move its hidden states over the link.
    def _pass_on(self, h: mx.array, B: int, kept: int) -> mx.array | None:
        """Sends the stage's output on (the last stage: its last `kept` positions); stage 0's
        ranks return what the last stage sent back, the others None."""
        out = (h[:, -kept:, :] if self.topo.last else h).astype(self.dtype)
        mx.eval(out)  # a stage evaluates before it hands off
        self.link.send(out)
        return self._receive((B, kept, self.hidden)) if self.rank == 0 else None

    def _receive(self, shape: tuple[int, ...]) -> mx.array:
        h = self.link.recv()
        if h.shape != shape:
            raise HandoffError(
                f"stage {self.topo.stage} expected a hidden state of {shape}, "
                f"got {h.shape} from {self.link.pred_name}"
            )
        return h


def load_stage(
    model: nn.Module, group: mx.distributed.Group, layout, read: RowReader
) -> HybridStage:
    """Connects this rank's hand-off (before any weight is read: ranks load at their own
    pace), then shards and cuts `model` for it. `layout`: engine.loader.Layout."""
    groups = tuple(layout.groups or ())
    bounds = check(model, groups, layout.tp_weights, layout.layer_split)
    link = Link(Topology(groups, layout.stage, group.rank()), tuple(layout.handoff))
    weights = group_weights(groups, layout.stage, layout.tp_weights)
    return HybridStage(model, group, bounds, link, weights, read)


def describe(config: dict, layout) -> dict:
    """Which stage, layers and heads each rank holds (global rank order), for /v1/cluster."""
    groups = tuple(layout.groups or ())
    n_layers = shape.n_layers(config)
    bounds = split_layers(n_layers, len(groups), list(layout.layer_split or []) or None)
    heads, kv = shape.heads(config, 0), shape.kv_heads(config)
    ranks = []
    for s, n in enumerate(groups):
        weights = group_weights(groups, s, layout.tp_weights) or [1.0] * n
        for r, share in enumerate(tensor.split_heads(heads, kv, weights, config_head_unit(config))):
            ranks.append(
                {
                    "rank": len(ranks),
                    "stage": s,
                    "group_rank": r,
                    "layers": list(bounds[s]),
                    "heads": {"q": [share.q0, share.q1], "kv": [share.kv0, share.kv1]},
                }
            )
    return {"parallel": "hybrid", "groups": list(groups), "ranks": ranks}
