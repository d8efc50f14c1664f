"""The prefix cache's index on the leader: which prompts every rank keeps the KV of. Pure: no MLX.

The scheduler asks `lookup(prompt)` when a request starts prefilling and `store(prompt)` when it
plans the prompt's last chunk; the answers ride on the plan's Prefill (reuse, store, evict), and
every rank keeps its own shard's KV under the same entry ids (prefix_kv.py), so no KV crosses the
wire. An entry is a whole prompt; a lookup takes the longest common prefix over all entries (the
budget keeps them few). Entries leave least recently used first, within a budget in tokens
(`budget_tokens`: the byte budget over the model's KV bytes per token, all ranks together).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

UNBOUNDED = 1 << 62


@dataclass(frozen=True, slots=True)
class Hit:
    """Reuse the first `tokens` tokens of entry `entry`."""

    entry: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Stored:
    """Keep the prompt's KV as entry `entry` after freeing the entries in `evict`."""

    entry: int
    evict: tuple[int, ...]


class PrefixIndex:
    def __init__(self, budget_tokens: int, max_tokens: int = UNBOUNDED, min_reuse: int = 1):
        # max_tokens: the longest prompt whose KV can be cut back (sliding-window caches).
        self.budget, self.max_tokens, self.min_reuse = budget_tokens, max_tokens, min_reuse
        self.entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # oldest use first
        self.used = 0  # tokens held
        self.lookups = self.hits = 0
        self.lookup_tokens = self.hit_tokens = 0
        self._next = 0

    def lookup(self, prompt: tuple[int, ...]) -> Hit | None:
        """The longest cached prefix of `prompt`, short of its last token (whose logits the
        prefill must compute), or None."""
        best, best_n = None, 0
        for entry, tokens in self.entries.items():
            n = common_prefix(tokens, prompt)
            if n > best_n:
                best, best_n = entry, n
        n = min(best_n, len(prompt) - 1)
        self.lookups, self.lookup_tokens = self.lookups + 1, self.lookup_tokens + len(prompt)
        if best is None or n < self.min_reuse:
            return None
        self.entries.move_to_end(best)
        self.hits, self.hit_tokens = self.hits + 1, self.hit_tokens + n
        return Hit(best, n)

    def store(self, prompt: tuple[int, ...]) -> Stored | None:
        """Where to keep this prompt's KV, or None (too long, or an entry already holds it)."""
        n = len(prompt)
        if n > min(self.budget, self.max_tokens):
            return None
        for entry, tokens in self.entries.items():
            if len(tokens) >= n and tokens[:n] == prompt:
                self.entries.move_to_end(entry)
                return None
        # An entry that is a prefix of this prompt matches nothing this one does not match
        # at least as far: the new entry replaces it (a chat's turn replaces the one before).
        evict = [e for e, t in self.entries.items() if prompt[: len(t)] == t]
        left = self.used - sum(len(self.entries[e]) for e in evict)
        for entry, tokens in self.entries.items():
            if left + n <= self.budget:
                break
            if entry not in evict:
                evict.append(entry)
                left -= len(tokens)
        for entry in evict:
            del self.entries[entry]
        entry, self._next = self._next, self._next + 1
        self.entries[entry] = prompt
        self.used = left + n
        return Stored(entry, tuple(evict))


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix; compares blocks of tokens at C speed first."""
    n, block = min(len(a), len(b)), 256
    i = 0
    while i + block <= n and a[i : i + block] == b[i : i + block]:
        i += block
    while i < n and a[i] == b[i]:
        i += 1
    return i


def budget_tokens(
    budget_bytes: float, config: dict, kv_bits: int | None = None, kv_group_size: int = 64
) -> int:
    """The byte budget in tokens of KV cache over the whole model (every rank's share)."""
    if budget_bytes <= 0:
        return 0
    return int(budget_bytes // kv_bytes_per_token(config, kv_bits, kv_group_size))


def kv_bytes_per_token(config: dict, kv_bits: int | None = None, kv_group_size: int = 64) -> float:
    """KV bytes of one token over all layers, as the planner counts them (planner/spec.py),
    at the checkpoint's dtype, or quantized to `kv_bits` (--kv-bits)."""
    from thunderpool.errors import ThunderpoolError
    from thunderpool.planner.spec import kv_element_bytes, model_spec_from_config

    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    width = kv_element_bytes(4.0 if "32" in dtype else 2.0, kv_bits, kv_group_size)
    try:
        return model_spec_from_config(config, kv_dtype_bytes=width).kv_bytes_per_token()
    except (ThunderpoolError, KeyError, TypeError, ValueError):
        from thunderpool.models import shape

        kv = shape.kv_heads(config) or 1
        return 2.0 * shape.n_layers(config) * kv * shape.head_dim(config) * width
