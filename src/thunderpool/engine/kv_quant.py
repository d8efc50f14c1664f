"""KV-cache quantization (`--kv-bits`): each layer's KVCache becomes mlx-lm's QuantizedKVCache,
whose keys and values are stored as `bits`-bit integers with a scale and a bias per `group_size`
values of a head (mlx-lm's attention reads them through quantized matmuls).

Every rank quantizes from the first token, so the caches are the same on every rank and in
the prefix cache whichever rank or request filled them (mlx-lm's generate converts a plain
cache once it is long; a cache that changes type mid-request could not be kept and restored
alike). Quantization runs along head_dim, so a TP rank's heads are those of the whole cache.
Rows batch in a BatchQuantizedKVCache (mlx-lm has no batch form): BatchKVCache's left padding
and positions over quantized buffers. Only plain KVCaches of families whose attention reads the
cache through mlx-lm's `scaled_dot_product_attention` can be quantized; any other is refused
before a rank starts.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, make_prompt_cache

from thunderpool.errors import ShardingError

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)  # mx.quantize's affine group sizes


def check(model: nn.Module, bits: int | None, group_size: int = 64) -> None:
    """Refuses `--kv-bits` for a model whose cache cannot be quantized (ShardingError naming
    the family, the cache and the fix). `model`: the whole model, built lazily."""
    if bits is None:
        return
    family = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
    flag = f"--kv-bits {bits}"
    if bits not in BITS or group_size not in GROUP_SIZES:
        raise ShardingError(
            f"{flag} --kv-group-size {group_size}: use bits in {BITS} and a group size in "
            f"{GROUP_SIZES}"
        )
    for i, c in enumerate(make_prompt_cache(model)):
        if type(c) is not KVCache:
            raise ShardingError(
                f"{flag}: {family} keeps its layer {i} state in a {type(c).__name__} "
                "(sliding-window, recurrent or compressed), which mlx-lm cannot quantize; "
                "drop --kv-bits"
            )
    if getattr(getattr(model, "args", None), "kv_lora_rank", None):
        # MLA caches a latent that the attention projects on, outside the quantized matmuls.
        raise ShardingError(
            f"{flag}: {family} caches a compressed latent (MLA), which its attention reads "
            "outside mlx-lm's quantized attention; drop --kv-bits"
        )
    if not _reads_quantized(model):
        raise ShardingError(
            f"{flag}: {family}'s attention does not read its cache through mlx-lm's "
            "scaled_dot_product_attention, so it cannot read a quantized cache; drop --kv-bits"
        )
    dims = _head_dims(model)
    if bad := sorted(d for d in dims if d % group_size):
        fits = [g for g in GROUP_SIZES if all(d % g == 0 for d in dims)]
        fix = f"use --kv-group-size {fits[-1]}" if fits else "drop --kv-bits"
        raise ShardingError(
            f"{flag}: {family}'s head width {bad[0]} is not a multiple of --kv-group-size "
            f"{group_size}; {fix}"
        )


def _reads_quantized(model: nn.Module) -> bool:
    """Whether a module of a decoder layer calls mlx-lm's cache-aware attention function."""
    layers = getattr(model, "layers", None) or [nn.Module()]
    for _, m in layers[0].named_modules():
        found = getattr(sys.modules.get(type(m).__module__), "scaled_dot_product_attention", None)
        if found is scaled_dot_product_attention:
            return True
    return False


def _head_dims(model: nn.Module) -> set[int]:
    """The key/value widths of one head, from the config (head_dim, or hidden / heads)."""
    args = getattr(model, "args", None)
    head_dim = getattr(args, "head_dim", None)
    if not head_dim:
        hidden, heads = getattr(args, "hidden_size", 0), getattr(args, "num_attention_heads", 0)
        head_dim = hidden // heads if heads else 0
    return {head_dim} if head_dim else set()


def quantize(caches: list, bits: int, group_size: int, local: range | None = None) -> list:
    """`caches` (fresh, from make_prompt_cache) with each KVCache of a `local` layer (all
    when None) replaced by a QuantizedKVCache. A PP stage's other layers keep the plain,
    zero-width caches that only carry the position (pipeline._advance_others)."""
    return [
        QuantizedKVCache(group_size, bits)
        if type(c) is KVCache and (local is None or i in local)
        else c
        for i, c in enumerate(caches)
    ]


def bytes_per_token(caches: list) -> float:
    """Bytes of state one context token takes in these filled caches (all layers), read
    from the stored arrays: quantized words, scales and biases, or plain keys and values."""
    total = 0.0
    for c in caches:
        if getattr(c, "keys", None) is None:
            continue
        for a in tree_flatten((c.keys, c.values)):
            arr = a[1]
            total += arr.nbytes / arr.shape[-2]  # (B, heads, capacity, width)
    return total


def merge(caches: list):
    """One layer's caches of single rows as one batch cache (left-padded, as mlx-lm's
    KVCache.merge); quantized rows make a BatchQuantizedKVCache."""
    if type(caches[0]) is QuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)
    return caches[0].merge(caches)


def _parts(x, fn):
    return tuple(fn(a) for a in x)


def _rows(a: tuple, b: tuple) -> tuple:
    """Two batches' (words, scales, biases), row after row."""
    return tuple(mx.concatenate([x, y]) for x, y in zip(a, b, strict=True))


class BatchQuantizedKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache (left padding, a shared write index) holding its keys and values
    quantized as QuantizedKVCache does: (words, scales, biases), each (B, heads, T, ...).
    Padding holds zero words, scales and biases (the mask keeps it out). Positions, masks and
    trims are BatchKVCache's own."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits  # attention reads them (base.py)

    def _quantize(self, x: mx.array) -> tuple:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def update_and_fetch(self, keys, values):
        prev, n = self._idx, keys.shape[2]
        keys, values = self._quantize(keys), self._quantize(values)
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            size = (self.step + n - 1) // self.step * self.step

            def grow(old, new):
                blank = mx.zeros((*new.shape[:2], size, new.shape[3]), new.dtype)
                if old is None:
                    return blank
                return mx.concatenate([old[..., :prev, :], blank], axis=2)

            old_k = self.keys or (None,) * 3
            old_v = self.values or (None,) * 3
            self.keys = tuple(grow(o, k) for o, k in zip(old_k, keys, strict=True))
            self.values = tuple(grow(o, v) for o, v in zip(old_v, values, strict=True))
        self.offset = self.offset + n
        self._idx += n
        for buf, new in zip((*self.keys, *self.values), (*keys, *values), strict=True):
            buf[..., prev : self._idx, :] = new
        return self.keys_and_values()

    def keys_and_values(self):
        cut = lambda a: a[..., : self._idx, :]  # noqa: E731
        return _parts(self.keys, cut), _parts(self.values, cut)

    def filter(self, batch_indices):
        if self.keys is not None:
            pick = lambda a: a[batch_indices]  # noqa: E731
            self.keys, self.values = _parts(self.keys, pick), _parts(self.values, pick)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        # The padding every row shares is dropped (as BatchKVCache.filter).
        if (common := min(self.left_padding.tolist())) > 0:
            if self.keys is not None:
                drop = lambda a: a[..., common:, :]  # noqa: E731
                self.keys, self.values = _parts(self.keys, drop), _parts(self.values, drop)
            self._idx -= common
            self.left_padding = self.left_padding - common

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Appends `other`'s rows, both right-aligned on the longer write index."""
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other))

        def aligned(c):
            left = idx - c._idx
            right = size - c.keys[0].shape[2] - left

            def pad(a):
                if right < 0:
                    a = a[..., :right, :]
                return mx.pad(a, [(0, 0), (0, 0), (left, max(right, 0)), (0, 0)])

            return _parts(c.keys, pad), _parts(c.values, pad), c.offset, c.left_padding + left

        mine, theirs = aligned(self), aligned(other)
        self.keys, self.values = _rows(mine[0], theirs[0]), _rows(mine[1], theirs[1])
        self.offset = mx.concatenate([mine[2], theirs[2]])
        self.left_padding = mx.concatenate([mine[3], theirs[3]])
        self._idx = idx

    @classmethod
    def merge(cls, caches: list[QuantizedKVCache]) -> BatchQuantizedKVCache:
        """Rows of filled QuantizedKVCaches, right-aligned on the longest."""
        longest = max(c.offset for c in caches)
        first = caches[0]
        cache = cls([longest - c.offset for c in caches], first.group_size, first.bits)

        def stack(part: int, which: str) -> mx.array:
            rows = []
            for c in caches:
                a = getattr(c, which)[part][..., : c.offset, :]
                rows.append(mx.pad(a, [(0, 0), (0, 0), (longest - c.offset, 0), (0, 0)]))
            return mx.concatenate(rows)

        cache.keys = tuple(stack(i, "keys") for i in range(3))
        cache.values = tuple(stack(i, "values") for i in range(3))
        cache.offset = cache.offset + longest
        cache._idx = longest
        return cache

    @property
    def nbytes(self):
        return sum(a.nbytes for a in (*self.keys, *self.values)) if self.keys else 0
