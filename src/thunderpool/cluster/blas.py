"""A fast BLAS for rank processes on Linux: the mlx[cpu] wheel bundles a slow reference one.

Preloading an optimized OpenBLAS (Debian's libopenblas0-pthread) makes fp32 GEMM ~30x and
GEMV ~2-3x faster here. It is used only after a self-test in a child process shows it loads
and multiplies correctly; otherwise ranks keep the bundled BLAS. THUNDERPOOL_BLAS=reference
turns it off; THUNDERPOOL_BLAS=/path/libopenblas.so.0 picks a library.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from thunderpool.config import blas_choice

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

# One GEMM against numpy's: a misdetected kernel crashes or returns garbage, both caught here.
_SELF_TEST = """
import mlx.core as mx, numpy as np
a = np.random.default_rng(0).standard_normal((257, 129)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((129, 65)).astype(np.float32)
got = np.array(mx.array(a) @ mx.array(b))
assert np.allclose(got, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4), "wrong GEMM"
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


@functools.cache
def fast_blas_env() -> dict[str, str]:
    """Environment for rank processes: LD_PRELOAD (+ OPENBLAS_CORETYPE), or {} to keep the
    bundled BLAS. Computed once per process: the self-test costs about a second."""
    if not sys.platform.startswith("linux"):
        return {}
    choice = blas_choice()
    if choice == "reference":
        return {}
    paths = [choice] if choice != "auto" else [p for p in CANDIDATES if Path(p).is_file()]
    if not paths:
        return {}
    preloaded = os.environ.get("LD_PRELOAD", "").split()
    env = {"LD_PRELOAD": " ".join([paths[0], *(p for p in preloaded if p != paths[0])])}
    if "OPENBLAS_CORETYPE" not in os.environ:
        try:
            kind = core_type(Path("/proc/cpuinfo").read_text())
        except OSError:
            kind = None
        if kind:
            env["OPENBLAS_CORETYPE"] = kind
    try:
        out = subprocess.run(
            [sys.executable, "-c", _SELF_TEST],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return env if out.returncode == 0 and out.stdout.strip() == "ok" else {}
