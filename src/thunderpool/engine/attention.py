"""Prefill attention for float32 on an x86 CPU rank, in numpy where the scores are many.

A long prompt's prefill is mostly attention, and attention mostly the softmax's exp: MLX's
x86 CPU build computes elementwise ops one value at a time (no SIMD there; ~12 ns per exp),
numpy's vectorized exp is ~7x faster. So from MIN_SCORES scores on, q, k and v are evaluated
and the products and the softmax run in numpy (its BLAS on one thread beside BLIS,
launch/blas.py), in place (docs/benchmarks.md §13: 4K-token prefill); below it, MLX ops.
Either way each KV head's query heads are the rows of one product (as the compiled decode
step does, fused.py). Everything else (other devices, CPUs and dtypes, quantized caches,
attention sinks) keeps mlx-lm's call.
"""

from __future__ import annotations

import contextlib
import platform
import sys
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# Score blocks smaller than this stay in MLX: the round trip to numpy costs more there.
MIN_SCORES = 1 << 20


def sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """softmax(q k^T * scale + mask) v for queries (B, H, L, D), keys/values (B, K, S, D);
    mask None, "causal" (aligned to the last query) or an array broadcasting to
    (B, H, L, S), boolean (True keeps) or additive. Each KV head's g = H / K query heads are
    the rows of one product."""
    B, H, L, D = queries.shape
    K, S, Dv = keys.shape[1], keys.shape[2], values.shape[-1]  # MLA: values' width differs
    g = H // K
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"attention mask {mask!r} is not one this path knows")
    if B * H * L * S < MIN_SCORES or L > S:
        return _in_mlx(queries, keys, values, scale, mask)
    mx.eval(queries, keys, values)
    # Zero-copy views of the evaluated arrays; numpy's BLAS and vectorized exp from here on.
    q = np.asarray(queries * scale).reshape(B, K, g * L, D)
    a = (q @ np.asarray(keys).swapaxes(-1, -2)).reshape(B, K, g, L, S)
    low = np.finfo(a.dtype).min
    if isinstance(mask, str):  # causal: only the last L keys hold masked positions
        tail = a[..., S - L :]
        np.copyto(tail, low, where=np.triu(np.ones((L, L), bool), 1))
    elif mask is not None:
        m = np.asarray(_grouped(mask, K, g))
        if m.dtype == np.bool_:
            np.copyto(a, low, where=~m)
        else:
            a += m
    a -= a.max(axis=-1, keepdims=True)
    np.exp(a, out=a)
    a /= a.sum(axis=-1, keepdims=True)
    out = a.reshape(B, K, g * L, S) @ np.asarray(values)
    return mx.array(out.reshape(B, H, L, Dv))


def _in_mlx(queries, keys, values, scale: float, mask) -> mx.array:
    """`sdpa` in MLX ops, for score blocks too small to pay for numpy's round trip."""
    B, H, L, D = queries.shape
    K, S, Dv = keys.shape[1], keys.shape[2], values.shape[-1]
    g = H // K
    q = (queries * scale).reshape(B, K, g * L, D)
    scores = (q @ keys.swapaxes(-1, -2)).reshape(B, K, g, L, S)
    if isinstance(mask, str):
        mask = (mx.arange(L)[:, None] + (S - L)) >= mx.arange(S)[None]
    elif mask is not None:
        mask = _grouped(mask, K, g)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = mx.softmax(scores, axis=-1, precise=True).reshape(B, K, g * L, S)
    return (probs @ values).reshape(B, H, L, Dv)


def _grouped(mask: mx.array, K: int, g: int) -> mx.array:
    """A mask broadcasting to (B, H, L, S) as one broadcasting to (B, K, g, L, S)."""
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], K, g, *mask.shape[2:])


X86 = platform.machine().lower() in ("x86_64", "amd64")


def applies(queries: mx.array, keys: mx.array, cache, sinks) -> bool:
    """Float32 on an x86 CPU, a plain cache (not quantized), no sinks, GQA-shaped heads."""
    return (
        X86
        and mx.default_device() == mx.cpu
        and not hasattr(cache, "bits")
        and sinks is None
        and isinstance(keys, mx.array)  # a quantized cache hands (values, scales, biases)
        and queries.dtype == mx.float32
        and keys.dtype == mx.float32
        and queries.shape[1] % keys.shape[1] == 0
    )


@contextlib.contextmanager
def cpu_prefill(model: nn.Module) -> Iterator[None]:
    """While in the block, the model's module calls `sdpa` where it `applies` (its own
    mlx-lm call otherwise); outside it, mlx-lm's model is untouched (bench's mlx-lm baseline
    runs in the same process)."""
    module = sys.modules.get(type(model).__module__)
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None:
        yield
        return

    def attention(queries, keys, values, cache, scale, mask, sinks=None):
        known = not isinstance(mask, str) or mask == "causal"
        if known and applies(queries, keys, cache, sinks):
            return sdpa(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    module.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        module.scaled_dot_product_attention = original
