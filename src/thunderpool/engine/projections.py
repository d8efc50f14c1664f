"""A layer's products as the compiled step runs them: projections joined into one matmul (q|k|v,
gate|up) in MLX's weight layout, or kept apart over a CPU rank's input-major weights; each with
its quantization and its TP reduction."""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn

from thunderpool.engine import kmajor, rowsplit


@dataclass(frozen=True, slots=True)
class Projection:
    """The arrays of one (possibly quantized, possibly fused) projection; `parts`, where set,
    are slices of it multiplied on one CPU stream each (engine/rowsplit.py)."""

    weight: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None
    bias: mx.array | None = None
    group_size: int = 0
    bits: int = 0
    mode: str = "affine"
    kmajor: bool = False  # weight is stored (in, out): engine/kmajor.py
    parts: tuple[Projection, ...] = ()

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """x @ W.T (+ bias) (+ residual); a single addend goes into the matmul (addmm)."""
        if self.parts and self.kmajor:  # input slices times weight row blocks, summed
            y = kmajor.summed(x, tuple(p.weight for p in self.parts))
        elif self.parts:
            ss = rowsplit.streams(len(self.parts))
            y = mx.concatenate(
                [p.product(x, s) for p, s in zip(self.parts, ss, strict=True)], axis=-1
            )
        elif self.scales is None and (self.bias is None) != (residual is None):
            w = self.weight if self.kmajor else self.weight.T
            return mx.addmm(self.bias if residual is None else residual, x, w)
        else:
            y = self.product(x)
        y = y + self.bias if self.bias is not None else y
        return residual + y if residual is not None else y

    def product(self, x: mx.array, stream: mx.Stream | None = None) -> mx.array:
        """x @ W.T, quantized or not, on `stream` (the default one if None)."""
        if self.scales is None:
            return mx.matmul(x, self.weight if self.kmajor else self.weight.T, stream=stream)
        return mx.quantized_matmul(
            x,
            self.weight,
            scales=self.scales,
            biases=self.biases,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            stream=stream,
        )

    def split(self, ways: int) -> Projection:
        """This projection in `ways` parts (views, no copy): blocks of output rows, or of the
        input dimension where the weight is input-major (then the parts' products are summed);
        itself where that leaves one part."""
        cuts = rowsplit.bounds(self.weight.shape[0], ways)
        if len(cuts) < 2:
            return self
        q = {n: getattr(self, n) for n in ("group_size", "bits", "mode", "kmajor")}
        parts = tuple(
            Projection(
                **{
                    n: getattr(self, n)[a:b]
                    for n in ("weight", "scales", "biases")
                    if getattr(self, n) is not None
                },
                **q,
            )
            for a, b in cuts
        )
        # Evaluated now, scales and biases too: a lazy slice is tied to the loading thread's
        # stream, and the engine may step in another thread (as FusedForward's tables).
        mx.eval([[a for a in (p.weight, p.scales, p.biases) if a is not None] for p in parts])
        return replace(self, parts=parts)


@dataclass(frozen=True, slots=True)
class Joined:
    """Projections of one input, their outputs concatenated: how q|k|v and gate|up run where
    the weights are input-major, since joining those matrices would leave each module a
    column slice, which MLX copies at every product (engine/kmajor.py)."""

    members: tuple[Projection, ...]

    def __call__(self, x: mx.array) -> mx.array:
        return mx.concatenate([p(x) for p in self.members], axis=-1)

    def split(self, ways: int) -> Joined:
        return Joined(tuple(p.split(ways) for p in self.members))


def _plain(m: nn.Module) -> bool:
    """A projection whose forward is exactly x @ W.T (+ bias), quantized or not (mlx's
    Linear, QuantizedLinear and their TP AllToSharded forms, whose extra op is the identity
    in a forward)."""
    names = {"Linear", "QuantizedLinear", "AllToShardedLinear", "QuantizedAllToShardedLinear"}
    if kmajor.is_kmajor(m):
        return m.group is None
    return type(m).__name__ in names and "weight" in m


def _names(m: nn.Module) -> tuple[str, ...]:
    """The arrays a projection holds (mxfp formats have scales but no biases)."""
    return tuple(n for n in _ARRAYS if isinstance(m.get(n), mx.array))


def _quant(m: nn.Module) -> tuple:
    return (m.group_size, m.bits, getattr(m, "mode", "affine")) if "scales" in m else ()


def fuse(modules: list[nn.Module]) -> Projection | Joined | None:
    """One projection for `modules` that read the same input: their arrays concatenated along
    the output axis; each module then holds views of the fused arrays (no second copy once
    evaluated). Input-major weights are joined, not concatenated. None when they differ in
    kind (plain/quantized, bits, bias, layout)."""
    if not all(_plain(m) for m in modules):
        return None
    kinds = {(_quant(m), _names(m), kmajor.is_kmajor(m)) for m in modules}
    if len(kinds) != 1:
        return None
    (quant, names, input_major) = kinds.pop()
    if input_major:
        return Joined(tuple(_projection(m) for m in modules))
    fused = {n: mx.concatenate([m[n] for m in modules], axis=0) for n in names}
    mx.eval(fused)
    start = 0
    for m in modules:
        rows = m["weight"].shape[0]
        for n in names:
            m[n] = fused[n][start : start + rows]
        start += rows
    mx.eval([m.parameters() for m in modules])
    q = dict(zip(("group_size", "bits", "mode"), quant, strict=True)) if quant else {}
    return Projection(**fused, **q)


@dataclass(frozen=True, slots=True)
class Reduced:
    """A TP row-parallel projection (mlx's ShardedToAllLinear, parallel/tensor.SumAfter for
    uneven shares): this rank's product summed over the group, then the bias, in the
    module's order; the product may split its rows."""

    local: Projection
    group: mx.distributed.Group
    bias: mx.array | None = None

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        y = mx.distributed.all_sum(self.local(x), group=self.group)
        y = y + self.bias if self.bias is not None else y
        return residual + y if residual is not None else y

    def split(self, ways: int) -> Reduced:
        return replace(self, local=self.local.split(ways))


def _projection(m: nn.Module, bias: bool = True) -> Projection:
    """A module's arrays (without its bias unless `bias`) and quantization as a Projection."""
    q = dict(zip(("group_size", "bits", "mode"), _quant(m), strict=True)) if "scales" in m else {}
    arrays = {n: m[n] for n in _names(m) if bias or n != "bias"}
    if kmajor.is_kmajor(m):  # the module holds W_t.T: take back the contiguous (in, out) array
        arrays["weight"] = m["weight"].T
        mx.eval(arrays["weight"])  # not left lazy on the loading thread's stream
        return Projection(**arrays, kmajor=True)
    return Projection(**arrays, **q)


def _linear(m: nn.Module) -> Projection | Reduced | None:
    """A single projection's arrays, where its forward is a plain matmul (and, after TP's
    row split, an all_sum)."""
    kind = type(m).__name__
    if kind == "SumAfter":  # ours: uneven shares
        local = _linear(m.inner)
        return Reduced(local, m.group, m.get("bias")) if isinstance(local, Projection) else None
    row_parallel = kind in ("ShardedToAllLinear", "QuantizedShardedToAllLinear")
    reduced = (row_parallel or kmajor.is_kmajor(m)) and getattr(m, "group", None) is not None
    if reduced and "weight" in m:
        return Reduced(_projection(m, bias=False), m.group, m.get("bias"))
    return _projection(m) if _plain(m) else None


_ARRAYS = ("weight", "scales", "biases", "bias")
