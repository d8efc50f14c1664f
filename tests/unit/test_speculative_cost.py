"""The simulator's speculative-decoding model: expected tokens per verify step and the step's
price from the same cost model as plain decode."""

from __future__ import annotations

import pytest

from thunderpool.errors import ThunderpoolError
from thunderpool.planner.cost import kv_read_bytes, predict, shares
from thunderpool.planner.presets import parse_cluster
from thunderpool.planner.simulate import load_model, simulate
from thunderpool.planner.speculative import expected_tokens, predict_speculative


def test_expected_tokens_per_verify_step():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    with pytest.raises(ValueError, match="1.5"):
        expected_tokens(1.5, 2)


@pytest.fixture(scope="module")
def tp4():
    cluster = parse_cluster("4x m3-ultra-512@tb5-rdma")
    spec = load_model("qwen3-235b-a22b:q8")
    plan = next(p for p in simulate(spec, cluster) if p.kind == "tp" and len(p.nodes) == 4)
    listed, links = cluster.specs()
    return spec, plan, {n.name: n for n in listed}, links


def test_a_verify_step_reads_the_weights_and_the_cache_once_for_k_plus_one_positions(tp4):
    spec, plan, nodes, links = tp4
    draft = load_model("qwen3-0.6b:q8")
    s = predict_speculative(spec, plan.stages, nodes, links, draft, 0.7, 4)
    assert s.plain_tps == pytest.approx(plan.prediction.decode_tps)
    verify = predict(spec, plan.stages, nodes, links, tokens_per_row=5)
    assert s.verify_s == pytest.approx(1 / verify.decode_tps)
    # Five rows would read five caches; five positions of one sequence read one.
    rows = predict(spec, plan.stages, nodes, links, concurrency=5)
    share = shares(spec, plan.stages[0])[0]
    kv = kv_read_bytes(spec, plan.stages[0], share, 1, 512, 2.0)
    bw = nodes[share.node].mem_bw_Bps
    assert rows.breakdown.memory_s - verify.breakdown.memory_s == pytest.approx(4 * kv / bw)
    assert rows.breakdown.dispatch_s == verify.breakdown.dispatch_s
    # One step costs more than a plain token (more experts read, k drafts) but less than k+1.
    assert 1 / s.plain_tps < s.verify_s < 5 / s.plain_tps
    assert s.decode_tps == pytest.approx(s.tokens_per_step / (4 * s.draft_s + s.verify_s))
    # A draft nobody accepts only costs time; one always accepted gains.
    assert predict_speculative(spec, plan.stages, nodes, links, draft, 0.0, 4).speedup < 1
    assert predict_speculative(spec, plan.stages, nodes, links, draft, 1.0, 4).speedup > 1


def test_an_mtp_draft_is_one_layer_of_the_model_with_its_head():
    """`simulate --draft mtp`: DeepSeek V3's MTP layer reads one MoE layer's active experts,
    eh_proj and the output head per draft token: far less than a separate 0.6B draft's
    28 layers cost, so the same acceptance buys more."""
    from thunderpool.planner.speculative import mtp_draft

    spec = load_model("deepseek-v3:q4")
    draft = mtp_draft(spec)
    eh = 2 * spec.hidden * spec.hidden * spec.head_bytes / (spec.vocab * spec.hidden)
    assert draft.layers == 1
    assert draft.total_bytes == pytest.approx(
        spec.bytes_per_layer[-1] + eh + spec.embed_bytes + spec.head_bytes + spec.norm_bytes
    )
    cluster = parse_cluster("4x m3-ultra-512@tb5-rdma")
    plan = next(p for p in simulate(spec, cluster) if p.kind == "tp" and len(p.nodes) == 4)
    listed, links = cluster.specs()
    nodes = {n.name: n for n in listed}
    mtp = predict_speculative(spec, plan.stages, nodes, links, draft, 0.85, 1)
    small = predict_speculative(
        spec, plan.stages, nodes, links, load_model("qwen3-0.6b:q8"), 0.85, 1
    )
    assert mtp.draft_s < small.draft_s / 2
    assert mtp.speedup > small.speedup > 1
    with pytest.raises(ThunderpoolError, match="kimi_k2 checkpoints do not ship"):
        mtp_draft(load_model("kimi-k2"))


def test_spec_rows_compare_with_the_best_one_node_plan_even_when_it_is_not_shown():
    """`simulate --spec-accept --top N` may list no one-node plan; the ratio is still against
    the best of all plans that fit one node, priced plainly."""
    from thunderpool.planner.speculative import spec_rows

    cluster = parse_cluster("m4-max-128+m3-ultra-256@tb5-rdma")
    spec, draft = load_model("qwen3-30b-a3b:q8"), load_model("qwen3-0.6b:q8")
    plans = simulate(spec, cluster)
    ones = [p for p in plans if len(p.nodes) == 1]
    shown = [p for p in plans if p.kind == "tp" and len(p.nodes) == 2]
    assert len(ones) == 2 and shown  # both nodes hold the model alone; neither is shown
    listed, links = cluster.specs()
    nodes = {n.name: n for n in listed}
    best = max(predict(spec, p.stages, nodes, links).decode_tps for p in ones)
    rows = spec_rows(spec, shown, plans, cluster, draft, 0.7, 2, 512)
    assert [r.kind for r in rows] == ["tp"] * len(shown)
    for r, p in zip(rows, shown, strict=True):
        s = predict_speculative(spec, p.stages, nodes, links, draft, 0.7, 2)
        assert r.baseline_tps == pytest.approx(best)
        assert r.vs_one_node == pytest.approx(s.decode_tps / best)


def test_an_ep_plan_is_priced_as_ep_with_and_without_the_draft():
    from thunderpool.planner.ep import predict_ep
    from thunderpool.planner.speculative import spec_rows

    cluster = parse_cluster("2x m3-ultra-512@tb5-rdma")
    spec, draft = load_model("qwen3-235b-a22b:q8"), load_model("qwen3-0.6b:q8")
    plans = simulate(spec, cluster)
    ep = next(p for p in plans if p.kind == "ep")
    tp = next(p for p in plans if p.kind == "tp" and p.stages == ep.stages)
    listed, links = cluster.specs()
    nodes = {n.name: n for n in listed}
    (row,) = spec_rows(spec, [ep], plans, cluster, draft, 0.8, 3, 512)
    stage, counts = ep.stages[0], list(ep.experts)
    plain = predict_ep(spec, stage, nodes, links, 512, 1, counts=counts).ep
    four = predict_ep(spec, stage, nodes, links, 512, 1, counts=counts, tokens_per_row=4).ep
    assert row.spec.plain_tps == pytest.approx(plain.decode_tps)
    assert row.spec.verify_s == pytest.approx(1 / four.decode_tps)
    assert row.spec.plain_tps != pytest.approx(tp.prediction.decode_tps, rel=0.01)


def test_a_tp_plan_prices_its_draft_sharded_where_that_is_faster(tp4):
    """A plain TP plan's separate draft runs as the draft's own TP step over the plan's nodes
    where that token is faster than the whole draft on the leader (engine/draft_load.py
    times both): over RDMA, a 4B draft's bytes outweigh its collectives, a 0.6B draft's do
    not. With shard_draft off (an MTP draft) the leader reads the whole draft alone."""
    from thunderpool.planner.cost import Stage

    spec, plan, nodes, links = tp4
    stage = plan.stages[0]
    for name, sharded_wins in (("qwen3-4b:q8", True), ("qwen3-0.6b:q8", False)):
        draft = load_model(name)
        tp = (Stage(stage.nodes, (0, draft.layers), stage.tp_weights),)
        alone = (Stage(stage.nodes[:1], (0, draft.layers), (1.0,)),)
        tp_s = 1 / predict(draft, tp, nodes, links).decode_tps
        alone_s = 1 / predict(draft, alone, nodes, links).decode_tps
        assert (tp_s < alone_s) is sharded_wins
        s = predict_speculative(spec, plan.stages, nodes, links, draft, 0.7, 4)
        assert s.draft_s == pytest.approx(min(tp_s, alone_s))
        whole = predict_speculative(
            spec, plan.stages, nodes, links, draft, 0.7, 4, shard_draft=False
        )
        assert whole.draft_s == pytest.approx(alone_s) and whole.verify_s == s.verify_s
