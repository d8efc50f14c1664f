"""This rank's share of the prefix cache: per-layer KV of kept prompts, under the leader's ids.

The plan says which entry to keep, reuse or free (prefix.py decides on the leader); every rank
does the same on its own shard, so the caches agree without a byte of KV on the wire. Only
caches that can be cut back to a prefix are kept: mlx-lm's KVCache and QuantizedKVCache (its
packed words, scales and biases kept as they are: restored exactly), and RotatingKVCache while
nothing has rotated out of its window. Recurrent and other caches turn the prefix cache off
(`keepable_tokens` is 0); a rank asked to keep what it cannot stops with an error, never
reusing a wrong state.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from thunderpool.engine.prefix import UNBOUNDED

# Per layer (keys, values), (B=1, heads, T, dim); a quantized layer's are each a tuple of
# (words, scales, biases), all (B=1, heads, T, ...).
Entry = list[tuple]
CUTTABLE = (KVCache, QuantizedKVCache)


def keepable_tokens(caches: list) -> int:
    """The longest prompt whose KV these caches can give back cut to any prefix: UNBOUNDED
    for plain KV caches, under the window for sliding ones, 0 for any other cache type."""
    limit = UNBOUNDED
    for c in caches:
        if type(c) is RotatingKVCache:
            limit = min(limit, c.max_size - 1)  # a longer prompt rotates tokens out
        elif type(c) not in CUTTABLE:
            return 0
    return limit


class PrefixStore:
    def __init__(self):
        self.entries: dict[int, Entry] = {}

    def keep(self, entry: int, caches: list) -> None:
        """Keeps a snapshot of the prefilled caches (slices: later writes leave it alone)."""
        kept = []
        for c in caches:
            if type(c) not in (*CUTTABLE, RotatingKVCache) or (
                type(c) is RotatingKVCache and c.offset >= c.max_size
            ):
                raise RuntimeError(
                    f"the prefix cache cannot keep a {type(c).__name__} holding {c.offset} "
                    "tokens on this rank; serve with --prefix-cache-gb 0"
                )
            kept.append((_cut(c.keys, c.offset), _cut(c.values, c.offset)))
        mx.async_eval([a for _, a in tree_flatten(kept)])
        self.entries[entry] = kept

    def restore(self, entry: int, tokens: int, caches: list) -> list:
        """`caches` (fresh) holding the first `tokens` tokens of the entry."""
        kept = self.entries[entry]
        for c, (k, v) in zip(caches, kept, strict=True):
            held = (k[0] if isinstance(k, tuple) else k).shape[2]
            if held < tokens:
                raise RuntimeError(f"entry {entry} holds {held} tokens, not {tokens}")
            if isinstance(k, tuple) != isinstance(c, QuantizedKVCache):
                kind = "quantized" if isinstance(k, tuple) else "plain"
                raise RuntimeError(
                    f"entry {entry} was kept from a {kind} cache; it cannot fill a "
                    f"{type(c).__name__}"
                )
            # Fresh slices: the row's own writes go to new arrays, never into the entry.
            c.keys, c.values, c.offset = _cut(k, tokens), _cut(v, tokens), tokens
            if type(c) is RotatingKVCache:
                c._idx = tokens
        return caches

    def evict(self, entries: tuple[int, ...]) -> None:
        for entry in entries:
            self.entries.pop(entry, None)


def _cut(x, tokens: int):
    """The first `tokens` positions of a cache's keys or values (each part when quantized)."""
    if isinstance(x, tuple):
        return tuple(a[..., :tokens, :] for a in x)
    return x[..., :tokens, :]
