"""The compiled CPU step's arithmetic exp (engine/cpu_exp.py) against float64 references.

Expected: exp within 2e-7 relative of numpy's float64 exp from -87 to 88 (MLX's own exp is
within ~1e-6 there), exactly 0 below -87, finite above 88; SiLU and attention's softmax
within 1e-6 of float64; the same inside a compiled graph as outside; on by default on a CPU,
off with THUNDERPOOL_CPU_EXP=0, refused by name on a GPU and for a bad value. The compiled
step with it equals eager decode: tests/engine/test_compiled.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from thunderpool.engine import cpu_exp
from thunderpool.errors import ThunderpoolError


def test_exp_is_within_two_ulp_of_float64():
    x = mx.linspace(cpu_exp.LOW, cpu_exp.HIGH, 400_001)
    ref = np.exp(np.array(x).astype(np.float64))
    for fn in (cpu_exp.exp, mx.compile(cpu_exp.exp)):
        got = np.array(fn(x)).astype(np.float64)
        assert np.max(np.abs(got - ref) / ref) < 2e-7
    mine = np.max(np.abs(np.array(cpu_exp.exp(x)) - ref) / ref)
    theirs = np.max(np.abs(np.array(mx.exp(x)) - ref) / ref)
    assert mine <= theirs  # at least as close as MLX's own


def test_exp_edges_underflow_to_zero_and_stay_finite():
    x = mx.array([-1e30, -200.0, -87.5, 0.0, 88.0, 100.0, 1e30], mx.float32)
    got = np.array(cpu_exp.exp(x))
    assert got[0] == got[1] == got[2] == 0.0 and got[3] == 1.0
    assert np.isfinite(got).all() and got[4] == got[5] == got[6] > 1e38
    half = cpu_exp.exp(mx.array([0.5], mx.bfloat16))
    assert half.dtype == mx.bfloat16 and abs(half.item() - np.exp(0.5)) < 1e-2


def test_silu_and_attention_match_float64():
    rng = np.random.default_rng(0)
    g, u = rng.normal(0, 4, (5, 1000)), rng.normal(0, 1, (5, 1000))  # past SILU_VALUES
    ref = g / (1 + np.exp(-g)) * u
    got = np.array(cpu_exp.swiglu(mx.array(g, mx.float32), mx.array(u, mx.float32)))
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    scores = rng.normal(0, 3, (2, 4, 5, 300))
    scores[..., 250:] = np.finfo(np.float32).min  # masked positions weigh exactly nothing
    values = rng.normal(0, 1, (2, 4, 300, 8))
    e = np.exp(scores - scores.max(-1, keepdims=True))
    ref = (e / e.sum(-1, keepdims=True)) @ values
    got = cpu_exp.attend(mx.array(scores, mx.float32), mx.array(values, mx.float32))
    np.testing.assert_allclose(np.array(got), ref, rtol=1e-5, atol=1e-6)


def test_switch_defaults_on_a_cpu_and_refuses_a_gpu_or_bad_value(monkeypatch):
    monkeypatch.delenv("THUNDERPOOL_CPU_EXP", raising=False)
    assert cpu_exp.wanted()
    monkeypatch.setenv("THUNDERPOOL_CPU_EXP", "0")
    assert not cpu_exp.wanted()
    monkeypatch.setenv("THUNDERPOOL_CPU_EXP", "yes")
    with pytest.raises(ThunderpoolError, match="THUNDERPOOL_CPU_EXP='yes'"):
        cpu_exp.wanted()
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setenv("THUNDERPOOL_CPU_EXP", "auto")
    assert not cpu_exp.wanted()
    monkeypatch.setenv("THUNDERPOOL_CPU_EXP", "1")
    with pytest.raises(ThunderpoolError, match="GPU"):
        cpu_exp.wanted()
