"""Continuous batching on one rank: staggered, concurrent greedy requests give exactly the
tokens of the same requests run one at a time; cancelled rows leave the batch."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from thunderpool.engine.control import Control
from thunderpool.engine.engine import Leader
from thunderpool.engine.loader import Layout, load_shard
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.scheduler import Scheduler


def prompts(n: int, seed: int = 4) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(3, 60))).tolist() for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def runner(request, tiny_models):
    group = mx.distributed.init()
    runner, _, _ = load_shard(Path(tiny_models[request.param]), group, Layout())
    return runner


def one_at_a_time(runner, prompt, params) -> list[int]:
    leader = Leader(runner, Control(runner.group), prefill_chunk=16)
    return [s.token for s in leader.generate_ids(prompt, params)]


def run_batched(runner, requests, arrivals, cancel=None):
    """Submit request i before step arrivals[i]; optionally cancel one after some steps."""
    sched = Scheduler(runner, Control(runner.group), None, prefill_chunk=16, max_batch=8)
    out = {i: [] for i in range(len(requests))}
    done = {}
    ids = {}
    max_rows = 0
    for step in range(10_000):
        for i, (prompt, params) in enumerate(requests):
            if arrivals[i] == step:
                ids[i] = sched.submit(
                    prompt,
                    params,
                    lambda d, i=i: (
                        out[i].extend(d.tokens),
                        d.finish_reason and done.setdefault(i, d),
                    ),
                )
        if cancel and step == cancel[1]:
            sched.cancel(ids[cancel[0]])
        sched.step()
        max_rows = max(max_rows, len(sched.state.rows))
        expected = len(requests) - (1 if cancel else 0)
        if len(done) == expected and step > max(arrivals):
            break
    sched.step()  # lets the last finished rows leave
    return out, done, sched, max_rows


def test_eight_concurrent_equal_one_at_a_time(runner):
    params = [SamplingParams(max_tokens=8 + 3 * i) for i in range(8)]
    reqs = list(zip(prompts(8), params, strict=True))
    expected = [one_at_a_time(runner, p, sp) for p, sp in reqs]
    out, done, sched, max_rows = run_batched(runner, reqs, arrivals=[0, 0, 1, 2, 2, 5, 9, 14])
    assert [out[i] for i in range(8)] == expected
    assert all(done[i].finish_reason == "length" for i in range(8))
    assert [done[i].completion_tokens for i in range(8)] == [p.max_tokens for p in params]
    assert max_rows >= 4  # requests really overlapped in one batch
    assert sched.state.rows == [] and sched.state.batch is None and not sched.state.pending


def test_cancelled_request_leaves_the_batch(runner):
    params = SamplingParams(max_tokens=30)
    reqs = [(p, params) for p in prompts(3, seed=9)]
    expected = [one_at_a_time(runner, p, params) for p, _ in reqs]
    out, done, sched, _ = run_batched(runner, reqs, arrivals=[0, 0, 0], cancel=(1, 8))
    assert 1 not in done and 0 < len(out[1]) < 30
    assert out[1] == expected[1][: len(out[1])]
    assert out[0] == expected[0] and out[2] == expected[2]
    assert sched.state.rows == []


def test_seeded_sampling_is_the_same_alone_and_batched(runner):
    hot = SamplingParams(max_tokens=12, temperature=1.2, top_k=40, seed=3)
    reqs = [(p, hot) for p in prompts(3, seed=2)]
    alone = [one_at_a_time(runner, p, hot) for p, _ in reqs]
    out, _, _, _ = run_batched(runner, reqs, arrivals=[0, 1, 1])
    assert [out[i] for i in range(3)] == alone
