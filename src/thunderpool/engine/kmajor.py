"""Input-major ("K-major") weights for a CPU rank: each dense projection's matrix is stored
transposed, (in, out) row-major, in an `InputMajor` module that replaces mlx's.

MLX and mlx-lm store a projection as (out, in) and multiply x @ W.T. With BLIS on an x86 CPU,
a product of a few rows (a speculative verify of k+1 positions, a batch of decode rows) then
runs as a gemm that packs the weights and reaches little of the memory bandwidth: 5 rows of a
46 MB matrix cost 1.9x one row. Stored (in, out), the same product reads each weight once per
input row block: 5 rows cost 1.1-1.4x one row, and a one-row product on one thread is faster
too (docs/benchmarks.md §14). Up to SPLIT_ROWS rows, the product is also split over the CPU
streams by input blocks, so it runs on every core. The module's `weight` keeps its (out, in)
shape and values: it is a transposed view, so `x @ weight.T` is `x @ W_t`, with no copy.

Only plain float projections inside the decoder layers and an untied lm_head are turned; a
quantized, expert (3-D), embedding or vocab-split matrix keeps its layout. On a GPU nothing is
turned (Metal's and CUDA's kernels are tuned for MLX's own layout). THUNDERPOOL_KMAJOR=0 turns
it off, for comparisons.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from thunderpool.config import cpu_only, kmajor_choice
from thunderpool.engine import rowsplit

# Module types whose forward is x @ weight.T (+ bias) on a 2-D float weight, around which a
# TP all_sum may come (mlx's sharded linears; parallel/tensor.SumAfter wraps one of these).
PLAIN = frozenset({"Linear", "AllToShardedLinear", "ShardedToAllLinear"})
FLOATS = (mx.float32, mx.float16, mx.bfloat16)
# Up to this many rows a product is split over the CPU streams by input blocks (as the
# compiled decode step does); past it one BLAS call spreads better (docs/benchmarks.md §14).
SPLIT_ROWS = 32


def wanted() -> bool:
    """K-major weights on a CPU rank, unless THUNDERPOOL_KMAJOR turns them off; refused on a
    GPU, where no test has compared them with MLX's layout."""
    return cpu_only(
        kmajor_choice(),
        mx.default_device() == mx.cpu,
        "THUNDERPOOL_KMAJOR=1 asks for input-major weights on a GPU rank, where they are "
        "untested; unset it (GPU ranks keep MLX's layout)",
    )


def split_rows(rows: int) -> bool:
    """Whether a forward of `rows` token rows splits its products over the streams (and so
    wants BLIS on one thread)."""
    return rows <= SPLIT_ROWS


def summed(x: mx.array, blocks: tuple[mx.array, ...]) -> mx.array:
    """x @ W_t from W_t's consecutive row blocks: each block times its slice of x's inputs, on
    a CPU stream of its own, then summed."""
    y, a = None, 0
    for w, s in zip(blocks, rowsplit.streams(len(blocks)), strict=True):
        b = a + w.shape[0]
        part = mx.matmul(x[..., a:b], w, stream=s)
        y, a = (part if y is None else y + part), b
    return y


class _Blocks:
    """The input-dimension blocks of a weight, kept out of the module's parameters."""

    def __init__(self, blocks: tuple[mx.array, ...]):
        self.blocks = blocks


class InputMajor(nn.Module):
    """A dense projection stored (in, out): x @ W_t, then TP's all_sum where the module it
    replaces had one (mlx's ShardedToAllLinear), then the bias. `weight` is W_t's transposed
    view, so it reads as the (out, in) matrix it replaced, with no second copy. Few-row
    products are split over the CPU streams by input blocks and summed."""

    def __init__(self, source: nn.Module, ways: int):
        super().__init__()
        wt = mx.contiguous(source["weight"].T)
        self.weight = wt.T
        if "bias" in source:
            self.bias = source["bias"]
        reduced = type(source).__name__ == "ShardedToAllLinear"
        self.group = source.group if reduced else None
        cuts = rowsplit.bounds(wt.shape[0], ways) if ways > 1 else []
        self._blocks = _Blocks(tuple(wt[a:b] for a, b in cuts) if len(cuts) > 1 else ())
        # Evaluated now, views too: a lazy one is tied to this thread's stream, and the engine
        # may step in another thread.
        mx.eval(self.weight, wt, self._blocks.blocks)

    def product(self, x: mx.array) -> mx.array:
        blocks = self._blocks.blocks
        if not blocks or not split_rows(x.size // x.shape[-1]):
            return x @ self["weight"].T
        return summed(x, blocks)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.product(x)
        if self.group is not None:
            y = mx.distributed.all_sum(y, group=self.group)
        return y + self["bias"] if "bias" in self else y


def is_kmajor(m: nn.Module) -> bool:
    return isinstance(m, InputMajor)


def _turnable(m) -> bool:
    w = m.get("weight") if isinstance(m, nn.Module) else None
    return (
        type(m).__name__ in PLAIN
        and isinstance(w, mx.array)
        and w.ndim == 2
        and w.dtype in FLOATS
        and "scales" not in m
    )


def _children(m) -> list[tuple[object, object, object]]:
    """(parent, key, child) for the direct children of a module or list."""
    if isinstance(m, nn.Module):
        return [(m, k, v) for k, v in m.items() if isinstance(v, (nn.Module, list, tuple))]
    return [(m, i, v) for i, v in enumerate(m) if isinstance(v, (nn.Module, list, tuple))]


def turn(model: nn.Module, ways: int = 1) -> int:
    """Replaces the decoder layers' plain projections (and a separate lm_head) with input-major
    ones, one matrix at a time so memory peaks at one extra matrix; returns how many."""
    inner = getattr(model, "model", None)
    todo = [(inner, "layers", getattr(inner, "layers", None) or [])]
    if _turnable(getattr(model, "lm_head", None)):
        todo.append((model, "lm_head", model.lm_head))
    turned = 0
    while todo:
        parent, key, m = todo.pop()
        if _turnable(m):
            if isinstance(parent, tuple):
                continue  # an immutable container: leave it as MLX stores it
            parent[key] = InputMajor(m, ways)
            turned += 1
            mx.clear_cache()
        else:
            todo += _children(m)
    return turned
