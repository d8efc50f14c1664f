"""One-row products over every core of a CPU rank, for the compiled decode step.

A decode step's matmuls have one row per sequence (M = 1 for a lone request), and a CPU BLAS
runs such a product on one thread whatever its thread settings (BLIS 0.9 here), so one rank
decodes at one core's memory bandwidth. Splitting each weight's output rows into `ways`
parts, multiplied on `ways` CPU streams (one thread each) and concatenated, computes the same
dot products on every core (docs/benchmarks.md §8). On a GPU, one kernel already uses the
whole device: no split there.

BLIS with more than one thread starts and joins its threads in every call, which slows the
many one-row products of a step without spreading them; so during compiled decode steps BLIS
runs one thread, and prefill (large products, which BLIS does spread) gets the process's
setting back.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

import mlx.core as mx

from thunderpool.config import decode_ways
from thunderpool.cores import work_cores
from thunderpool.errors import ThunderpoolError

MAX_WAYS = 8  # past this a part's rows are too few to pay for their stream's sync
ALIGN = 16  # parts start on whole SIMD-register rows
_local = threading.local()
_blas_setting: list[int | None] = [None]  # BLIS's thread count is process-wide


def own_cores() -> int:
    """The cores this process may run on (mpirun --bind-to core and pinned ranks: one; a Mac:
    its performance cores, thunderpool/cores.py)."""
    return work_cores()


def ways() -> int:
    """How many parts a decode product splits into here: one per core of a CPU rank
    (THUNDERPOOL_DECODE_WAYS overrides), 1 on a GPU."""
    if mx.default_device().type == mx.DeviceType.gpu:
        return 1
    chosen = decode_ways()
    if chosen is not None and chosen > MAX_WAYS:
        raise ThunderpoolError(
            f"THUNDERPOOL_DECODE_WAYS={chosen} is more than {MAX_WAYS} parts; "
            f"set it to at most {MAX_WAYS}, or unset it (one per core, at most {MAX_WAYS})"
        )
    return min(chosen or own_cores(), MAX_WAYS)


def bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """`parts` consecutive, nearly equal row ranges covering `rows` (fewer where rows are few)."""
    inner = (min(rows, round(rows * i / parts / ALIGN) * ALIGN) for i in range(1, parts))
    cuts = sorted({0, rows, *inner})
    return list(zip(cuts, cuts[1:], strict=False))


def streams(n: int) -> list[mx.Stream]:
    """This thread's default CPU stream and n - 1 more. MLX streams belong to the thread that
    made them, so each thread that steps gets its own, made once."""
    have = getattr(_local, "streams", None)
    if have is None or len(have) < n:
        have = [mx.default_stream(mx.cpu)] + [mx.new_stream(mx.cpu) for _ in range(n - 1)]
        _local.streams = have
    return have[:n]


@functools.cache
def _blis() -> ctypes.CDLL | None:
    """The BLIS this process multiplies with (a rank's preload, launch/blas.py), if any."""
    from thunderpool.engine.blas import in_use

    blas = in_use()
    if blas["blas"] != "BLIS" or blas["blas_path"] is None:
        return None
    try:
        lib = ctypes.CDLL(blas["blas_path"])
        lib.bli_thread_set_num_threads.argtypes = [ctypes.c_long]
        return lib
    except (OSError, AttributeError):
        return None


def _process_threads() -> int:
    return int(os.environ.get("BLIS_NUM_THREADS", "1") or 1)


def blas_threads(one_row: bool) -> None:
    """One BLIS thread for one-row (decode) products, the process's setting otherwise.
    BLIS reads the setting at each call, so a product already queued may run under the
    other one: a matter of speed, never of values."""
    lib = _blis()
    want = 1 if one_row else _process_threads()
    if lib is not None and _blas_setting[0] != want:
        lib.bli_thread_set_num_threads(want)
        _blas_setting[0] = want
