"""The preloaded fast BLAS changes speed, not results: logits within 1e-4, same greedy tokens."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import run_trace, tiny_prompts

from thunderpool.launch.blas import blas_env, core_type, installed, passes_self_test


def test_core_type_from_cpu_flags():
    assert core_type("flags\t: fpu sse avx2 avx512f avx512bw avx512cd") == "SkylakeX"
    assert core_type("flags\t: fpu sse avx avx2 fma") == "Haswell"
    assert core_type("flags\t: fpu sse sse2") is None
    assert core_type("") is None


def test_blis_gets_threads_and_openblas_its_kernel_family(monkeypatch):
    monkeypatch.delenv("BLIS_NUM_THREADS", raising=False)
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    blis = blas_env("/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4")
    assert blis["LD_PRELOAD"].split() == [
        "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4",
        "/other.so",
    ]
    assert blis["BLIS_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))
    assert "OPENBLAS_CORETYPE" not in blis
    assert blis["OPENBLAS_NUM_THREADS"] == "1"  # numpy's own, beside BLIS's threads
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    assert "OPENBLAS_NUM_THREADS" not in blas_env(blis["LD_PRELOAD"].split()[0])
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Zen")  # the user's choice is kept
    openblas = blas_env("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
    assert "OPENBLAS_CORETYPE" not in openblas and "BLIS_NUM_THREADS" not in openblas


def test_a_library_that_cannot_load_fails_the_self_test(tmp_path):
    bogus = tmp_path / "libnot-a-blas.so"
    bogus.write_bytes(b"not an ELF file")
    assert not passes_self_test(blas_env(str(bogus)))


PROMPTS = tiny_prompts(2) + [list(range(200))]  # a long prompt: a real GEMM in prefill


@pytest.fixture(scope="module")
def bundled(tiny_models, tmp_path_factory) -> dict:
    """The reference every library compares with: TP2 ranks on the wheel's own BLAS."""
    out = tmp_path_factory.mktemp("bundled") / "r.npz"
    env = {"LD_PRELOAD": "", "OPENBLAS_CORETYPE": ""}
    return run_trace(tiny_models["qwen3"], out, 2, "tp", prompts=PROMPTS, env=env)


@pytest.mark.parametrize("library", installed() or [pytest.param("", marks=pytest.mark.skip)])
def test_each_fast_blas_matches_the_bundled_one(library, tiny_models, tmp_path, bundled):
    """Every library ranks may preload gives the bundled BLAS's logits and tokens."""
    env = blas_env(library)
    if not passes_self_test(env):
        pytest.skip(f"{library} does not pass the self-test here")
    fast = run_trace(tiny_models["qwen3"], tmp_path / "f.npz", 2, "tp", prompts=PROMPTS, env=env)
    np.testing.assert_array_equal(fast["tokens"], bundled["tokens"])
    np.testing.assert_allclose(fast["logits"], bundled["logits"], atol=1e-4, rtol=1e-4)
