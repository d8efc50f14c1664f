"""Full forward == prefill + token-by-token decode with the KV cache, for each tiny model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_prefill_plus_decode_equals_full_forward(kind, tiny_models):
    model, _ = load_model(tiny_models[kind])
    seq = np.random.default_rng(3).integers(0, 256, 24).tolist()
    full = np.array(model(mx.array([seq]))[0].astype(mx.float32))
    cache = make_prompt_cache(model)
    prefill = np.array(model(mx.array([seq[:10]]), cache=cache)[0].astype(mx.float32))
    steps = [
        np.array(model(mx.array([[t]]), cache=cache)[0, 0].astype(mx.float32)) for t in seq[10:]
    ]
    got = np.concatenate([prefill, np.stack(steps)])
    np.testing.assert_allclose(got, full, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(got.argmax(-1), full.argmax(-1))
