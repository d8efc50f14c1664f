"""The split vocabulary's pieces against the whole embedding and head, in one process.

HeadRows of a plain or quantized head (or tied embedding) must give exactly the matching
columns of the whole head's logits; SplitEmbedding lookups of every rank's rows, summed as the
all_sum would, must give exactly the whole embedding's vectors. The collectives themselves are
checked on real ranks in tests/parallel/test_family_matrix.py (uneven shares: 256 rows over 3
ranks) and tests/parallel/test_vocab_memory.py."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from thunderpool.parallel.heads import proportional_split
from thunderpool.parallel.vocab import HeadRows, SplitEmbedding, SplitHead, split_vocab

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


def _rank_embeddings(source, weights):
    """Each simulated rank's SplitEmbedding of `source`, on a group of one (all_sum = identity)."""
    group = mx.distributed.init()
    bounds = proportional_split(VOCAB, weights)
    sizes = [b - a for a, b in bounds]
    return [SplitEmbedding(SplitHead(HeadRows(source, a, b), sizes, group), a) for a, b in bounds]


@pytest.mark.parametrize("kind", ["embedding", "quantized"])
@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [1.0, 2.0], [3.0, 1.0, 1.0, 2.0]])
def test_masked_lookups_sum_to_the_whole_embedding(kind, weights):
    source, _ = _heads()[kind]
    ranks = _rank_embeddings(source, weights)
    assert len({e.head.rows["weight"].shape[0] for e in ranks}) > 1  # uneven shares
    # Every id, the first and last row of each share, in a (B, L) batch.
    ids = mx.array(np.random.default_rng(0).permutation(VOCAB).reshape(4, VOCAB // 4))
    want = np.array(source(ids))
    parts = [np.array(e(ids)) for e in ranks]
    for e, part in zip(ranks, parts, strict=True):
        n = e.head.rows["weight"].shape[0]
        mine = (np.array(ids) >= e.start) & (np.array(ids) < e.start + n)
        assert not part[~mine].any()  # ids of other ranks give exact zeros
        np.testing.assert_array_equal(part[mine], want[mine])
    np.testing.assert_array_equal(sum(parts), want)


@pytest.mark.parametrize("kind", ["embedding", "quantized"])
def test_split_vocab_on_one_rank_keeps_call_and_as_linear(kind):
    """A tied model's embed_tokens becomes one SplitEmbedding: the lookup and the tied head
    (as_linear) are the whole table's, and there is no second copy in the parameters."""
    source, whole = _heads()[kind]
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = source
    split_vocab(model, mx.distributed.init(), None)
    embed = model.model.embed_tokens
    assert isinstance(embed, SplitEmbedding) and "lm_head" not in model
    ids = mx.array([[0, 5, VOCAB - 1], [7, 7, 100]])
    np.testing.assert_array_equal(np.array(embed(ids)), np.array(source(ids)))
    x = mx.random.normal((2, 1, HIDDEN))
    np.testing.assert_allclose(np.array(embed.as_linear(x)), np.array(whole(x)), atol=1e-5)
    names = {k for k, _ in nn.utils.tree_flatten(model.parameters())}
    assert all(k.startswith("model.embed_tokens.head.rows.") for k in names), names
