"""A fast BLAS for rank processes on Linux: the mlx[cpu] wheel bundles a slow reference one.

MLX runs every float32 matmul as one cblas_sgemm, decode's single-token products included.
Preloading an optimized BLAS makes GEMM ~30x faster here. BLIS (Debian's libblis4-pthread) is
preferred: it streams those M = 1 products 2-4x faster than OpenBLAS 0.3.21 (Debian's
libopenblas0-pthread), whose sgemm packs the whole weight matrix first, at about the same GEMM
speed. A library is used only after a self-test in a child process shows it loads and
multiplies correctly; otherwise the next is tried, and at the end ranks keep the bundled BLAS.
THUNDERPOOL_BLAS=reference turns it off; THUNDERPOOL_BLAS=/path/lib.so picks a library.
`engine/blas.py` names the BLAS a process actually runs on.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from thunderpool.config import blas_choice

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4",
    "/usr/lib/aarch64-linux-gnu/blis-pthread/libblis.so.4",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

# The fix for a Debian/Ubuntu node on the reference BLAS (doctor, serve's startup lines).
INSTALL = "sudo apt-get install -y libblis4-pthread"

# One GEMM against numpy: a misdetected kernel crashes or returns garbage, both caught here. A
# library the loader could not preload is only warned about, so check that it is mapped.
_SELF_TEST = """
import sys, mlx.core as mx, numpy as np
a = np.random.default_rng(0).standard_normal((257, 129)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((129, 65)).astype(np.float32)
got = np.array(mx.array(a) @ mx.array(b))
assert np.allclose(got, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4), "wrong GEMM"
assert sys.argv[1] in open("/proc/self/maps").read(), "not loaded"
print("ok")
"""


def core_type(cpuinfo: str) -> str | None:
    """The OpenBLAS kernel family for this CPU: OpenBLAS 0.3.21 misdetects some (e.g. AMD EPYC
    under a hypervisor), so name it from the CPU flags."""
    flags = next(
        (ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), []
    )
    if "avx512f" in flags and "avx512bw" in flags:
        return "SkylakeX"
    if "avx2" in flags:
        return "Haswell"
    return None


def installed() -> list[str]:
    """The candidate libraries present on this machine, preferred first."""
    return [p for p in CANDIDATES if Path(p).is_file()]


def blas_env(path: str) -> dict[str, str]:
    """What a rank needs to run on the library at `path`: the preload, the threads BLIS may
    use (it runs one unless told) and OpenBLAS's kernel family for this CPU."""
    preloaded = os.environ.get("LD_PRELOAD", "").split()
    env = {"LD_PRELOAD": " ".join([path, *(p for p in preloaded if p != path)])}
    if "blis" in Path(path).name:
        if "BLIS_NUM_THREADS" not in os.environ:
            cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ()
            env["BLIS_NUM_THREADS"] = str(len(cores) or os.cpu_count() or 1)
        # numpy's own OpenBLAS (prefill attention, engine/attention.py) runs one thread:
        # its idle threads spin beside BLIS's and slowed a 2K prefill by 1.8x here.
        if "OPENBLAS_NUM_THREADS" not in os.environ:
            env["OPENBLAS_NUM_THREADS"] = "1"
    elif "OPENBLAS_CORETYPE" not in os.environ:
        try:
            kind = core_type(Path("/proc/cpuinfo").read_text())
        except OSError:
            kind = None
        if kind:
            env["OPENBLAS_CORETYPE"] = kind
    return env


def passes_self_test(env: dict[str, str]) -> bool:
    """Whether a child with `env` loads the preloaded library and multiplies correctly."""
    library = env["LD_PRELOAD"].split()[0]
    try:
        out = subprocess.run(
            [sys.executable, "-c", _SELF_TEST, os.path.realpath(library)],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == "ok"


@functools.cache
def fast_blas_env() -> dict[str, str]:
    """Environment for rank processes: the first library that passes the self-test, or {} to
    keep the bundled BLAS. Computed once per process: each self-test costs about a second."""
    if not sys.platform.startswith("linux"):
        return {}
    choice = blas_choice()
    if choice == "reference":
        return {}
    for path in [choice] if choice != "auto" else installed():
        env = blas_env(path)
        if passes_self_test(env):
            return env
    return {}
