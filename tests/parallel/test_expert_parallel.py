"""Expert parallelism (EP) against the unsharded model: whole routed experts per rank.

Reference: mlx-lm's own model, one process, full forward at every step (no KV cache), as in
test_family_matrix.py. Expected: identical greedy tokens and fp32 logits within 1e-4 on EP2
(even and uneven expert counts) and EP3 (uneven: 2+1+1 experts, 4 heads over 3 ranks), each
rank holding exactly its experts; continuous batching on EP2 gives the same tokens as one
request at a time. In process: the ranks' expert outputs add up to the full block's.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from batch_ranks import run_ranks
from conftest import run_trace
from families import FAMILIES, VOCAB, make_family
from mlx_lm.models.switch_layers import SwitchGLU
from test_family_matrix import Built, greedy_full_forward

from thunderpool.engine.loader import Layout, build_lazy, preflight
from thunderpool.errors import ShardingError
from thunderpool.parallel import experts

STEPS = 8
TOL = 1e-4
# A short prompt and one whose prefill routes more than 64 (token, expert) pairs to a rank,
# so SwitchGLU's sorted path runs too.
PROMPTS = [
    np.random.default_rng(1).integers(0, VOCAB, size=29).tolist(),
    np.random.default_rng(5).integers(0, VOCAB, size=70).tolist(),
]
# (family, ranks, experts per rank or None for the default even split)
CELLS = [
    ("qwen3_moe", 2, None),
    ("qwen3_moe", 3, None),  # 4 experts: 2 + 1 + 1; 4 heads: uneven TP attention
    ("deepseek_v3", 2, (3, 1)),  # MLA attention in equal shares, experts 3 + 1
    ("glm4_moe", 2, (1, 3)),  # shared experts, attention biases
    ("gpt_oss", 2, None),  # experts named `experts`, with biases; attention sinks
    ("mixtral", 2, None),  # a block that cannot sum itself: TP's SumAfter sums it
]
# Families whose EP cells all pass here: models/families.py's VERIFIED lists "ep" for them.
PROVEN = {"qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "mixtral"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    return Built(lambda kind: make_family(kind, root / kind))


@pytest.fixture(scope="module")
def references(dirs):
    return Built(lambda kind: greedy_full_forward(dirs[kind], PROMPTS, STEPS))


def _n_experts(kind: str) -> int:
    config = FAMILIES[kind].config
    return (
        config.get("num_experts") or config.get("n_routed_experts") or config["num_local_experts"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind,nodes,split", CELLS, ids=[f"{k}-ep{n}" for k, n, _ in CELLS])
def test_ep_matches_unsharded(kind, nodes, split, dirs, references, tmp_path):
    tokens, logits, total_bytes = references[kind]
    got = run_trace(
        dirs[kind],
        tmp_path / "t.npz",
        nodes,
        "ep",
        prompts=PROMPTS,
        max_tokens=STEPS,
        expert_split=split,
    )
    np.testing.assert_array_equal(got["tokens"], tokens)
    np.testing.assert_allclose(got["logits"], logits, atol=TOL, rtol=TOL)
    loaded = sorted(
        (e.event for e in got["events"] if e.event["kind"] == "loaded"), key=lambda e: e["rank"]
    )
    assert {e["method"] for e in loaded} == {"ep"}
    want = experts.split_experts(_n_experts(kind), [1.0] * nodes, list(split) if split else None)
    assert [tuple(e["experts"]) for e in loaded] == [(s.e0, s.e1) for s in want]
    # Memory pooling: every rank holds a strict part of the weights, none holds them all.
    assert max(e["param_bytes"] for e in loaded) < total_bytes * 0.8


@pytest.mark.slow
def test_ep_batched_equals_one_at_a_time(dirs, references, tmp_path):
    """Continuous batching on EP2 (experts 1 + 3): the second and third requests join a
    running batch and leave it at different steps; each gets its one-at-a-time tokens."""
    kind = "deepseek_v3"
    tokens = references[kind][0].tolist()
    greedy = {"temperature": 0.0, "max_tokens": STEPS}
    requests = [{"prompt": p, "params": greedy} for p in [*PROMPTS, PROMPTS[0]]]
    requests[1]["after"], requests[2]["after"] = [0, 2], [1, 4]
    spec = {
        "model": str(dirs[kind]),
        "parallel": "ep",
        "expert_split": [1, 3],
        "requests": requests,
        "eos": [],
        "prefill_chunk": 32,
    }
    got = run_ranks(spec, tmp_path, nodes=2)
    assert [o["tokens"] for o in got["out"]] == [*tokens, tokens[0]]


def test_ep_refusals(dirs, tiny_models):
    # A dense model has no experts to place; MLA attention splits only into equal shares.
    with pytest.raises(ShardingError, match="no routed experts; use --parallel tp or pp"):
        preflight(tiny_models["llama"], 2, Layout("ep"))
    with pytest.raises(ShardingError, match=r"deepseek_v3 \(MLA attention\) .* tp=3"):
        preflight(dirs["deepseek_v3"], 3, Layout("ep"))
    with pytest.raises(ShardingError, match="--expert-split 4,0 must give each of the 2 ranks"):
        preflight(dirs["qwen3_moe"], 2, Layout("ep", expert_split=(4, 0)))
    with pytest.raises(ShardingError, match="ep=5 exceeds the model's 4 routed experts"):
        experts.split_experts(4, [1.0] * 5)


def test_rank_holds_only_its_experts(dirs):
    """shard_experts keeps rows [e0, e1) of every MoE layer's stacked experts, whole."""
    model, _ = build_lazy(dirs["qwen3_moe"])
    full = experts.originals(model)  # references to the unsliced lazy arrays
    experts.shard_experts(model, experts.ExpertShare(1, 3), full)
    assert sorted(full) == [1, 2, 3]  # layer 0 is dense (mlp_only_layers)
    for i, projs in full.items():
        local = model.layers[i].mlp.switch_mlp
        assert isinstance(local, experts.LocalExperts)
        for name, tensors in projs.items():
            got = local.inner[name]["weight"]
            assert got.shape[0] == 2
            param, lazy = tensors["weight"]
            assert param == f"model.layers.{i}.mlp.switch_mlp.{name}.weight"
            assert mx.array_equal(got, lazy[1:3]).item()


@pytest.mark.parametrize("skip", [True, False], ids=["skip", "masked"])
def test_local_experts_add_up_to_the_block(skip):
    """Uneven shares (2 + 1 + 2 of 5 experts): the ranks' outputs sum to the full SwitchGLU's,
    for a decode-sized and a prefill-sized (sorted) batch of routes."""
    mx.random.seed(0)
    n, dim, hidden, k = 5, 16, 24, 2
    full = SwitchGLU(dim, hidden, n)
    x = mx.random.normal((2, 70, dim))
    inds = mx.argpartition(mx.random.normal((2, 70, n)), kth=-k, axis=-1)[..., -k:]
    for xs, ids in ((x[:, :1], inds[:, :1]), (x, inds)):
        total = mx.zeros((*ids.shape, dim))
        for share in experts.split_experts(n, [1.0] * 3, [2, 1, 2]):
            part = SwitchGLU(dim, hidden, share.e1 - share.e0)
            for p in ("gate_proj", "up_proj", "down_proj"):
                part[p]["weight"] = full[p]["weight"][share.e0 : share.e1]
            total = total + experts.LocalExperts(part, share, skip)(xs, ids)
        np.testing.assert_allclose(np.array(total), np.array(full(xs, ids)), atol=1e-5)


def test_verified_ep_is_what_these_tests_prove():
    from thunderpool.models.families import MATRIX as VERIFIED

    assert {kind for kind, layouts in VERIFIED.items() if "ep" in layouts} == PROVEN
    assert PROVEN == {kind for kind, _, _ in CELLS}


def test_describe_layout_shows_each_ranks_experts():
    from thunderpool.engine.loader import describe_layout

    config = FAMILIES["deepseek_v3"].config
    got = describe_layout(config, Layout("ep", expert_split=(3, 1)), 2)
    assert got["parallel"] == "ep"
    assert [r["experts"] for r in got["ranks"]] == [[0, 3], [3, 4]]
    assert [r["heads"]["q"] for r in got["ranks"]] == [[0, 2], [2, 4]]


@pytest.mark.parametrize("n_tokens", [1, 70])
def test_replicated_experts_are_computed_once_and_add_up_to_the_block(n_tokens):
    """Experts 2 + 1 + 2 of 5 on three ranks, expert 0 copied onto ranks 1 and 2 and expert 4
    onto rank 0: every (token, route) is computed by exactly one holder, so the ranks' outputs
    still sum to the full block's, and the copies take a share of expert 0's routes."""
    mx.random.seed(0)
    n, dim, hidden, k = 5, 16, 24, 2
    full = SwitchGLU(dim, hidden, n)
    x = mx.random.normal((1, n_tokens, dim))
    inds = mx.argpartition(mx.random.normal((1, n_tokens, n)), kth=-k, axis=-1)[..., -k:]
    shares = experts.split_experts(n, [1.0] * 3, [2, 1, 2])
    replicas = ((0, 1), (0, 2), (4, 0))
    total, seen = mx.zeros((*inds.shape, dim)), np.zeros(inds.shape, dtype=np.int32)
    for r, share in enumerate(shares):
        held = experts.holders(shares, replicas, r)
        rows = list(range(share.e0, share.e1)) + list(held.extra)
        part = SwitchGLU(dim, hidden, len(rows))
        for p in ("gate_proj", "up_proj", "down_proj"):
            part[p]["weight"] = full[p]["weight"][mx.array(rows)]
        y = experts.LocalExperts(part, share, True, held)(x, inds)
        total = total + y
        seen += np.array(mx.any(y != 0, axis=-1)).astype(np.int32)
    np.testing.assert_allclose(np.array(total), np.array(full(x, inds)), atol=1e-5)
    assert seen.max() == 1  # no route computed twice
    table = experts.holders(shares, replicas, 0)
    who = experts.route_holders(np.array(inds.reshape(-1, k)), table.table, table.count)
    to0 = who[np.array(inds.reshape(-1, k)) == 0]
    if n_tokens > 1:
        assert set(to0.tolist()) == {0, 1, 2}  # expert 0's tokens are spread over its holders


@pytest.mark.slow
def test_ep2_with_replicated_experts_matches_unsharded(dirs, references, tmp_path):
    """qwen3_moe EP2 (experts 2 + 2) with expert 0 of layers 1-3 also on rank 1 and expert 3
    of layer 2 also on rank 0: the same greedy tokens and logits as one rank."""
    tokens, logits, _ = references["qwen3_moe"]
    replicas = ((1, 0, 1), (2, 0, 1), (3, 0, 1), (2, 3, 0))
    got = run_trace(
        dirs["qwen3_moe"],
        tmp_path / "t.npz",
        2,
        "ep",
        prompts=PROMPTS,
        max_tokens=STEPS,
        expert_replicas=replicas,
    )
    np.testing.assert_array_equal(got["tokens"], tokens)
    np.testing.assert_allclose(got["logits"], logits, atol=TOL, rtol=TOL)
    # The copies are held: rank 1 has 3 extra expert rows, rank 0 one (float32 gate/up/down).
    config = FAMILIES["qwen3_moe"].config
    expert = 3 * config["moe_intermediate_size"] * config["hidden_size"] * 4
    loaded = {e.rank: e.event["param_bytes"] for e in got["events"] if e.event["kind"] == "loaded"}
    assert loaded[1] - loaded[0] == 2 * expert
    with pytest.raises(ShardingError, match="layer 0, expert 1, rank 1"):
        preflight(dirs["qwen3_moe"], 2, Layout("ep", expert_replicas=((0, 1, 1),)))
