"""Seeded sampling: reproducible, seed-dependent, and the same whether sharded or not."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from conftest import run_trace, tiny_prompts

from thunderpool.engine.sampling import SamplingParams

HOT = SamplingParams(temperature=1.5, top_p=0.95, top_k=50, seed=11)


def test_seeded_sampling_is_reproducible_and_shard_invariant(tiny_models, tmp_path):
    model = tiny_models["qwen3"]
    prompts = tiny_prompts(2, seed=5)
    kw = {"prompts": prompts, "max_tokens": 24}
    a = run_trace(model, tmp_path / "a.npz", 1, sampling=HOT, **kw)["tokens"]
    b = run_trace(model, tmp_path / "b.npz", 1, sampling=HOT, **kw)["tokens"]
    other = run_trace(model, tmp_path / "c.npz", 1, sampling=replace(HOT, seed=12), **kw)["tokens"]
    tp2 = run_trace(model, tmp_path / "d.npz", 2, "tp", sampling=HOT, **kw)["tokens"]
    greedy = run_trace(model, tmp_path / "e.npz", 1, **kw)["tokens"]
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, tp2)  # the leader samples; followers never draw
    assert (a != other).any()
    assert (a != greedy).any()
