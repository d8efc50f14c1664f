"""The split output head's pieces against the whole head, in one process.

HeadRows of a plain or quantized head (or tied embedding) must give exactly the matching
columns of the whole head's logits; the gather itself is checked on real ranks in
tests/parallel/test_equivalence.py (uneven shares: 256 rows over 3 ranks)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from thunderpool.parallel.vocab import HeadRows, SplitHead

VOCAB, HIDDEN = 200, 64


def _heads():
    mx.random.seed(3)
    linear = nn.Linear(HIDDEN, VOCAB, bias=True)
    embed = nn.Embedding(VOCAB, HIDDEN)
    quant = nn.QuantizedEmbedding.from_embedding(embed, group_size=32, bits=4)
    return {
        "linear": (linear, linear),
        "embedding": (embed, embed.as_linear),
        "quantized": (quant, quant.as_linear),
    }


@pytest.mark.parametrize("kind", ["linear", "embedding", "quantized"])
@pytest.mark.parametrize(("a", "b"), [(0, 67), (67, 134), (134, 200)])
def test_rows_are_the_whole_heads_columns(kind, a, b):
    source, whole = _heads()[kind]
    x = mx.random.normal((2, 3, HIDDEN))
    want = np.array(whole(x))[..., a:b]
    got = np.array(HeadRows(source, a, b)(x))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_split_head_on_one_rank_is_the_whole_head():
    source, whole = _heads()["quantized"]
    head = SplitHead(HeadRows(source, 0, VOCAB), [VOCAB], mx.distributed.init())
    x = mx.random.normal((2, 1, HIDDEN))
    np.testing.assert_allclose(np.array(head(x)), np.array(whole(x)), atol=1e-5, rtol=1e-5)
    # Only the rows are parameters: the gather's bookkeeping is not a weight.
    assert {k for k, _ in nn.utils.tree_flatten(head.parameters())} == {
        "rows.weight",
        "rows.scales",
        "rows.biases",
    }
