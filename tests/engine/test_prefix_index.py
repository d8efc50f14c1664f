"""The prefix cache's decisions, pure: lookups, stores, LRU eviction within the budget, and the
plans the scheduler makes from them (reuse on the first chunk, store and evict on the last)."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from thunderpool.engine.plan import Prefill, StepPlan
from thunderpool.engine.prefix import UNBOUNDED, Hit, PrefixIndex, Stored, common_prefix
from thunderpool.engine.prefix_kv import keepable_tokens
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.scheduler import Scheduler

A = tuple(range(100, 140))  # 40 tokens


def test_common_prefix_across_blocks():
    a = tuple(range(1000))
    assert common_prefix(a, a) == 1000
    assert common_prefix(a, a[:700] + (-1,) + a[701:]) == 700
    assert common_prefix(a[:3], a) == 3
    assert common_prefix((), a) == 0


def test_lookup_takes_the_longest_prefix_short_of_the_last_token():
    index = PrefixIndex(budget_tokens=1000)
    assert index.lookup(A) is None
    assert index.store(A) == Stored(0, ())
    assert index.store(A[:20] + (1, 2, 3)) == Stored(1, ())
    assert index.lookup(A[:30] + (7,)) == Hit(0, 30)
    assert index.lookup(A[:20] + (1, 2, 9)) == Hit(1, 22)
    # The whole prompt is cached: the last token is still prefilled, for its logits.
    assert index.lookup(A) == Hit(0, 39)
    assert index.lookup((5, 6)) is None
    assert (index.hits, index.lookups, index.hit_tokens) == (3, 5, 30 + 22 + 39)


def test_a_longer_prompt_replaces_its_prefix_and_a_covered_one_is_not_kept():
    index = PrefixIndex(budget_tokens=1000)
    index.store(A)
    turn2 = A + (1, 2, 3, 4)
    assert index.store(turn2) == Stored(1, (0,))  # the chat's turn 1 is inside turn 2
    assert index.used == len(turn2)
    assert index.store(A[:10]) is None  # entry 1 already holds it
    assert list(index.entries) == [1]


def test_lru_eviction_within_the_budget():
    index = PrefixIndex(budget_tokens=100)
    b, c = tuple(range(500, 540)), tuple(range(600, 640))
    assert index.store(A).entry == 0
    assert index.store(b).entry == 1
    assert index.lookup(A[:5] + (0,)) == Hit(0, 5)  # A is now the most recent
    assert index.store(c) == Stored(2, (1,))  # b, the least recent, makes room
    assert index.used == 80 and set(index.entries) == {0, 2}
    assert index.store(tuple(range(101))) is None  # over the whole budget
    assert index.lookup(b) is None


def test_window_limits_what_is_kept():
    index = PrefixIndex(budget_tokens=1000, max_tokens=15)
    assert index.store(A) is None
    assert index.store(A[:15]) == Stored(0, ())


def test_keepable_tokens_by_cache_type():
    assert keepable_tokens([KVCache(), KVCache()]) == UNBOUNDED
    assert keepable_tokens([KVCache(), RotatingKVCache(max_size=16)]) == 15
    assert keepable_tokens([KVCache(), ArraysCache(2)]) == 0


def test_scheduler_plans_reuse_store_and_cached_tokens():
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    s = Scheduler(prefill_chunk=16, prefix=PrefixIndex(1000))
    s.add(0, list(A), greedy)
    plans = [s.schedule() for _ in range(3)]
    assert [p.prefill.reuse for p in plans] == [None, None, None]
    assert [p.prefill.store for p in plans] == [None, None, 0]
    s.postprocess([0], [7])
    s.postprocess([0], [8])
    assert s.schedule().drop == (0,)
    turn2 = [*A, 7, 8, 9]
    s.add(1, turn2, greedy)
    plan = s.schedule()
    assert plan.prefill == Prefill(1, (7, 8, 9), True, greedy, reuse=(0, 40), store=1, evict=(0,))
    (event,) = s.postprocess([1], [5])
    assert (event.prompt_tokens, event.cached_tokens) == (43, 40)
    # The plan's few ints cross the wire as JSON and come back the same.
    assert StepPlan.decode_bytes(plan.encode()) == plan


@pytest.mark.parametrize("budget", [0, 10])
def test_nothing_is_reused_without_room(budget):
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    s = Scheduler(prefix=PrefixIndex(budget) if budget else None)
    for sid in range(2):
        s.add(sid, list(A), greedy)
        plan = s.schedule()
        assert (plan.prefill.reuse, plan.prefill.store) == (None, None)
        s.postprocess([sid], [1])


def test_planner_counts_the_prefix_cache_as_kv():
    from thunderpool.planner.hardware import NodeSpec
    from thunderpool.planner.placement import PlacementError, place
    from thunderpool.planner.spec import model_spec_from_config

    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    }
    spec, gib = model_spec_from_config(config), 2**30
    node = NodeSpec("a", 64 * gib, 48 * gib, 400e9, 30e12, 2 * gib)
    base = place(spec, [node], [])[0].memory_used["a"]
    kept = place(spec, [node], [], prefix_cache_bytes=4 * gib)[0].memory_used["a"]
    assert kept - base == pytest.approx(4 * gib, rel=1e-3)  # 128 KiB of KV per token
    with pytest.raises(PlacementError, match="prefix cache 40.0 GiB"):
        place(spec, [node], [], prefix_cache_bytes=40 * gib)
