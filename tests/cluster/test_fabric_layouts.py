"""Weights over the fabric for hybrid TP×PP and EP with copied experts, on loopback: node a
holds the models, node b lacks them. Hybrid: a runs stage 0's TP group and b stage 1's, for
which b fetches only its stage's layers TP-sliced over its group (no embedding, no other
stage's layer). EP: b fetches its own experts and the hot expert copied to it. Both answers
equal one local rank's."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_trace, tiny_prompts
from test_fabric import loaded_bytes, pair, received  # noqa: F401  (pair: the two agents)

from thunderpool.cluster.control.instance import ClusterInstance
from thunderpool.cluster.weights.pieces import RankLayout, rank_pieces
from thunderpool.cluster.weights.shards import geometry, index_model
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


@pytest.mark.slow
def test_ep2_with_a_hot_expert_copied_fetches_the_copy_and_matches_one_rank(
    pair,  # noqa: F811
    tiny_models,
    tmp_path,
):
    """--replicate-experts over the fabric: rank 1 (node b, without the model) also holds
    layer 0's expert 0, fetched with its own experts; the answer equals one rank's."""
    _, _, b, coord = pair
    model = tiny_models["qwen3_moe"]
    ref = run_trace(model, tmp_path / "ref.npz", 1, prompts=tiny_prompts(2), max_tokens=16)
    out = tmp_path / "ep.npz"
    task = TraceTask(prompts=tuple(map(tuple, tiny_prompts(2))), max_tokens=16, out=str(out))
    replicas = ((0, 0, 1),)  # (layer, expert, rank)
    job = RankJob(
        model_dir=str(model),
        world_size=2,
        parallel="ep",
        expert_split=(2, 2),
        expert_replicas=replicas,
        task=task,
    )
    index = index_model(model)
    plain = RankLayout(rank=1, world=2, parallel="ep", expert_split=(2, 2))
    copied = plain.model_copy(update={"expert_replicas": replicas})
    size = lambda layout: sum(geometry(p, index).size for p in rank_pieces(index, layout))  # noqa: E731
    files = sum(p.stat().st_size for p in model.iterdir() if p.suffix == ".json")
    before = received(b)
    with ClusterInstance(coord, coord.discover(), ["a", "b"], job, timeout=300) as inst:
        list(inst.events())
    got = np.load(out)
    np.testing.assert_array_equal(got["tokens"], ref["tokens"])
    np.testing.assert_allclose(got["logits"], ref["logits"], atol=1e-4)
    # More than its own experts' shard: the copy moved too, and nothing beyond it.
    fetched = received(b) - before
    assert size(plain) + files < fetched <= size(copied) + files, (fetched, size(plain))
