"""The prefix cache on two real ranks (ring on loopback), TP and PP: requests that share a
prefix, batched together, a chat's second turn and, with a budget of one prompt, reuse after
eviction get exactly the greedy tokens of each request run alone on one rank without a cache.
Each rank keeps its own shard's KV; only the plan's entry ids cross the wire."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from batch_ranks import GREEDY, prefix_turns, run_ranks

from thunderpool.engine.control import Control
from thunderpool.engine.engine import Engine
from thunderpool.engine.loader import Layout, load_shard
from thunderpool.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def alone(tiny_models):
    """Greedy tokens of one prompt alone on one rank, without a prefix cache."""
    runner, _, _ = load_shard(Path(tiny_models["llama"]), mx.distributed.init(), Layout())

    def run(prompt: list[int]) -> list[int]:
        engine, out = Engine(runner, Control(runner.group), prefill_chunk=16), []
        engine.generate(prompt, SamplingParams(**GREEDY), lambda ev: out.append(ev.token))
        return out

    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel, budget, cached",
    [("tp", 4096, [0, 40, 48, 40]), ("pp", 70, [0, 40, 40, 40])],
    ids=["tp2", "pp2-evicting"],
)
def test_prefix_cache_on_two_ranks_equals_alone(
    tiny_models, alone, tmp_path, parallel, budget, cached
):
    requests = prefix_turns(alone)
    prompts = [r["prompt"] for r in requests]
    spec = {
        "model": str(tiny_models["llama"]),
        "parallel": parallel,
        "prefill_chunk": 16,
        "prefix_cache_tokens": budget,
        "requests": requests,
    }
    got = run_ranks(spec, tmp_path)["out"]
    assert [o["tokens"] for o in got] == [alone(p) for p in prompts]
    assert [o["cached"] for o in got] == cached
