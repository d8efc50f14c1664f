"""Sampling parameters and the sampler built from them (mlx-lm's samplers do the work)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler


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


def build_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """logits (B, V) -> token ids (B,). Greedy skips the softmax normalisation entirely."""
    if params.temperature == 0:
        return lambda logits: mx.argmax(logits, axis=-1)
    sample = make_sampler(
        temp=params.temperature,
        top_p=params.top_p if params.top_p < 1 else 0.0,
        top_k=params.top_k,
    )
    return lambda logits: sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
