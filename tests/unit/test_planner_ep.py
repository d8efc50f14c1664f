"""EP's cost beside TP's (planner/ep.py): the sampled load imbalance against its exact value,
and what EP changes about a TP plan on deepseek-v3:q4 over two M3 Ultras."""

from __future__ import annotations

import pytest

from thunderpool.planner.ep import expert_load, predict_ep
from thunderpool.planner.presets import parse_cluster
from thunderpool.planner.simulate import load_model, simulate


def test_expert_load_matches_the_exact_expectation():
    # 4 experts, 2 per token, 2 + 2 per rank: both routes on one rank with probability 1/3
    # (max 2), else one each (max 1): E[max] = 4/3 over a mean of 1.
    worst, mean = expert_load(4, 2, [2, 2], 1, [1.0, 1.0], samples=8000)
    assert worst == pytest.approx(4 / 3, abs=0.02)
    assert mean == pytest.approx(1.0, abs=1e-9)
    # A batch that touches every expert leaves no imbalance; a rank twice as fast halves its time.
    assert expert_load(4, 2, [2, 2], 64, [1.0, 1.0]) == pytest.approx((2.0, 2.0))
    assert expert_load(4, 2, [2, 2], 64, [2.0, 1.0]) == pytest.approx((2.0, 1.5))


def test_ep_beside_tp_on_two_m3_ultras():
    spec = load_model("deepseek-v3:q4")
    cluster = parse_cluster("2x m3-ultra-512@tb5-rdma")
    plan = next(p for p in simulate(spec, cluster) if p.kind == "tp" and len(p.nodes) == 2)
    nodes, links = cluster.specs()
    e = predict_ep(spec, plan.stages[0], nodes, links, 512, 1)
    assert e.tp.decode_tps == pytest.approx(plan.prediction.decode_tps)
    assert e.experts == (128, 128)
    # Same weights in all, moved between the ranks; here the same per rank too.
    assert sum(e.ep_weight_bytes) == pytest.approx(sum(e.tp_weight_bytes))
    # One token's 8 routes rarely split 4 + 4: the busier rank sets the pace.
    assert 1.1 < e.imbalance < 1.5
    assert e.ep.decode_tps < e.tp.decode_tps
    # A 512-token prefill touches every expert on both ranks: the same time.
    assert e.ep.prefill_tps == pytest.approx(e.tp.prefill_tps, rel=0.02)
    assert e.ep.collectives_per_token == e.tp.collectives_per_token


def test_place_offers_ep_beside_tp_and_the_coordinator_runs_it():
    from thunderpool.parallel.layout import Layout
    from thunderpool.planner.ep import ep_costs
    from thunderpool.planner.placement import _Needs, memory_use, place

    spec = load_model("deepseek-v3:q4")
    cluster = parse_cluster("2x m3-ultra-512@tb5-rdma")
    nodes, links = cluster.specs()
    plans = place(spec, nodes, links)
    ep = next(p for p in plans if p.kind == "ep" and len(p.nodes) == 2)
    tp = next(p for p in plans if p.kind == "tp" and p.nodes == ep.nodes)
    assert ep.experts == (128, 128) and "experts 128+128" in ep.reason
    e = predict_ep(spec, ep.stages[0], nodes, links, 512, 1)
    assert ep.prediction == e.ep
    # Memory: TP's, with each rank's channel slices of the experts swapped for whole ones.
    by_name = {n.name: n for n in nodes}
    used = memory_use(spec, ep.stages, by_name, _Needs(4096, 1, 2, 512))
    for n, tp_b, ep_b in zip(ep.nodes, e.tp_weight_bytes, e.ep_weight_bytes, strict=True):
        assert ep.memory_used[n] == int(used[n] - tp_b + ep_b)
        assert tp.memory_used[n] == used[n]
    assert ep_costs(spec, ep.stages[0], by_name, links, _Needs(4096, 1, 2, 512), used)[2] == (
        128,
        128,
    )
    assert ep.layout() == Layout("ep", ep.stages[0].tp_weights, expert_split=(128, 128))
    # A dense model gets no EP plans.
    assert not any(p.kind == "ep" for p in place(load_model("qwen3-4b"), nodes, links))


def test_measured_routing_prices_the_imbalance_and_replicas_relieve_it():
    """Qwen3-30B-A3B on 2 M3 Ultras: measured counts where experts 0-15 (all on rank 0) take
    60% of every MoE layer's routes make EP's slowest rank slower than uniform routing does;
    copying them onto rank 1 (plan_replicas) brings the imbalance back down, costs 16
    experts' bytes per layer on rank 1, and place() prices what predict_ep does."""
    from thunderpool.planner.placement import place
    from thunderpool.planner.replicas import plan_replicas

    spec = load_model("qwen3-30b-a3b")
    cluster = parse_cluster("2x m3-ultra-512@tb5-rdma")
    nodes, links = cluster.specs()
    plan = next(p for p in simulate(spec, cluster) if p.kind == "tp" and len(p.nodes) == 2)
    stage = plan.stages[0]
    moe = [i for i, b in enumerate(spec.expert_bytes_per_layer) if b]
    rest = 0.4 / (spec.experts - 16)
    hot = {i: (*[0.6 / 16] * 16, *[rest] * (spec.experts - 16)) for i in moe}
    uniform = predict_ep(spec, stage, nodes, links, 512, 4)
    measured = predict_ep(spec, stage, nodes, links, 512, 4, routing=hot)
    assert measured.imbalance > uniform.imbalance + 0.1
    assert measured.ep.decode_tps < uniform.ep.decode_tps
    replicas = plan_replicas(hot, list(measured.experts), 16)
    assert replicas == tuple((i, e, 1) for i in moe for e in range(16))
    relieved = predict_ep(spec, stage, nodes, links, 512, 4, routing=hot, replicas=replicas)
    assert relieved.imbalance < measured.imbalance
    per_expert = sum(spec.expert_bytes_per_layer) / spec.experts
    assert relieved.ep_weight_bytes[1] - measured.ep_weight_bytes[1] == pytest.approx(
        16 * per_expert
    )
    assert relieved.ep_weight_bytes[0] == measured.ep_weight_bytes[0]
    ep = next(
        p
        for p in place(spec, nodes, links, concurrency=4, routing=hot)
        if p.kind == "ep" and p.nodes == plan.nodes
    )
    assert ep.prediction.decode_tps == pytest.approx(measured.ep.decode_tps)


def test_route_counts_are_measured_at_the_experts(tmp_path):
    """parallel/routing.py counts k routes per token in every MoE layer of a tiny qwen3_moe,
    the same routes the router gives, and leaves the model as it was."""
    import sys
    from pathlib import Path

    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from conftest import make_tiny

    from thunderpool.engine.loader import build_lazy
    from thunderpool.parallel.routing import RoutingCounts, calibration_prompts, measure

    model_dir = make_tiny("qwen3_moe", tmp_path / "moe")
    model, config = build_lazy(model_dir)
    prompts = calibration_prompts(model_dir)[:3]
    before = model(mx.array([prompts[0]]))
    got = measure(model, config, prompts)
    n = sum(map(len, prompts))
    assert got.tokens == n and sorted(got.layers) == [0, 1, 2, 3] and got.top_k == 2
    assert all(sum(c) == 2 * n for c in got.layers.values())
    # The same counts from the router directly (layer 0's gate, top-2 of its logits).
    layer = model.layers[0]
    want = np.zeros(4, dtype=int)
    for ids in prompts:
        h = model.model.embed_tokens(mx.array([ids]))
        h = h + layer.self_attn(layer.input_layernorm(h), mask="causal")
        gates = layer.mlp.gate(layer.post_attention_layernorm(h))
        top = mx.argpartition(-gates, kth=1, axis=-1)[..., :2]
        want += np.bincount(np.array(top).reshape(-1), minlength=4)
    assert tuple(want) == got.layers[0]
    assert mx.array_equal(model(mx.array([prompts[0]])), before).item()
    path = tmp_path / "r.json"
    path.write_text(got.model_dump_json())
    assert RoutingCounts.read(path) == got


def test_replicate_experts_reads_the_counts_next_to_the_model(tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from conftest import make_tiny

    from thunderpool.cli import main
    from thunderpool.errors import ModelError
    from thunderpool.parallel.routing import ROUTING_FILE, RoutingCounts
    from thunderpool.planner.replicas import expert_replicas, plan_replicas

    model_dir = make_tiny("qwen3_moe", tmp_path / "moe")
    with pytest.raises(ModelError, match="thunderpool route-counts --model"):
        expert_replicas(model_dir, 2, 1)
    counts = RoutingCounts(
        model_type="qwen3_moe", experts=4, top_k=2, tokens=10, layers={1: (1, 2, 9, 8)}
    )
    (model_dir / ROUTING_FILE).write_text(counts.model_dump_json())
    # Expert 2 is the hottest of layer 1; it lives on rank 1, so its copy goes to rank 0.
    assert expert_replicas(model_dir, 2, 1) == ((1, 2, 0),)
    assert plan_replicas({1: counts.popularity(1)}, [2, 2], 1) == ((1, 2, 0),)
    assert main(["generate", "--replicate-experts", "1", "--prompt", "x"]) == 2
    assert "--replicate-experts copies experts for --parallel ep" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--parallel", "ep", "--nodes", "1", "--prompt", "x"],
        ["serve", "--parallel", "ep", "--nodes", "1"],
        ["bench", "--modes", "ep", "--nodes", "1"],
    ],
)
def test_replicate_experts_on_one_rank_is_refused(argv, capsys):
    # One rank has no other EP rank to copy experts to: refused before any model is read.
    from thunderpool.cli import main

    assert main([*argv, "--replicate-experts", "3"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--replicate-experts 3 copies experts between expert-parallel ranks" in err
    assert "--nodes 1 runs one rank" in err and "use --nodes 2 or more" in err


def test_replicate_experts_on_two_ranks_or_a_planned_cluster_passes_the_check():
    from argparse import Namespace

    from thunderpool.cli.flags import check_replication

    check_replication(Namespace(replicate_experts=1, nodes=None, cluster=False))  # 2 locally
    check_replication(Namespace(replicate_experts=1, nodes=2, cluster=False))
    check_replication(Namespace(replicate_experts=1, nodes=(1, 2)))  # bench's list
    check_replication(Namespace(replicate_experts=1, nodes=None, cluster=True))  # the planner's
    check_replication(Namespace(replicate_experts=None, nodes=1, cluster=False))
