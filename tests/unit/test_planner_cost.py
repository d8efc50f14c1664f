"""Roofline cost model: exact predictions for hand-computed layouts."""

import pytest

from thunderpool.errors import ThunderpoolError
from thunderpool.planner.cost import LinkSpec, NodeSpec, Stage, predict, shares
from thunderpool.planner.spec import model_spec_from_config

GiB = 2**30

# 8 layers, 8 heads / 8 KV heads of 64, a tiny vocabulary so the head is negligible.
CONFIG = {
    "model_type": "llama",
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "intermediate_size": 1024,
    "vocab_size": 64,
    "tie_word_embeddings": True,
}


def node(name, bw=100e9, flops=1e15):
    return NodeSpec(name, 64 * GiB, 60 * GiB, bw, flops)


def test_single_node_decode_is_bytes_over_bandwidth():
    spec = model_spec_from_config(CONFIG)
    nodes = {"a": node("a")}
    pred = predict(spec, [Stage(("a",), (0, 8), (1.0,))], nodes, [], prompt_tokens=16)
    kv = 16 * spec.kv_bytes_per_token_per_layer * 8
    expect = (spec.active_bytes_per_token + kv) / 100e9
    assert pred.breakdown.memory_s == pytest.approx(expect, rel=1e-12)
    assert pred.breakdown.collective_s == 0 and pred.breakdown.compute_s == 0
    assert pred.decode_tps == pytest.approx(1 / expect, rel=1e-12)
    assert pred.collectives_per_token == 0


def test_tp_pays_two_ring_all_reduces_per_layer():
    spec = model_spec_from_config(CONFIG)
    nodes = {"a": node("a"), "b": node("b")}
    link = LinkSpec("a", "b", 1e-3, 1e9, "ethernet")
    pred = predict(spec, [Stage(("a", "b"), (0, 8), (1.0, 1.0))], nodes, [link], prompt_tokens=16)
    # Ring over 2 ranks: (2*1/2) * 1024 B / 1e9 + 2 * 1 ms, 16 times, plus the leader's
    # 512-byte command all_sum once per step.
    assert pred.collectives_per_token == 16 + 1
    expected = 16 * (1024 / 1e9 + 2e-3) + (512 / 1e9 + 2e-3)
    assert pred.breakdown.collective_s == pytest.approx(expected, rel=1e-12)


def test_pp_pays_one_hop_per_boundary_including_the_return():
    spec = model_spec_from_config(CONFIG)
    nodes = {"a": node("a"), "b": node("b"), "c": node("c")}
    links = [
        LinkSpec("a", "b", 1e-3, 1e9, "ethernet"),
        LinkSpec("b", "c", 2e-3, 1e9, "ethernet"),
        LinkSpec("c", "a", 4e-3, 1e9, "ethernet"),
    ]
    stages = [
        Stage((n,), (2 * i, 2 * i + 2 + (2 if n == "c" else 0)), (1.0,))
        for i, n in enumerate("abc")
    ]
    pred = predict(spec, stages, nodes, links, prompt_tokens=16)
    assert pred.collectives_per_token == 3 + 1
    # Three hops, plus the command all_sum paced by the ring's slowest link (c-a, 4 ms).
    control = links[2].all_reduce_s(512, 3)
    assert pred.breakdown.collective_s == pytest.approx(7e-3 + 3 * 1024 / 1e9 + control, rel=1e-12)
    # Stages run one after another: memory time is the whole model at one node's bandwidth.
    single = predict(spec, [Stage(("a",), (0, 8), (1.0,))], nodes, [], prompt_tokens=16)
    assert pred.breakdown.memory_s == pytest.approx(single.breakdown.memory_s, rel=1e-12)


def test_uneven_tp_step_is_set_by_the_slowest_rank():
    spec = model_spec_from_config(CONFIG)
    nodes = {"fast": node("fast", bw=300e9), "slow": node("slow", bw=100e9)}
    link = LinkSpec("fast", "slow", 0.0, 1e12, "rdma")
    even = Stage(("fast", "slow"), (0, 8), (1.0, 1.0))
    weighted = Stage(("fast", "slow"), (0, 8), (3.0, 1.0))
    assert [s.q for s in shares(spec, weighted)] == [6 / 8, 2 / 8]
    p_even = predict(spec, [even], nodes, [link], prompt_tokens=1)
    p_weighted = predict(spec, [weighted], nodes, [link], prompt_tokens=1)
    assert p_weighted.decode_tps > 1.5 * p_even.decode_tps


def test_compute_bound_prefill_uses_flops():
    spec = model_spec_from_config(CONFIG)
    nodes = {"a": node("a", bw=1e15, flops=1e9)}
    pred = predict(spec, [Stage(("a",), (0, 8), (1.0,))], nodes, [], prompt_tokens=100)
    attn = 4 * 8 * 64 * 50 * 8  # QK and AV over half the prompt on average
    flops = 100 * (2 * sum(spec.active_params_per_layer) + attn + 2 * 64 * 512)
    assert pred.ttft_s == pytest.approx(flops / 1e9, rel=1e-9)
    assert pred.prefill_tps == pytest.approx(100 / pred.ttft_s)


def test_missing_link_and_bad_node_are_named():
    spec = model_spec_from_config(CONFIG)
    nodes = {"a": node("a"), "b": node("b")}
    with pytest.raises(ThunderpoolError, match="no link between a and b"):
        predict(spec, [Stage(("a", "b"), (0, 8), (1.0, 1.0))], nodes, [])
    with pytest.raises(ThunderpoolError, match="'x' has mem_bw_Bps=0"):
        NodeSpec("x", GiB, GiB, 0, 1e12)
    with pytest.raises(ThunderpoolError, match="'carrier-pigeon'"):
        LinkSpec("a", "b", 1.0, 1.0, "carrier-pigeon")
