"""Pure splitting rules: heads (even, uneven, replicated KV), channels, pipeline stages."""

from __future__ import annotations

import pytest

from thunderpool.errors import ShardingError
from thunderpool.parallel.heads import HeadShare, proportional_split, split_heads
from thunderpool.parallel.pipeline import split_layers


def test_proportional_split_even_and_weighted():
    assert proportional_split(12, [1, 1, 1]) == [(0, 4), (4, 8), (8, 12)]
    assert proportional_split(1536, [2, 1], align=32) == [(0, 1024), (1024, 1536)]
    assert proportional_split(3, [1, 1]) == [(0, 2), (2, 3)]


def test_proportional_split_refuses_too_many_parts():
    with pytest.raises(ShardingError, match="cannot split 2 into 3 parts"):
        proportional_split(2, [1, 1, 1])


def test_smollm2_heads_on_two_ranks_split_kv_two_plus_one():
    # 9 query heads, 3 KV heads (groups of 3).
    assert split_heads(9, 3, [1, 1]) == [HeadShare(0, 6, 0, 2), HeadShare(6, 9, 2, 3)]


def test_more_ranks_than_kv_heads_replicates_kv():
    shares = split_heads(9, 3, [1, 1, 1, 1])
    assert shares == [
        HeadShare(0, 2, 0, 1),
        HeadShare(2, 3, 0, 1),
        HeadShare(3, 6, 1, 2),
        HeadShare(6, 9, 2, 3),
    ]
    # Every query head is computed exactly once, next to its own KV head.
    for s in shares:
        assert all(s.kv0 <= h // 3 < s.kv1 for h in range(s.q0, s.q1))
    assert sum(s.q1 - s.q0 for s in shares) == 9


def test_tp_wider_than_heads_is_refused_with_the_fix():
    with pytest.raises(ShardingError, match="tp=10 exceeds the 9 attention heads"):
        split_heads(9, 3, [1] * 10)


def test_split_layers_counts_weights_and_default():
    assert split_layers(30, 2, [20, 10]) == [(0, 20), (20, 30)]
    assert split_layers(30, 2, [2, 1]) == [(0, 20), (20, 30)]
    assert split_layers(30, 3) == [(0, 10), (10, 20), (20, 30)]
    assert split_layers(4, 3) == [(0, 2), (2, 3), (3, 4)]


def test_split_layers_refuses_more_stages_than_layers():
    with pytest.raises(ShardingError, match="--nodes 31 is more than the 30 layers"):
        split_layers(30, 31)
    with pytest.raises(ShardingError, match="3 parts for 2 nodes"):
        split_layers(30, 2, [1, 1, 1])
