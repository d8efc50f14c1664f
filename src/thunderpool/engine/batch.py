"""The KV caches of one rank under continuous batching, changed only by the leader's plans.

Every rank applies the same plans (executor.py) in the same order, so the batch rows
line up on every rank without ever shipping a cache. Prefill runs per sequence (B=1); the
finished prefix cache then joins the decoding batch, which is left-padded (mlx-lm BatchKVCache).
A lone row decodes on its own prefix cache (no padding mask, as mlx-lm's generate); it becomes
a batch cache when a second row joins.
"""

from __future__ import annotations

import os

import mlx.core as mx

from thunderpool.engine.runner import Runner


def overlaps(runner: Runner) -> bool:
    """Whether to build decode step k+1 while step k computes: yes where a GPU computes, on one
    rank, in PP (stages take turns: a rank builds while the other stage computes), and where
    the rank may use more than one core. A CPU TP rank pinned to one core steps one at a time:
    there the Python that builds a step takes the compute thread's core, and each rank's
    stall then holds up the other at the next all_sum."""
    gpu = mx.default_device().type == mx.DeviceType.gpu
    return gpu or runner.size == 1 or runner.stage is not None or own_cores() > 1


def own_cores() -> int:
    """The cores this process may run on (mpirun --bind-to core and pinned ranks: one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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
                self.batch, self.lone = [c.merge([c]) for c in self.batch], False
            for cache, new in zip(self.batch, caches, strict=True):
                cache.extend(new.merge([new]))
        self.rows.append(sid)
