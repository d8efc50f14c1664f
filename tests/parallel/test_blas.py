"""The preloaded fast BLAS changes speed, not results: logits within 1e-4, same greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_trace, tiny_prompts

from thunderpool.cluster.blas import core_type, fast_blas_env


def test_core_type_from_cpu_flags():
    assert core_type("flags\t: fpu sse avx2 avx512f avx512bw avx512cd") == "SkylakeX"
    assert core_type("flags\t: fpu sse avx avx2 fma") == "Haswell"
    assert core_type("flags\t: fpu sse sse2") is None
    assert core_type("") is None


@pytest.mark.skipif(not fast_blas_env(), reason="no optimized BLAS passed the self-test here")
def test_fast_blas_matches_the_bundled_one(tiny_models, tmp_path):
    prompts = tiny_prompts(2) + [list(range(200))]  # a long prompt: a real GEMM in prefill
    fast = run_trace(tiny_models["qwen3"], tmp_path / "f.npz", 2, "tp", prompts=prompts)
    ref = run_trace(
        tiny_models["qwen3"],
        tmp_path / "r.npz",
        2,
        "tp",
        prompts=prompts,
        env={"LD_PRELOAD": "", "OPENBLAS_CORETYPE": ""},
    )
    np.testing.assert_array_equal(fast["tokens"], ref["tokens"])
    np.testing.assert_allclose(fast["logits"], ref["logits"], atol=1e-4, rtol=1e-4)
