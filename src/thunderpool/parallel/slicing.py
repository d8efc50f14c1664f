"""Cutting one projection's arrays: output rows, or input columns of a possibly quantized,
possibly per-expert (E, out, in) matrix, on whole groups and packed words (packing.py)."""

from __future__ import annotations

from math import lcm

import mlx.core as mx
import mlx.nn as nn

from thunderpool.parallel.packing import Packing, check_cut


def packing_of(module: nn.Module) -> Packing | None:
    """How a projection is quantized, or None for a plain one."""
    if "scales" in module:
        return Packing(module.bits, module.group_size, getattr(module, "mode", "affine"))
    return None


def slice_rows(module: nn.Module, a: int, b: int) -> None:
    """Keep output features [a, b) of a (possibly quantized, possibly per-expert) projection:
    whole rows of weight, scales and biases, whatever the format."""
    for name in ("weight", "scales", "biases", "bias"):
        if name in module:
            w = module[name]
            axis = w.ndim - 1 if name == "bias" else w.ndim - 2
            module[name] = mx.contiguous(_take(w, axis, a, b))


def keep_rows(module: nn.Module, spans: list[tuple[int, int]]) -> None:
    """Keep the output features of each span [a, b), in order: one rank's share of each part
    of a fused projection (q|k|v, gate|up), as one projection of its own."""
    for name in ("weight", "scales", "biases", "bias"):
        if name in module:
            w = module[name]
            axis = w.ndim - 1 if name == "bias" else w.ndim - 2
            parts = [_take(w, axis, a, b) for a, b in spans]
            module[name] = mx.contiguous(mx.concatenate(parts, axis=axis))


def slice_cols(module: nn.Module, a: int, b: int) -> None:
    """Keep input features [a, b) of a (possibly quantized, possibly per-expert) projection:
    packed words of the weight, groups of the scales (and biases, where the format has them)."""
    p = packing_of(module)
    if p is None:
        module["weight"] = mx.contiguous(_take(module["weight"], -1, a, b))
        return
    wa, wb = check_cut(a, b, p, f"a {type(module).__name__}")
    module["weight"] = mx.contiguous(_take(module["weight"], -1, wa, wb))
    for name in ("scales", "biases"):
        if name in module:
            g = p.group_size
            module[name] = mx.contiguous(_take(module[name], -1, a // g, b // g))


def _take(w: mx.array, axis: int, a: int, b: int) -> mx.array:
    index = [slice(None)] * w.ndim
    index[axis] = slice(a, b)
    return w[tuple(index)]


def step_of(*modules: nn.Module) -> int:
    """Channel step that keeps quantization groups and packed words whole."""
    return lcm(1, *(p.step for m in modules if (p := packing_of(m))))
