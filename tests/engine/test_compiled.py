"""The compiled, fused decode step (engine/compiled.py, engine/fused.py) against the eager
one of the same model loaded with compile off (projections unfused), on the same scenario.

Expected: fp32 logits within 1e-5 at every step of a lone row, a left-padded batch of two
rows and the batch after one leaves (tests/engine/compiled_ranks.py), hence identical greedy
tokens; every step compiled, and through the fused forward, where the family is proven, none
where it is not (eager only, never approximately); the same for 4-bit weights (fused scales
and biases). TP2 and PP2 run the same on two ring ranks on loopback, each rank fusing its own shards
(TP) or layers (PP: a stage compiles its own layers; recv and send stay outside the graph).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from compiled_ranks import PHASES, WINDOWS, compare, fused
from families import make_family

from thunderpool.engine import compiled
from thunderpool.engine.loader import Layout, load_shard
from thunderpool.engine.runner import Runner
from thunderpool.errors import ThunderpoolError
from thunderpool.launch.local import free_ports

TOL = 1e-5
PROVEN = ("llama", "qwen2", "qwen3", "qwen3_moe")
TP2 = ("llama", "qwen3", "qwen3_moe")  # qwen3: uneven KV heads (3 on 2 ranks)
PP2 = ("llama", "qwen3_moe")  # qwen3_moe's stages: dense, then MoE layers
STEPS = sum(steps for _, _, steps in PHASES)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    return {kind: make_family(kind, root / kind) for kind in (*PROVEN, "gemma3_text")}


def check(result: dict, proven: bool, tol: float = TOL) -> None:
    eager, comp = result["eager"]["logits"], result["compiled"]["logits"]
    assert len(eager) == len(comp) == STEPS
    assert [len(rows) for rows in comp] == [1] * 3 + [2] * 4 + [1] * 3  # lone, batch, left
    for e, c in zip(eager, comp, strict=True):
        e, c = np.array(e), np.array(c)
        np.testing.assert_allclose(c, e, atol=tol, rtol=tol)
        assert (c.argmax(-1) == e.argmax(-1)).all()
    assert result["eager"]["compiled_steps"] == 0
    assert result["compiled"]["compiled_steps"] == (STEPS if proven else 0)
    # Verify windows: every position's logits, then the decode step after the trims.
    assert "windows" in result or not proven
    if "windows" not in result:
        return
    eager, comp = result["windows"]["eager"], result["windows"]["compiled"]
    assert len(eager["logits"]) == len(comp["logits"]) == 2 * len(WINDOWS)
    for e, c in zip(eager["logits"], comp["logits"], strict=True):
        e, c = np.array(e), np.array(c)
        np.testing.assert_allclose(c, e, atol=tol, rtol=tol)
        assert (c.argmax(-1) == e.argmax(-1)).all()
    assert eager["compiled_verifies"] == 0
    windows = len(WINDOWS) if result["compiles_windows"] else 0
    assert comp["compiled_verifies"] == windows


@pytest.mark.parametrize("kind", [*PROVEN, "gemma3_text"])
def test_one_rank_compiled_equals_eager(kind, family_dirs):
    group = mx.distributed.init()
    runner, _, _ = load_shard(family_dirs[kind], group, Layout(compile=True))
    reference, _, _ = load_shard(family_dirs[kind], group, Layout(compile=False))
    assert (runner.compiled is not None) == fused(runner) == (kind in PROVEN)
    result = compare(runner, reference)
    assert result["compiles_windows"] == (kind in PROVEN)  # verify windows compile too
    check(result, kind in PROVEN)


def test_compile_is_on_by_default_on_a_cpu_and_off_on_a_gpu(family_dirs, monkeypatch):
    """No GPU run has proven the compiled step equal to eager yet (scripts/gpu_check.py): on a
    GPU it runs only when asked for (--compile); --no-compile turns it off everywhere."""
    from thunderpool.cli import build_parser

    flags = [build_parser().parse_args(["generate", *f, "--prompt", "x"]).compile for f in
             ([], ["--compile"], ["--no-compile"])]  # fmt: skip
    assert flags == [None, True, False]
    assert [compiled.wanted(f) for f in flags] == [True, True, False]  # this CPU
    group = mx.distributed.init()
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert [compiled.wanted(f) for f in flags] == [False, True, False]
    runner, _, _ = load_shard(family_dirs["llama"], group, Layout())
    assert runner.compiled is None
    runner, _, _ = load_shard(family_dirs["llama"], group, Layout(compile=True))
    assert runner.compiled is not None


def test_a_step_in_another_thread_than_the_load_equals_eager(family_dirs):
    """serve and the API's local engine step in a thread of their own: nothing the compiled
    step built at load may be left lazy on the loading thread's stream."""
    group = mx.distributed.init()
    runner, _, _ = load_shard(family_dirs["llama"], group, Layout(compile=True))
    reference, _, _ = load_shard(family_dirs["llama"], group, Layout(compile=False))
    results: list = []
    worker = threading.Thread(target=lambda: results.append(compare(runner, reference)))
    worker.start()
    worker.join(timeout=120)
    assert results, "the step failed in its thread (see the thread's traceback above)"
    check(results[0], True)


def test_old_shapes_are_traced_again_and_still_equal(family_dirs, monkeypatch):
    """Only the most recently used shapes keep their compiled graph (each costs MiBs, and a
    long serve sees hundreds of shapes): with room for one, every change of batch or window
    shape traces afresh, and every step still equals eager."""
    monkeypatch.setenv("THUNDERPOOL_DECODE_GRAPHS", "1")
    group = mx.distributed.init()
    runner, _, _ = load_shard(family_dirs["llama"], group, Layout(compile=True))
    reference, _, _ = load_shard(family_dirs["llama"], group, Layout(compile=False))
    check(compare(runner, reference), True)
    assert runner.compiled.limit == 1 and len(runner.compiled._graphs) == 1
    for bad in ("0", "many"):
        monkeypatch.setenv("THUNDERPOOL_DECODE_GRAPHS", bad)
        with pytest.raises(ThunderpoolError, match=f"THUNDERPOOL_DECODE_GRAPHS='{bad}'"):
            load_shard(family_dirs["llama"], group, Layout(compile=True))
    shapes = 2 + 1 + 2 * len(WINDOWS)  # at least: lone/batch/left decode, each window + step
    assert runner.compiled.traces >= shapes, runner.compiled.traces


def test_fused_weights_are_views_and_unfused_compile_still_equal(family_dirs, monkeypatch):
    """The modules keep views of the fused arrays (one copy in memory); a model the fused
    forward does not take still compiles mlx-lm's own forward, equal to eager."""
    monkeypatch.setenv("THUNDERPOOL_KMAJOR", "0")  # MLX's layout: fused q|k|v (below: K-major)
    group = mx.distributed.init()
    runner, _, _ = load_shard(family_dirs["qwen2"], group, Layout(compile=True))
    layer, attn = runner.compiled.fused.layers[0], runner.model.layers[0].self_attn
    address = lambda a: np.asarray(a).__array_interface__["data"][0]  # noqa: E731
    q_bytes = attn.q_proj.weight.nbytes  # k's rows follow q's in the fused weight
    assert address(attn.k_proj.weight) == address(layer.qkv.weight) + q_bytes
    assert address(attn.q_proj.bias) == address(layer.qkv.bias)
    monkeypatch.setattr(compiled.fused, "build", lambda model, local=None, ways=1: None)
    runner, _, _ = load_shard(family_dirs["llama"], group, Layout(compile=True))
    reference, _, _ = load_shard(family_dirs["llama"], group, Layout(compile=False))
    assert runner.compiled is not None and not fused(runner)
    check(compare(runner, reference), True)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # qwen3: q/k norms between the parts
@pytest.mark.parametrize("ways", [1, 2, 3])
def test_products_split_over_streams_equal_eager(kind, ways, family_dirs, monkeypatch):
    """Each projection's and the head's rows in `ways` parts on their own CPU streams
    (engine/rowsplit.py; 3 leaves uneven parts): the same logits as eager, the parts views
    of the one weight (MLX's (out, in) layout: tests/engine/test_kmajor.py has the other)."""
    monkeypatch.setenv("THUNDERPOOL_DECODE_WAYS", str(ways))
    monkeypatch.setenv("THUNDERPOOL_KMAJOR", "0")
    group = mx.distributed.init()
    runner, _, _ = load_shard(family_dirs[kind], group, Layout(compile=True))
    reference, _, _ = load_shard(family_dirs[kind], group, Layout(compile=False))
    layer = runner.compiled.fused.layers[0]
    assert runner.ways == ways and len(layer.gate_up.parts) == (ways if ways > 1 else 0)
    assert (runner.head is not None) == (ways > 1)
    if ways > 1:
        address = lambda a: np.asarray(a).__array_interface__["data"][0]  # noqa: E731
        first = layer.qkv.parts[0].weight
        assert address(layer.qkv.parts[1].weight) == address(layer.qkv.weight) + first.nbytes
        rows = [p.weight.shape[0] for p in runner.head.parts]
        assert sum(rows) == runner.head.weight.shape[0] and min(rows) > 0
    check(compare(runner, reference), True)


@pytest.mark.parametrize("ways", [2, 3])
def test_attention_split_over_streams_equals_eager(ways, family_dirs, monkeypatch):
    """A long cache's keys in `ways` parts, each part's softmax merged by its max and sum
    (fused.FusedForward._attend; here from the first position on): the same logits."""
    from thunderpool.engine import fused as fused_module

    monkeypatch.setenv("THUNDERPOOL_DECODE_WAYS", str(ways))
    monkeypatch.setattr(fused_module, "SPLIT_KEYS", 0)
    group = mx.distributed.init()
    runner, _, _ = load_shard(family_dirs["qwen3"], group, Layout(compile=True))
    reference, _, _ = load_shard(family_dirs["qwen3"], group, Layout(compile=False))
    assert runner.compiled.fused.ways == ways
    check(compare(runner, reference), True)


@pytest.mark.parametrize("cpu_exp", ["0", "1"])
def test_softmax_and_silu_by_arithmetic_exp_equal_eager(cpu_exp, family_dirs, monkeypatch):
    """Attention's softmax and SwiGLU from the arithmetic exp (engine/cpu_exp.py; here from
    the first value on, by default from SOFTMAX_SCORES and SILU_VALUES), and with
    THUNDERPOOL_CPU_EXP=0 MLX's own: the same logits, decode and verify windows alike."""
    from thunderpool.engine import cpu_exp as cpu_exp_module

    monkeypatch.setenv("THUNDERPOOL_CPU_EXP", cpu_exp)
    monkeypatch.setattr(cpu_exp_module, "SOFTMAX_SCORES", 0)
    monkeypatch.setattr(cpu_exp_module, "SILU_VALUES", 0)
    group = mx.distributed.init()
    runner, _, _ = load_shard(family_dirs["qwen3"], group, Layout(compile=True))
    reference, _, _ = load_shard(family_dirs["qwen3"], group, Layout(compile=False))
    assert runner.compiled.fused.cpu == (cpu_exp == "1")
    check(compare(runner, reference), True)


def test_buffers_grow_finely_while_short_and_coarsely_past_1024():
    """The compiled step sizes each cache buffer to the step's multiple holding the next
    positions: mlx-lm's 256-position prefill buffer is cut to 64 for a short prompt, grows by
    64 to 1024 positions, then by 256."""
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 2, 10, 4)), mx.zeros((1, 2, 10, 4)))
    assert cache.keys.shape[2] == 256
    sizes = []
    for need in (11, 64, 65, 1024, 1025, 1300):
        compiled._reserve(cache, need)
        sizes.append(cache.keys.shape[2])
        assert cache.values.shape == cache.keys.shape
    assert sizes == [64, 64, 128, 1024, 1280, 1536]
    assert float(cache.keys[..., :10, :].sum()) == 0.0  # the written positions kept


def test_fused_quantized_equals_eager(family_dirs, monkeypatch):
    """4-bit llama: q|k|v and gate|up fused with their scales and biases, split in two."""
    monkeypatch.setenv("THUNDERPOOL_DECODE_WAYS", "2")
    monkeypatch.setenv("THUNDERPOOL_KMAJOR", "0")  # quantized after a first load, as floats
    group = mx.distributed.init()
    runners = []
    for compile in (True, False):
        loaded, _, _ = load_shard(family_dirs["llama"], group, Layout(compile=False))
        nn.quantize(loaded.model, group_size=32, bits=4)  # deterministic: alike both times
        mx.eval(loaded.model.parameters())  # as the loader leaves them: nothing lazy
        runners.append(Runner(loaded.model, group, None, compile=compile))
    assert fused(runners[0]) and "scales" in runners[0].model.layers[0].self_attn.q_proj
    assert len(runners[0].compiled.fused.layers[0].qkv.parts) == 2
    # Stepped in a thread of its own, as serve does: no part's scales left lazy on this one.
    results: list = []
    worker = threading.Thread(target=lambda: results.append(compare(*runners)))
    worker.start()
    worker.join(timeout=120)
    assert results, "the step failed in its thread (see the thread's traceback above)"
    check(results[0], True)


def test_no_compile_stays_eager(family_dirs):
    runner, _, _ = load_shard(family_dirs["llama"], mx.distributed.init(), Layout(compile=True))
    assert Runner(runner.model, runner.group, None, compile=False).compiled is None
    assert compiled.supports(runner.model)


@pytest.mark.slow
def test_tp2_and_pp2_compiled_equal_eager(family_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("THUNDERPOOL_DECODE_WAYS", "2")  # each rank splits its products too
    layouts = {
        "tp": {k: str(family_dirs[k]) for k in TP2},
        "pp": {k: str(family_dirs[k]) for k in PP2},
    }
    results = _run_ranks({"layouts": layouts}, 2, tmp_path)
    assert sorted(results) == sorted(f"{p}/{k}" for p, ks in layouts.items() for k in ks)
    for name, result in results.items():
        check(result, True)
        assert result["fused"]
        # Every product split in two, TP's o too: its rank's part, then the all_sum.
        tp = name.startswith("tp/")
        assert result["split"] == {"qkv": 2, "o": 2, "o_reduced": tp}


def _run_ranks(spec: dict, nodes: int, tmp: Path, timeout: float = 300.0) -> dict:
    script = Path(__file__).with_name("compiled_ranks.py")
    spec_file, out_file, hosts = tmp / "spec.json", tmp / "out.json", tmp / "hosts.json"
    spec_file.write_text(json.dumps(spec))
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(nodes)]))
    procs, logs = [], [tmp / f"rank{r}.log" for r in range(nodes)]
    try:
        for rank in range(nodes):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hosts)}
            with logs[rank].open("w") as log:
                cmd = [sys.executable, str(script), str(spec_file), str(out_file)]
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        codes = [p.wait(timeout=timeout) for p in procs]
        assert codes == [0] * nodes, "\n".join(f.read_text()[-3000:] for f in logs)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return json.loads(out_file.read_text())


def test_compiled_step_dispatches_fewer_kernels(family_dirs, monkeypatch):
    from thunderpool.bench.graph_ops import decode_step_ops

    monkeypatch.setenv("THUNDERPOOL_DECODE_WAYS", "1")
    monkeypatch.setenv("THUNDERPOOL_KMAJOR", "0")  # fused q|k|v (test_kmajor: the other layout)
    # MLX's exp, one kernel per SwiGLU as on a GPU, where dispatches count; the CPU's
    # arithmetic exp (engine/cpu_exp.py) spends a few more kernels to save the scalar exp.
    monkeypatch.setenv("THUNDERPOOL_CPU_EXP", "0")
    runner, _, _ = load_shard(family_dirs["llama"], mx.distributed.init(), Layout(compile=True))
    eager, comp = decode_step_ops(runner, False), decode_step_ops(runner, True)
    layers = len(runner.model.layers)
    matmuls = lambda ops: ops["by_op"].get("Matmul", 0) + ops["by_op"].get("AddMM", 0)  # noqa: E731
    # Per layer 7 weight matmuls and attention's 2 become 4 and 2; the head stays one.
    assert matmuls(eager) == 9 * layers + 1 and matmuls(comp) == 6 * layers + 1
    # Ops per token at least halved, kernels and graph nodes alike.
    assert 2 * comp["kernels"] <= eager["kernels"] and 2 * comp["total"] <= eager["total"]
    # Split in two, each of the 4 products per layer and the head is 2 matmuls and a concat.
    monkeypatch.setenv("THUNDERPOOL_DECODE_WAYS", "2")
    runner, _, _ = load_shard(family_dirs["llama"], mx.distributed.init(), Layout(compile=True))
    split = decode_step_ops(runner, True)
    assert matmuls(split) == 2 * layers + 2 * (4 * layers + 1)
    assert split["by_op"].get("Concatenate", 0) >= 4 * layers + 1
    assert 2 * split["kernels"] <= eager["kernels"]
