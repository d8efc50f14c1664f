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


def _reference(q, k, v, scale, mask) -> np.ndarray:
    """The attention in float64 numpy, each query head on its KV head's keys and values."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, H, L, _ = q.shape
    S, g = k.shape[2], H // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scores = q @ k.swapaxes(-1, -2) * scale
    if isinstance(mask, str):
        mask = (np.arange(L)[:, None] + S - L) >= np.arange(S)[None]
    if mask is not None:
        m = np.asarray(mask)
        scores = np.where(m, scores, -np.inf) if m.dtype == bool else scores + m
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (scores / scores.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("v_width", [32, 24])  # 24: values narrower than keys, as MLA's
def test_sdpa_equals_a_float64_reference_and_mlx_attention(shape, v_width):
    B, H, K, L, S = shape
    mx.random.seed(1)
    q, k = mx.random.normal((B, H, L, 32)), mx.random.normal((B, K, S, 32))
    v = mx.random.normal((B, K, S, v_width))
    for name, mask in _masks(B, H, L, S):
        got = attention.sdpa(q, k, v, 0.17, mask)
        assert got.shape == (B, H, L, v_width) and got.dtype == mx.float32
        # float32 rounding of sums over S keys, against float64.
        np.testing.assert_allclose(np.asarray(got), _reference(q, k, v, 0.17, mask), atol=2e-5)
        if v_width == 32:  # MLX's own (its CPU path needs equal widths)
            want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.17, mask=mask)
            tol = 2e-5 if B * H * L * S >= attention.MIN_SCORES else 1e-6
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


def test_the_patch_lasts_the_block_and_leaves_other_masks_to_mlx_lm(monkeypatch):
    import mlx_lm.models.llama as llama

    theirs, ours = [], []
    monkeypatch.setattr(llama, "scaled_dot_product_attention", lambda *a, **kw: theirs.append(kw))
    monkeypatch.setattr(attention, "sdpa", lambda *a: ours.append(a[-1]))
    monkeypatch.setattr(attention, "X86", True)
    before = llama.scaled_dot_product_attention
    q, k = mx.zeros((1, 4, 3, 8)), mx.zeros((1, 2, 3, 8))
    model = type("Model", (), {"__module__": "mlx_lm.models.llama"})()
    with attention.cpu_prefill(model):
        call = llama.scaled_dot_product_attention
        call(q, k, k, cache=None, scale=0.1, mask="causal")
        call(q, k, k, cache=None, scale=0.1, mask=None)
        call(q, k, k, cache=None, scale=0.1, mask="chunked")  # a mask string we do not know
    assert llama.scaled_dot_product_attention is before
    assert ours == ["causal", None] and [kw["mask"] for kw in theirs] == ["chunked"]
