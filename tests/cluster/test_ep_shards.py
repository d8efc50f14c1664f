"""EP shards over the fabric, without processes: every piece an EP rank is sent equals the
part of that tensor parallel/experts.py keeps on the rank, and a shard of only those pieces
loads into exactly the parameters the rank gets from the whole model."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY, make_tiny
from mlx.utils import tree_flatten
from test_shards import FakeGroup, _kept

from thunderpool.cluster.weights.pieces import RankLayout, rank_pieces
from thunderpool.cluster.weights.shards import geometry, index_model
from thunderpool.engine.loader import SHARD_MANIFEST, Layout, load_shard
from thunderpool.parallel import experts, vocab

_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")
SPLIT = (1, 3)  # uneven: rank 0 holds expert 0, rank 1 experts 1-3
# Copies: expert 2 of layer 1 and expert 3 of layer 0 also on rank 0, expert 0 of layer 1 on 1.
REPLICAS = ((1, 2, 0), (0, 3, 0), (1, 0, 1))


def _stacked(path, quantized: bool):
    """A qwen3_moe checkpoint in mlx-lm's layout (experts stacked), plain or 4-bit."""
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    config = {**TINY["qwen3_moe"], "moe_intermediate_size": 96}
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    if quantized:
        model, config = quantize_model(model, config, 32, 4)
    save_model(path, model)
    save_config(config, path / "config.json")
    return path


@pytest.fixture(params=["stacked", "stacked-q4", "per-expert"])
def moe(request, tmp_path):
    if request.param == "per-expert":
        return make_tiny("qwen3_moe", tmp_path / "moe")
    return _stacked(tmp_path / "moe", request.param.endswith("q4"))


def _rank_model(path, r: int, replicas):
    from mlx_lm.utils import load_model

    model, _ = load_model(path, lazy=True)
    experts.shard(model, FakeGroup(2, r), counts=list(SPLIT), replicas=replicas)
    vocab.split_vocab(model, FakeGroup(2, r), None)
    return model


@pytest.mark.parametrize("replicas", [None, REPLICAS], ids=["", "replicas"])
def test_ep_pieces_are_exactly_what_each_rank_keeps(moe, replicas):
    stored = {k: np.array(v) for k, v in mx.load(str(moe / "model.safetensors")).items()}
    index = index_model(moe)
    for r, (e0, e1) in enumerate([(0, 1), (1, 4)]):
        layout = RankLayout(
            rank=r, world=2, parallel="ep", expert_split=SPLIT, expert_replicas=replicas
        )
        pieces = [p for p in rank_pieces(index, layout) if not p.is_file]
        kept = _kept(_rank_model(moe, r, replicas))
        checked = set()
        for p in pieces:
            want = stored[p.name]
            want = want if p.axis is None else np.take(want, range(p.a, p.b), axis=p.axis)
            assert geometry(p, index).shape == want.shape
            layer = int(m[1]) if (m := re.search(r"layers\.(\d+)\.", p.name)) else -1
            extra = sorted(e for i, e, x in replicas or () if i == layer and x == r)
            held = [*range(e0, e1), *(e for e in extra if not e0 <= e < e1)]  # its rows, in order
            if m := _PER_EXPERT.search(p.name):  # one expert's own tensor, stacked on load
                e = int(m[1])
                stacked = p.name.replace(m[0], ".switch_mlp.")
                if e in held:
                    np.testing.assert_array_equal(kept[stacked][held.index(e)], want, err_msg=p.key)
                    checked.add(stacked)
                else:
                    assert (p.axis, p.a, p.b) == (0, 0, 0), p.key  # nothing of it is sent
                continue
            if ".switch_mlp." in p.name:
                assert (p.axis, p.a, p.b) == (0, min(held), max(held) + 1), p.key
                want = want[np.array(held) - p.a]  # the rows it keeps of the range it is sent
            np.testing.assert_array_equal(kept[p.name], want, err_msg=f"rank {r}: {p.key}")
            checked.add(p.name)
        # Every parameter the rank holds was checked against a piece it is sent.
        assert checked == set(kept), sorted(set(kept) - checked)


@pytest.mark.parametrize("replicas", [None, REPLICAS], ids=["", "replicas"])
def test_a_shard_of_only_those_pieces_loads_the_same_rank(moe, tmp_path, replicas):
    """Write rank r's pieces as a fetched shard (slices and empty slices in the manifest):
    the loader pads them back and keeps exactly what it keeps from the whole model."""
    stored = dict(mx.load(str(moe / "model.safetensors")))
    index = index_model(moe)
    layout = Layout("ep", expert_split=SPLIT, compile=False, expert_replicas=replicas)
    for r in (0, 1):
        shard = tmp_path / f"shard{r}"
        shard.mkdir()
        weights, slices = {}, {}
        rank = RankLayout(
            rank=r, world=2, parallel="ep", expert_split=SPLIT, expert_replicas=replicas
        )
        for p in rank_pieces(index, rank):
            if p.is_file:
                name = p.name.removeprefix("file:")
                (shard / name).write_bytes((moe / name).read_bytes())
                continue
            full = stored[p.name]
            if p.axis is None:
                weights[p.name] = full
                continue
            weights[p.name] = mx.contiguous(
                mx.take(full, mx.arange(p.a, p.b, dtype=mx.int32), axis=p.axis)
            )
            slices[p.name] = {"axis": p.axis, "a": p.a, "b": p.b, "shape": list(full.shape)}
        mx.save_safetensors(str(shard / "model.safetensors"), weights, metadata={"format": "mlx"})
        (shard / SHARD_MANIFEST).write_text(json.dumps({"slices": slices}))
        got = load_shard(shard, FakeGroup(2, r), layout)
        want = load_shard(moe, FakeGroup(2, r), layout)
        assert got[2].experts == want[2].experts == ((0, 1), (1, 4))[r]
        a = dict(tree_flatten(got[0].model.parameters()))
        b = tree_flatten(want[0].model.parameters())
        assert a.keys() == dict(b).keys()
        for name, v in b:
            np.testing.assert_array_equal(np.array(a[name]), np.array(v), err_msg=name)
        assert got[2].param_bytes == want[2].param_bytes
