"""Seeded sampling: reproducible, seed-dependent, and the same whether sharded or not.

The single-rank traces share one launch (matrix_ranks.py), one after another: the second run
of the seed must not see the first's draws; the TP2 launch reproduces them in other processes.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from conftest import tiny_prompts
from matrix_ranks import run_traces

from thunderpool.engine.sampling import SamplingParams

HOT = SamplingParams(temperature=1.5, top_p=0.95, top_k=50, seed=11)


def test_seeded_sampling_is_reproducible_and_shard_invariant(tiny_models, tmp_path):
    common = {"model_dir": tiny_models["qwen3"], "prompts": tiny_prompts(2, seed=5)}
    runs = {
        "a": (1, HOT),
        "b": (1, HOT),
        "other": (1, replace(HOT, seed=12)),
        "greedy": (1, None),
        "tp2": (2, HOT),
    }
    cells = {
        i: {**common, "nodes": n, "max_tokens": 24, "sampling": s} for i, (n, s) in runs.items()
    }
    got = {i: trace["tokens"] for i, trace in run_traces(cells, tmp_path).items()}
    np.testing.assert_array_equal(got["a"], got["b"])
    np.testing.assert_array_equal(got["a"], got["tp2"])  # the leader samples; followers never draw
    assert (got["a"] != got["other"]).any()
    assert (got["a"] != got["greedy"]).any()
