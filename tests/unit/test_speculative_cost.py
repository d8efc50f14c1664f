"""The simulator's speculative-decoding model: expected tokens per verify step and the step's
price from the same cost model as plain decode."""

from __future__ import annotations

import pytest
from conftest import SMOLLM2

from thunderpool.bench.synthetic import PRESETS
from thunderpool.errors import ThunderpoolError
from thunderpool.planner.cost import Stage, kv_read_bytes, predict, shares
from thunderpool.planner.hardware import NodeSpec
from thunderpool.planner.presets import (
    live_op_latency_s,
    live_row_op_latency_s,
    live_row_read_fraction,
    parse_cluster,
    presets,
)
from thunderpool.planner.simulate import load_model, simulate
from thunderpool.planner.spec import model_spec_from_config
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


# --- the CPU's extra rows, fitted on two measured models (issue 28, docs/benchmarks.md §16) --

# step(rows) / step(1), measured on one rank of the 2-core VM, float32: SmolLM2's 8 batched
# streams at 93.0 tok/s against 24.0 for one; the 1.1 B verify of 5 positions at 204.8/206.8 ms
# against a plain step of 158.3/160.1 ms.
MEASURED = {"smollm2": 8 * 24.0 / 93.0, "1b": (204.8 + 206.8) / (158.3 + 160.1)}
ROWS = {"smollm2": (SMOLLM2, {"concurrency": 8}), "1b": (PRESETS["1b"], {"tokens_per_row": 5})}


def vm_ratio(model: str, chip: str = "cpu") -> float:
    """The simulator's step(rows) / step(1) on docs/simulator.md's node for this VM (22 GB/s,
    150 GFLOP/s, bench's 128-token prompt) with `chip`'s constants, as live agents take them."""
    config, rows = ROWS[model]
    spec = model_spec_from_config(config, dtype_bytes=4.0)
    vm = NodeSpec(
        "vm",
        24 * 10**9,
        24 * 10**9,
        22e9,
        150e9,
        op_latency_s=live_op_latency_s(chip),
        row_op_latency_s=live_row_op_latency_s(chip),
        row_read_fraction=live_row_read_fraction(chip),
    )
    stage, nodes = [Stage(("vm",), (0, spec.layers), (1.0,))], {"vm": vm}
    one = predict(spec, stage, nodes, [], prompt_tokens=128)
    many = predict(spec, stage, nodes, [], prompt_tokens=128, **rows)
    return one.decode_tps / many.decode_tps


@pytest.mark.parametrize("model", list(MEASURED))
def test_cpu_extra_rows_price_both_measured_models_within_10_percent(model):
    """One per-matmul constant could not fit both (it priced the 1.1 B verify at 1.10x); a
    share of the weights' read per extra row with it does."""
    assert vm_ratio(model) == pytest.approx(MEASURED[model], rel=0.10)


def test_metal_rows_read_the_weights_once():
    """The CPU's per-row read is assumed 0 on Metal: an 8-row step on a Mac preset still reads
    the weights once and adds only the rows' caches, as before the term."""
    cal = presets()["calibration"]["row_read_fraction"]
    assert cal["cpu"] > 0 and cal["m4"] == cal["m3-ultra"] == 0.0
    assert live_row_read_fraction("Apple M4 Max") == live_row_read_fraction("Apple M3 Ultra") == 0
    spec = load_model("qwen3-4b")
    for preset in ("m4-max-64", "m3-ultra-512"):
        (node,), _ = parse_cluster(preset).specs()
        stages, nodes = [Stage((node.name,), (0, spec.layers), (1.0,))], {node.name: node}
        one = predict(spec, stages, nodes, [])
        rows = predict(spec, stages, nodes, [], concurrency=8)
        kv = kv_read_bytes(spec, stages[0], shares(spec, stages[0])[0], 1, 512, 2.0)
        gap = rows.breakdown.memory_s - one.breakdown.memory_s
        assert gap == pytest.approx(7 * kv / node.mem_bw_Bps)
