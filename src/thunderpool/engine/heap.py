"""A fixed mmap threshold for glibc's malloc in a rank process.

glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB on a
64-bit system); from then on, blocks below it come from the heap. The compiled decode step
(engine/compiled.py) returns new KV buffers every step, sized by the batch's rows and
capacity, which change as rows join and leave: from the heap they fragmented it. One serving
rank under the soak's load (tests/api/test_soak.py) grew 94 then 38 MiB in two 90 s rounds
while MLX's active memory stayed flat; with the fixed threshold, 60 in the first (its batch
and graphs filling), then 4 and 4. A fixed threshold (setting it turns the raising off)
keeps large blocks on mmap, handed back to the system when freed. A MALLOC_MMAP_THRESHOLD_
the user set is kept.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD = 128 * 1024  # glibc's own starting value


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def fix_mmap_threshold() -> bool:
    """True when glibc took the fixed threshold (False off Linux, on a libc without mallopt,
    or where the user set MALLOC_MMAP_THRESHOLD_)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1

