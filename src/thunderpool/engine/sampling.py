"""Sampling parameters and per-sequence samplers (mlx-lm's top-k / top-p filters do the work).

Each sequence draws from its own PRNG key, split once per token, so a seeded request gives the
same tokens whether it runs alone or in a batch, on one rank or many.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """logits (1, V) -> token (1,) for one sequence."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.key = mx.random.key(seed)

    def __call__(self, logits: mx.array) -> mx.array:
        p = self.params
        if p.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < p.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, p.top_k)
        if p.top_p < 1:
            logprobs = apply_top_p(logprobs, p.top_p)
        self.key, draw = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1 / p.temperature), key=draw)


def sample_rows(logits: mx.array, samplers: list[Sampler]) -> mx.array:
    """logits (B, V) -> tokens (B,); an all-greedy batch takes one argmax."""
    if all(s.params.greedy for s in samplers):
        return mx.argmax(logits, axis=-1)
    return mx.concatenate([s(logits[i : i + 1]) for i, s in enumerate(samplers)])
