"""Measurements of this node for its self-report: memory bandwidth, a rank's decode speed, host
bandwidth across processes, matmul FLOP/s; each timed alone (measuring_alone)."""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from thunderpool.planner.hardware import LONG_ROW, SHORT_ROW


def _copy_size(available: int) -> int:
    # Two arrays of at most 1/16 of free memory each, so a small node is not pushed into swap.
    return max(16 * 2**20, min(128 * 2**20, available // 16))


def _best_time(step: Callable[[], object], repeats: int, budget_s: float) -> float:
    """Best wall time of `step` over up to `repeats` runs, stopping once `budget_s` is spent."""
    best, spent = math.inf, 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
        if spent > budget_s:
            break
    return best


def measure_memory_bandwidth(
    nbytes: int = 128 * 2**20, repeats: int = 3, row: int = LONG_ROW
) -> float:
    """Bytes per second an MLX fp32 matrix-vector product streams, best of `repeats`, with
    weight rows of `row` floats (CPU BLASes stream short rows slower: planner/cost.py).

    Decode is a chain of such products, so this predicts decode speed better than a raw copy
    (on Linux CPUs the mlx wheel's reference BLAS reaches a fraction of the copy bandwidth).
    """
    import mlx.core as mx

    rows = nbytes // (4 * row)
    w = mx.random.normal((rows, row), dtype=mx.float32)
    x = mx.random.normal((1, row), dtype=mx.float32)
    # x @ w.T is what nn.Linear runs for one token (a different, faster kernel than w @ x).
    mx.eval(w, x, x @ w.T)  # warm-up: materialise the matrix, pick the kernel
    return w.nbytes / _best_time(lambda: mx.eval(x @ w.T), repeats, budget_s=0.5)


def measure_split_bandwidth(nbytes: int = 128 * 2**20, repeats: int = 3) -> float:
    """Bytes per second of the same product with its rows split over this process's cores,
    one CPU stream each, as the compiled decode step runs it (engine/rowsplit.py); 0 where
    that step would not split (one core, a GPU)."""
    import mlx.core as mx

    from thunderpool.engine import rowsplit

    ways = rowsplit.ways()
    if ways < 2:
        return 0.0
    rowsplit.blas_threads(one_row=True)
    w = mx.random.normal((nbytes // (4 * LONG_ROW), LONG_ROW), dtype=mx.float32)
    x = mx.random.normal((1, LONG_ROW), dtype=mx.float32)
    parts = [w[a:b] for a, b in rowsplit.bounds(w.shape[0], ways)]
    streams = rowsplit.streams(len(parts))

    def product() -> mx.array:
        ys = [mx.matmul(x, p.T, stream=s) for p, s in zip(parts, streams, strict=True)]
        return mx.concatenate(ys, axis=-1)

    mx.eval(w, x, parts, product())
    return w.nbytes / _best_time(lambda: mx.eval(product()), repeats, budget_s=0.5)


def _gemv_rate(start_at: float, seconds: float, nbytes: int = 64 * 2**20) -> float:
    """Bytes/s of single-token GEMVs from `start_at` for `seconds` (one of several processes)."""
    import mlx.core as mx

    w = mx.random.normal((nbytes // (4 * 4096), 4096), dtype=mx.float32)
    x = mx.random.normal((1, 4096), dtype=mx.float32)
    mx.eval(w, x, x @ w.T)
    while time.time() < start_at:
        time.sleep(0.005)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        mx.eval(x @ w.T)
        n += 1
    return n * w.nbytes / (time.perf_counter() - t0)


def rank_env(**extra: str) -> dict[str, str]:
    """The environment rank processes run in (the fast BLAS on Linux, launch/blas.py): the
    agent itself runs MLX's bundled BLAS, 2-3x slower on GEMV, which would mislead the planner."""
    from thunderpool.launch.blas import fast_blas_env

    return {**os.environ, **fast_blas_env(), **extra}


def measure_op_latency(layers: int = 16, steps: int = 20) -> float:
    """Seconds a decode step spends per weight matmul besides streaming weights, on MLX's CPU
    backend (0 elsewhere: the GPU families have calibrated values). A tiny llama of mlx-lm's
    own blocks, whose weights stay in cache, decodes token by token; the time of all its ops
    (norms, RoPE, attention, activations) is charged to its 7 matmuls per layer, as the cost
    model charges op_latency_s."""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    if mx.default_device() != mx.cpu:
        return 0.0
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=256,
    )
    model = llama.Model(args)
    cache = make_prompt_cache(model)
    mx.eval(model.parameters(), model(mx.array([[1, 2, 3, 4]]), cache=cache))
    times = []
    for _ in range(steps):
        out = model(mx.array([[5]]), cache=cache)  # built apart: the engine builds ahead
        start = time.perf_counter()
        mx.eval(out)
        times.append(time.perf_counter() - start)
    # The median step, as decode tok/s is a median: on one pinned core, MLX's stream thread
    # and Python take turns, which costs half as much again (best 32 us, median 51, here).
    return statistics.median(times) / (7 * layers + 1)


def measure_rank_speed(
    nbytes: int, core: int | None = None
) -> tuple[float, float, float, float, float]:
    """(GEMV bytes/s, the same with short rows, matmul FLOP/s, seconds per matmul of fixed
    cost, GEMV bytes/s split over the cores) measured in a child with the ranks' environment;
    in this process if the child fails. With `core`, the child runs as a pinned rank does: on
    that core alone with one BLAS thread (zeros if it fails: the planner then keeps the
    unpinned rates)."""
    from thunderpool.launch.local import one_core_env

    code = (
        "import os, sys; from thunderpool.cluster.node import measure as c; "
        "core = int(sys.argv[2]); core >= 0 and os.sched_setaffinity(0, {core}); "
        "n = int(sys.argv[1]); print(c.measure_memory_bandwidth(n), "
        "c.measure_memory_bandwidth(n, row=c.SHORT_ROW), c.measure_matmul_flops(), "
        "c.measure_op_latency(), c.measure_split_bandwidth(n))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(nbytes), str(-1 if core is None else core)],
            env=rank_env(**one_core_env(core)),
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        bw, short_bw, flops, op_latency, split_bw = (float(x) for x in done.stdout.split())
        return bw, short_bw, flops, op_latency, split_bw
    except (OSError, ValueError, subprocess.SubprocessError):
        if core is not None:
            return 0.0, 0.0, 0.0, 0.0, 0.0
        short_bw = measure_memory_bandwidth(nbytes, row=SHORT_ROW)
        return measure_memory_bandwidth(nbytes), short_bw, measure_matmul_flops(), 0.0, 0.0


def measure_host_bandwidth(procs: int, seconds: float = 0.6) -> float:
    """Aggregate GEMV bandwidth with `procs` processes streaming at once: what co-located
    ranks share (on many machines one core cannot saturate the memory bus, or all can). Each
    runs one BLAS thread, as a rank pinned to one core does."""
    from thunderpool.launch.local import one_core_env

    start = time.time() + 3.0  # time for every process to import MLX and warm up
    code = (
        "import sys; from thunderpool.cluster.node.capabilities import _gemv_rate; "
        "print(_gemv_rate(float(sys.argv[1]), float(sys.argv[2])))"
    )
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(start), str(seconds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=rank_env(**one_core_env(0)),
        )
        for _ in range(procs)
    ]
    total = 0.0
    for p in runs:
        out, _ = p.communicate(timeout=60)
        total += float(out.strip() or 0)
    return total


def usable_cores() -> list[int]:
    """The cores this process may run on: a container's cpuset (or `taskset`) gives fewer than
    the machine has, and its ranks get only those (os.cpu_count counts the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def measure_matmul_flops(n: int = 1024, repeats: int = 4) -> float:
    """fp32 matmul FLOP/s on MLX's default device (the GPU on a Mac), best of `repeats`."""
    import mlx.core as mx

    a = mx.random.normal((n, n), dtype=mx.float32)
    b = mx.random.normal((n, n), dtype=mx.float32)
    mx.eval(mx.matmul(a, b))  # warm-up: kernel selection and allocation
    return 2 * n**3 / _best_time(lambda: mx.eval(mx.matmul(a, b)), repeats, budget_s=0.5)


@contextlib.contextmanager
def measuring_alone(lock: Path | None = None) -> Iterator[None]:
    """Hold this machine's measurement lock: agents sharing a machine (e.g. one per network
    namespace) that measured at once would each see a fraction of it."""
    lock = lock or Path(tempfile.gettempdir()) / "thunderpool-measure.lock"
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield
