"""Sampling parameters and per-sequence samplers (mlx-lm's top-k / top-p / min-p filters do
the work; logits.py the penalties and logprobs; constraint.py the grammar mask).

Each sequence draws from its own PRNG key, split once per token, so a seeded request gives the
same tokens whether it runs alone or in a batch, on one rank or many.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from thunderpool.engine.logits import Logprobs, Penalties, TokenLogprob

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    logprobs: bool = False  # report each token's logprob (and top_logprobs alternatives)
    top_logprobs: int = 0
    json_schema: str | None = None  # the output must match it (constraint.check_schema)
    # vLLM's: no end-of-sequence token (or stop string) ends it before min_tokens tokens,
    # and ignore_eos runs on past the end token (to max_tokens, or a stop string).
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= (v := getattr(self, name)) <= 2:
                raise ValueError(f"{name}={v} must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        for t, b in self.logit_bias:
            if t < 0 or not -100 <= b <= 100:
                bad = f"logit_bias={{{t}: {b}}}"
                raise ValueError(f"{bad} needs a token id >= 0 and a bias in [-100, 100]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]"
            )
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs={self.top_logprobs} must be in [0, {MAX_TOP_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def speculable(self) -> bool:
        """What speculate.py's accept rule reproduces exactly: temperature, top-k and top-p;
        no grammar, penalties, bias, min_p or logprobs (those rows decode one token a step)."""
        penalized = (self.frequency_penalty, self.presence_penalty, self.repetition_penalty)
        return (
            self.json_schema is None
            and not self.logprobs
            and not self.logit_bias
            and self.min_p == 0
            and self.min_tokens == 0
            and penalized == (0.0, 0.0, 1.0)
        )


class Sampler:
    """logits (1, V) -> token (1,) for one sequence. `grammars` (constraint.Grammars, the
    leader's, per tokenizer) makes the row's matcher when the params carry a json_schema."""

    def __init__(self, params: SamplingParams, grammars=None, eos=frozenset()):
        self.params = p = params
        # min_tokens: the end tokens' logits are masked until that many tokens are drawn.
        self.eos = mx.array(sorted(eos), dtype=mx.int32) if p.min_tokens and eos else None
        self.drawn = 0
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.key = mx.random.key(seed)
        if p.json_schema is not None and grammars is None:
            raise ValueError("a json_schema needs the engine's tokenizer (Engine(tokenizer=...))")
        self.matcher = grammars.matcher(p.json_schema) if p.json_schema is not None else None
        penalties = Penalties(
            p.frequency_penalty, p.presence_penalty, p.repetition_penalty, p.logit_bias
        )
        self.penalties = penalties if penalties.active else None
        self.logprobs = Logprobs(p.top_logprobs) if p.logprobs else None
        self.last: mx.array | None = None  # the token drawn last (1,), lazy

    @property
    def plain(self) -> bool:
        """Greedy and nothing else: a batch of such rows is one argmax."""
        masking = self.eos is not None and self.drawn < self.params.min_tokens
        return self.params.greedy and not (
            self.matcher or self.penalties or self.logprobs or masking
        )

    def observe_prompt(self, tokens) -> None:
        if self.penalties is not None:
            self.penalties.observe_prompt(tokens)

    def take_logprob(self) -> TokenLogprob | None:
        """The next delivered token's logprob record (None unless the request asked)."""
        return self.logprobs.take() if self.logprobs is not None else None

    def __call__(self, logits: mx.array) -> mx.array:
        p, raw = self.params, logits
        if self.last is not None:
            if self.penalties is not None:
                self.penalties.add(self.last)
            if self.matcher is not None:
                # The grammar needs the previous token itself: this waits for its step.
                self.matcher.consume(int(self.last.item()))
        if self.penalties is not None:
            logits = self.penalties(logits)
        if self.matcher is not None:
            from thunderpool.engine.constraint import apply_mask

            logits = apply_mask(logits, self.matcher.allowed(logits.shape[-1]))
        if self.eos is not None and self.drawn < p.min_tokens:
            logits = logits.at[..., self.eos].add(-mx.inf)
        self.drawn += 1
        token = self._draw(logits, p)
        if self.logprobs is not None:
            self.logprobs.record(raw, token)
        self.last = token
        return token

    def _draw(self, logits: mx.array, p: SamplingParams) -> mx.array:
        if p.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < p.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, p.top_k)
        if p.top_p < 1:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p > 0:
            logprobs = apply_min_p(logprobs, p.min_p)
        self.key, draw = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1 / p.temperature), key=draw)


def sample_rows(logits: mx.array, samplers: list[Sampler]) -> mx.array:
    """logits (B, V) -> tokens (B,); an all-plain-greedy batch takes one argmax."""
    if all(s.plain for s in samplers):
        return mx.argmax(logits, axis=-1)
    return mx.concatenate([s(logits[i : i + 1]) for i, s in enumerate(samplers)])
