"""Input-major weights on a CPU rank (engine/kmajor.py) against MLX's own (out, in) layout.

Expected: with the projections stored (in, out) and few-row products split over 1-3 CPU
streams by input blocks, the compiled decode (lone row, left-padded batch, a row leaving) and
a multi-position verify give fp32 logits within 1e-5 of the same model loaded with
THUNDERPOOL_KMAJOR=0, eager, unsplit; hence the same greedy tokens. Each projection then holds
one copy of its matrix, shared by the module and the fused decode step. TP2 ranks run the
replaced sharded projections in the TP tests (tests/engine/test_compiled.py and the layout
tests compare them with one rank).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from compiled_ranks import compare
from families import make_family
from test_compiled import check

from thunderpool.engine import kmajor
from thunderpool.engine.loader import Layout, load_shard
from thunderpool.engine.projections import Joined

TOL = 1e-5
KINDS = ("llama", "qwen2", "qwen3")  # qwen2: biases; qwen3: q/k norms between the parts


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kmajor")
    return {kind: make_family(kind, root / kind) for kind in KINDS}


def _load(path, monkeypatch, kmajor_on: bool, ways: int, compile: bool):
    monkeypatch.setenv("THUNDERPOOL_KMAJOR", "1" if kmajor_on else "0")
    monkeypatch.setenv("THUNDERPOOL_DECODE_WAYS", str(ways))
    runner, _, _ = load_shard(path, mx.distributed.init(), Layout(compile=compile))
    return runner


def _address(a: mx.array) -> int:
    return np.asarray(a).__array_interface__["data"][0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ways", [1, 2, 3])
def test_input_major_decode_and_verify_equal_mlx_layout(kind, ways, family_dirs, monkeypatch):
    runner = _load(family_dirs[kind], monkeypatch, True, ways, compile=True)
    reference = _load(family_dirs[kind], monkeypatch, False, 1, compile=False)
    check(compare(runner, reference), True, TOL)
    tokens = mx.array([[3, 17, 42, 9, 11], [5, 8, 13, 21, 34]])  # 10 rows: split products
    got = runner.verify(tokens, runner.make_cache())
    want = reference.verify(tokens, reference.make_cache())
    np.testing.assert_allclose(np.array(got), np.array(want), atol=TOL, rtol=TOL)
    long = mx.array([list(range(1, 41))])  # 40 rows: one BLAS call per product
    got = runner.forward(long, runner.make_cache())
    want = reference.forward(long, reference.make_cache())
    np.testing.assert_allclose(np.array(got), np.array(want), atol=TOL, rtol=TOL)


def test_each_matrix_is_held_once_by_module_and_fused_step(family_dirs, monkeypatch):
    runner = _load(family_dirs["qwen2"], monkeypatch, True, 2, compile=True)
    layers = runner.model.model.layers
    attn, mlp = layers[0].self_attn, layers[0].mlp
    mods = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj]
    assert all(kmajor.is_kmajor(m) for m in [*mods, mlp.down_proj])
    assert all(kmajor.is_kmajor(layer.mlp.down_proj) for layer in layers)
    assert "bias" in attn.q_proj  # qwen2's q/k/v biases move with the module
    fused = runner.compiled.fused.layers[0]
    assert isinstance(fused.qkv, Joined) and isinstance(fused.gate_up, Joined)
    for m, p in zip(mods[:3], fused.qkv.members, strict=True):
        assert m.weight.shape == (p.weight.shape[1], p.weight.shape[0])  # reads as (out, in)
        assert _address(m.weight.T) == _address(p.weight)  # the same memory
        first = p.parts[0].weight
        assert _address(p.parts[1].weight) == _address(p.weight) + first.nbytes  # views


def test_a_bad_kmajor_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("THUNDERPOOL_KMAJOR", "yes")
    with pytest.raises(Exception, match="THUNDERPOOL_KMAJOR='yes'"):
        kmajor.wanted()
    monkeypatch.setenv("THUNDERPOOL_KMAJOR", "0")
    assert kmajor.wanted() is False


def test_input_major_weights_are_refused_on_a_gpu(monkeypatch):
    """Untested on a GPU: off there by default, and asking for them is refused by name."""
    monkeypatch.setattr(kmajor.mx, "default_device", lambda: mx.gpu)
    monkeypatch.delenv("THUNDERPOOL_KMAJOR", raising=False)
    assert kmajor.wanted() is False
    monkeypatch.setenv("THUNDERPOOL_KMAJOR", "1")
    with pytest.raises(Exception, match="THUNDERPOOL_KMAJOR=1 .* GPU"):
        kmajor.wanted()


def test_input_major_step_keeps_its_products_apart_and_splits_them(family_dirs, monkeypatch):
    """q, k, v and gate, up stay separate products (joining input-major matrices would copy
    the modules' column slices); still half the kernels of eager; split in two, each product
    is two matmuls (one per input block) and an add."""
    from thunderpool.bench.graph_ops import decode_step_ops

    monkeypatch.setenv("THUNDERPOOL_CPU_EXP", "0")  # MLX's one-kernel SwiGLU (test_compiled)
    runner = _load(family_dirs["llama"], monkeypatch, True, 1, compile=True)
    eager, comp = decode_step_ops(runner, False), decode_step_ops(runner, True)
    layers = len(runner.model.layers)
    matmuls = lambda ops: ops["by_op"].get("Matmul", 0) + ops["by_op"].get("AddMM", 0)  # noqa: E731
    assert matmuls(eager) == matmuls(comp) == 9 * layers + 1
    assert 2 * comp["kernels"] <= eager["kernels"]
    runner = _load(family_dirs["llama"], monkeypatch, True, 2, compile=True)
    split = decode_step_ops(runner, True)
    assert matmuls(split) == 2 * layers + 2 * (7 * layers + 1)
