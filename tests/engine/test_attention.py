"""Prefill attention on an x86 CPU (engine/attention.py) against MLX's own
scaled_dot_product_attention, and the engine's tokens with it against mlx-lm's path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny

from thunderpool.engine import attention
from thunderpool.engine.control import Control
from thunderpool.engine.engine import Engine
from thunderpool.engine.loader import Layout, load_shard
from thunderpool.engine.sampling import SamplingParams

# (B, H, K, L, S): score blocks below MIN_SCORES (MLX ops) and above it (numpy).
SHAPES = [(1, 9, 3, 7, 7), (2, 8, 2, 5, 40), (1, 4, 4, 1, 100), (1, 9, 3, 512, 640)]
SHAPES += [(2, 8, 2, 300, 600)]


def _masks(B, H, L, S):
    keep = np.random.default_rng(0).random((B, 1, L, S)) > 0.3
    keep[..., 0] = True  # every query sees a key
    heads = np.broadcast_to(keep, (B, H, L, S)).copy()
    heads[:, 1, :, 1] = False
    yield "none", None
    yield "causal", "causal"
    yield "bool", mx.array(keep)
    yield "additive", mx.where(mx.array(keep), 0.0, -1e9)
    yield "per-head", mx.array(heads)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sdpa_equals_mlx_attention(shape):
    B, H, K, L, S = shape
    mx.random.seed(1)
    q, k, v = (mx.random.normal((B, n, m, 32)) for n, m in ((H, L), (K, S), (K, S)))
    numpy_path = B * H * L * S >= attention.MIN_SCORES
    for name, mask in _masks(B, H, L, S):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.17, mask=mask)
        got = attention.sdpa(q, k, v, 0.17, mask)
        assert got.shape == want.shape and got.dtype == mx.float32
        # numpy's products and exp round differently from MLX's: float32 noise only.
        tol = 2e-5 if numpy_path else 1e-6
        assert mx.allclose(got, want, atol=tol, rtol=tol).item(), (name, shape)


def test_only_plain_float32_attention_on_an_x86_cpu_is_taken(monkeypatch):
    q, k = mx.zeros((1, 4, 3, 8)), mx.zeros((1, 2, 3, 8))
    monkeypatch.setattr(attention, "X86", True)
    assert attention.applies(q, k, cache=None, sinks=None)
    assert not attention.applies(q.astype(mx.float16), k.astype(mx.float16), None, None)
    assert not attention.applies(q, k, cache=type("Q", (), {"bits": 8})(), sinks=None)
    assert not attention.applies(q, k, cache=None, sinks=mx.zeros((4,)))
    assert not attention.applies(q, (k, k, k), cache=None, sinks=None)
    assert not attention.applies(q, mx.zeros((1, 3, 3, 8)), cache=None, sinks=None)
    monkeypatch.setattr(attention, "X86", False)  # an arm64 Mac's CPU: MLX's own
    assert not attention.applies(q, k, cache=None, sinks=None)


def test_a_long_prompt_gives_mlx_lms_tokens_and_logits(tmp_path, monkeypatch):
    """A 400-token prompt on the tiny llama (8 heads: 1.3 M scores, the numpy path) against the
    same engine with mlx-lm's attention."""
    model = make_tiny("llama", tmp_path / "llama")
    runner = load_shard(model, mx.distributed.init(), Layout())[0]
    prompt = np.random.default_rng(3).integers(0, 256, 400).tolist()
    called = []
    sdpa = attention.sdpa
    monkeypatch.setattr(attention, "sdpa", lambda *a: called.append(1) or sdpa(*a))

    def run(x86: bool):
        monkeypatch.setattr(attention, "X86", x86)
        logits = runner.forward(mx.array([prompt]), runner.make_cache())
        engine = Engine(runner, Control(runner.group))
        tokens = []
        engine.generate(prompt, SamplingParams(max_tokens=12), lambda ev: tokens.append(ev.token))
        return logits, tokens

    ours, theirs = run(True), run(False)
    assert called  # the numpy path ran
    assert mx.allclose(ours[0], theirs[0], atol=1e-4, rtol=1e-4).item()
    assert ours[1] == theirs[1]
