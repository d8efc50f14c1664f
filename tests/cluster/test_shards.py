"""Pieces read by byte range at the source reassemble to exactly the tensor slices, in
several chunks; each chunk's hash is computed once and reused."""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import numpy as np
import pytest

from thunderpool.cluster.weights.shards import Piece, geometry, index_model
from thunderpool.cluster.weights.source import ModelSource, SourceError

CHUNK = 1 << 16


@pytest.fixture
def model(tmp_path):
    rng = np.random.default_rng(0)
    weights = {
        "a.weight": rng.standard_normal((300, 200)).astype(np.float32),  # 234 KiB
        "b.weight": rng.standard_normal((7, 5)).astype(np.float16),
        "c.bias": rng.standard_normal((1000,)).astype(np.float32),
    }
    path = tmp_path / "m"
    path.mkdir()
    mx.save_safetensors(
        str(path / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}
    )
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path, weights


@pytest.mark.parametrize(
    "name, axis, a, b",
    [("a.weight", None, 0, 0), ("a.weight", 0, 37, 251), ("a.weight", 1, 13, 117),
     ("b.weight", 1, 1, 4), ("c.bias", 0, 100, 900)],
)  # fmt: skip
def test_chunks_reassemble_to_the_slice(model, tmp_path, name, axis, a, b):
    path, weights = model
    source = ModelSource(lambda _: path, tmp_path / "cache")
    index = source.model(None)[1]
    assert index == index_model(path)
    piece = Piece(name=name, axis=axis, a=a, b=b)
    g = geometry(piece, index)
    want = weights[name] if axis is None else np.take(weights[name], range(a, b), axis=axis)
    chunks = g.chunks(CHUNK)
    assert g.shape == want.shape and sum(n for _, n in chunks) == want.nbytes
    data = b"".join(source.chunk(None, piece, k, CHUNK) for k in range(len(chunks)))
    np.testing.assert_array_equal(np.frombuffer(data, want.dtype).reshape(want.shape), want)
    hashes = source.hashes(None, piece, CHUNK)
    assert hashes == [
        hashlib.sha256(source.chunk(None, piece, k, CHUNK)).hexdigest() for k in range(len(chunks))
    ]
    if want.nbytes > CHUNK:
        assert len(chunks) > 1  # the multi-chunk path is the one exercised


def test_the_source_refuses_what_is_not_in_the_model(model, tmp_path):
    path, _ = model
    source = ModelSource(lambda _: path, tmp_path / "cache")
    for piece in (
        Piece(name="nope"),
        Piece(name="a.weight", axis=0, a=5, b=400),
        Piece(name="file:../../etc/passwd"),
    ):
        with pytest.raises(SourceError):
            source.chunk(None, piece, 0)
    with pytest.raises(SourceError, match="chunk 9"):
        source.chunk(None, Piece(name="b.weight"), 9)


class FakeGroup:
    """Rank r of n for tensor.shard, which only slices here: no collective runs."""

    def __init__(self, n: int, r: int):
        self.n, self.r = n, r

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


def _kept(model) -> dict[str, np.ndarray]:
    """The rank's parameters under their stored names (wrappers' names taken out)."""
    from mlx.utils import tree_flatten

    out = {}
    for name, v in tree_flatten(model.parameters()):
        for wrapper in (".inner.", ".rows.", ".head."):
            name = name.replace(wrapper, ".")
        out[name] = np.array(v)
    return out


@pytest.mark.parametrize("quantized", [False, True])
def test_tp_pieces_are_exactly_what_each_rank_keeps(tmp_path, quantized):
    """Stacked (E, out, in) experts in mlx-lm's layout, plain or 4-bit in groups of 32 (an
    uneven channel split, 64 + 32), sliced at the source: every sliced piece equals the part
    of that tensor rank r keeps after parallel/tensor.py and vocab.py shard the full model."""
    from conftest import TINY
    from mlx_lm.utils import _get_classes, load_model, quantize_model, save_config, save_model

    from thunderpool.cluster.weights.pieces import RankLayout, rank_pieces
    from thunderpool.parallel import tensor, vocab

    config = {**TINY["qwen3_moe"], "moe_intermediate_size": 96}
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    if quantized:
        model, config = quantize_model(model, config, 32, 4)
    path = tmp_path / "moe"
    save_model(path, model)
    save_config(config, path / "config.json")
    stored = {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}
    index = index_model(path)
    for r in (0, 1):
        pieces = [p for p in rank_pieces(index, RankLayout(rank=r, world=2)) if p.axis is not None]
        names = {p.name for p in pieces}
        assert any("switch_mlp.down_proj" in n for n in names), sorted(names)
        if quantized:
            assert any(n.endswith("switch_mlp.down_proj.scales") for n in names)
            assert any(n.endswith("o_proj.biases") for n in names)
        rank_model, _ = load_model(path, lazy=True)
        tensor.shard(rank_model, FakeGroup(2, r))
        vocab.split_vocab(rank_model, FakeGroup(2, r), None)
        kept = _kept(rank_model)
        for p in pieces:
            want = np.take(stored[p.name], range(p.a, p.b), axis=p.axis)
            np.testing.assert_array_equal(kept[p.name], want, err_msg=f"rank {r}: {p.key}")


@pytest.mark.parametrize(
    "fmt",
    ["q3g32", "q5g64", "q6g128", "q2g32", "mxfp4", "nvfp4", "mxfp8", "mixed_3_6", "overrides"],
)
def test_tp3_source_cuts_are_the_loaders_cuts_for_every_width(fmt, tmp_path):
    """The fabric's pieces of a rank's split projections hold exactly the arrays the loader
    keeps after tensor.shard (uneven TP3: 4 KV heads 2+1+1), packed words, scales and biases
    alike, at every width; the ranks' pieces tile each tensor."""
    from types import SimpleNamespace

    from mlx.utils import tree_flatten
    from quant_formats import make_base, make_quantized

    from thunderpool.cluster.weights.pieces import RankLayout, rank_pieces
    from thunderpool.engine.loader import build_lazy
    from thunderpool.parallel import tensor

    model_dir = make_quantized(make_base("llama", tmp_path / "base"), fmt, tmp_path / fmt)
    index = index_model(model_dir)
    stored = mx.load(str(model_dir / "model.safetensors"))
    cut = {}
    for rank in range(3):
        model, _ = build_lazy(model_dir)
        group = SimpleNamespace(size=lambda: 3, rank=lambda r=rank: r)  # shard reads only these
        assert tensor.shard(model, group) == "uneven"
        kept = {n.replace(".inner.", "."): v for n, v in tree_flatten(model.parameters())}
        for p in rank_pieces(index, RankLayout(rank=rank, world=3)):
            if p.axis is None or p.name not in kept or "layers." not in p.name:
                continue
            index_ = [slice(None)] * stored[p.name].ndim
            index_[p.axis] = slice(p.a, p.b)
            want = stored[p.name][tuple(index_)]
            assert mx.array_equal(kept[p.name], want).item(), (rank, p)
            cut.setdefault((p.name, p.axis), []).append((p.a, p.b))
    assert any(n.endswith("o_proj.scales") for n, _ in cut), sorted(cut)
    assert any(n.endswith("down_proj.weight") for n, _ in cut), sorted(cut)
    for (name, axis), spans in cut.items():  # the three ranks' ranges tile the axis
        ends = [a for a, _ in spans] + [stored[name].shape[axis]]
        assert len(spans) == 3 and ends[0] == 0, (name, spans)
        assert [b for _, b in spans] == ends[1:], (name, spans)
