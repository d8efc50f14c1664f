"""exp, SiLU and attention's softmax for the compiled CPU step (engine/fused.py), from
multiplies, adds and integer ops only.

MLX's x86 CPU build computes exp one value at a time (~12 ns each): ~9 ms of SiLU in a
5-position verify of a 1B model, ~14 ms of softmax in a decode step of the embedded model at
4K context. In a compiled graph a chain of plain arithmetic becomes a few generated kernels
that the C++ compiler vectorizes: this exp runs 2-4x faster, within 1e-7 of float64's (MLX's
own is within 1e-6). Cephes' expf: x = n ln2 + f with |f| <= ln2/2, exp(f) by a polynomial,
2^n put into the float's exponent bits. Not used on a GPU, whose exp is native;
THUNDERPOOL_CPU_EXP=0 turns it off, for comparisons.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.activations import swiglu as _swiglu

from thunderpool.config import cpu_exp_choice, cpu_only

LOG2E = 1.4426950408889634
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 in two parts (Cody-Waite): f stays exact
POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1)
HALF = 5.0000001201e-1
LOW, HIGH = -87.0, 88.0  # below: 0 (exp < 1.7e-38); above: exp(88), so 2^n stays finite
# From this many scores in a layer on, attend() beats mx.softmax, whose one kernel costs less
# to launch than attend's max, exp, sum and division (the embedded model's 9 query rows, 30
# layers: 9K scores 6.0 against 5.2 ms, 36K scores 26.8 against 29.9 ms).
SOFTMAX_SCORES = 16384
# Likewise for SwiGLU: the embedded model's one row (1536 values a layer) ran 2 ms a step
# slower with this exp; the 1.1 B model's 5-position verify (28K values) ~10 ms faster.
SILU_VALUES = 4096


def wanted() -> bool:
    """On a CPU rank unless THUNDERPOOL_CPU_EXP=0; refused on a GPU, where no test has
    compared it with the native exp."""
    return cpu_only(
        cpu_exp_choice(),
        mx.default_device() == mx.cpu,
        "THUNDERPOOL_CPU_EXP=1 asks for the CPU's arithmetic exp on a GPU rank, where it is "
        "untested; unset it (GPU ranks keep the native exp)",
    )


def exp(x: mx.array) -> mx.array:
    """e**x in float32 (x's dtype back), exactly 0 below LOW. The polynomial is evaluated in
    Estrin's form, a shallower graph: MLX's compile fuses it into fewer kernels (five, the
    bit cast one of them)."""
    dtype, x = x.dtype, x.astype(mx.float32)
    c = mx.clip(x, LOW, HIGH)
    n = mx.floor(c * LOG2E + 0.5)
    f = (c - n * LN2_HI) - n * LN2_LO
    f2 = f * f
    c0, c1, c2, c3, c4 = POLY  # the coefficients of f^7 down to f^3
    low = (1.0 + f) + (HALF + c4 * f) * f2  # 1 + f + f^2/2 + c4 f^3
    high = (c3 + c2 * f) + (c1 + c0 * f) * f2
    p = low + high * (f2 * f2)
    two_n = mx.view((n.astype(mx.int32) + 127) << 23, mx.float32)
    return mx.where(x < LOW, 0.0, p * two_n).astype(dtype)


def silu(x: mx.array) -> mx.array:
    """x * sigmoid(x)."""
    return x / (1.0 + exp(-x))


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up, as mlx-lm's activations.swiglu; by MLX's own exp below SILU_VALUES
    gate values, where this exp's extra kernels cost more than the scalar exps."""
    if gate.size < SILU_VALUES:
        return _swiglu(gate, up)
    return silu(gate) * up


def attend(scores: mx.array, values: mx.array) -> mx.array:
    """softmax(scores) @ values, the softmax over the last axis in float32 (as mx.softmax's
    precise mode), normalized after the product (fewer divisions)."""
    s = scores.astype(mx.float32)
    e = exp(s - mx.max(s, axis=-1, keepdims=True))
    total = mx.sum(e, axis=-1, keepdims=True)
    return ((e.astype(values.dtype) @ values) / total).astype(values.dtype)
