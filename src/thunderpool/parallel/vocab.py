"""TP split of the vocabulary: each rank holds its rows of the embedding and of the output head.

Whole, the embedding sat on every rank (Qwen2.5-0.5B: a third of its weights) and a tied head
kept a second, sliced copy of it. Split, rank r holds rows [a, b) of each vocabulary matrix:
- lookup: a masked gather of the local rows (other ids give zeros), then one all_sum;
- projection: logits for the local rows, then one all_gather, in vocabulary order.
A tied head projects onto the very rows the lookup reads; an untied one keeps its own rows.
Row shares follow the TP weights, like the heads and channels of parallel/tensor.py.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from thunderpool.errors import ShardingError
from thunderpool.parallel.anatomy import anatomy
from thunderpool.parallel.heads import proportional_split

_TENSORS = ("weight", "scales", "biases", "bias")

# (parameter name, lazy array, a, b) -> rows [a, b): stored_rows.StoredRows.rows reads only
# those rows from the file; the default slices the lazy array (which reads it whole).
RowReader = Callable[[str, mx.array, int, int], mx.array]


def _slice(_name: str, lazy: mx.array, a: int, b: int) -> mx.array:
    return mx.contiguous(lazy[a:b])


class HeadRows(nn.Module):
    """Rows [a, b) of a vocabulary matrix (linear head or embedding), plain or quantized:
    `__call__` projects onto them, `lookup` reads them."""

    def __init__(self, source: nn.Module, a: int, b: int, read: RowReader = _slice, name: str = ""):
        super().__init__()
        for t in _TENSORS:
            if t in source:
                self[t] = read(f"{name}.{t}" if name else t, source[t], a, b)
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

    def lookup(self, rows: mx.array) -> mx.array:
        """The given local rows, dequantizing only those."""
        if not self.quantized:
            return self["weight"][rows]
        biases = self.get("biases")
        return mx.dequantize(
            self["weight"][rows],
            scales=self["scales"][rows],
            biases=biases[rows] if biases is not None else None,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )


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


class SplitEmbedding(nn.Module):
    """Stands in for nn.Embedding / nn.QuantizedEmbedding with rows [start, start + n) on this
    rank: the same call (ids -> vectors) and `as_linear` (the tied head, through `head`)."""

    def __init__(self, head: SplitHead, start: int):
        super().__init__()
        self.head = head
        self.start = start

    def __call__(self, ids: mx.array) -> mx.array:
        n = self.head.rows["weight"].shape[0]
        local = ids - self.start
        mine = (local >= 0) & (local < n)
        x = self.head.rows.lookup(mx.where(mine, local, 0))
        # Every id is inside exactly one rank's rows: the sum adds zeros to it, exactly.
        x = mx.where(mine[..., None], x, mx.zeros((), x.dtype))
        return mx.distributed.all_sum(x, group=self.head.group)

    def as_linear(self, h: mx.array) -> mx.array:
        return self.head(h)


def _split(
    source: nn.Module, name: str, group: mx.distributed.Group, weights: list[float], read
) -> tuple[SplitHead, int]:
    """This rank's SplitHead of a vocabulary matrix, and its first row."""
    if "weight" not in source or source["weight"].ndim != 2:
        raise ShardingError(f"{name} ({type(source).__name__}) has no 2-D weight to split")
    bounds = proportional_split(source["weight"].shape[0], weights)
    a, b = bounds[group.rank()]
    rows = HeadRows(source, a, b, read, name)
    return SplitHead(rows, [hi - lo for lo, hi in bounds], group), a


def split_vocab(
    model: nn.Module,
    group: mx.distributed.Group,
    weights: list[float] | None,
    read: RowReader = _slice,
) -> None:
    """Replace the model's embedding and output head by this rank's rows of them, with row
    shares in proportion to the TP weights. `read` loads rows (stored_rows.StoredRows.rows)."""
    weights = weights or [1.0] * group.size()
    inner = getattr(model, "model", None)
    if getattr(model, "layers", None) and not anatomy(model).standard:
        return  # a decoder elsewhere, or its embedding under another name: kept whole
    if _reads_table(model):
        return  # its head multiplies by embed_tokens.weight itself (Seed-OSS): kept whole
    embed = getattr(inner, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if head is not None:
        model.lm_head = _split(head, "lm_head", group, weights, read)[0]
    # Only the standard tables: a model whose embedding does more (or is read as
    # embed_tokens.weight) keeps it whole, and a tied head then gets its rows as a copy.
    if type(embed) in (nn.Embedding, nn.QuantizedEmbedding):
        split, start = _split(embed, "model.embed_tokens", group, weights, read)
        inner.embed_tokens = SplitEmbedding(split, start)
    elif head is None:
        if embed is None:
            raise ShardingError(f"{type(model).__module__} has no lm_head or embed_tokens")
        model.lm_head = _split(embed, "model.embed_tokens", group, weights, _slice)[0]


def _reads_table(model: nn.Module) -> bool:
    import inspect

    try:
        return "embed_tokens.weight" in inspect.getsource(type(model).__call__)
    except (OSError, TypeError):
        return False


def split_head_of(model: nn.Module) -> SplitHead | None:
    """The module that projects onto this rank's vocabulary rows and gathers the logits."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, SplitHead):
        return head
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return embed.head if head is None and isinstance(embed, SplitEmbedding) else None


def has_split_head(model: nn.Module) -> bool:
    return split_head_of(model) is not None
