"""Placement: only plans that fit, ranked by predicted decode speed, refusals that say why."""

from dataclasses import replace

import pytest

from thunderpool.planner.cost import Stage, predict
from thunderpool.planner.hardware import LinkSpec, NodeSpec
from thunderpool.planner.placement import PlacementError, explain, place
from thunderpool.planner.spec import kv_element_bytes, model_spec_from_config

GiB = 2**30

# Llama-3-8B shapes at bf16: 8,030,261,248 parameters, ~15 GiB of weights.
LLAMA_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def spec():
    s = model_spec_from_config(LLAMA_8B)
    assert s.params == 8_030_261_248
    return s


def mac(name, avail_gib=48, bw=400e9):
    return NodeSpec(name, 64 * GiB, avail_gib * GiB, bw, 30e12, 2 * GiB)


def check_fits(plans, nodes):
    avail = {n.name: n.available_bytes for n in nodes}
    for plan in plans:
        for name, used in plan.memory_used.items():
            assert used <= avail[name]
            assert plan.memory_free[name] == avail[name] - used >= 0


def test_tp_wins_over_rdma(spec):
    nodes = [mac("a"), mac("b")]
    plans = place(spec, nodes, [LinkSpec("a", "b", 10e-6, 8e9, "rdma")])
    check_fits(plans, nodes)
    assert plans[0].kind == "tp" and plans[0].nodes == ("a", "b")
    # + the split embedding's all_sum, the split head's all_gather and the command all_sum
    assert plans[0].prediction.collectives_per_token == 2 * 32 + 3
    # Memory-bound decode nearly halves: each node reads half the layers.
    single = next(p for p in plans if p.kind == "single")
    assert plans[0].prediction.decode_tps > 1.6 * single.prediction.decode_tps
    text = explain(plans)
    assert text.startswith("winner: tp over a,b") and "67 collectives" in text and "rdma" in text


def test_tp_loses_across_a_slow_link(spec):
    nodes = [mac("a"), mac("b")]
    plans = place(spec, nodes, [LinkSpec("a", "b", 5e-3, 1e9, "ethernet")])
    check_fits(plans, nodes)
    assert plans[0].kind in ("single", "pp")
    assert plans[-1].kind == "tp"  # 64 all-reduces x 2 x 5 ms cost 640 ms per token
    assert "ethernet" in plans[-1].reason


def test_model_that_fits_only_on_two_nodes_is_split(spec):
    nodes = [mac("a", avail_gib=12), mac("b", avail_gib=12)]
    plans = place(spec, nodes, [LinkSpec("a", "b", 10e-6, 8e9, "rdma")])
    check_fits(plans, nodes)
    assert plans and {p.kind for p in plans} <= {"tp", "pp"}
    assert all(len(p.nodes) == 2 for p in plans)


def test_pp_moves_layers_off_a_node_that_is_full(spec):
    # b is 3x faster, so by bandwidth it would take 24 of 32 layers; it only has room for fewer.
    nodes = [mac("a", avail_gib=40, bw=100e9), mac("b", avail_gib=10, bw=300e9)]
    plans = place(spec, nodes, [LinkSpec("a", "b", 1e-3, 1e9, "ethernet")])
    check_fits(plans, nodes)
    pp = [p for p in plans if p.kind == "pp" and p.nodes == ("a", "b")]
    assert pp and sum(pp[0].layer_split) == 32 and pp[0].layer_split[1] < 24


def test_uneven_tp_weights_follow_bandwidth(spec):
    nodes = [mac("fast", bw=800e9), mac("slow", bw=400e9)]
    plans = place(spec, nodes, [LinkSpec("fast", "slow", 10e-6, 8e9, "rdma")])
    tp = next(p for p in plans if p.kind == "tp")
    assert tp.tp_weights == (800e9, 400e9)
    # 32 heads over 8 KV groups at 2:1 -> 5 and 3 KV groups: the fast node holds more weights.
    assert tp.memory_used["fast"] > tp.memory_used["slow"]


def test_refusal_states_missing_memory_and_fixes(spec):
    nodes = [mac("a", avail_gib=10)]
    with pytest.raises(PlacementError) as err:
        place(spec, nodes, [])
    text = str(err.value)
    # weights 14.96 GiB + KV 0.5 GiB + reserve 2 GiB = 17.46 GiB against 10 GiB.
    assert "7.5 GiB of memory is missing" in text
    assert "4-bit quantized model" in text and "one more node with at least 7.5 GiB free" in text


def test_refusal_suggests_a_shorter_context(spec):
    nodes = [mac("a", avail_gib=20)]
    with pytest.raises(PlacementError, match=r"a context of at most \d+ tokens"):
        place(spec, nodes, [], context_tokens=131072)
    plans = place(spec, nodes, [], context_tokens=8192)
    assert [p.kind for p in plans] == ["single"]


def test_kv_cache_grows_with_context_and_concurrency(spec):
    nodes = [mac("a")]
    base = place(spec, nodes, [], context_tokens=4096)[0].memory_used["a"]
    more = place(spec, nodes, [], context_tokens=4096, concurrency=4)[0].memory_used["a"]
    kv_token = 2 * 8 * 128 * 2 * 32  # K and V, 8 KV heads of 128, fp16, 32 layers
    act_logits = 3 * 128256 * 4  # three more sequences' fp32 logits
    assert more - base == 3 * 4096 * kv_token + act_logits


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_kv_cache_is_priced_per_element_with_its_scales(spec, bits):
    nodes = [mac("a")]
    plain = place(spec, nodes, [], context_tokens=4096)[0]
    element = kv_element_bytes(2.0, bits, 64)
    assert element == bits / 8 + 2 * 2 / 64  # the values, then a bf16 scale and bias per 64
    quant = place(spec, nodes, [], context_tokens=4096, kv_dtype_bytes=element)[0]
    elements = 2 * 8 * 128 * 32  # K and V, 8 KV heads of 128, 32 layers
    assert plain.kv_token_bytes == elements * 2
    assert quant.kv_token_bytes == elements * element  # 8 bits: 34,816 B; 4 bits: 18,432 B
    assert plain.memory_used["a"] - quant.memory_used["a"] == 4096 * elements * (2 - element)


def test_hybrid_tp_inside_rdma_groups_pp_between(spec):
    nodes = [mac(n, avail_gib=9) for n in "abcd"]
    links = [
        LinkSpec("a", "b", 10e-6, 8e9, "rdma"),
        LinkSpec("c", "d", 10e-6, 8e9, "rdma"),
        LinkSpec("b", "c", 200e-6, 1e9, "ethernet"),
        LinkSpec("a", "d", 200e-6, 1e9, "ethernet"),
    ]
    plans = place(spec, nodes, links)
    check_fits(plans, nodes)
    assert plans[0].kind == "hybrid"
    assert [s.nodes for s in plans[0].stages] in (
        [("a", "b"), ("c", "d")],
        [("c", "d"), ("a", "b")],
    )


def test_hybrid_islands_of_fast_links_without_rdma(spec):
    nodes = [mac(n, avail_gib=9) for n in "abcd"]
    fast = [LinkSpec(a, b, 50e-6, 1.2e9, "ethernet") for a, b in ("ab", "cd")]
    slow = [LinkSpec(a, b, 200e-6, 1e8, "ethernet") for a, b in ("ac", "ad", "bc", "bd")]
    hybrid = [p for p in place(spec, nodes, fast + slow) if p.kind == "hybrid"]
    assert {tuple(s.nodes for s in p.stages) for p in hybrid} == {
        (("a", "b"), ("c", "d")),
        (("c", "d"), ("a", "b")),
    }
    layout = hybrid[0].layout()
    assert layout.parallel == "hybrid" and layout.groups == (2, 2)
    assert sum(layout.layer_split) == spec.layers and len(layout.tp_weights) == 4
    # One class of links (all within ISLAND_RATIO of the slowest): no islands, no hybrid.
    even = [LinkSpec(a, b, 50e-6, 1e9, "ethernet") for a, b in ("ab", "cd", "ac", "ad", "bc", "bd")]
    assert all(p.kind != "hybrid" for p in place(spec, nodes, even))


def _box(name: str, host: str, avail_gb: float, cores: int = 2) -> NodeSpec:
    return NodeSpec(
        name=name,
        memory_bytes=int(64 * GiB),
        available_bytes=int(avail_gb * GiB),
        mem_bw_Bps=4e9,
        flops=5e10,
        host=host,
        cores=cores,
        host_mem_bw_Bps=5e9,
    )


def test_nodes_on_one_machine_share_its_memory_and_cores():
    spec = model_spec_from_config(LLAMA_8B)  # ~16 GB of bf16 weights
    loop = [LinkSpec(a, b, 2e-5, 5e9, "loopback") for a, b in (("x", "y"), ("y", "z"), ("x", "z"))]
    # Three agents on one 2-core box that has 12 GB free: each reports the same 12 GB.
    same = [_box(n, "box", 12) for n in "xyz"]
    with pytest.raises(PlacementError):
        place(spec, same, loop, context_tokens=1024)  # 16 GB never fits in one box's 12 GB
    # With 40 GB free, 2-rank plans fit, but no plan puts 3 busy-polling ranks on 2 cores.
    roomy = [_box(n, "box", 40) for n in "xyz"]
    plans = place(spec, roomy, loop, context_tokens=1024)
    assert plans and max(len(p.nodes) for p in plans) == 2
    # The same agents with host ids of their own (`node --host-id`: containers with their own
    # cpusets and memory) are separate machines: 3-rank plans are offered.
    apart = [_box(n, f"box-{n}", 40) for n in "xyz"]
    assert max(len(p.nodes) for p in place(spec, apart, loop, context_tokens=1024)) == 3


def test_co_located_tp_ranks_split_the_host_bandwidth():
    spec = model_spec_from_config(LLAMA_8B)
    link = [LinkSpec("x", "y", 2e-5, 5e9, "loopback")]
    shared = [_box("x", "box", 40), _box("y", "box", 40)]
    apart = [_box("x", "box1", 40), _box("y", "box2", 40)]
    tp = [Stage(("x", "y"), (0, spec.layers), (1.0, 1.0))]
    on_one = predict(spec, tp, {n.name: n for n in shared}, link)
    on_two = predict(spec, tp, {n.name: n for n in apart}, link)
    # Two ranks on one box each stream at 5e9 / 2 instead of 4e9: memory time grows by 1.6x.
    assert on_one.breakdown.memory_s == pytest.approx(on_two.breakdown.memory_s * 1.6, rel=1e-9)


def test_co_located_pp_stages_run_at_the_pinned_core_rates():
    """Two stages on one 2-core box are pinned to a core each, so each runs at what one core
    with one BLAS thread reaches, not at the whole machine's rate (they take turns)."""
    spec = model_spec_from_config(LLAMA_8B)
    link = [LinkSpec("x", "y", 2e-5, 5e9, "loopback")]
    half = spec.layers // 2
    pp = [Stage(("x",), (0, half), (1.0,)), Stage(("y",), (half, spec.layers), (1.0,))]
    pinned = {"core_mem_bw_Bps": 1e9, "core_flops": 1e10}
    shared = {n: replace(_box(n, "box", 40), **pinned) for n in "xy"}
    apart = {n: replace(_box(n, f"box-{n}", 40), **pinned) for n in "xy"}
    on_one, on_two = predict(spec, pp, shared, link), predict(spec, pp, apart, link)
    assert on_one.breakdown.memory_s == pytest.approx(on_two.breakdown.memory_s * 4, rel=1e-9)
    assert on_one.ttft_s > 4 * on_two.ttft_s  # prefill: 5e10 -> 1e10 FLOP/s (links alike)
    # More ranks than cores: nothing is pinned, each stage keeps the machine's rates.
    three = {**shared, "z": replace(_box("z", "box", 40), **pinned)}
    loops = link + [LinkSpec(a, "z", 2e-5, 5e9, "loopback") for a in "xy"]
    cuts = {"x": (0, 10), "y": (10, 20), "z": (20, spec.layers)}
    thirds = [Stage((n,), cut, (1.0,)) for n, cut in cuts.items()]
    crowded = predict(spec, thirds, three, loops)
    loose = predict(spec, thirds, {n: replace(v, host="") for n, v in three.items()}, loops)
    assert crowded.breakdown.memory_s == pytest.approx(loose.breakdown.memory_s, rel=1e-9)


def test_pinned_ranks_pay_the_per_matmul_cost_measured_on_one_core():
    """A pinned rank's threads share its core: its fixed cost per matmul is the pinned one."""
    spec = model_spec_from_config(LLAMA_8B)
    link = [LinkSpec("x", "y", 2e-5, 5e9, "loopback")]
    tp = [Stage(("x", "y"), (0, spec.layers), (1.0, 1.0))]
    box = {"core_mem_bw_Bps": 1e9, "core_flops": 1e10, "op_latency_s": 3e-5}
    pinned = {n: replace(_box(n, "box", 40), **box, core_op_latency_s=5e-5) for n in "xy"}
    unmeasured = {n: replace(_box(n, "box", 40), **box) for n in "xy"}
    apart = {n: replace(v, host=f"box-{n}") for n, v in pinned.items()}
    matmuls = 7 * spec.layers + 1  # every layer's 7, plus the split output head
    got = [predict(spec, tp, n, link).breakdown.dispatch_s for n in (pinned, unmeasured, apart)]
    assert got == pytest.approx([matmuls * 5e-5, matmuls * 3e-5, matmuls * 3e-5], rel=1e-9)


def test_a_draft_is_reserved_on_the_leader_and_can_rule_a_plan_out(spec):
    draft = model_spec_from_config({**LLAMA_8B, "num_hidden_layers": 4})
    nodes = [mac("a", avail_gib=48), mac("b", avail_gib=48)]
    link = [LinkSpec("a", "b", 10e-6, 8e9, "rdma")]
    plain = {(p.kind, p.nodes): p for p in place(spec, nodes, link, context_tokens=1024)}
    drafted = {(p.kind, p.nodes): p for p in place(spec, nodes, link, 1024, draft=draft)}
    extra = draft.total_bytes + int(draft.kv_bytes_per_token(2) * 1024)
    for key, p in drafted.items():
        leader, *others = p.nodes
        assert p.memory_used[leader] == plain[key].memory_used[leader] + extra
        assert all(p.memory_used[n] == plain[key].memory_used[n] for n in others)
    # A leader with room for the model but not the draft: only the other node may lead.
    tight = plain["single", ("a",)].memory_used["a"] + extra // 2
    nodes = [mac("a", avail_gib=tight / GiB), mac("b", avail_gib=48)]
    singles = [p.nodes for p in place(spec, nodes, link, 1024, draft=draft) if p.kind == "single"]
    assert singles == [("b",)]
    with pytest.raises(PlacementError, match="the draft on the leader"):
        place(spec, [mac("a", avail_gib=tight / GiB)], [], 1024, draft=draft)
