"""TP output head split over the vocabulary: each rank projects onto its rows, one all_gather.

Left whole, the output head runs on the leader alone after the last all_sum while the other
ranks wait (21% of SmolLM2's weights). Split, every rank reads its share of it, and one
all_gather per forward assembles the full logits on every rank, in vocabulary order.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from thunderpool.errors import ShardingError
from thunderpool.parallel.tensor import proportional_split, slice_rows

_TENSORS = ("weight", "scales", "biases", "bias")


class HeadRows(nn.Module):
    """Output rows [a, b) of a linear head or of a tied embedding, plain or quantized."""

    def __init__(self, source: nn.Module, a: int, b: int):
        super().__init__()
        for name in _TENSORS:
            if name in source:
                self[name] = source[name]
        slice_rows(self, a, b)
        self.quantized = "scales" in source
        if self.quantized:
            self.group_size, self.bits = source.group_size, source.bits
            self.mode = getattr(source, "mode", "affine")

    def __call__(self, x: mx.array) -> mx.array:
        if self.quantized:
            y = mx.quantized_matmul(
                x,
                self["weight"],
                scales=self["scales"],
                biases=self.get("biases"),
                transpose=True,
                group_size=self.group_size,
                bits=self.bits,
                mode=self.mode,
            )
        else:
            y = x @ self["weight"].T
        return y + self["bias"] if "bias" in self else y


class SplitHead(nn.Module):
    """This rank's HeadRows plus the all_gather that puts every rank's logits together."""

    def __init__(self, rows: HeadRows, sizes: list[int], group: mx.distributed.Group):
        super().__init__()
        self.rows = rows
        self.group = group
        self._sizes = sizes  # rows per rank, in rank order
        self.width = max(sizes)  # all_gather wants equal shapes: shorter shares are padded
        self.uneven = len(set(sizes)) > 1

    def __call__(self, h: mx.array) -> mx.array:
        local = self.rows(h)
        lead, mine = local.shape[:-1], local.shape[-1]
        # Vocabulary first, so the gather concatenates the shares along the vocabulary.
        flat = local.reshape(-1, mine).T
        if mine < self.width:
            flat = mx.pad(flat, [(0, self.width - mine), (0, 0)])
        full = mx.distributed.all_gather(flat, group=self.group)
        if self.uneven:
            w = self.width
            full = mx.concatenate([full[r * w : r * w + n] for r, n in enumerate(self._sizes)])
        return full.T.reshape(*lead, -1)


def split_head(model: nn.Module, group: mx.distributed.Group, weights: list[float] | None) -> None:
    """Replace the model's output head (or tied embedding) by this rank's SplitHead, with
    vocabulary shares in proportion to the TP weights."""
    head = getattr(model, "lm_head", None)
    source = head if head is not None else model.model.embed_tokens
    if "weight" not in source:
        raise ShardingError(f"output head {type(source).__name__} has no weight to split")
    bounds = proportional_split(source["weight"].shape[0], weights or [1.0] * group.size())
    a, b = bounds[group.rank()]
    model.lm_head = SplitHead(HeadRows(source, a, b), [hi - lo for lo, hi in bounds], group)


def has_split_head(model: nn.Module) -> bool:
    return isinstance(getattr(model, "lm_head", None), SplitHead)
