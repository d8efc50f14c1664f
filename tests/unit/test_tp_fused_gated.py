"""TP of fused projections, output gates, per-layer head counts and wide q/k norms, in one process:
what each rank keeps, and that the fabric's pieces (cluster/weights/pieces.py) are exactly
those arrays or whole. Equality with the unsharded model is the all-families matrix's
(tests/parallel/test_all_families.py); this checks the cuts themselves and the refusals."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from thunderpool.cluster.weights.pieces import RankLayout, rank_pieces
from thunderpool.cluster.weights.shards import index_model
from thunderpool.engine.loader import build_lazy
from thunderpool.errors import ShardingError
from thunderpool.models import tiny
from thunderpool.models.checkpoint import write_checkpoint
from thunderpool.parallel import tensor


def _group(n: int, rank: int):
    return SimpleNamespace(size=lambda: n, rank=lambda: rank)  # shard reads only these


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-fused")
    return lambda family: write_checkpoint(tiny.family_config(family), root / family, 0)


@pytest.mark.parametrize(
    "family", ["phi3", "glm4", "afm7", "laguna", "afmoe", "mimo_v2_flash", "olmo2"]
)
def test_each_rank_keeps_its_share_and_the_pieces_match(family, built):
    model_dir = built(family)
    index = index_model(model_dir)
    stored = mx.load(str(model_dir / "model.safetensors"))
    for rank in (0, 1):
        model, _ = build_lazy(model_dir)
        assert tensor.shard(model, _group(2, rank)) == "uneven"
        kept = {n.replace(".inner.", "."): v for n, v in tree_flatten(model.parameters())}
        for p in rank_pieces(index, RankLayout(rank=rank, world=2)):
            if p.axis is None or p.name not in kept or "layers." not in p.name:
                continue
            cut = [slice(None)] * stored[p.name].ndim
            cut[p.axis] = slice(p.a, p.b)
            assert mx.array_equal(kept[p.name], stored[p.name][tuple(cut)]).item(), (rank, p)


def test_fused_qkv_keeps_q_k_v_rows_of_the_ranks_heads(built):
    model_dir = built("phi3")  # 4 query heads, 4 KV heads (no GQA in the tiny config)
    full = mx.load(str(model_dir / "model.safetensors"))["model.layers.0.self_attn.qkv_proj.weight"]
    model, _ = build_lazy(model_dir)
    attn = model.layers[0].self_attn
    d, h, kv = attn.head_dim, attn.n_heads, attn.n_kv_heads
    tensor.shard(model, _group(2, 1))
    q, k = h * d, kv * d
    rows = [*range(q // 2, q), *range(q + k // 2, q + k), *range(q + k + k // 2, q + 2 * k)]
    assert mx.array_equal(attn.qkv_proj.weight, full[mx.array(rows)]).item()
    assert (attn.n_heads, attn.n_kv_heads) == (h // 2, kv // 2)


def test_per_layer_heads_refuse_uneven_weights_and_tp3(built):
    model, _ = build_lazy(built("mimo_v2_flash"))  # (64, 4) full layers, (64, 8) sliding ones
    with pytest.raises(ShardingError, match=r"mimo_v2_flash: .*equal shares .*use tp in \[2, 4\]"):
        tensor.check(model, 2, [2.0, 1.0])
    with pytest.raises(ShardingError, match=r"mimo_v2_flash: tensor parallelism \(tp=3"):
        tensor.check(model, 3)
    tensor.check(model, 4)


def test_wide_k_norm_refuses_more_ranks_than_kv_heads(tmp_path):
    # OLMo 2's k_norm sums over every KV head: a KV head shared by two ranks would count twice.
    config = {**tiny.family_config("olmo2"), "num_key_value_heads": 2}
    model, _ = build_lazy(write_checkpoint(config, tmp_path / "olmo2", 0))
    tensor.check(model, 2)
    with pytest.raises(ShardingError, match=r"olmo2: .*tp=3.* k_norm .*use tp of at most 2"):
        tensor.check(model, 3)
