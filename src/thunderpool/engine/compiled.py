"""A compiled decode step: `mx.compile` traces the whole one-token forward of a batch once per
shape, so each later token replays a fused graph instead of rebuilding it op by op in Python.

mlx-lm does not compile its models because its caches keep Python state (int offsets,
buffers that grow and are sliced to the offset), which a traced graph would freeze. Here the
step is functional: it takes each layer's preallocated key/value buffers, the write index
and the rows' left padding as arrays and returns the new buffers; the mlx-lm cache objects
stay the source of truth between steps, so prefill, join and drop are unchanged. TP's
all_sums are traced into the graph like any other op. A PP stage compiles its own layers
only (with the fused forward): the recv before them and the send after run outside the graph.

Only families whose compiled step is proven equal to the eager one (tests/engine/
test_compiled.py) compile; any other decodes eagerly, never approximately.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from thunderpool.config import decode_graphs
from thunderpool.engine import fused
from thunderpool.parallel.pipeline import PipelineStage

# Families whose attention reads the cache only through offset, update_and_fetch and
# make_mask (the contract _StepCache keeps), proven equal by the tests.
COMPILED_FAMILIES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe"})
# Buffer capacity grows in steps of FINE up to COARSE_FROM positions, of STEP past it. The
# step's attention reads the whole buffer, so a short context wastes less with fine steps (a
# 5-position verify of a 1B model at 21 positions: 1.27x a plain step, 1.30x with 256); past
# COARSE_FROM, the rarer retrace and buffer copy pay more than the masked positions cost.
FINE, COARSE_FROM, STEP = 64, 1024, 256
# mx.compile keeps every shape's traced graph for the life of the compiled function (about
# 2 MiB each for a 30-layer model here), and batch size x buffer capacity x window width makes
# hundreds of shapes over a long serve (part of a soak's growth; README). The most recently
# used GRAPHS shapes keep their graph (THUNDERPOOL_DECODE_GRAPHS overrides); an older one is
# traced again if it comes back (~0.1-0.3 s for that model here).
GRAPHS = 32


def wanted(requested: bool | None) -> bool:
    """Whether this rank decodes with the compiled step: --compile / --no-compile as given;
    unset, on for a CPU rank and off on a GPU (Metal, CUDA), where the compiled step has never
    run against eager (scripts/gpu_check.py is the run that would prove it)."""
    if requested is not None:
        return requested
    return mx.default_device() != mx.gpu


def supports(model: nn.Module) -> bool:
    """Whether this model's decode step may be compiled."""
    return getattr(getattr(model, "args", None), "model_type", None) in COMPILED_FAMILIES


class _StepCache:
    """What an mlx-lm attention layer asks of its cache during one traced decode step."""

    def __init__(self, keys: mx.array, values: mx.array, idx: mx.array, left: mx.array):
        self.keys, self.values, self.idx, self.left = keys, values, idx, left
        self.offset = idx - left  # (B,) each row's position, for RoPE

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys = mx.slice_update(self.keys, keys, self.idx, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.idx, axes=(2,))
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # The written positions of each row: past its left padding, up to the new token.
        pos = mx.arange(self.keys.shape[2])
        mask = (pos[None] >= self.left[:, None]) & (pos[None] <= self.idx + N - 1)
        if window_size is not None:
            mask = mask & (pos[None] > self.idx + N - 1 - window_size)
        return mask[:, None, None, :]  # (B, 1, 1, capacity)


def _position(cache) -> tuple[int, mx.array]:
    """The write index and the rows' left padding of an mlx-lm cache."""
    if isinstance(cache, BatchKVCache):
        return cache._idx, cache.left_padding
    return cache.offset, mx.zeros((cache.keys.shape[0],), mx.int32)


def _reserve(cache, need: int) -> None:
    """Sizes the buffers to the multiple of the step holding `need` positions: attention reads
    the whole buffer (the mask hides the unwritten part), so a larger one (mlx-lm's prefill
    grows in 256s, filter() may leave more) is cut back."""
    cap, step = cache.keys.shape[2], FINE if need <= COARSE_FROM else STEP
    size = -(-need // step) * step
    if cap == size:
        return
    if cap > size:
        cache.keys, cache.values = cache.keys[..., :size, :], cache.values[..., :size, :]
    else:
        pad = [(0, 0), (0, 0), (0, size - cap), (0, 0)]
        cache.keys, cache.values = mx.pad(cache.keys, pad), mx.pad(cache.values, pad)


def eligible(cache: list) -> bool:
    """Plain (batch) KV caches with buffers: the ones _StepCache stands in for."""
    return all(
        type(c) in (KVCache, BatchKVCache) and c.keys is not None and c.keys.ndim == 4
        for c in cache
    )


def build(
    model: nn.Module,
    finish: Callable[[mx.array], mx.array | None],
    stage: PipelineStage | None = None,
    ways: int = 1,
    every: Callable[[mx.array], mx.array | None] | None = None,
) -> CompiledDecode | None:
    """The compiled step of a runner: on one rank or TP, tokens (B, 1) through a one-token
    forward then `finish` (the runner's head); on a PP stage, the received hidden state
    (B, 1, D) through the stage's own layers and the final norm (an identity but on the last
    stage). The forward is the fused one (engine/fused.py) where the model's structure allows,
    else mlx-lm's own; a PP stage compiles only the fused one (None otherwise). With the fused
    forward on one rank or TP, a verify window of L tokens compiles too, then `every` (the
    head on every position)."""
    # Fuses the projections' weights in place (the modules keep views).
    run = fused.build(model, stage.local if stage is not None else None, ways)
    if stage is not None:
        if run is None:
            return None
        return CompiledDecode(lambda h, cache: run.inner.norm(run.layers_forward(h, cache)), run)
    plain = run or (lambda tokens, cache: model.model(tokens, cache=cache))
    window = None
    if run is not None and every is not None:  # mlx-lm's own forward masks no window
        window = lambda tokens, cache: every(run(tokens, cache))  # noqa: E731
    return CompiledDecode(lambda tokens, cache: finish(plain(tokens, cache)), run, window)


def _traced(forward: Callable) -> Callable:
    """`forward` as a functional step over the cache buffers, for mx.compile."""

    def step(x, idx, left, *buffers):
        n = len(buffers) // 2
        cache = [_StepCache(buffers[i], buffers[n + i], idx, left) for i in range(n)]
        out = forward(x, cache)
        return (out, *[c.keys for c in cache], *[c.values for c in cache])

    return step


class CompiledDecode:
    """`decode(x, cache)`: `forward(x, step caches)` compiled, on the mlx-lm caches;
    `verify(tokens, cache)`: `window` compiled likewise, where there is one."""

    def __init__(
        self,
        forward: Callable,
        fused_forward: fused.FusedForward | None,
        window: Callable | None = None,
    ):
        # Kept: measure.py traces them afresh.
        self.forward, self.fused, self.window = forward, fused_forward, window
        self._step = _traced(forward)
        self._window = _traced(window) if window is not None else None
        # One compiled function per shape: dropping it frees its graph (mx.compile's cache
        # is per function), which a single function for every shape never would.
        self._graphs: OrderedDict[tuple, Callable] = OrderedDict()
        self.limit = decode_graphs() or GRAPHS
        self.steps = 0  # compiled steps run (tests and benchmarks read it)
        self.verifies = 0  # compiled verify windows run
        self.traces = 0  # graphs traced (a shape first seen, or seen again after eviction)

    @property
    def windows(self) -> bool:
        """Whether verify windows compile (the fused forward on one rank or TP)."""
        return self._window is not None

    def decode(self, x: mx.array, cache: list) -> mx.array:
        self.steps += 1
        return self._run(self._step, x, cache)

    def verify(self, tokens: mx.array, cache: list) -> mx.array:
        """tokens (B, L) written at the cache's index: what `window` returns (the logits of
        every position, on ranks that project)."""
        self.verifies += 1
        return self._run(self._window, tokens, cache)

    def _graph(self, step: Callable, shape: tuple) -> Callable:
        """The compiled `step` for inputs of this shape: the `limit` most recently used kept."""
        key = (step is self._window, *shape)
        graph = self._graphs.get(key)
        if graph is None:
            # mx.compile's cache is per function object: a partial of its own per shape, so
            # that dropping one does not erase the graphs of the others (which it did).
            graph = self._graphs[key] = mx.compile(functools.partial(step))
            self.traces += 1
            if len(self._graphs) > self.limit:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        return graph

    def _run(self, step: Callable, x: mx.array, cache: list) -> mx.array:
        idx, left = _position(cache[0])
        width = x.shape[1]
        for c in cache:
            _reserve(c, idx + width)
        keys, values = [c.keys for c in cache], [c.values for c in cache]
        step = self._graph(step, (*x.shape, *keys[0].shape, *values[0].shape))
        for c in cache:  # only the graph holds the old buffers: updated in place
            c.keys = c.values = None
        out, *buffers = step(x, mx.array([idx], mx.int32), left, *keys, *values)
        del keys, values
        n = len(cache)
        for i, c in enumerate(cache):
            c.keys, c.values = buffers[i], buffers[n + i]
            if isinstance(c, BatchKVCache):
                c._idx += width
                c.offset = c.offset + width
            else:
                c.offset += width
        return out
