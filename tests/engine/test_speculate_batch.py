"""Speculative decoding under continuous batching: rows that join, leave, are cancelled, decode
without drafts (penalties) or sample, all in one verify step per position, give every greedy
row exactly the tokens of plain batched decoding, on one rank and on TP2."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from batch_ranks import run_ranks, run_scenario
from conftest import make_tiny, tiny_prompts
from mlx_lm.models.cache import KVCache

from thunderpool.bench.synthetic import write_truncated
from thunderpool.engine import batch as batch_module
from thunderpool.engine.batch import trim_rows
from thunderpool.engine.control import Control
from thunderpool.engine.draft_load import load_drafter
from thunderpool.engine.loader import Layout, load_shard

GREEDY = {"temperature": 0.0}
PENALIZED, SAMPLED, CANCELLED = 1, 3, 2  # request indices
CANCEL_AT = 7


def test_each_row_keeps_its_own_target_distribution():
    """Two sampled rows verified together, each with its own target p and draft q (swapped
    between the rows): each row's first emitted token follows its own p (chi-square, 1k
    draws), not the other row's."""
    from types import SimpleNamespace

    from scipy.stats import chisquare

    from thunderpool.engine.sampling import SamplingParams
    from thunderpool.engine.speculate import accept_rows as _accept

    p = np.array([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.15, 0.2, 0.5]])
    q = p[::-1].copy()  # each row's draft favours the other row's tokens
    logits = mx.array(np.log(np.stack([np.stack([r, r]) for r in p])))  # (2, n+1=2, 5)
    rng = np.random.default_rng(0)
    ex = SimpleNamespace(drafter=SimpleNamespace(rngs={0: rng, 1: rng}))
    rows = [SimpleNamespace(params=SamplingParams(temperature=1.0))] * 2
    counts = np.zeros((2, 5))
    for _ in range(1000):
        drafts = [[int(rng.choice(5, p=q[i]))] for i in range(2)]
        proposals = [(drafts[i], q[i][None]) for i in range(2)]
        outs = _accept(ex, [0, 1], rows, [0, 1], proposals, logits)
        for i in range(2):
            counts[i, outs[i][0]] += 1
    for i in range(2):
        assert chisquare(counts[i], p[i] * counts[i].sum()).pvalue > 1e-3
        assert chisquare(counts[i], p[1 - i] * counts[i].sum()).pvalue < 1e-12


def test_uneven_trims_keep_each_rows_prefix():
    """Three rows of different lengths; after cutting 0, 2 and 3 positions, every row's keys
    and the causal mask's view of them equal the row's prefix cache cut alone."""
    rng = np.random.default_rng(0)
    lengths, trims = [5, 9, 7], [0, 2, 3]
    rows = [mx.array(rng.standard_normal((1, 2, n, 4)).astype(np.float32)) for n in lengths]
    singles = []
    for r in rows:
        c = KVCache()
        c.update_and_fetch(r, r * 2)
        singles.append(c)
    batch = [KVCache.merge(singles)]
    trim_rows(batch, trims)
    c = batch[0]
    assert c.offset.tolist() == [n - t for n, t in zip(lengths, trims, strict=True)]
    for i, (r, t) in enumerate(zip(rows, trims, strict=True)):
        one = c.extract(i)
        want = r[..., : r.shape[2] - t, :]
        np.testing.assert_array_equal(np.array(one.keys), np.array(want))
        np.testing.assert_array_equal(np.array(one.values), np.array(want * 2))
    # The padding every row shared (the longest row cut least) was dropped.
    assert min(c.left_padding.tolist()) == 0 and c._idx == max(c.offset.tolist())


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("specbatch")
    target = make_tiny("llama", root / "target")
    return {"target": target, "cut": write_truncated(target, 3, root / "cut")}


@pytest.fixture(scope="module")
def runner(models):
    return load_shard(models["target"], mx.distributed.init(), Layout())[0]


def scenario(models) -> dict:
    """Five requests of different lengths that arrive mid-burst; one decodes with a penalty
    (no drafts), one samples, one is cancelled."""
    p = tiny_prompts(5, seed=4)
    requests = [
        {"prompt": p[0], "params": GREEDY | {"max_tokens": 30}},
        {"prompt": p[1], "params": GREEDY | {"max_tokens": 14, "repetition_penalty": 1.3}},
        {"prompt": p[2], "params": GREEDY | {"max_tokens": 24}, "after": [0, 3]},
        {
            "prompt": p[3],
            "params": {"max_tokens": 12, "temperature": 0.8, "top_k": 40, "seed": 5},
            "after": [1, 4],
        },
        {"prompt": p[4], "params": GREEDY | {"max_tokens": 10}, "after": [2, 5]},
    ]
    spec = {"model": str(models["target"]), "requests": requests}
    return spec | {"cancel": [[CANCELLED, CANCEL_AT]], "max_batch": 4}


def greedy_rows(out: list[dict]) -> list[list[int]]:
    return [o["tokens"] for i, o in enumerate(out) if i != SAMPLED]


def test_batched_speculation_gives_the_plain_batched_tokens(runner, models, monkeypatch):
    spec = scenario(models)
    plain = run_scenario(runner, Control(runner.group), None, spec)
    trims: list[list[int]] = []
    rows: list[int] = []

    def recording_trim(cache, cut):
        trims.append(list(cut))
        return trim_rows(cache, cut)

    monkeypatch.setattr(batch_module, "trim_rows", recording_trim)
    drafter = load_drafter(models["cut"], models["target"], 3)
    drafter.max_rows = 4  # more rows than the default speculate together: the mechanism
    propose = drafter.propose_rows
    drafter.propose_rows = lambda sids, *a: rows.append(len(sids)) or propose(sids, *a)
    got = run_scenario(runner, Control(runner.group), None, spec, drafter)
    assert greedy_rows(got["out"]) == greedy_rows(plain["out"])
    assert len(got["out"][CANCELLED]["tokens"]) == CANCEL_AT
    assert len(got["out"][SAMPLED]["tokens"]) == 12
    steps, proposed, accepted, _ = got["spec"]
    assert 0 < accepted < proposed  # some drafts rejected: rows cut different tails
    assert max(rows) >= 3  # three rows drafted together in one batched draft forward
    assert any(len(t) > 1 and len(set(t)) > 1 for t in trims)
    assert got["left"] == [[], True, 0]
    # Above max_rows the batch decodes plainly; below it, drafts catch up on what they missed.
    drafter, rows[:] = load_drafter(models["cut"], models["target"], 3), []
    drafter.max_rows, propose = 2, drafter.propose_rows
    drafter.propose_rows = lambda sids, *a: rows.append(len(sids)) or propose(sids, *a)
    capped = run_scenario(runner, Control(runner.group), None, spec, drafter)
    assert greedy_rows(capped["out"]) == greedy_rows(plain["out"])
    assert rows and max(rows) <= 2 and capped["spec"][0] > 0


@pytest.mark.slow
@pytest.mark.parametrize("shards", [["1", "1"], ["1", "0"]], ids=["sharded", "follower-no"])
def test_batched_speculation_is_exact_on_tp2(runner, models, tmp_path, shards):
    """Both TP2 ways to draft: sharded like the target (both ranks draft in lockstep), and
    whole on the leader where a follower cannot hold the draft (it votes so: draft_load.py)."""
    spec = scenario(models)
    plain = run_scenario(runner, Control(runner.group), None, spec)
    # Up to 4 rows speculate (the default is 2): the exchange carries every row's drafts.
    tp = {"parallel": "tp", "draft": str(models["cut"]), "spec_k": 3, "max_rows": 4}
    got = run_ranks(spec | tp | {"draft_shards": shards}, tmp_path)
    assert got["draft_ranks"] == (1 if "0" in shards else 2)
    assert greedy_rows(got["out"]) == greedy_rows(plain["out"])
    assert len(got["out"][SAMPLED]["tokens"]) == 12
    steps, proposed, accepted, _ = got["spec"]
    assert steps > 0 and 0 < accepted < proposed
