"""The BLAS this process multiplies with, for /v1/cluster, serve's startup lines and rowsplit.
Choosing one for a rank to preload is the launcher's (launch/blas.py)."""

from __future__ import annotations

import sys
from pathlib import Path

# File-name prefixes of optimized BLASes. numpy's own OpenBLAS ("libscipy_openblas64_") serves
# numpy only, not MLX, so it does not count.
KINDS = (("libblis", "BLIS"), ("libopenblas", "OpenBLAS"), ("libmkl_rt", "MKL"))
REFERENCE = "reference"  # the mlx[cpu] wheel's bundled BLAS


def kind_of(path: str) -> str | None:
    """ "BLIS", "OpenBLAS" or "MKL" for a library file, or None for any other."""
    name = Path(path).name
    return next((kind for prefix, kind in KINDS if name.startswith(prefix)), None)


def in_use(
    maps: str | None = None, platform: str = sys.platform, gpu: bool | None = None
) -> dict[str, str | None]:
    """What this process multiplies with: {"blas": "BLIS" | "OpenBLAS" | "MKL" | "Accelerate"
    | "reference" | "Metal" | "CUDA", "blas_path": the library or None}. A rank on the GPU
    (`gpu`; None: MLX's default device) multiplies with the GPU's kernels, not a BLAS. On
    Linux's CPU, the first optimized library mapped into it (`maps`: /proc/self/maps), as a
    rank's preload is."""
    if gpu is None:
        import mlx.core as mx

        gpu = mx.default_device() == mx.gpu
    if gpu:
        return {"blas": "Metal" if platform == "darwin" else "CUDA", "blas_path": None}
    if platform == "darwin":
        return {"blas": "Accelerate", "blas_path": None}
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            maps = ""
    for line in maps.splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if (kind := kind_of(path)) is not None:
            return {"blas": kind, "blas_path": path}
    return {"blas": REFERENCE, "blas_path": None}
