"""What the leader's sampler does to one row's logits besides drawing: penalties, logit bias,
and the log-probabilities it reports.

Semantics follow OpenAI and vLLM: frequency and presence penalties count the generated tokens
only; the repetition penalty (Hugging Face's, sign-aware) covers the prompt and the generated
tokens; reported logprobs are the model's own (log_softmax of the raw logits), before any
penalty, bias or grammar mask. Everything stays lazy (mx), so a decode burst still overlaps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's logprob under the model (log_softmax of its raw logits) and the
    `top` most likely tokens at that step as (id, logprob) pairs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Penalties:
    """One row's token history as counts over the vocabulary (mx, lazy) and the penalties and
    bias it applies: logits (1, V) -> logits (1, V)."""

    def __init__(
        self,
        frequency: float = 0.0,
        presence: float = 0.0,
        repetition: float = 1.0,
        bias: tuple[tuple[int, float], ...] = (),
    ):
        self.frequency, self.presence, self.repetition = frequency, presence, repetition
        self.bias = bias
        self.prompt: list[int] = []  # only kept for the repetition penalty
        self.counts: mx.array | None = None  # (V,) generated-token counts
        self.seen: mx.array | None = None  # (V,) prompt or generated, for repetition

    @property
    def active(self) -> bool:
        return bool(self.frequency or self.presence or self.repetition != 1.0 or self.bias)

    def observe_prompt(self, tokens) -> None:
        if self.repetition != 1.0:
            self.prompt.extend(int(t) for t in tokens)

    def add(self, token: mx.array) -> None:
        """A generated token (1,), lazy."""
        if self.counts is not None:
            self.counts = self.counts.at[token].add(1.0)

    def __call__(self, logits: mx.array) -> mx.array:
        V = logits.shape[-1]
        if self.counts is None:
            self.counts = mx.zeros((V,), dtype=mx.float32)
            prompt = [t for t in self.prompt if 0 <= t < V]
            seen = mx.zeros((V,), dtype=mx.float32)
            self.seen = (seen.at[mx.array(prompt)].add(1.0) if prompt else seen) > 0
        out = logits
        if self.bias:  # first, as mlx-lm's make_logits_processors orders them
            ids = mx.array([t for t, _ in self.bias if 0 <= t < V])
            vals = mx.array([b for t, b in self.bias if 0 <= t < V], dtype=out.dtype)
            out = out.at[:, ids].add(vals) if ids.size else out
        if self.repetition != 1.0:
            seen = self.seen | (self.counts > 0)
            p = self.repetition
            out = mx.where(seen, mx.where(out > 0, out / p, out * p), out)
        if self.frequency or self.presence:
            out = out - self.frequency * self.counts - self.presence * (self.counts > 0)
        return out.astype(logits.dtype)


class Logprobs:
    """Records each sampled token's logprob (and the top-k) lazily; `take` hands them out in
    sampling order as the tokens are delivered."""

    def __init__(self, top: int):
        self.top = top
        self.pending: deque[tuple[mx.array, mx.array, mx.array | None, mx.array | None]] = deque()

    def record(self, logits: mx.array, token: mx.array) -> None:
        """logits (1, V) raw; token (1,)."""
        lp = logits.astype(mx.float32)
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, token.reshape(1, 1), axis=-1)
        ids = vals = None
        if self.top:
            k = min(self.top, lp.shape[-1])
            ids = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
            vals = mx.take_along_axis(lp, ids, axis=-1)
        self.pending.append((token, chosen, ids, vals))

    def take(self) -> TokenLogprob | None:
        if not self.pending:
            return None
        token, chosen, ids, vals = self.pending.popleft()
        top: tuple[tuple[int, float], ...] = ()
        if ids is not None and vals is not None:
            pairs = zip(ids[0].tolist(), vals[0].tolist(), strict=True)
            top = tuple(sorted(pairs, key=lambda p: -p[1]))
        return TokenLogprob(int(token.item()), float(chosen.item()), top)
