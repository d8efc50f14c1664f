"""Hybrid TP×PP on real ranks: each stage a TP group in its own MLX ring world (loopback),
stages joined by our TCP hand-off, against the unsharded model.

Reference: mlx-lm's own model in this process, full forward of the whole sequence at every
step. Expected: identical greedy tokens and fp32 logits within 1e-4 (TP2×PP2 on tiny llama,
qwen3, whose 3 KV heads split 2+1 inside each group, and qwen3_moe; the embedded SmolLM2 in
stages of 18 and 12 layers against one rank); the uneven case (groups
2,1, layers 3+1, TP weights 2:1 in group 0) under continuous batching with the prefix
cache gets each request's tokens alone on one rank, and the cache's hits. Four ranks share
two cores here, so the traces are short.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from batch_ranks import run_ranks
from conftest import greedy_full_forward, run_trace, tiny_prompts
from mlx_lm.utils import load_model

from thunderpool.engine.control import Control
from thunderpool.engine.engine import Engine
from thunderpool.engine.loader import Layout, describe_layout, load_shard, preflight
from thunderpool.engine.sampling import SamplingParams
from thunderpool.errors import ThunderpoolError
from thunderpool.models.families import VERIFIED

STEPS = 6
TOL = 1e-4
PROMPTS = tiny_prompts()
# family -> (groups, layer_split) of its trace cell; the batch cell is llama's uneven one.
CELLS = {"llama": ((2, 2), None), "qwen3": ((2, 2), (3, 1)), "qwen3_moe": ((2, 2), None)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", CELLS)
def test_hybrid_matches_unsharded(kind, tiny_models, tmp_path):
    groups, split = CELLS[kind]
    want_tokens, want_logits = greedy_full_forward(tiny_models[kind], PROMPTS, STEPS)
    got = run_trace(
        tiny_models[kind],
        tmp_path / "t.npz",
        sum(groups),
        "hybrid",
        prompts=PROMPTS,
        max_tokens=STEPS,
        prefill_chunk=16,  # the long prompt prefills in chunks
        groups=groups,
        layer_split=split,
    )
    np.testing.assert_array_equal(got["tokens"], want_tokens)
    np.testing.assert_allclose(got["logits"], want_logits, atol=TOL, rtol=TOL)
    loaded = sorted(
        (e.event for e in got["events"] if e.event["kind"] == "loaded"), key=lambda e: e["rank"]
    )
    assert {e["method"] for e in loaded} == {"hybrid"}
    bounds = [tuple(e["layers"]) for e in loaded]
    first = (0, split[0]) if split else (0, 2)
    assert bounds == [first] * groups[0] + [(first[1], 4)] * groups[1]
    # Each group holds a strict part of its stage: no rank holds the whole model.
    one = sum(v.nbytes for v in _params(tiny_models[kind]))
    assert max(e["param_bytes"] for e in loaded) < one * 0.75


@pytest.mark.slow
def test_the_embedded_model_in_uneven_stages_matches_one_rank(tmp_path):
    """SmolLM2: 3 KV heads split 2+1 in each group, tied embedding split over group 0,
    stages of 18 and 12 layers."""
    from thunderpool.models.source import resolve_model

    model = resolve_model(None, progress=False)
    prompts = tiny_prompts(2)
    one = run_trace(model, tmp_path / "one.npz", 1, prompts=prompts, max_tokens=STEPS)
    got = run_trace(
        model,
        tmp_path / "h.npz",
        4,
        "hybrid",
        prompts=prompts,
        max_tokens=STEPS,
        groups=(2, 2),
        layer_split=(18, 12),
    )
    np.testing.assert_array_equal(got["tokens"], one["tokens"])
    np.testing.assert_allclose(got["logits"], one["logits"], atol=TOL, rtol=TOL)
    loaded = sorted(
        (e.event for e in got["events"] if e.event["kind"] == "loaded"), key=lambda e: e["rank"]
    )
    assert [tuple(e["layers"]) for e in loaded] == [(0, 18)] * 2 + [(18, 30)] * 2


def _params(model_dir: Path):
    from mlx.utils import tree_flatten

    model, _ = load_model(model_dir)
    return [v for _, v in tree_flatten(model.parameters())]


MAX_TOKENS = 5
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS}


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.mark.slow
def test_uneven_hybrid_batched_with_prefix_cache_equals_alone(tiny_models, tmp_path):
    runner, _, _ = load_shard(Path(tiny_models["llama"]), mx.distributed.init(), Layout())

    def alone(prompt: list[int]) -> list[int]:
        engine, out = Engine(runner, Control(runner.group), prefill_chunk=16), []
        engine.generate(prompt, SamplingParams(**GREEDY), lambda ev: out.append(ev.token))
        return out

    shared = _tokens(40, 1)
    first = shared + _tokens(8, 2)
    turn2 = first + alone(first) + _tokens(5, 3)
    prompts = [first, shared + _tokens(11, 4), turn2]
    requests = [
        {"prompt": prompts[0], "params": GREEDY},
        {"prompt": prompts[1], "params": GREEDY},  # batched with request 0
        {"prompt": prompts[2], "params": GREEDY, "after": [0, MAX_TOKENS]},  # turn 2
    ]
    spec = {
        "model": str(tiny_models["llama"]),
        "parallel": "hybrid",
        "groups": [2, 1],
        "layer_split": [3, 1],
        "tp_weights": [2, 1, 1],  # group 0: MLP channels 2:1 (heads stay whole KV groups)
        "prefill_chunk": 16,
        "prefix_cache_tokens": 4096,
        "requests": requests,
    }
    got = run_ranks(spec, tmp_path)
    assert [o["tokens"] for o in got["out"]] == [alone(p) for p in prompts]
    assert [o["cached"] for o in got["out"]] == [0, 40, 48]
    assert got["left"] == [[], True, 0]


def test_layout_checks_and_description(tiny_models):
    llama = tiny_models["llama"]
    layout = Layout("hybrid", tp_weights=(2, 1, 1), layer_split=(3, 1), groups=(2, 1))
    config = preflight(llama, 3, layout)
    described = describe_layout(config, layout, 3)
    assert described["groups"] == [2, 1]
    assert [(r["stage"], r["layers"], r["heads"]["q"]) for r in described["ranks"]] == [
        (0, [0, 3], [0, 4]),  # weights 2:1 of 2 KV heads: one KV group (4 query heads) each
        (0, [0, 3], [4, 8]),
        (1, [3, 4], [0, 8]),
    ]
    with pytest.raises(ThunderpoolError, match="--tp-weights has 2 parts for the 3 ranks"):
        preflight(llama, 3, Layout("hybrid", tp_weights=(1, 1), groups=(2, 1)))
    with pytest.raises(ThunderpoolError, match="at least two TP groups"):
        preflight(llama, 2, Layout("hybrid", groups=(2,)))


def test_what_hybrid_does_not_run_yet_is_refused_before_a_rank_starts():
    from thunderpool.cli import main
    from thunderpool.engine.job import RankJob, TraceTask

    task = TraceTask(prompts=((1, 2),), out="unused.npz")
    fields = {"model_dir": "m", "world_size": 3, "parallel": "hybrid", "task": task}
    with pytest.raises(ValueError, match="speculative decoding does not run on hybrid"):
        RankJob(**fields, groups=(2, 1), draft_model="draft")
    with pytest.raises(ValueError, match="expert parallelism does not run inside hybrid"):
        RankJob(**fields, groups=(2, 1), expert_split=(2, 2))
    with pytest.raises(ValueError, match="must add up to world_size 3"):
        RankJob(**fields, groups=(1, 1))
    argv = ["generate", "--parallel", "hybrid", "--groups", "1,1", "--prompt", "x"]
    assert main([*argv, "--draft-model", "d"]) == 2
    assert main([*argv, "--backend", "mpi"]) == 2
    assert main(["generate", "--groups", "1,1", "--prompt", "x"]) == 2


def test_verified_hybrid_is_what_this_file_proves():
    assert {k for k, v in VERIFIED.items() if "hybrid" in v} == set(CELLS)


@pytest.mark.slow
def test_a_lost_stage_stops_every_world(tiny_models, tmp_path):
    """Killing the later stage's rank mid-decode stops the instance (both worlds) with the
    lost rank named; stage 0's rank, left reading a closed hand-off, raises too."""
    import os
    import signal

    from thunderpool.engine.job import RankJob, TraceTask
    from thunderpool.errors import LaunchError
    from thunderpool.launch.local import LocalInstance

    task = TraceTask(prompts=(tuple(PROMPTS[0]),), max_tokens=5000, out=str(tmp_path / "t.npz"))
    job = RankJob(
        model_dir=str(tiny_models["llama"]),
        world_size=2,
        parallel="hybrid",
        groups=(1, 1),
        task=task,
    )
    with LocalInstance(job, timeout=120) as inst, pytest.raises(LaunchError) as err:
        loaded = 0
        for ev in inst.events():
            loaded += ev.event["kind"] == "loaded"
            if loaded == 2:
                os.kill(inst.procs[1].pid, signal.SIGKILL)
                loaded += 1
    assert "rank 1 was killed by signal 9" in str(err.value)
    assert all(p.poll() is not None for p in inst.procs)
