"""Collectives per decode step, counted exactly: TP issues 2 all_sums per layer, one all_sum
of the split embedding's lookup, one all_gather of the split output head's logits and one
control exchange; PP one send and one recv on the leader plus the exchange. Counted by the
bench's shim around mx.distributed inside real 2-rank runs, and in one process. Serve's decode
bursts (continuous batching) issue the same per step: no JSON plan, one exchange."""

from __future__ import annotations

import mlx.core as mx
import pytest
from batch_ranks import run_ranks

from thunderpool.bench.breakdown import count_decode_step, counting_collectives, solo_collectives
from thunderpool.bench.run import bench_parallel
from thunderpool.engine.control import Control
from thunderpool.engine.engine import Engine
from thunderpool.engine.loader import Layout, load_shard
from thunderpool.parallel import tensor

LAYERS = 4  # num_hidden_layers of the tiny checkpoints in conftest.py
# 2 per layer + the embedding's + the control exchange's all_sum; the logits' all_gather.
TP_STEP = {"all_gather": 1, "all_sum": 2 * LAYERS + 2}
TP_MODEL = 2 * LAYERS + 2  # all but the control exchange


def test_shim_counts_and_restores():
    real = mx.distributed.all_sum
    with counting_collectives() as counts:
        group = mx.distributed.init()
        mx.eval(mx.distributed.all_sum(mx.ones(3), group=group))
        mx.eval(mx.distributed.all_sum(mx.ones(3), group=group))
    assert counts == {"all_sum": 2}
    assert mx.distributed.all_sum is real


def test_solo_collectives_are_local_stand_ins():
    real = (mx.distributed.all_sum, mx.distributed.send, mx.distributed.recv)
    with solo_collectives():
        x = mx.arange(4.0)
        assert mx.distributed.all_sum(x, group=None).tolist() == [0.0, 1.0, 2.0, 3.0]
        assert mx.distributed.send(x, 1, group=None) is x
        got = mx.distributed.recv((2, 3), mx.float32, 0, group=None)
        assert got.shape == (2, 3) and got.dtype == mx.float32 and not got.any().item()
    assert (mx.distributed.all_sum, mx.distributed.send, mx.distributed.recv) == real


def test_one_process_tp_layout_counts_two_all_sums_per_layer(tiny_models):
    """The uneven-TP wrapping (SumAfter) on a group of one: the same graph as a TP rank's,
    so one decode step builds exactly 2 all_sums per layer and no control message."""
    group = mx.distributed.init()
    runner, _, _ = load_shard(tiny_models["qwen3"], group, Layout())
    for layer in runner.model.layers:
        tensor.shard_attention(layer.self_attn, tensor.HeadShare(0, 6, 0, 3), group)
        tensor.shard_mlp(layer.mlp, [1.0], 0, group)
    counts = count_decode_step(Engine(runner, Control(group)), list(range(1, 9)))
    expected = {"by_op": {"all_sum": 2 * LAYERS}, "model": 2 * LAYERS, "control": 0}
    assert counts == {**expected, "total": 2 * LAYERS}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "parallel", "weights", "by_op", "model"),
    [
        # mlx-lm's even shard (llama, 2 KV heads) and our uneven one (qwen3, 3 KV heads).
        ("llama", "tp", None, TP_STEP, TP_MODEL),
        ("qwen3", "tp", None, TP_STEP, TP_MODEL),
        ("qwen3", "tp", (1.0, 2.0), TP_STEP, TP_MODEL),
        ("llama", "pp", None, {"all_sum": 1, "recv": 1, "send": 1}, 2),
    ],
)
def test_two_ranks_count_per_decode_step(tiny_models, kind, parallel, weights, by_op, model):
    r = bench_parallel(tiny_models[kind], 2, parallel, 8, 6, repeats=2, tp_weights=weights)
    counts = r["breakdown"]["collectives_per_step"]
    assert counts == {"by_op": by_op, "model": model, "control": 1, "total": model + 1}
    assert (r["collectives_per_token"], r["control_collectives_per_token"]) == (model, 1)
    # The count stopped a generation early; both timed runs after it match token for token.
    assert r["identical_runs"] is True and len(r["tokens"]) == 6
    assert len(r["breakdown"]["compute_ms_by_rank"]) == 2


def _minus(after: dict, before: dict) -> dict:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "pipeline"), [("llama", True), ("llama", False), ("qwen3", None)])
def test_two_ranks_count_per_serve_decode_step(tiny_models, tmp_path, kind, pipeline):
    """One request through serve's engine on 2 TP ranks: a prefill plan, the plan of the last
    chunk that starts a burst, then decode steps, each built exactly once: 2 all_sums per
    layer, the embedding's and the exchange's, and the logits' all_gather. Pipelined, the
    leader builds step k before it delivers token k (the first token comes from the prefill),
    so the last "token gap" holds no step."""
    request = {"prompt": list(range(3, 20)), "params": {"max_tokens": 8}}
    spec = {"model": str(tiny_models[kind]), "requests": [request], "count": True}
    got = run_ranks(spec | {"pipeline": pipeline}, tmp_path)
    steps = ["pre", "step+", *["x"] * 7]  # 17 prompt tokens in chunks of 16
    assert got["events"] == [["submit", 0], *steps, ["finish", 0], "step"]
    per_token = got["per_token"]  # (collectives by op, Control.collectives) at each token
    assert len(per_token) == 8
    gaps = [
        (_minus(after[0], before[0]), after[1] - before[1])
        for before, after in zip(per_token, per_token[1:], strict=False)
    ]
    one = (TP_STEP, 1)
    if pipeline:
        assert gaps == [*[one] * 6, ({}, 0)]
        built = 6  # step 1 was built before the first token was delivered
    else:  # the default on CPU ranks pinned to a core (batch.overlaps)
        assert gaps == [one] * 7
        built = 7
    # 7 decode forwards after the prefill, each with exactly one control collective: its
    # token exchange (the plan's JSON came before the first token).
    assert per_token[7][1] - per_token[0][1] == built
    assert _minus(per_token[7][0], per_token[0][0]) == {
        "all_gather": built,
        "all_sum": built * (2 * LAYERS + 2),
    }


def test_solo_steps_issue_no_collective_and_leave_the_engine_as_it_was(tiny_models):
    """measure.solo_step_ms (bench's split of a TP step's forward) on the one-process TP
    layout: a verify of 5 positions and a compiled 2-row decode step, timed with every
    collective stood in for (none reaches mx.distributed), then the engine decodes the same
    tokens as before."""
    from thunderpool.engine.measure import solo_step_ms
    from thunderpool.engine.sampling import SamplingParams

    group = mx.distributed.init()
    runner, _, _ = load_shard(tiny_models["qwen3"], group, Layout())
    for layer in runner.model.layers:
        tensor.shard_attention(layer.self_attn, tensor.HeadShare(0, 6, 0, 3), group)
        tensor.shard_mlp(layer.mlp, [1.0], 0, group)
    engine = Engine(runner, Control(group))
    prompt, params = list(range(1, 9)), SamplingParams(max_tokens=6)
    before, after = [], []
    engine.generate(prompt, params, lambda ev: before.append(ev.token))
    with counting_collectives() as counts:
        ms = [solo_step_ms(runner, prompt, 2, rows, width) for rows, width in ((1, 5), (2, 1))]
    assert counts == {} and all(m > 0 for m in ms)
    engine.generate(prompt, params, lambda ev: after.append(ev.token))
    assert after == before and len(before) == 6
