"""The draft side of speculative decoding: a draft model's per-row caches and proposals.

A `Drafter` keeps, per sequence, the tokens it has seen and a draft KV cache fed lazily the
first time that sequence speculates. On the leader it draws each draft token (greedy or from
the draft's distribution q, for the accept rule). A draft sharded like the target (`Shard`,
draft_load.py) runs on every TP rank in lockstep: every rank runs the same draft forwards,
whose products each read 1/N of the draft, and the leader's draft tokens are shared per
position, so no rank waits while another drafts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from thunderpool.engine import compiled
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.scheduler import MAX_ROWS
from thunderpool.errors import ThunderpoolError

if TYPE_CHECKING:
    from collections.abc import Callable

    from thunderpool.engine.runner import Runner

DEFAULT_K = 4
# Cache types whose rejected tail can be cut by trim() at any length (no ring, no recurrence).
TRIMMABLE = {"KVCache", "BatchKVCache", "QuantizedKVCache", "ConcatenateKVCache"}


@dataclass(frozen=True, slots=True)
class Shard:
    """A draft sharded like the target over its TP group (draft_load.py): this rank's
    runner of it, whether this rank leads, and how the leader's draft tokens reach the
    others (Control.share_ints)."""

    runner: Runner
    leads: bool
    share: Callable[[list[int] | None, int], list[int]]


def untrimmable(cache: list) -> list[str]:
    """The names of cache types in `cache` that cannot drop a rejected tail."""
    bad = []
    for c in cache:
        for part in getattr(c, "caches", (c,)):
            if type(part).__name__ not in TRIMMABLE:
                bad.append(type(part).__name__)
    return sorted(set(bad))


def check_speculable(cache: list, what: str) -> None:
    if bad := untrimmable(cache):
        raise ThunderpoolError(
            f"speculative decoding needs KV caches that can drop rejected tokens, but the {what} "
            f"uses {', '.join(bad)} (sliding window or recurrent state); run without --draft-model"
        )


def trim(cache: list, n: int) -> None:
    if n > 0:
        for c in cache:
            c.trim(n)


def distribution(logits: mx.array, params: SamplingParams) -> np.ndarray:
    """logits (L, V) -> the sampler's distribution (L, V) as float64: temperature, top-k and
    top-p applied as in sampling.Sampler."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    if params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    probs = np.array(mx.softmax(logprobs * (1 / params.temperature), axis=-1), np.float64)
    return probs / probs.sum(axis=-1, keepdims=True)


def draw(
    logits: mx.array, params: SamplingParams, rngs: dict, sid: int
) -> tuple[int, np.ndarray | None]:
    """One draft token: the argmax (greedy), or a draw from the draft's distribution q (then
    returned too, for the accept rule) with the row's own seeded generator."""
    if params.greedy:
        return int(mx.argmax(logits).item()), None
    q = distribution(logits[None], params)[0]
    rng = rngs.setdefault(sid, row_rng(params))
    return int(rng.choice(q.shape[-1], p=q)), q


def row_rng(params: SamplingParams) -> np.random.Generator:
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
    return np.random.default_rng(seed)


class Drafter:
    """The draft model, whole on the leader or this rank's shard of it (`shard`): one prefix
    cache per sequence, fed lazily with the sequence's tokens (prompt and delivered ones) the
    first time that sequence speculates."""

    def __init__(
        self,
        model,
        k: int = DEFAULT_K,
        vocab: int | None = None,
        max_rows: int = MAX_ROWS,
        compile: bool | None = None,
        shard: Shard | None = None,
    ):
        if k < 1:
            raise ThunderpoolError(f"--spec-k {k} must be at least 1")
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.k, self.vocab = model, k, vocab
        self.max_rows = max_rows  # batches of more rows decode plainly (choose_k)
        self._make_cache = lambda: make_prompt_cache(model)
        # A draft sharded like the target runs on every rank in lockstep (draft_load.py).
        self.shard = shard
        # One-token draft steps take the compiled, fused step where the family has one: on a
        # CPU its products then use every core, as the target's decode does (runner.py).
        if shard is not None:
            self.runner = shard.runner if shard.runner.compiled is not None else None
        else:
            self.runner = _draft_runner(model, compile)
        check_speculable(self._make_cache(), "draft model")
        self.seqs: dict[int, list[int]] = {}
        self.fed: dict[int, int] = {}  # tokens of seqs[sid] in the draft cache
        self.caches: dict[int, list] = {}
        self.rngs: dict[int, np.random.Generator] = {}
        self.sent: dict[int, int] = {}  # leader of a sharded draft: seqs[sid] tokens sent

    def extend(self, sid: int, tokens: list[int]) -> None:
        self.seqs.setdefault(sid, []).extend(tokens)

    def drop(self, sid: int) -> None:
        for d in (self.seqs, self.fed, self.caches, self.rngs, self.sent):
            d.pop(sid, None)

    def unsent(self, sid: int) -> list[int]:
        """Leader of a sharded draft: the row's tokens the other ranks' drafts lack."""
        seq = self.seqs[sid]
        new, self.sent[sid] = seq[self.sent.get(sid, 0) :], len(seq)
        return new

    def pick(
        self, logits: mx.array, sids: list[int], params: list
    ) -> tuple[list[int], list[np.ndarray | None]]:
        """Each row's next draft token from logits (B, V), and its q: drawn on the leader
        and, for a sharded draft, shared with the other ranks (their params are None)."""
        if self.shard is not None and not self.shard.leads:
            mx.eval(logits)  # this rank's part of the forward's collectives, then the share
            return self.shard.share(None, len(sids)), [None] * len(sids)
        rows = enumerate(zip(sids, params, strict=True))
        picked = [draw(logits[i], p, self.rngs, sid) for i, (sid, p) in rows]
        tokens = [d for d, _ in picked]
        if self.shard is not None:
            self.shard.share(tokens, len(tokens))
        return tokens, [q for _, q in picked]

    def _logits(self, tokens: list[int], cache: list) -> mx.array:
        if len(tokens) == 1 and self.runner is not None and compiled.eligible(cache):
            out = self.runner.decode(mx.array([tokens]), cache)[0]
        else:
            out = self.model(mx.array([tokens]), cache=cache)[0, -1]
        return out[: self.vocab] if self.vocab is not None else out

    def propose(self, sid: int, n: int, params: SamplingParams) -> tuple[list[int], np.ndarray]:
        """n draft tokens after the sequence's last token, and their distributions (n, V)
        (empty when greedy). The draft cache then holds the sequence plus n-1 drafts."""
        seq, cache = self.seqs[sid], self.caches.setdefault(sid, self._make_cache())
        fed = self.fed.get(sid, 0)
        assert fed < len(seq), "the sequence's last token is always new to the draft"
        for start in range(fed, len(seq) - 1, 512):  # catch up a long prompt in chunks
            chunk = seq[start : min(start + 512, len(seq) - 1)]
            mx.eval(self.model(mx.array([chunk]), cache=cache))
        logits = self._logits(seq[-1:], cache)
        self.fed[sid] = len(seq)
        drafts, qs = [], []
        for i in range(n):
            [d], [q] = self.pick(logits[None], [sid], [params])
            qs += [] if q is None else [q]
            drafts.append(d)
            if i < n - 1:
                logits = self._logits([d], cache)
        return drafts, np.stack(qs) if qs else np.zeros((0, 0))

    def propose_rows(
        self, sids: list[int], n: int, params: list[SamplingParams]
    ) -> list[tuple[list[int], np.ndarray]]:
        """`propose` for several sequences at once: one batched draft forward per draft
        position. Each row's cache is first brought to all but its last `lag` tokens (the same
        lag for every row: a cache ahead is trimmed and the token fed again), the row caches
        are merged into one left-padded batch, and split back afterwards."""
        if n == 0:  # a row's last token: nothing to draft, nothing fed
            return [([], np.zeros((0, 0))) for _ in sids]
        if len(sids) <= 1:
            return [self.propose(sid, n, p) for sid, p in zip(sids, params, strict=True)]
        seqs = [self.seqs[sid] for sid in sids]
        # After a verify step a row's draft lags 1 token (a rejection) or 2 (all accepted).
        lag = min(2, max(len(self.seqs[sid]) - self.fed.get(sid, 0) for sid in sids))
        caches = []
        for sid, seq in zip(sids, seqs, strict=True):
            cache = self.caches.setdefault(sid, self._make_cache())
            fed, want = self.fed.get(sid, 0), len(seq) - lag
            for start in range(fed, want, 512):  # catch up a long prompt in chunks
                chunk = seq[start : min(start + 512, want)]
                mx.eval(self.model(mx.array([chunk]), cache=cache))
            trim(cache, fed - want)
            self.fed[sid] = len(seq)
            caches.append(cache)
        batch = [type(layer[0]).merge(list(layer)) for layer in zip(*caches, strict=True)]
        logits = self._batch_logits([seq[-lag:] for seq in seqs], batch)
        drafts: list[list[int]] = [[] for _ in sids]
        qs: list[list[np.ndarray]] = [[] for _ in sids]
        for step in range(n):
            picked, q_rows = self.pick(logits, sids, params)
            for i, (d, q) in enumerate(zip(picked, q_rows, strict=True)):
                drafts[i].append(d)
                qs[i] += [] if q is None else [q]
            if step < n - 1:
                logits = self._batch_logits([[d[-1]] for d in drafts], batch)
        for i, sid in enumerate(sids):
            self.caches[sid] = [c.extract(i) for c in batch]
        empty = np.zeros((0, 0))
        return [(d, np.stack(q) if q else empty) for d, q in zip(drafts, qs, strict=True)]

    def _batch_logits(self, tokens: list[list[int]], cache: list) -> mx.array:
        if len(tokens[0]) == 1 and self.runner is not None and compiled.eligible(cache):
            out = self.runner.decode(mx.array(tokens), cache)  # (B, V)
        else:
            out = self.model(mx.array(tokens), cache=cache)[:, -1]
        return out[:, : self.vocab] if self.vocab is not None else out

    def settle(self, sid: int, n: int, accepted: int) -> None:
        """Drop the rejected drafts from the draft cache (it holds n-1 of them)."""
        if n == 0:
            return
        kept = min(accepted, n - 1)
        trim(self.caches[sid], n - 1 - kept)
        self.fed[sid] += kept


def _draft_runner(model, compile: bool | None):
    """A runner of the whole draft model on this (the leader's) process, for its compiled
    one-token steps; None where the family does not compile or compile is off (--compile as
    for the model)."""
    from thunderpool.engine.runner import Runner

    if not (compiled.wanted(compile) and compiled.supports(model)):
        return None
    runner = Runner(model, mx.distributed.init(), None)
    return runner if runner.compiled is not None else None
