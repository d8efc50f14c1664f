"""Measurements every rank runs together (bench's step breakdown): collective latency, and
each rank's decode compute alone with the collectives replaced by local stand-ins."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator

import mlx.core as mx

from thunderpool.engine.batch import overlaps
from thunderpool.engine.runner import Runner

PROBES = {"all_sum": mx.distributed.all_sum, "all_gather": mx.distributed.all_gather}


def collective_latency(
    group: mx.distributed.Group, shape: tuple[int, ...], repeats: int, op: str = "all_sum"
) -> float:
    """Median seconds of one `op` (all_sum or all_gather) of `shape` floats across the group
    (all ranks join)."""
    if op not in PROBES:
        raise RuntimeError(f"cannot probe {op!r}; one of {sorted(PROBES)}")
    x, collective = mx.zeros(shape), PROBES[op]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(collective(x, group=group))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


@contextlib.contextmanager
def replaced(fns: dict) -> Iterator[None]:
    """mx.distributed's functions named in `fns` replaced inside the block, restored after."""
    originals = {name: getattr(mx.distributed, name) for name in fns}
    try:
        for name, fn in fns.items():
            setattr(mx.distributed, name, fn)
        yield
    finally:
        for name, fn in originals.items():
            setattr(mx.distributed, name, fn)


@contextlib.contextmanager
def solo_collectives() -> Iterator[None]:
    """Inside the block collectives are local no-ops of the right shape (compute-only runs)."""
    stand_ins = {
        "all_sum": lambda x, *a, **k: x,
        "send": lambda x, *a, **k: x,
        "recv": lambda shape, dtype, *a, **k: mx.zeros(shape, dtype),
        # Every rank's share of the split output head stands in for the others' (same shape).
        "all_gather": lambda x, *a, group=None, **k: mx.concatenate([x] * _size(group)),
    }
    with replaced(stand_ins):
        yield


def _size(group) -> int:
    return group.size() if group is not None else 1


def solo_decode_ms(runner: Runner, prompt: list[int], steps: int) -> float:
    """Median ms per decode step of this rank's shard alone, pipelined where the engine is."""
    pipeline = overlaps(runner)
    with solo_collectives():
        cache = runner.make_cache()
        out = runner.forward(mx.array([prompt]), cache)
        token = _next_token(runner, out, prompt[-1])
        mx.eval(token, *_arrays(out))
        times, pending, last = [], None, time.perf_counter()
        for _ in range(steps):
            out = runner.forward(token[:, None], cache)
            token = _next_token(runner, out, prompt[-1])
            current = [token, *_arrays(out)]
            # Stepped one at a time where the engine is (batch.overlaps).
            (mx.async_eval if pipeline else mx.eval)(current)
            if pending is not None:
                mx.eval(pending)
                now = time.perf_counter()
                times.append(now - last)
                last = now
            pending = current
        mx.eval(pending)
        times.append(time.perf_counter() - last)
    return statistics.median(times) * 1e3


def _arrays(out: mx.array | None) -> list[mx.array]:
    return [] if out is None else [out]


def _next_token(runner: Runner, out: mx.array | None, fallback: int) -> mx.array:
    """The leader samples greedily like a real step; followers feed a fixed token."""
    if runner.is_leader and out is not None:
        return mx.argmax(out, axis=-1)
    return mx.array([fallback])


def step_ms(runner: Runner, prompt: list[int], steps: int, rows: int, width: int, step=None):
    """Median ms of one forward of `rows` rows of `width` tokens (a decode step: 1; a verify
    step: k+1) after `prompt`, each step evaluated before the next; the cache is cut back
    after each step, so every one sees the same context. `step(tokens, cache)` defaults to
    the engine's own: the runner's decode (compiled where it is) or verify."""
    cache = runner.make_cache()
    mx.eval(*_arrays(runner.forward(mx.array([prompt] * rows), cache)))
    tokens = mx.array([[prompt[-1]] * width] * rows)
    step = step or (runner.decode if width == 1 else runner.verify)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        mx.eval(*_arrays(step(tokens, cache)))
        times.append(time.perf_counter() - start)
        for c in cache:
            c.trim(width)
    return statistics.median(times) * 1e3


def solo_step_ms(runner: Runner, prompt: list[int], steps: int, rows: int, width: int) -> float:
    """`step_ms` on this rank's shard alone: collectives stood in for, and the compiled graph
    of a decode step or verify window traced afresh inside the stand-ins (the runner's own
    holds the real ones)."""
    from thunderpool.engine import compiled, kmajor, rowsplit

    with solo_collectives():
        step = runner.forward if width == 1 else runner.verify
        c = runner.compiled
        fresh = c is not None and runner.stage is None and compiled.eligible(runner.make_cache())
        if fresh and width == 1:
            rowsplit.blas_threads(one_row=True)
            step = compiled.CompiledDecode(c.forward, None).decode
        elif fresh and c.windows and not runner.keep_hidden and kmajor.split_rows(rows * width):
            rowsplit.blas_threads(one_row=True)  # as Runner.verify takes the compiled window
            step = compiled.CompiledDecode(c.forward, None, c.window).verify
        return step_ms(runner, prompt, steps, rows, width, step)


def solo_compute(
    runner: Runner, group: mx.distributed.Group, prompt: list[int], steps: int, *shape: int
) -> list[float]:
    """Every rank runs `solo_decode_ms` (or, given (rows, width), `solo_step_ms`) at once;
    returns each rank's median ms (all ranks)."""
    if shape:
        mine = solo_step_ms(runner, prompt, steps, *shape)
    else:
        mine = solo_decode_ms(runner, prompt, steps)
    slots = [0.0] * group.size()
    slots[group.rank()] = mine
    if group.size() == 1:
        return slots
    summed = mx.distributed.all_sum(mx.array(slots), group=group, stream=mx.cpu)
    return summed.tolist()
