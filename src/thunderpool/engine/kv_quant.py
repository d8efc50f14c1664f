"""KV-cache quantization (`--kv-bits`): each layer's KVCache becomes mlx-lm's QuantizedKVCache,
whose keys and values are stored as `bits`-bit integers with a scale and a bias per `group_size`
values of a head (mlx-lm's attention reads them through quantized matmuls).

Every rank quantizes from the first token, so the caches are the same on every rank and in
the prefix cache whichever rank or request filled them (mlx-lm's generate converts a plain
cache once it is long; a cache that changes type mid-request could not be kept and restored
alike). Quantization runs along head_dim, so a TP rank's heads are those of the whole cache.
Only plain KVCaches of families whose attention reads the cache through mlx-lm's
`scaled_dot_product_attention` can be quantized; any other is refused before a rank starts.
"""

from __future__ import annotations

import sys

import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

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
    if getattr(model.args, "kv_lora_rank", None):
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
    layer = model.layers[0]
    for _, m in layer.named_modules():
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
