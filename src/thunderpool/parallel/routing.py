"""Routing counts: how often each MoE layer's router picks each expert on calibration prompts.

EP's hot-expert copies (parallel/experts.py) and its cost (planner/ep.py) read them. They are
counted at the experts module's input, the (x, indices) every SwitchGLU/SwitchMLP receives,
so every family EP shards is counted the same way. The model runs in this one process (a full
forward per prompt: prefill routes), so measure on a machine that holds the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from pydantic import BaseModel, ConfigDict

from thunderpool.errors import ModelError
from thunderpool.models import shape
from thunderpool.parallel.experts import moe_experts, n_experts

ROUTING_FILE = "thunderpool-routing.json"  # next to the model, where `route-counts` writes
# A calibration set of varied text (facts, code, chat, arithmetic, other languages).
CALIBRATION = (
    "The capital of France is Paris, and the Seine runs through it.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "User: Can you suggest a recipe for dinner tonight? Assistant: Try a lentil curry.",
    "12 * 17 = 204, and 204 / 4 = 51. The square root of 144 is 12.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "SELECT name, count(*) FROM orders GROUP BY name ORDER BY 2 DESC LIMIT 10;",
    "Once upon a time, in a kingdom by the sea, there lived a curious young engineer.",
)


class RoutingCounts(BaseModel):
    """Routes per expert of each MoE layer (by layer index), over `tokens` tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    model_type: str
    experts: int
    top_k: int
    tokens: int
    layers: dict[int, tuple[int, ...]]

    def popularity(self, layer: int) -> tuple[float, ...] | None:
        counts = self.layers.get(layer)
        return tuple(c / max(1, sum(counts)) for c in counts) if counts else None

    @classmethod
    def read(cls, path: Path) -> RoutingCounts:
        try:
            return cls.model_validate_json(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ModelError(
                f"cannot read routing counts from {path} ({e}); measure them with "
                "`thunderpool route-counts --model M --out FILE`"
            ) from e


class _Counter(nn.Module):
    """An experts module that counts the routes it is given, then runs them."""

    def __init__(self, inner: nn.Module, n: int):
        super().__init__()
        self.inner = inner
        self._counts = np.zeros(n, dtype=np.int64)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        flat = np.array(indices.reshape(-1)).astype(np.int64)
        self._counts += np.bincount(flat, minlength=len(self._counts))
        return self.inner(x, indices)


def measure(model: nn.Module, config: dict, prompts: list[list[int]]) -> RoutingCounts:
    """Run each token prompt through `model` (one full forward) and count every route."""
    n = n_experts(model)
    counters: dict[int, tuple[nn.Module, str, _Counter]] = {}
    for i, layer in enumerate(model.layers):
        if (found := moe_experts(layer)) is not None:
            block, name = found
            block[name] = counter = _Counter(block[name], n)
            counters[i] = (block, name, counter)
    tokens = 0
    for ids in prompts:
        mx.eval(model(mx.array([ids])))
        tokens += len(ids)
    for block, name, counter in counters.values():  # the experts back: the model is as it was
        block[name] = counter.inner
    k = shape.experts_per_token(config)
    return RoutingCounts(
        model_type=str(config.get("model_type", "")),
        experts=n,
        top_k=k,
        tokens=tokens,
        layers={i: tuple(int(v) for v in c[2]._counts) for i, c in counters.items()},
    )


def calibration_prompts(model_dir: Path, texts: list[str] | None = None) -> list[list[int]]:
    """Token ids of `texts` (default CALIBRATION) with the model's tokenizer; a model without
    one (a synthetic or test checkpoint) gets as many seeded random prompts of 64 tokens."""
    texts = list(texts or CALIBRATION)
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer.model").is_file():
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        return [tokenizer.encode(t) for t in texts]
    from thunderpool.models.shape import vocab as vocab_of

    vocab = vocab_of(json.loads((model_dir / "config.json").read_text()))
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, size=64).tolist() for _ in texts]
