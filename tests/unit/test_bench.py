"""The engine benchmark reports exact facts (tokens, counts), whatever the timings were."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from thunderpool.bench.engine_bench import Run, run_bench, spread, synthetic_prompt, timed

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
        console=console,
    )

    single = results["single"]
    assert single["identical_tokens"] is True
    assert len(single["tokens"]) == 8
    for engine in ("thunderpool", "mlx_lm"):
        assert single[engine]["generated_tokens"] == 8

    tp, pp = results["parallel"]["tp"], results["parallel"]["pp"]
    assert (tp["parallel"], tp["world_size"]) == ("tp", 2)
    assert tp["collectives_per_token"] == 2 * LAYERS
    assert (pp["parallel"], pp["world_size"]) == ("pp", 2)
    assert pp["collectives_per_token"] == 2
    for r in (tp, pp):
        # fp32 TP and PP decode the same greedy tokens as one rank.
        assert r["tokens"] == single["tokens"]
        assert r["identical_runs"] is True
        assert r["control_collectives_per_token"] == 1
        assert r["generated_tokens"] == 8
        assert [rank["rank"] for rank in r["ranks"]] == [0, 1]
        assert all(rank["param_bytes"] > 0 and rank["peak_rss_bytes"] > 0 for rank in r["ranks"])
    assert [rank["layers"] for rank in pp["ranks"]] == [[0, 2], [2, 4]]

    assert json.loads(out.read_text()) == results
    printed = console.file.getvalue()
    for row in ("mlx-lm", "thunderpool", "TP2", "PP2", "goal >= 0.95"):
        assert row in printed
