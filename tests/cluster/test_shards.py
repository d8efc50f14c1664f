"""Pieces read by byte range at the source reassemble to exactly the tensor slices, in
several chunks; each chunk's hash is computed once and reused."""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import numpy as np
import pytest

from thunderpool.cluster.shards import Piece, geometry, index_model
from thunderpool.cluster.source import ModelSource, SourceError

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
