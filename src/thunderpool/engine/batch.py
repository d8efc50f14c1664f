"""The KV caches of one rank under continuous batching, changed only by the leader's plans.

Every rank applies the same plans (executor.py) in the same order, so the batch rows
line up on every rank without ever shipping a cache. Prefill runs per sequence (B=1); the
finished prefix cache then joins the decoding batch, which is left-padded (mlx-lm BatchKVCache;
kv_quant.BatchQuantizedKVCache for --kv-bits).
A lone row decodes on its own prefix cache (no padding mask, as mlx-lm's generate); it becomes
a batch cache when a second row joins. A speculative verify step (speculate.py) leaves each
row a different rejected tail: `trim_rows` cuts them (batch rows stay right-aligned).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, dynamic_roll

from thunderpool.engine.kv_quant import merge
from thunderpool.engine.rowsplit import own_cores
from thunderpool.engine.runner import Runner


def overlaps(runner: Runner) -> bool:
    """Whether to build decode step k+1 while step k computes: yes where a GPU computes, on one
    rank, in PP (stages take turns: a rank builds while the other stage computes), and where
    the rank may use more than one core. A CPU TP rank pinned to one core steps one at a time:
    there the Python that builds a step takes the compute thread's core, and each rank's
    stall then holds up the other at the next all_sum."""
    gpu = mx.default_device().type == mx.DeviceType.gpu
    if not getattr(runner.stage, "overlaps", True):
        return False
    return gpu or runner.size == 1 or runner.stage is not None or own_cores() > 1


def trim_rows(cache: list, trims: list[int]) -> None:
    """Drops the last trims[i] positions of row i from every layer's cache. The common part is
    a plain trim; a row that drops more is rolled right by the rest, which turns its tail
    into left padding (BatchKVCache.finalize does the same for right padding)."""
    low = min(trims)
    if low > 0:
        for c in cache:
            c.trim(low)
    extra = [t - low for t in trims]
    if not any(extra):
        return
    shift = mx.array(extra)
    for c in cache:
        assert isinstance(c, BatchKVCache), f"uneven trims need batch caches, not {type(c)}"
        idx = c._idx
        for buf in _buffers(c):
            buf[..., :idx, :] = dynamic_roll(buf[..., :idx, :], shift[:, None], axis=2)
        c.left_padding = c.left_padding + shift
        c.offset = c.offset - shift
    # The padding every row shares is dropped, so the batch does not grow with rejections.
    if (common := min(cache[0].left_padding.tolist())) > 0:
        for c in cache:
            k, v = c.keys, c.values
            if isinstance(k, tuple):  # quantized: words, scales and biases alike
                c.keys, c.values = (tuple(a[..., common:, :] for a in x) for x in (k, v))
            else:
                c.keys, c.values = k[..., common:, :], v[..., common:, :]
            c._idx -= common
            c.left_padding = c.left_padding - common


def _buffers(c) -> tuple:
    """A batch cache's key and value arrays (a quantized one's words, scales and biases)."""
    if isinstance(c.keys, tuple):
        return (*c.keys, *c.values)
    return c.keys, c.values


def rows_trimmable(cache: list) -> bool:
    """Whether trim_rows can cut uneven tails once these (per-layer) caches batch."""
    plain = ("KVCache", "BatchKVCache", "QuantizedKVCache", "BatchQuantizedKVCache")
    return all(type(c).__name__ in plain for c in cache)


class BatchState:
    def __init__(self, runner: Runner):
        self.runner = runner
        self.pending: dict[int, list] = {}  # sequence id -> per-layer caches being prefilled
        self.batch: list | None = None  # per-layer caches of the decoding rows
        self.lone = False  # self.batch is one row's own prefix cache, not a batch cache
        self.rows: list[int] = []  # sequence id of each batch row

    def start(self, sid: int, cache: list) -> None:
        """Row `sid` prefills on `cache`, which holds a cached prefix of its prompt."""
        self.pending[sid] = cache

    def prefill(self, sid: int, tokens: list[int]) -> mx.array | None:
        cache = self.pending.setdefault(sid, self.runner.make_cache())
        return self.runner.forward(mx.array([tokens]), cache)

    def decode(self, tokens: mx.array) -> mx.array | None:
        """One decode step of every row on tokens (B,), lazily (a burst step feeds the
        exchanged tokens, so the forward waits on the exchange on every rank)."""
        return self.runner.decode(tokens[:, None], self.batch)

    def verify(self, tokens: mx.array) -> mx.array | None:
        """A speculative verify step of every row on tokens (B, L): logits (B, L, V)."""
        return self.runner.verify(tokens, self.batch)

    def trim_rows(self, trims: list[int]) -> None:
        if any(trims):
            trim_rows(self.batch, trims)

    def drop(self, drop: set[int]) -> list[int] | None:
        """Frees the rows and prefills in `drop`; returns the kept rows' indices (None: no row
        left the batch)."""
        for sid in drop:
            self.pending.pop(sid, None)
        keep = [i for i, sid in enumerate(self.rows) if sid not in drop]
        if len(keep) == len(self.rows):
            return None
        if not keep:
            self.batch, self.rows, self.lone = None, [], False
            return keep
        index = mx.array(keep)
        for cache in self.batch:
            cache.filter(index)
        self.rows = [self.rows[i] for i in keep]
        return keep

    def join(self, sid: int) -> None:
        caches = self.pending.pop(sid)
        if self.batch is None:
            self.batch, self.lone = caches, True
        else:
            if self.lone:
                self.batch, self.lone = [merge([c]) for c in self.batch], False
            for cache, new in zip(self.batch, caches, strict=True):
                cache.extend(merge([new]))
        self.rows.append(sid)
