"""Weights over the fabric for hybrid TP×PP, on loopback: node a holds the model and runs
stage 0's TP group, node b lacks it and runs stage 1's. b fetches only its stage's layers,
TP-sliced over its group (no embedding, no other stage's layer), and the answer equals one
local rank's."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_trace, tiny_prompts
from test_fabric import loaded_bytes, pair, received  # noqa: F401  (pair: the two agents)

from thunderpool.cluster.coordinator import ClusterInstance
from thunderpool.cluster.shards import RankLayout, index_model, rank_pieces
from thunderpool.engine.job import RankJob, TraceTask

pytestmark = pytest.mark.timeout(600)


@pytest.mark.slow
def test_hybrid_stage_fetches_its_layers_tp_sliced_and_matches_one_rank(pair, tmp_path):  # noqa: F811
    model, _, b, coord = pair
    ref = run_trace(model, tmp_path / "ref.npz", 1, prompts=tiny_prompts(2), max_tokens=16)
    index = index_model(model)
    n = index.config["num_hidden_layers"]
    stage1 = [RankLayout(rank=r, world=2, parallel="tp", stage=1, stages=2) for r in (0, 1)]
    for layout in stage1:
        names = {p.name for p in rank_pieces(index, layout)}
        layers = {int(x.split(".")[2]) for x in names if x.startswith("model.layers.")}
        assert layers == set(range(n // 2, n))
        assert not any("embed_tokens" in x or x.startswith("lm_head") for x in names)
        assert "model.norm.weight" in names
    # Stage 0 keeps the embedding (vocabulary rows split) and the first half of the layers.
    first = {p.name: p for p in rank_pieces(index, RankLayout(rank=1, world=2, stage=0, stages=2))}
    assert first["model.embed_tokens.weight"].axis == 0 and "model.norm.weight" not in first
    task = TraceTask(
        prompts=tuple(map(tuple, tiny_prompts(2))), max_tokens=16, out=str(tmp_path / "h.npz")
    )
    job = RankJob(model_dir=str(model), world_size=4, parallel="hybrid", groups=(2, 2), task=task)
    before = received(b)
    with ClusterInstance(coord, coord.discover(), ["a", "a", "b", "b"], job, timeout=300) as inst:
        events = list(inst.events())
    np.testing.assert_array_equal(np.load(tmp_path / "h.npz")["tokens"], ref["tokens"])
    got = received(b) - before
    files = sum(p.stat().st_size for p in model.iterdir() if p.suffix == ".json")
    held = loaded_bytes(events, 2) + loaded_bytes(events, 3)
    # Its two ranks' slices of their stage and the config: no more, within 5%.
    assert 0 < got <= (held + files) * 1.05, (got, held)
