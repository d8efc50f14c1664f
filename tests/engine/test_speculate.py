"""Speculative decoding: the accept rules keep the target's tokens (greedy) and distribution
(sampling, chi-square), and the engine with a draft gives exactly the tokens (and logits) of
plain decoding on one rank, TP2 and PP2, whatever the draft's acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny, run_trace, tiny_prompts
from mlx_lm.utils import load_model

from thunderpool.bench.synthetic import write_truncated
from thunderpool.engine.control import Control
from thunderpool.engine.draft_load import load_drafter
from thunderpool.engine.drafter import Drafter, check_speculable
from thunderpool.engine.engine import Engine
from thunderpool.engine.loader import Layout, load_shard
from thunderpool.engine.plan import StepPlan
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.speculate import accept_greedy, accept_sampled
from thunderpool.errors import ThunderpoolError

GREEDY = SamplingParams(max_tokens=40)


def test_accept_greedy_keeps_the_agreeing_prefix_and_the_targets_next():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == [4]
    assert accept_greedy([], [3]) == [3]


def test_rejection_sampling_keeps_the_target_distribution():
    """Two draft tokens from q against position-wise targets p: the first two emitted tokens
    follow p[0] x p[1] (chi-square over 25 cells, 10k draws), although q is far from p."""
    from scipy.stats import chisquare

    rng = np.random.default_rng(0)
    p = np.array([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.2, 0.25, 0.4], [0.2] * 5])
    q = np.array([[0.05, 0.05, 0.1, 0.3, 0.5], [0.6, 0.1, 0.1, 0.1, 0.1]])
    counts = np.zeros((5, 5))
    for _ in range(10_000):
        drafts = [int(rng.choice(5, p=q[0])), int(rng.choice(5, p=q[1]))]
        out = accept_sampled(drafts, p, q, rng)
        if len(out) < 2:  # rejected at the first: the second token is a fresh draw from p[1]
            out.append(int(rng.choice(5, p=p[1])))
        counts[out[0], out[1]] += 1
    expected = np.outer(p[0], p[1]) * counts.sum()
    assert chisquare(counts.ravel(), expected.ravel()).pvalue > 1e-3
    # The same counts against the draft's own distribution are far off (the test can fail).
    wrong = np.outer(q[0], q[1]) * counts.sum()
    assert chisquare(counts.ravel(), wrong.ravel()).pvalue < 1e-12


def test_plan_carries_the_draft_length():
    plan = StepPlan(decode=True, spec=(4, 0, 2))
    assert StepPlan.decode_bytes(plan.encode()) == plan
    with pytest.raises(ValueError, match=r"spec=\(3,\)"):
        StepPlan(spec=(3,))
    with pytest.raises(ValueError, match=r"spec=\(0, 0\)"):
        StepPlan(decode=True, spec=(0, 0))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    target = make_tiny("llama", root / "target")
    return {
        "target": target,
        "random": make_tiny("llama", root / "random", seed=5),  # same vocab, ~0 acceptance
        "cut": write_truncated(target, 3, root / "cut"),  # partial acceptance
    }


@pytest.fixture(scope="module")
def runner(models):
    return load_shard(models["target"], mx.distributed.init(), Layout())[0]


def generate(runner, drafter, prompts, params=GREEDY) -> tuple[list[list[int]], Engine]:
    """Every prompt submitted at once (a batch while two or more run), to its end."""
    engine = Engine(runner, Control(runner.group), prefill_chunk=16, drafter=drafter)
    out: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        out[i] = []
        engine.submit(prompt, params, lambda ev, i=i: out[i].append(ev.token))
    while engine.step():
        pass
    return [out[i] for i in range(len(prompts))], engine


@pytest.mark.parametrize(("draft", "acceptance"), [("target", 1.0), ("cut", None), ("random", 0)])
def test_greedy_speculation_gives_the_plain_tokens(runner, models, draft, acceptance):
    prompts = tiny_prompts(3 if draft == "cut" else 2)
    plain = [generate(runner, None, [p])[0][0] for p in prompts]
    drafter = Drafter(load_model(models[draft])[0], k=4)
    stats = []
    for p, ref in zip(prompts, plain, strict=True):
        tokens, engine = generate(runner, drafter, [p])
        assert tokens[0] == ref
        stats.append(engine.executor.spec_stats)
    rate = sum(s.accepted for s in stats) / sum(s.proposed for s in stats)
    if acceptance is None:
        assert 0 < rate < 1  # some drafts rejected mid-way: the KV trim path runs
    else:
        assert rate == acceptance
    if acceptance == 1.0:
        assert all(s.tokens_per_step > 4 for s in stats)  # every row keeps k = 4
    if acceptance == 0:  # k = 4 at the first step, then one draft per step (draft_length.py)
        assert all(s.proposed < 2 * s.steps for s in stats)
    if draft != "cut":
        return
    # Three requests at once: the rows speculate together (batched drafts, one verify forward
    # of every row; test_speculate_batch.py covers joins, leaves and rows without drafts).
    together, engine = generate(runner, drafter, prompts)
    assert together == plain
    assert engine.executor.spec_stats.steps > 0


def test_seeded_speculative_sampling_is_reproducible(runner, models):
    drafter = Drafter(load_model(models["cut"])[0], k=3)
    hot = SamplingParams(max_tokens=30, temperature=1.0, top_k=20, seed=3)
    a = generate(runner, drafter, tiny_prompts(1), hot)[0]
    b = generate(runner, drafter, tiny_prompts(1), hot)[0]
    assert a == b and len(a[0]) == 30


def test_a_draft_of_another_vocabulary_is_refused(models, tmp_path):
    other = tmp_path / "other"
    write_truncated(models["target"], 1, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"vocab_size": 300}))
    with pytest.raises(ThunderpoolError, match="vocab 300"):
        load_drafter(other, models["target"])


def test_caches_that_cannot_drop_a_tail_are_refused():
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    check_speculable([KVCache()], "model")
    with pytest.raises(ThunderpoolError, match="RotatingKVCache"):
        check_speculable([KVCache(), RotatingKVCache(max_size=8)], "model")
    with pytest.raises(ThunderpoolError, match="ArraysCache"):
        check_speculable([ArraysCache(2)], "model")


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["tp", "pp"])
def test_speculation_is_exact_on_two_ranks(runner, models, tmp_path, parallel):
    """TP2 and PP2 with a partly accepted draft: the plain one-rank tokens, and logits close
    to them (each verify position against the same position decoded one token at a time)."""
    prompts = tiny_prompts(2)
    engine = Engine(runner, Control(runner.group), prefill_chunk=16)
    plain, logits = [], []
    for p in prompts:
        rows, tokens = [], []
        engine.executor.on_logits = lambda sids, out, rows=rows: rows.append(np.array(out[0]))
        engine.generate(p, SamplingParams(max_tokens=24), lambda ev, t=tokens: t.append(ev.token))
        plain.append(tokens)
        logits.append(np.stack(rows))
    out = run_trace(
        models["target"],
        tmp_path / "spec.npz",
        2,
        parallel,
        prompts=prompts,
        max_tokens=24,
        draft_model=str(models["cut"]),
        spec_k=3,
        env={"THUNDERPOOL_DRAFT_SHARDS": "1"},  # TP: sharded however the timing falls
    )
    np.testing.assert_array_equal(out["tokens"], np.array(plain))
    done = next(e.event for e in out["events"] if e.event["kind"] == "done")
    assert done["spec_steps"] > 0 and 0 < done["spec_acceptance"] < 1
    # TP shards the draft like the target (both ranks draft); PP drafts on the leader.
    assert done["spec_draft_ranks"] == (2 if parallel == "tp" else 1)
    np.testing.assert_allclose(out["logits"], np.stack(logits), atol=1e-4, rtol=1e-4)


def test_metrics_report_acceptance(runner, models):
    from thunderpool.api.metrics import render
    from thunderpool.engine.speculate import spec_metrics

    drafter = Drafter(load_model(models["target"])[0], k=2)
    _, engine = generate(runner, drafter, tiny_prompts(1))
    keys = spec_metrics(engine)
    assert keys["spec_acceptance_rate"] == 1.0 and keys["spec_tokens_per_step"] > 2
    text = render(keys, {})
    assert "# TYPE thunderpool_spec_draft_tokens_total counter" in text
    assert "thunderpool_spec_acceptance_rate 1" in text


def test_draftable_synthetic_damps_only_later_layers_writes(tmp_path):
    from safetensors.numpy import load_file

    from thunderpool.bench.synthetic import PRESETS, write_synthetic

    shape = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
    shape |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
    out = write_synthetic(PRESETS["1b-draftable"] | shape, tmp_path / "m")
    w = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    first, later = "model.layers.0.", "model.layers.1."
    ratio = w[later + "mlp.down_proj.weight"].std() / w[first + "mlp.down_proj.weight"].std()
    assert ratio == pytest.approx(PRESETS["1b-draftable"]["residual_scale"], rel=0.2)
    assert w[later + "self_attn.q_proj.weight"].std() == pytest.approx(0.02, rel=0.2)
    assert "residual_scale" not in json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("draft", [None, "cut"])
def test_a_step_account_changes_no_token_and_accounts_for_every_one(runner, models, draft):
    """bench's step account (engine/account.py): the same tokens with it on, every delivered
    token counted in a step, and each step's parts adding up to the time between steps."""
    from thunderpool.engine.account import StepAccount

    prompts = tiny_prompts(2)
    plain = generate(runner, None, prompts)[0]
    drafter = Drafter(load_model(models[draft])[0], k=4) if draft else None
    engine = Engine(runner, Control(runner.group), prefill_chunk=16, drafter=drafter)
    engine.executor.account = acct = StepAccount()
    out: dict[int, list[int]] = {0: [], 1: []}
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, GREEDY, lambda ev, i=i: out[i].append(ev.token))
    while engine.step():
        pass
    assert [out[0], out[1]] == plain
    # Every token is counted once: in its step, or (a request's first) at its prefill.
    assert sum(acct.tokens) + acct.outside == sum(map(len, plain))
    assert acct.outside <= len(prompts)
    assert all(v >= 0 for step in acct.steps for v in step.values())
    parts = {p for step in acct.steps for p in step}
    assert {"forward", "exchange", "deliver"} <= parts
    assert ({"draft", "trim", "accept"} <= parts) == (draft is not None)
    summary = acct.summary()
    assert summary["total"]["median_ms"] >= summary["forward"]["median_ms"] > 0
    if draft is None:
        assert max(acct.rows) == 2 and summary["tokens_per_step"] in (1, 2)


def test_a_sharded_draft_is_kept_only_where_its_token_is_timed_faster(models, monkeypatch):
    """draft_load._sharding_pays: the sharded token, timed with its collectives, against the
    shard alone times the ranks; THUNDERPOOL_DRAFT_SHARDS=1 keeps it regardless, and any
    other value than 0, 1 or auto is refused by name."""
    from thunderpool.engine import draft_load, measure

    group = mx.distributed.init()
    draft, _, _ = load_shard(models["cut"], group, Layout())
    control = Control(group)
    monkeypatch.setattr(measure, "solo_step_ms", lambda *a: 1e6)  # a whole draft: slow
    assert draft_load._sharding_pays(draft, control)
    monkeypatch.setattr(measure, "solo_step_ms", lambda *a: 0.0)  # a whole draft: free
    assert not draft_load._sharding_pays(draft, control)
    monkeypatch.setenv("THUNDERPOOL_DRAFT_SHARDS", "1")
    assert draft_load._sharding_pays(draft, control)
    monkeypatch.setenv("THUNDERPOOL_DRAFT_SHARDS", "yes")
    with pytest.raises(ThunderpoolError, match="THUNDERPOOL_DRAFT_SHARDS='yes'"):
        draft_load._sharding_pays(draft, control)
