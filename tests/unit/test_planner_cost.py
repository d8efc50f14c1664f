"""Roofline cost model: exact predictions for hand-computed layouts."""

import pytest

from thunderpool.errors import ThunderpoolError
from thunderpool.planner.cost import Stage, predict, shares
from thunderpool.planner.hardware import LinkSpec, NodeSpec
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
    # Ring over 2 ranks: (2*1/2) * 1024 B / 1e9 + 2 * 1 ms, 16 times and once more for the
    # split embedding's lookup; the split head's all_gather of 64 two-byte logits:
    # 1/2 * 128 B / 1e9 + 1 ms; plus the leader's 512-byte command all_sum once per step.
    assert pred.collectives_per_token == 16 + 2 + 1
    expected = 17 * (1024 / 1e9 + 2e-3) + (64 / 1e9 + 1e-3) + (512 / 1e9 + 2e-3)
    assert pred.breakdown.collective_s == pytest.approx(expected, rel=1e-12)


def test_each_tp_message_is_priced_on_the_link_slowest_for_its_size():
    """Three ranks: a-b a fast link with high latency, c joined by a slow one with low latency.
    The small all-reduces wait on a-b's latency, the logits' gather on c's bandwidth (pricing
    the gather on the latency-slowest link hid a 20 Mbit/s link from TP, islands apart)."""
    spec = model_spec_from_config({**CONFIG, "vocab_size": 49152})
    nodes = {n: node(n) for n in "abc"}
    fast = LinkSpec("a", "b", 1e-3, 1e9, "ethernet")
    slow = [LinkSpec(x, "c", 1e-5, 2.5e6, "ethernet") for x in "ab"]
    stage = Stage(("a", "b", "c"), (0, 8), (1.0, 1.0, 1.0))
    pred = predict(spec, [stage], nodes, [fast, *slow], prompt_tokens=16)
    step = 512 * 2  # one token's hidden state, 2 bytes each
    reduce = fast.all_reduce_s(step, 3)
    assert reduce > slow[0].all_reduce_s(step, 3)  # latency sets the small messages
    gather = slow[0].all_gather_s(49152 * 2, 3)
    assert gather > fast.all_gather_s(49152 * 2, 3)  # bandwidth sets the logits
    control = max(x.all_reduce_s(512, 3) for x in (fast, slow[0]))
    assert pred.breakdown.collective_s == pytest.approx(17 * reduce + gather + control, rel=1e-12)


def test_tp_splits_the_output_head_by_weight():
    """Each TP rank reads and holds its weight share of the (tied) vocabulary matrix, once;
    PP's first stage reads and holds it whole."""
    from thunderpool.planner.cost import head_share, read_bytes, weight_bytes

    spec = model_spec_from_config({**CONFIG, "vocab_size": 32000})
    stage = Stage(("a", "b"), (0, 8), (1.0, 3.0))
    a, b = shares(spec, stage)
    assert (head_share([stage], 0, a), head_share([stage], 0, b)) == (0.25, 0.75)
    pp = [Stage(("a",), (0, 4), (1.0,)), Stage(("b",), (4, 8), (1.0,))]
    whole = shares(spec, pp[0])[0]
    assert (head_share(pp, 0, whole), head_share(pp, 1, whole)) == (1.0, 0.0)
    layers = read_bytes(spec, stage, b, 0.0, 1)
    assert read_bytes(spec, stage, b, 0.75, 1) - layers == pytest.approx(
        spec.output_bytes * 0.75 + spec.norm_bytes
    )
    held = weight_bytes(spec, stage, b, 0.75) - weight_bytes(spec, stage, b, 0.0)
    assert spec.head_bytes == 0  # tied
    assert held == pytest.approx(0.75 * spec.embed_bytes + spec.norm_bytes)
    untied = model_spec_from_config({**CONFIG, "vocab_size": 32000, "tie_word_embeddings": False})
    held = weight_bytes(untied, stage, b, 0.75) - weight_bytes(untied, stage, b, 0.0)
    assert untied.head_bytes == untied.embed_bytes > 0
    assert held == pytest.approx(0.75 * 2 * untied.embed_bytes + untied.norm_bytes)


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


def test_rdma_all_reduce_is_one_mesh_round_plus_the_fixed_overhead():
    # MLX jaccl sends the whole buffer to every peer at once: one latency, and each rank's
    # n-1 copies of the bytes at one link's rate.
    rdma = LinkSpec("a", "b", 5e-6, 10e9, "rdma", overhead_s=4e-6)
    assert rdma.all_reduce_s(1e6, 2) == pytest.approx(4e-6 + 5e-6 + 1e6 / 10e9, rel=1e-12)
    assert rdma.all_reduce_s(1e6, 4) == pytest.approx(4e-6 + 5e-6 + 3e6 / 10e9, rel=1e-12)
    ring = LinkSpec("a", "b", 1e-3, 1e9, "ethernet", overhead_s=5e-5)
    assert ring.all_reduce_s(1024, 2) == pytest.approx(5e-5 + 1024 / 1e9 + 2e-3, rel=1e-12)
    assert ring.hop_s(1024) == pytest.approx(5e-5 + 1e-3 + 1024 / 1e9, rel=1e-12)


def test_dispatch_floor_does_not_shrink_with_tp():
    spec = model_spec_from_config(CONFIG)
    assert spec.matmuls_per_layer == (7,) * 8  # q, k, v, o, gate, up, down
    slow = NodeSpec("a", 64 * GiB, 60 * GiB, 100e9, 1e15, op_latency_s=10e-6)
    nodes = {"a": slow, "b": NodeSpec("b", 64 * GiB, 60 * GiB, 100e9, 1e15, op_latency_s=10e-6)}
    single = predict(spec, [Stage(("a",), (0, 8), (1.0,))], nodes, [], prompt_tokens=16)
    link = LinkSpec("a", "b", 0.0, 1e12, "rdma")
    tp = predict(spec, [Stage(("a", "b"), (0, 8), (1.0, 1.0))], nodes, [link], prompt_tokens=16)
    # 8 layers x 7 matmuls + the output head, 10 us each, on every rank whatever its share.
    assert single.breakdown.dispatch_s == pytest.approx(57 * 10e-6, rel=1e-12)
    assert tp.breakdown.dispatch_s == single.breakdown.dispatch_s
    assert tp.breakdown.memory_s < 0.6 * single.breakdown.memory_s
    step = sum((single.breakdown.memory_s, single.breakdown.compute_s, single.breakdown.dispatch_s))
    assert single.decode_tps == pytest.approx(1 / step, rel=1e-12)


def test_each_row_beyond_the_first_pays_its_own_cost_per_matmul():
    """A batched step (or a verify's positions) pays the fixed dispatch once and
    row_op_latency_s per matmul for every further row; rows read their own caches, the
    positions of one sequence read theirs once."""
    spec = model_spec_from_config(CONFIG)
    a = NodeSpec("a", 64 * GiB, 60 * GiB, 100e9, 1e15, op_latency_s=10e-6, row_op_latency_s=4e-6)
    stage = [Stage(("a",), (0, 8), (1.0,))]
    one = predict(spec, stage, {"a": a}, [], prompt_tokens=16)
    rows = predict(spec, stage, {"a": a}, [], prompt_tokens=16, concurrency=8)
    verify = predict(spec, stage, {"a": a}, [], prompt_tokens=16, tokens_per_row=8)
    # 57 llama-matmuls (8 layers x 7 + the head): 10 us once, then 4 us for each of 7 rows.
    assert rows.breakdown.dispatch_s == pytest.approx(57 * (10e-6 + 7 * 4e-6), rel=1e-12)
    assert verify.breakdown.dispatch_s == rows.breakdown.dispatch_s
    kv = 16 * spec.kv_bytes_per_token_per_layer * 8  # one sequence's cache, all layers
    weights = spec.active_bytes_per_token  # a dense model: the same bytes for any batch
    assert one.breakdown.memory_s == pytest.approx((weights + kv) / 100e9, rel=1e-12)
    assert rows.breakdown.memory_s == pytest.approx((weights + 8 * kv) / 100e9, rel=1e-12)
    assert verify.breakdown.memory_s == one.breakdown.memory_s
    assert rows.batch_tps == pytest.approx(8 * rows.decode_tps, rel=1e-12)
    # A few-row CPU product streams slower: each further row re-pays a share of the weights.
    cpu = NodeSpec("a", 64 * GiB, 60 * GiB, 100e9, 1e15, row_read_fraction=0.05)
    slow = predict(spec, stage, {"a": cpu}, [], prompt_tokens=16, tokens_per_row=8)
    assert slow.breakdown.memory_s == pytest.approx((weights * 1.35 + kv) / 100e9, rel=1e-12)


def test_unfused_mla_attention_reads_the_latent_twice_plus_scores():
    from dataclasses import replace

    spec = model_spec_from_config(CONFIG)
    nodes = {"a": node("a")}
    stage = [Stage(("a",), (0, 8), (1.0,))]
    fused = predict(spec, stage, nodes, [], prompt_tokens=1000)
    unfused = predict(replace(spec, attn_fused=False), stage, nodes, [], prompt_tokens=1000)
    cache = 1000 * spec.kv_bytes_per_token_per_layer * 8
    scores = 16 * 8 * 1000 * 8  # 2-byte scores, ~8 passes, per head per cached token per layer
    extra = (cache + scores) / 100e9
    assert unfused.breakdown.memory_s - fused.breakdown.memory_s == pytest.approx(extra, rel=1e-9)


@pytest.mark.parametrize(("hidden", "rate"), [(512, 0.5), (1024, 0.5**0.5), (2048, 1.0)])
def test_short_weight_rows_stream_at_the_measured_short_row_rate(hidden, rate):
    """Agents time GEMVs with rows of 512 and 4096 floats; a model's rows (its hidden size)
    stream at the short rate at 512, the full one from 2048, geometrically between."""
    spec = model_spec_from_config({**CONFIG, "hidden_size": hidden})
    stage = [Stage(("a",), (0, 8), (1.0,))]
    plain = predict(spec, stage, {"a": node("a")}, [], prompt_tokens=16)
    short = NodeSpec("a", 64 * GiB, 60 * GiB, 100e9, 1e15, short_row_mem_bw_Bps=50e9)
    slow = predict(spec, stage, {"a": short}, [], prompt_tokens=16)
    assert slow.breakdown.memory_s == pytest.approx(plain.breakdown.memory_s / rate, rel=1e-12)


# --- the fixed cost counted in kernels (planner/dispatch.py) and MoE prefill ---------------

QWEN3_MOE = {
    **CONFIG,
    "model_type": "qwen3_moe",
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
}
GLM = {
    **CONFIG,
    "model_type": "glm_moe_dsa",
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "first_k_dense_replace": 1,
    "index_n_heads": 4,
    "index_head_dim": 32,
}


def test_dispatch_counts_every_kernel_of_a_layer_in_llama_matmul_units():
    from thunderpool.planner import dispatch as d

    unit = d.REFERENCE_MATMULS / d.REFERENCE_KERNELS
    # A plain llama layer is the unit itself: its 7 matmuls.
    assert model_spec_from_config(CONFIG).dispatches_per_layer == pytest.approx((7.0,) * 8)
    wrap = 2 * d.BLOCK_WRAP
    moe = (wrap + d.GQA + d.QK_NORM + d.QWEN_ROUTER + d.EXPERTS) * unit
    assert model_spec_from_config(QWEN3_MOE).dispatches_per_layer == pytest.approx((moe,) * 8)
    # MLA: its 6 matmuls + the indexer's 3, unfused attention, the indexer's other kernels.
    mla = 6 + 3 + d.MLA_FIXED + d.UNFUSED_ATTENTION + d.INDEXER - 3
    dense = (wrap + mla + d.GLU) * unit
    routed = (wrap + mla + d.DEEPSEEK_ROUTER + d.EXPERTS + d.GLU + d.SHARED_ADD) * unit
    spec = model_spec_from_config(GLM)
    assert spec.matmuls_per_layer[:2] == (12, 16)  # 9 attention + GLU; + router, experts, shared
    assert spec.dispatches_per_layer == pytest.approx((dense,) + (routed,) * 7)


def test_dispatch_time_is_kernels_times_latency_and_compiled_counts_its_own():
    from thunderpool.planner import dispatch as d

    spec = model_spec_from_config(QWEN3_MOE)
    nodes = {n: NodeSpec(n, 64 * GiB, 60 * GiB, 100e9, 1e15, op_latency_s=10e-6) for n in "ab"}
    stage = [Stage(("a",), (0, 8), (1.0,))]
    eager = predict(spec, stage, nodes, [], prompt_tokens=16)
    compiled = predict(spec, stage, nodes, [], prompt_tokens=16, compiled=True)
    assert eager.breakdown.dispatch_s == pytest.approx(
        (sum(spec.dispatches_per_layer) + 1) * 10e-6, rel=1e-12
    )
    # Every layer routed: the fused attention with QK norms, the MoE block called whole.
    unit = d.REFERENCE_MATMULS / d.REFERENCE_KERNELS
    layer = (1 + d.FUSED_GQA + d.FUSED_QK_NORM + 2 + d.QWEN_ROUTER + d.EXPERTS) * unit
    assert compiled.breakdown.dispatch_s == pytest.approx((8 * layer + 1) * 10e-6, rel=1e-12)
    assert compiled.breakdown.dispatch_s < eager.breakdown.dispatch_s
    assert compiled.breakdown.memory_s == eager.breakdown.memory_s
    # A plain llama layer: 13 kernels on one rank; TP adds the two residual adds back.
    assert d.compiled_layer_kernels("llama", False, False) == pytest.approx(13 * unit)
    assert d.compiled_layer_kernels("llama", False, True) == pytest.approx(15 * unit)
    # Families without a compiled step keep their eager count.
    glm = model_spec_from_config(GLM)
    glm_stage = [Stage(("a",), (0, glm.layers), (1.0,))]
    a = predict(glm, glm_stage, nodes, [], prompt_tokens=16, compiled=True)
    assert a.breakdown == predict(glm, glm_stage, nodes, [], prompt_tokens=16).breakdown


def test_engine_and_planner_agree_on_what_compiles():
    from thunderpool.engine import compiled, fused
    from thunderpool.planner import dispatch as d

    assert d.COMPILED_FAMILIES == compiled.COMPILED_FAMILIES == fused.FAMILIES
    assert d.compiles("qwen3", "tp") and d.compiles("llama", "single")
    assert d.compiles("qwen3_moe", "pp") and not d.compiles("llama", "hybrid")
    assert not d.compiles("gemma3_text", "single")


@pytest.mark.parametrize("prompt", [256, 4096])
def test_moe_prefill_runs_expert_matmuls_at_their_rows_efficiency(prompt):
    from dataclasses import replace

    from thunderpool.planner import cost

    spec = model_spec_from_config(QWEN3_MOE)
    nodes = {"a": node("a", bw=1e15, flops=1e12)}  # compute-bound prefill
    stage = [Stage(("a",), (0, 8), (1.0,))]
    slow = predict(spec, stage, nodes, [], prompt_tokens=prompt)
    plain = predict(replace(spec, routed_active_per_layer=()), stage, nodes, [], prompt)
    chunk = min(prompt, cost.PREFILL_CHUNK)
    m, h = chunk * 4 / 16, cost.EXPERT_ROWS_HALF
    eff = (m / (m + h)) / (chunk / (chunk + h))
    assert cost.expert_efficiency(spec, prompt) == pytest.approx(eff, rel=1e-12)
    experts = 2 * prompt * 8 * (4 * 3 * 512 * 128)  # tokens x layers x routed params
    extra = experts * (1 / eff - 1) / 1e12
    assert slow.ttft_s - plain.ttft_s == pytest.approx(extra, rel=1e-9)
    dense = model_spec_from_config(CONFIG)
    assert cost.expert_efficiency(dense, prompt) == 1.0


def test_plans_record_the_compiled_step_and_price_its_kernels():
    from thunderpool.planner.presets import parse_cluster
    from thunderpool.planner.simulate import load_model, simulate

    spec, cluster = load_model("qwen3-4b"), parse_cluster("2x m3-ultra-512@tb5-rdma")
    plans = {(p.kind, len(p.nodes)): p for p in simulate(spec, cluster, compiled=True)}
    eager = {(p.kind, len(p.nodes)): p for p in simulate(spec, cluster)}  # the default
    assert all(plans[k].compiled for k in (("single", 1), ("tp", 2), ("pp", 2)))
    assert not any(p.compiled for p in eager.values())
    for key in (("single", 1), ("tp", 2), ("pp", 2)):
        a, b = plans[key].prediction, eager[key].prediction
        assert a.breakdown.dispatch_s < b.breakdown.dispatch_s and a.decode_tps > b.decode_tps
        assert a.breakdown.memory_s == b.breakdown.memory_s


def test_a_compiled_step_streams_at_the_split_rate_unless_its_rank_is_pinned():
    """engine/rowsplit.py: an unpinned rank's compiled step splits each product over its
    cores (split_mem_bw_Bps); eager steps, and ranks pinned to one core, do not."""
    spec = model_spec_from_config(CONFIG)
    split = dict(cores=2, host="h", core_mem_bw_Bps=50e9, split_mem_bw_Bps=160e9)
    nodes = {n: NodeSpec(n, 64 * GiB, 60 * GiB, 100e9, 1e15, **split) for n in "ab"}
    one = [Stage(("a",), (0, 8), (1.0,))]
    eager = predict(spec, one, nodes, [], prompt_tokens=16)
    compiled = predict(spec, one, nodes, [], prompt_tokens=16, compiled=True)
    assert compiled.breakdown.memory_s == pytest.approx(eager.breakdown.memory_s * 100 / 160)
    # Two ranks on the two cores of one machine: pinned, each at its core's rate either way.
    links = [LinkSpec("a", "b", 1e-6, 10e9, "ethernet")]
    two = [Stage(("a", "b"), (0, 8), (0.5, 0.5))]
    pinned = [predict(spec, two, nodes, links, prompt_tokens=16, compiled=c) for c in (0, 1)]
    assert pinned[0].breakdown.memory_s == pinned[1].breakdown.memory_s
