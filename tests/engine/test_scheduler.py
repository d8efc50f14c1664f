"""Continuous batching on one rank: staggered, concurrent greedy requests give exactly the
tokens of the same requests run one at a time (a batch of one row); cancelled rows leave the
batch. Decode bursts run here too (the same executor, minus the collective): requests that
arrive, finish or are cancelled mid-burst change nothing, and a burst runs no step past a
row's max_tokens."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from batch_ranks import run_scenario

from thunderpool.engine.control import Control
from thunderpool.engine.engine import Engine
from thunderpool.engine.loader import Layout, load_shard
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.sequence import TextRequests


def prompts(n: int, seed: int = 4) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(3, 60))).tolist() for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def runner(request, tiny_models):
    group = mx.distributed.init()
    runner, _, _ = load_shard(Path(tiny_models[request.param]), group, Layout())
    return runner


@pytest.fixture(params=[True, False], ids=["pipelined", "serial"])
def pipeline(request) -> bool:
    """A burst builds step k+1 while step k computes, or after it (batch.overlaps)."""
    return request.param


def one_at_a_time(runner, prompt, params) -> list[int]:
    engine, tokens = Engine(runner, Control(runner.group), prefill_chunk=16), []
    engine.generate(prompt, params, lambda ev: tokens.append(ev.token))
    return tokens


def run_batched(runner, requests, arrivals, cancel=None, pipeline=None):
    """Submit request i before step arrivals[i]; cancel=(i, n) cancels request i as its n-th
    token arrives (inside a decode burst, when one runs)."""
    control = Control(runner.group)
    engine = Engine(runner, control, prefill_chunk=16, max_batch=8, pipeline=pipeline)
    sched = TextRequests(engine, None)
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
                        cancel == (i, len(out[i])) and sched.cancel(ids[i]),
                    ),
                )
        engine.step()
        max_rows = max(max_rows, len(engine.executor.state.rows))
        expected = len(requests) - (1 if cancel else 0)
        if len(done) == expected and step > max(arrivals):
            break
    engine.step()  # lets the last finished rows leave
    return out, done, engine.executor.state, max_rows


def test_eight_concurrent_equal_one_at_a_time(runner, pipeline):
    params = [SamplingParams(max_tokens=8 + 3 * i) for i in range(8)]
    reqs = list(zip(prompts(8), params, strict=True))
    expected = [one_at_a_time(runner, p, sp) for p, sp in reqs]
    out, done, state, max_rows = run_batched(
        runner, reqs, arrivals=[0, 0, 1, 2, 2, 5, 9, 14], pipeline=pipeline
    )
    assert [out[i] for i in range(8)] == expected
    assert all(done[i].finish_reason == "length" for i in range(8))
    assert [done[i].completion_tokens for i in range(8)] == [p.max_tokens for p in params]
    assert max_rows >= 4  # requests really overlapped in one batch
    assert state.rows == [] and state.batch is None and not state.pending


def test_cancelled_request_leaves_the_batch(runner, pipeline):
    params = SamplingParams(max_tokens=30)
    reqs = [(p, params) for p in prompts(3, seed=9)]
    expected = [one_at_a_time(runner, p, params) for p, _ in reqs]
    out, done, state, _ = run_batched(
        runner, reqs, arrivals=[0, 0, 0], cancel=(1, 8), pipeline=pipeline
    )
    assert 1 not in done and out[1] == expected[1][:8]  # nothing after the cancellation
    assert out[0] == expected[0] and out[2] == expected[2]
    assert state.rows == []


def test_seeded_sampling_is_the_same_alone_and_batched(runner, pipeline):
    hot = SamplingParams(max_tokens=12, temperature=1.2, top_k=40, seed=3)
    reqs = [(p, hot) for p in prompts(3, seed=2)]
    alone = [one_at_a_time(runner, p, hot) for p, _ in reqs]
    out, _, _, _ = run_batched(runner, reqs, arrivals=[0, 1, 1], pipeline=pipeline)
    assert [out[i] for i in range(3)] == alone


def test_a_burst_runs_no_step_past_max_tokens(runner, pipeline):
    """One plan with the prompt's last chunk starts a burst, then exactly max_tokens - 1 decode
    steps; two rows: the burst ends on the shorter row's last token, which then leaves the
    batch."""
    prompt = prompts(2, seed=5)
    control = Control(runner.group)
    spec = {"requests": [{"prompt": prompt[0], "params": {"max_tokens": 9}}], "pipeline": pipeline}
    got = run_scenario(runner, control, None, spec)
    steps = ["pre"] * ((len(prompt[0]) + 15) // 16 - 1) + ["step+"] + ["x"] * 8
    assert got["events"] == [["submit", 0], *steps, ["finish", 0], "step"]
    assert got["out"][0]["tokens"] == one_at_a_time(runner, prompt[0], SamplingParams(max_tokens=9))
    two = [
        {"prompt": p, "params": {"max_tokens": n}} for p, n in zip(prompt, (14, 20), strict=True)
    ]
    got = run_scenario(runner, control, None, {"requests": two, "pipeline": pipeline})
    events = got["events"]
    assert events[events.index(["finish", 0]) + 1] == "step+"  # no burst step after its last
    assert events[-3:] == ["x", ["finish", 1], "step"]
    assert [o["tokens"] for o in got["out"]] == [
        one_at_a_time(runner, p, SamplingParams(max_tokens=n))
        for p, n in zip(prompt, (14, 20), strict=True)
    ]
    assert got["left"] == [[], True, 0]


def test_arrivals_eos_and_cancel_mid_burst_equal_one_at_a_time(runner, pipeline):
    """Requests submitted and cancelled from inside a burst (at some request's n-th token),
    one that meets eos mid-burst and a seeded hot one: each gets exactly its tokens alone."""
    hot = {"max_tokens": 16, "temperature": 1.1, "top_k": 30, "seed": 11}
    params = [{"max_tokens": 24}, hot, {"max_tokens": 30}, {"max_tokens": 20}, {"max_tokens": 10}]
    after = [None, [0, 3], [0, 8], [1, 5], [2, 4]]
    requests = [
        {"prompt": p, "params": sp, "after": a}
        for p, sp, a in zip(prompts(5, seed=8), params, after, strict=True)
    ]
    alone = [one_at_a_time(runner, r["prompt"], SamplingParams(**r["params"])) for r in requests]
    # Request 2 meets "eos": a token of its answer that it has not produced before.
    k = next(k for k in range(5, 20) if alone[2][k] not in alone[2][:k])
    eos = alone[2][k]
    spec = {"requests": requests, "cancel": [[3, 7]], "eos": [eos], "prefill_chunk": 64}
    spec["pipeline"] = pipeline
    got = run_scenario(runner, Control(runner.group), None, spec)
    expected = [next((t[:j] for j, x in enumerate(t) if x == eos), t) for t in alone]
    expected[3] = expected[3][:7]
    assert [o["tokens"] for o in got["out"]] == expected
    assert [o["reason"] for o in got["out"]] == ["length", "length", "stop", None, "length"]
    assert len(expected[2]) == k and len(expected[3]) == 7 and got["left"] == [[], True, 0]
    # Every arrival, the cancellation and every end came inside a burst: after its "step+"
    # command or a burst step, never after a plain "step".
    events = got["events"]
    for at, e in enumerate(events):
        if isinstance(e, list) and at > 0:
            assert [c for c in events[:at] if isinstance(c, str)][-1] in ("x", "step+"), (e, events)


def test_each_layout_chooses_its_pipelining(monkeypatch):
    """batch.overlaps: one rank, PP stages and ranks with cores to spare build step k+1 while
    step k computes; CPU TP ranks pinned to one core step one after another (their Python
    would take the compute thread's core)."""
    from types import SimpleNamespace

    from thunderpool.engine import batch

    gpu = mx.default_device().type == mx.DeviceType.gpu
    for cores in (1, 2):
        monkeypatch.setattr(batch, "own_cores", lambda cores=cores: cores)
        assert batch.overlaps(SimpleNamespace(size=1, stage=None))
        assert batch.overlaps(SimpleNamespace(size=2, stage=object()))
        assert batch.overlaps(SimpleNamespace(size=2, stage=None)) == (gpu or cores > 1)
