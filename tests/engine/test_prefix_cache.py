"""The prefix cache on one rank: greedy tokens with the cache equal the tokens without it, for
follow-up turns, shared prefixes, requests batched together and after eviction; sliding-window
caches keep only prompts under their window and recurrent ones turn the cache off."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from thunderpool.engine.control import Control
from thunderpool.engine.engine import Engine, prefix_index
from thunderpool.engine.loader import Layout, load_shard
from thunderpool.engine.runner import Runner
from thunderpool.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def runner(tiny_models):
    runner, _, _ = load_shard(Path(tiny_models["llama"]), mx.distributed.init(), Layout())
    return runner


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def run(engine: Engine, prompts: list[list[int]], together: bool = False) -> list[tuple]:
    """Each prompt's (tokens, cached_tokens): one after another, or all submitted at once."""
    out = [([], [0]) for _ in prompts]

    def on_event(i, ev):
        out[i][0].append(ev.token)
        out[i][1][0] = ev.cached_tokens

    for i, p in enumerate(prompts):
        engine.submit(p, GREEDY, lambda ev, i=i: on_event(i, ev))
        while not together and engine.step():
            pass
    while engine.step():
        pass
    return [(t, c[0]) for t, c in out]


def without_cache(runner, prompts):
    return [t for t, c in run(Engine(runner, Control(runner.group), prefill_chunk=16), prompts)]


def test_turns_and_shared_prefixes_equal_no_cache(runner):
    system = tokens(37, 1)
    first = system + tokens(9, 2)
    prompts = [first, system + tokens(12, 3)]
    engine = Engine(runner, Control(runner.group), prefill_chunk=16, prefix_cache_tokens=4096)
    got = run(engine, prompts)
    turn2 = first + got[0][0] + tokens(5, 4)
    got += run(engine, [turn2, list(first)])
    expected = without_cache(runner, [*prompts, turn2, first])
    assert [t for t, _ in got] == expected
    # Turn 2 reuses turn 1's prompt; the repeated prompt all but its last token.
    assert [c for _, c in got] == [0, 37, len(first), len(first) - 1]
    assert engine.scheduler.prefix.hits == 3


def test_batched_and_after_eviction_equal_no_cache(runner):
    system = tokens(40, 5)
    prompts = [system + tokens(n, 10 + n) for n in (3, 7, 20, 5)]
    # A budget of one prompt: every store evicts the entry before it.
    for budget, together in ((4096, True), (70, False)):
        engine = Engine(runner, Control(runner.group), prefill_chunk=16, prefix_cache_tokens=budget)
        got = run(engine, prompts + prompts[:1], together)
        assert [t for t, _ in got] == without_cache(runner, prompts + prompts[:1])
        cached = [c for _, c in got]
        assert cached[:4] == [0, 40, 40, 40]
        assert cached[4] == (len(prompts[0]) - 1 if budget > 70 else 40)
        assert engine.executor.prefix.entries.keys() == engine.scheduler.prefix.entries.keys()


def built(kind: str):
    """Family `kind`'s tiny model built in memory by mlx-lm (random weights, no checkpoint)."""
    from families import FAMILIES
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes

    config = FAMILIES[kind].config
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    # Bigger weights give peaked logits, so greedy ties are not a coin flip.
    weights = [(n, w * 2 if w.ndim == 2 else w) for n, w in tree_flatten(model.parameters())]
    model.update(tree_unflatten(weights))
    return Runner(model, mx.distributed.init(), None)


def test_sliding_window_keeps_prompts_under_the_window():
    runner = built("gemma3_text")
    engine = Engine(runner, Control(runner.group), prefill_chunk=4, prefix_cache_tokens=4096)
    short, long = tokens(9, 20), tokens(30, 21)  # the window is 16 tokens
    prompts = [short, short + tokens(12, 22), long, long + tokens(3, 23)]
    got = run(engine, prompts)
    assert [t for t, _ in got] == without_cache(runner, prompts)
    assert [c for _, c in got] == [0, 9, 0, 0]


def test_recurrent_caches_turn_the_cache_off():
    assert prefix_index(built("qwen3_next"), 4096) is None
    assert prefix_index(built("llama"), 4096) is not None


def test_prefix_bench_counts_what_the_cache_saves(tiny_models, monkeypatch):
    from thunderpool.bench import prefix_cache

    sizes = {"SYSTEM_TOKENS": 50, "TOOL_RESULT_TOKENS": 10, "CALL_TOKENS": 4, "ANSWER_TOKENS": 4}
    for name, n in sizes.items():
        monkeypatch.setattr(prefix_cache, name, n)
    out = prefix_cache.bench_prefix_cache(tiny_models["llama"], first_turn=30, repeats=1, turns=3)
    two, replay = out["two_turn"], out["agent_replay"]
    assert two["identical_tokens"] and replay["identical_tokens"]
    assert two["turn2_cached_tokens"] == 30
    # Turn k reuses turn k-1's whole prompt: only answers and tool results are prefilled.
    assert replay["nocache"]["prefilled_tokens"] == replay["cache"]["prompt_tokens"]
    assert replay["cache"]["prompt_tokens"] == 50 + 64 + 78
    assert replay["cache"]["prefilled_tokens"] == 50 + 14 + 14


def test_the_last_delta_and_the_counters_report_cached_tokens(runner):
    from thunderpool.engine.sequence import Counters, TextRequests

    engine = Engine(runner, Control(runner.group), prefill_chunk=16, prefix_cache_tokens=4096)
    counters, last = Counters(), []
    requests = TextRequests(engine, None, counters)
    prompt = tokens(30, 9)
    for _ in range(2):
        requests.submit(prompt, GREEDY, lambda d: d.finish_reason and last.append(d))
        while engine.step():
            pass
    assert [(d.prompt_tokens, d.cached_tokens) for d in last] == [(30, 0), (30, 29)]
    assert (counters.prompt_tokens_total, counters.prefix_cache_hit_tokens_total) == (60, 29)
