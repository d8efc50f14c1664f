"""Pipeline parallelism through mlx-lm's own `pipeline()`, for families whose layers hand more
than a hidden state to the next one.

DeepSeek V4.1's hyper-connection streams and shared windows, Kimi K3's attention-residual
blocks: what crosses a cut there is the family's own business, and mlx-lm's `pipeline(group)`
knows it (it is to PP what `shard()` is to TP). Its stages run in reverse rank order (the last
rank holds the first layers) and every rank gets the final hidden state (an all_gather), so
the leader projects it as on one rank. Our own stage (pipeline.py) serves every other family.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import mlx.core as mx
import mlx.nn as nn

from thunderpool.errors import ShardingError
from thunderpool.parallel.anatomy import anatomy


def hands_more(decoder: nn.Module) -> str | None:
    """What a layer of this decoder returns besides the hidden state (the names its forward
    unpacks, e.g. "streams, pre_mix"), read from the forward's source; None for one array."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(decoder).__call__)))
    except (OSError, TypeError, SyntaxError):
        return None
    loops = {
        n.id
        for node in ast.walk(tree)
        if isinstance(node, ast.For)
        for n in ast.walk(node.target)
        if isinstance(n, ast.Name)
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Tuple)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id in loops | {"layer"}
        ):
            return ", ".join(ast.unparse(t) for t in node.targets[0].elts)
    return None


def has_own(model: nn.Module) -> bool:
    return callable(getattr(anatomy(model).decoder, "pipeline", None))


def check(model: nn.Module, n_stages: int, split: list[int] | None) -> None:
    """Raise ShardingError where mlx-lm's pipeline() cannot take this layout."""
    if not has_own(model):
        more = hands_more(anatomy(model).decoder)
        raise ShardingError(
            f"{type(model).__module__}: its layers hand more than a hidden state to the next "
            f"({more}) and mlx-lm has no pipeline() for it; pipeline parallelism cannot cut it: "
            "use --parallel tp or --nodes 1"
        )
    if split is not None:
        raise ShardingError(
            f"{type(model).__module__} is cut by mlx-lm's own pipeline(), in its own even "
            f"split: --layer-split {split} cannot be kept; leave it out"
        )
    if n_stages > len(model.layers):
        raise ShardingError(
            f"--nodes {n_stages} is more than the {len(model.layers)} layers of this model"
        )


class NativeStage:
    """This rank's stage of mlx-lm's own pipeline(); the same calls as PipelineStage."""

    def __init__(self, model: nn.Module, group: mx.distributed.Group):
        self.model, self.group = model, group
        self.inner = anatomy(model).decoder
        n = len(model.layers)
        self.inner.pipeline(group)
        self.rank, self.size = group.rank(), group.size()
        self.leads = self.rank == 0
        self.start, self.end = self.inner.start_idx, self.inner.end_idx or n
        self.local = range(self.start, self.end)
        self.bounds = [(self.start, self.end)]
        self.overlaps = False  # its all_gather ends every step on every rank: no overlap

    def forward(self, tokens: mx.array, cache: list, last_only: bool = True) -> mx.array | None:
        """Every rank runs its layers; the leader returns the last (or every) position's
        final hidden state, the others evaluate their part of the exchange."""
        # The leader holds the last layers, whose input is received, not embedded: evaluate
        # the step's token exchange first, as every other rank does, before the stage's recv.
        mx.eval(tokens)
        h = self.inner(tokens, cache=cache)
        if not self.leads:
            mx.eval(h)
            return None
        return h[:, -1:, :] if last_only else h
