"""The engine benchmark reports exact facts (tokens, counts), whatever the timings were."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from thunderpool.bench.accuracy import _step_split
from thunderpool.bench.breakdown import decode_breakdown
from thunderpool.bench.energy import open_meter
from thunderpool.bench.engine_bench import Run, spread, synthetic_prompt, timed
from thunderpool.bench.report import render_table, write_plots
from thunderpool.bench.run import run_bench, scaling
from thunderpool.bench.synthetic import PRESETS, parameter_count, write_synthetic

LAYERS = 4  # num_hidden_layers of the tiny checkpoints in conftest.py


def test_run_rates_follow_from_the_timings():
    run = Run(tokens=[5, 6, 7, 8, 9], prompt_tokens=20, ttft_s=0.5, decode_s=2.0)
    assert run.prefill_tps == 40.0
    assert run.decode_tps == 2.0  # 4 steps after the first token
    assert Run([1], 3, 0.1, 0.0).decode_tps == 0.0


def test_timed_keeps_every_token_in_order():
    run = timed(iter([3, 1, 4, 1, 5]), prompt_tokens=7)
    assert run.tokens == [3, 1, 4, 1, 5]
    assert run.prompt_tokens == 7
    assert run.ttft_s >= 0 and run.decode_s >= 0


def test_spread_and_prompt_are_deterministic():
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    prompt = synthetic_prompt(50, vocab_size=256)
    assert prompt == synthetic_prompt(50, vocab_size=256)
    assert len(prompt) == 50 and all(0 <= t < 256 for t in prompt)


PNG = b"\x89PNG\r\n\x1a\n"


def test_breakdown_splits_a_step_exactly():
    counts = {"model": 60, "control": 1, "total": 61, "by_op": {"all_sum": 61}}
    tp = decode_breakdown(50.0, "tp", [40.0, 38.0], counts, 0.1, 0.05)
    assert tp["compute_ms"] == 40.0  # the slowest rank
    assert tp["collective_ms"] == pytest.approx(60 * 0.1 + 0.05)
    assert tp["wait_ms"] == pytest.approx(50.0 - 40.0 - 6.05)
    assert tp["measured_collective_ms"] == 10.0
    assert tp["latency_bound_ms"] == pytest.approx(6.0)
    assert tp["collective_ratio"] == pytest.approx(10.0 / 6.0)
    pp = decode_breakdown(50.0, "pp", [30.0, 25.0], {**counts, "model": 2}, 0.1, 0.05)
    assert pp["compute_ms"] == 55.0  # stages run one after another
    assert pp["wait_ms"] == 0.0 and pp["measured_collective_ms"] == 0.0  # clamped
    assert pp["collective_ratio"] is None  # the latency bound is TP's
    one = decode_breakdown(20.0, "single", [], {**counts, "model": 0, "control": 0}, 0, 0)
    assert (one["compute_ms"], one["collective_ms"], one["collective_ratio"]) == (20.0, 0, None)


def fake_layout(parallel: str, n: int, decode: float, prefill: float) -> dict:
    rate = lambda v: {"median": v, "min": v * 0.9, "max": v * 1.1}  # noqa: E731
    step = 1e3 / decode
    return {
        "parallel": parallel,
        "world_size": n,
        "ttft_ms": rate(100.0),
        "prefill_tps": rate(prefill),
        "decode_tps": rate(decode),
        "collectives_per_token": 8 if parallel == "tp" else (2 if parallel == "pp" else 0),
        "control_collectives_per_token": 1 if n > 1 else 0,
        "breakdown": decode_breakdown(
            step,
            parallel,
            [step * 0.6] * n,
            {"model": 8, "control": 1, "total": 9, "by_op": {"all_sum": 9}},
            0.1,
            0.05,
        ),
    }


def fake_results(pin: bool) -> dict:
    single = fake_layout("single", 1, 20.0, 200.0)
    results = {
        "model": "/m/SmolLM2",
        "nodes": [2],
        "single": {
            "prompt_tokens": 16,
            "max_tokens": 8,
            "repeats": 3,
            "thunderpool": single,
            "mlx_lm": fake_layout("single", 1, 19.0, 190.0),
        },
        "parallel": {
            "tp2": fake_layout("tp", 2, 30.0, 350.0),
            "pp2": fake_layout("pp", 2, 18.0, 190.0),
            "tp3": {"error": "boom", "parallel": "tp", "world_size": 3},
        },
    }
    if pin:
        results["pinned"] = fake_layout("single", 1, 15.0, 150.0)
    return results


def test_planner_accuracy_splits_both_steps_alike():
    from thunderpool.planner.cost import Breakdown

    predicted = Breakdown(compute_s=0.001, memory_s=0.030, collective_s=0.005, dispatch_s=0.007)
    split = _step_split(predicted, {"step_ms": 50.0, "compute_ms": 36.0, "collective_ms": 6.0})
    assert split == pytest.approx(
        {
            "predicted_step_ms": 43.0,
            "predicted_compute_ms": 38.0,
            "predicted_outside_ms": 5.0,
            "measured_step_ms": 50.0,
            "measured_compute_ms": 36.0,
            "measured_outside_ms": 14.0,
            "measured_collective_ms": 6.0,
        }
    )
    # One rank: bench's compute is the whole step.
    assert _step_split(predicted, {"step_ms": 40.0})["measured_outside_ms"] == 0.0


def test_scaling_series_and_speedups_from_the_baseline():
    results = fake_results(pin=True)
    s = scaling(results)
    assert s["baseline"] == "1 rank pinned to one core"
    assert [p[:2] for p in s["decode_tps"]["tp"]] == [[1, 15.0], [2, 30.0]]
    assert [p[:2] for p in s["decode_tps"]["pp"]] == [[1, 15.0], [2, 18.0]]
    assert s["decode_speedup"] == {"tp2": 2.0, "pp2": pytest.approx(1.2)}
    assert s["prefill_speedup"] == {
        "tp2": pytest.approx(350 / 150),
        "pp2": pytest.approx(190 / 150),
    }
    unpinned = scaling(fake_results(pin=False))
    assert unpinned["baseline"] == "1 rank, all cores"
    assert unpinned["decode_speedup"] == {"tp2": 1.5, "pp2": 0.9}


def test_plots_and_table_from_a_fake_run(tmp_path):
    results = fake_results(pin=True)
    results["scaling"] = scaling(results)
    write_plots(results, tmp_path / "scaling.png", tmp_path / "breakdown.png")
    for name in ("scaling.png", "breakdown.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    console = Console(file=io.StringIO(), width=100)
    console.print(render_table(results))
    printed = console.file.getvalue()
    for row in ("mlx-lm", "pinned", "TP2", "PP2", "boom", "8+1", "2.00"):
        assert row in printed


def test_synthetic_checkpoint_loads_with_the_expected_parameters(tmp_path):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    assert 1.0e9 < parameter_count(PRESETS["1b"]) < 1.2e9
    config = {**PRESETS["1b"], "hidden_size": 64, "intermediate_size": 96, "vocab_size": 128}
    config |= {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
    out = write_synthetic(config, tmp_path / "syn")
    model, _ = load_model(out)
    assert sum(v.size for _, v in tree_flatten(model.parameters())) == parameter_count(config)
    assert not (tmp_path / "syn.partial").exists()


@pytest.mark.slow
def test_run_bench_on_tiny_llama(tiny_models, tmp_path):
    out = tmp_path / "bench.json"
    console = Console(file=io.StringIO(), width=200)
    results = run_bench(
        tiny_models["llama"],
        nodes=2,
        prompt_tokens=16,
        max_tokens=8,
        repeats=2,
        json_out=out,
        out_dir=tmp_path / "out",
        console=console,
    )

    single = results["single"]
    assert single["identical_tokens"] is True
    assert len(single["tokens"]) == 8
    for engine in ("thunderpool", "mlx_lm"):
        assert single[engine]["generated_tokens"] == 8

    tp, pp = results["parallel"]["tp2"], results["parallel"]["pp2"]
    assert (tp["parallel"], tp["world_size"]) == ("tp", 2)
    # + the split embedding's all_sum and the split head's all_gather
    assert tp["collectives_per_token"] == 2 * LAYERS + 2
    by_op = {"all_gather": 1, "all_sum": 2 * LAYERS + 2}  # + the control exchange
    assert tp["breakdown"]["collectives_per_step"]["by_op"] == by_op
    assert tp["breakdown"]["logits_all_gather_ms"] > 0
    assert (pp["parallel"], pp["world_size"]) == ("pp", 2)
    assert pp["collectives_per_token"] == 2  # the leader's send and recv
    for r in (tp, pp):
        # fp32 TP and PP decode the same greedy tokens as one rank.
        assert r["tokens"] == single["tokens"]
        assert r["identical_runs"] is True
        assert r["control_collectives_per_token"] == 1
        assert r["generated_tokens"] == 8
        assert [rank["rank"] for rank in r["ranks"]] == [0, 1]
        assert all(rank["param_bytes"] > 0 and rank["peak_rss_bytes"] > 0 for rank in r["ranks"])
        assert set(r["breakdown"]) >= {"step_ms", "compute_ms", "collective_ms", "wait_ms"}
    assert [rank["layers"] for rank in pp["ranks"]] == [[0, 2], [2, 4]]

    assert [p[0] for p in results["scaling"]["decode_tps"]["tp"]] == [1, 2]
    assert set(results["scaling"]["decode_speedup"]) == {"tp2", "pp2"}
    meter, reason = open_meter()
    if meter is None:  # e.g. no RAPL here: the reason is reported instead of a number
        assert results["energy"] == {"available": False, "reason": reason}
    else:
        meter.close()
        assert results["energy"]["decode_joules_per_token"] > 0
    for f in ("bench.json", "scaling.png", "breakdown.png"):
        assert (tmp_path / "out" / f).is_file()
    for f in ("bench-scaling.png", "bench-breakdown.png"):
        assert (tmp_path / f).read_bytes()[:8] == PNG
    assert json.loads(out.read_text()) == results
    assert json.loads((tmp_path / "out" / "bench.json").read_text()) == results
    printed = console.file.getvalue()
    for row in ("mlx-lm", "thunderpool", "TP2", "PP2", "goal >= 0.95", "energy"):
        assert row in printed


def test_cluster_bench_runs_the_synthetic_model(monkeypatch, tmp_path, capsys):
    """`bench --cluster --synthetic 1b` plans and runs the synthetic checkpoint, not SmolLM2."""
    import thunderpool.bench.synthetic as synthetic
    from thunderpool.cli import commands, main

    seen = {}
    monkeypatch.setattr(commands, "_same_blas_as_ranks", lambda: None)
    monkeypatch.setattr(synthetic, "synthetic_model", lambda name, console: tmp_path / name)
    monkeypatch.setattr(commands, "_bench_accuracy", lambda args: seen.update(m=args.model))
    assert main(["bench", "--cluster", "--synthetic", "1b"]) == 0
    assert seen["m"] == str(tmp_path / "1b")
    assert main(["bench", "--cluster", "--synthetic", "1b", "--model", "x"]) == 2
    assert "--synthetic and --model both name a model" in capsys.readouterr().err


def test_spec_bench_accounts_for_plain_batched_and_speculative_steps(tiny_models, tmp_path):
    """bench --draft-layers with --concurrency: the same tokens in every mode, and a step
    account of each mode, alone and batched, whose parts are the ones the mode runs."""
    from thunderpool.bench.speculative import run_spec_bench
    from thunderpool.bench.synthetic import write_truncated
    from thunderpool.engine.job import BenchTask

    target = tiny_models["llama"]
    draft = write_truncated(target, 2, tmp_path / "draft")
    console = Console(file=io.StringIO(), width=200)
    task = BenchTask(prompt_tokens=8, max_tokens=12, repeats=1, concurrency=(1, 2))
    [result] = run_spec_bench(target, draft, [(1, "tp")], task, 3, console)
    for level in result["batching"]:
        assert level["identical_tokens"] is True
        accounts = {a["mode"]: a for a in level["accounts"]}
        assert set(accounts) == {"plain", "spec"} and accounts["plain"]["rows"] == level["rows"]
        plain, spec = accounts["plain"]["account"], accounts["spec"]["account"]
        assert {"forward", "sample", "deliver"} <= set(plain) and "draft" not in plain
        assert {"draft", "forward", "accept", "trim"} <= set(spec) and "sample" not in spec
        assert plain["rows"] == level["rows"] and plain["tokens_per_step"] == level["rows"]
        assert spec["tokens_per_step"] >= level["rows"]  # at least the target's own token each
    printed = console.file.getvalue()
    assert "step account: single 1, 2 row(s)" in printed and "timed ms/token" in printed


def test_batching_bench_runs_mlx_lms_batch_generator_on_the_same_prompts(tiny_models):
    """bench --concurrency on one rank: mlx-lm's BatchGenerator on the same checkpoint (its
    own load, in mlx-lm's layout) and prompts, beside ours, with the same greedy tokens in
    every stream."""
    import mlx.core as mx

    from thunderpool.bench.batching import bench_concurrency
    from thunderpool.engine.control import Control
    from thunderpool.engine.engine import Engine
    from thunderpool.engine.loader import Layout, load_shard

    runner = load_shard(tiny_models["llama"], mx.distributed.init(), Layout())[0]
    engine = Engine(runner, Control(runner.group))
    levels = bench_concurrency(
        engine, (1, 3), prompt_tokens=9, max_tokens=10, vocab=256, model_dir=tiny_models["llama"]
    )
    assert [r["concurrency"] for r in levels] == [1, 3]
    for r in levels:
        assert r["same_tokens_as_mlx_lm"] is True
        assert r["mlx_lm_decode_tps"] > 0 and r["decode_tps"] > 0


def test_a_tp_steps_forward_splits_into_compute_waiting_and_collectives():
    """bench's split of an accounted forward (median 30 ms) by each rank's forward timed
    alone: the leader's 20 ms, the slower rank's 4 ms more, and the 6 ms left."""
    from thunderpool.bench.accounts import forward_split

    account = {"forward": {"median_ms": 30.0}}
    split = forward_split(account, [20.0, 24.0])
    assert split == {"compute alone": 20.0, "waiting": 4.0, "collectives": 6.0}
    assert forward_split(account, []) == {}  # one rank: nothing to split
