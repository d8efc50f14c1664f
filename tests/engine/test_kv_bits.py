"""--kv-bits: a quantized KV cache agrees with the plain one on the embedded SmolLM2 (8-bit:
>= 95% of 128 greedy tokens), gives exactly one rank's tokens on TP2, PP2, hybrid and EP with
batched rows and the prefix cache reusing quantized entries, batches and speculates exactly,
holds the bytes per context token the planner counts, and is refused where a cache cannot be
quantized."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from batch_ranks import GREEDY, MAX_TOKENS, prefix_turns, run_ranks, tokens
from conftest import make_tiny, run_trace
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from mlx_lm.utils import load_model

from thunderpool.bench.synthetic import write_truncated
from thunderpool.engine import kv_quant
from thunderpool.engine.control import Control
from thunderpool.engine.drafter import Drafter
from thunderpool.engine.engine import Engine
from thunderpool.engine.loader import Layout, load_shard, read_config
from thunderpool.engine.prefix import kv_bytes_per_token
from thunderpool.engine.prefix_kv import PrefixStore
from thunderpool.engine.sampling import SamplingParams
from thunderpool.errors import ShardingError


@pytest.fixture(scope="module")
def hd64(tmp_path_factory) -> Path:
    """The tiny llama with 64-wide heads, so mlx-lm's group of 64 values fits one head."""
    return make_tiny("llama", tmp_path_factory.mktemp("kv") / "llama-hd64", head_dim=64)


@pytest.fixture(scope="module")
def alone(hd64):
    """Greedy tokens of one prompt alone on one rank with an 8-bit cache, no prefix cache."""
    runner, _, _ = load_shard(hd64, mx.distributed.init(), Layout(kv_bits=8))

    def run(prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
        engine, out = Engine(runner, Control(runner.group), prefill_chunk=16), []
        params = SamplingParams(temperature=0.0, max_tokens=n)
        engine.generate(prompt, params, lambda ev: out.append(ev.token))
        return out

    return run


@pytest.mark.slow
def test_8bit_cache_agrees_with_the_plain_cache_on_smollm2(tmp_path):
    from thunderpool.cluster.node.measure import rank_env

    out = tmp_path / "agreement.json"
    script = Path(__file__).with_name("kv_agreement.py")
    subprocess.run(
        [sys.executable, str(script), str(out), "8", "4"], env=rank_env(), check=True, timeout=600
    )
    result = json.loads(out.read_text())
    print("greedy agreement over 128 tokens:", result["agreement"])
    print("state bytes per context token:", result["bytes_per_token"])
    assert len(result["reference"]) == 128
    assert result["agreement"]["plain"] == 1.0  # the one-forward reading repeats the decode
    assert result["agreement"]["8"] >= 0.95
    # fp32 keys and values against 8 and 4 bits plus an fp32 scale and bias per 64 values.
    config = read_config(resolve_embedded())
    for key, bits in (("plain", None), ("8", 8), ("4", 4)):
        assert result["bytes_per_token"][key] == kv_bytes_per_token(config, bits)
    assert result["bytes_per_token"] == {"plain": 46080, "8": 12960, "4": 7200}


def resolve_embedded() -> Path:
    from thunderpool.models.source import resolve_model

    return resolve_model(None, progress=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel, layout",
    [("tp", {}), ("pp", {}), ("hybrid", {"groups": [1, 1], "layer_split": [3, 1]})],
    ids=["tp2", "pp2", "hybrid1x1"],
)
def test_two_ranks_batching_on_the_prefix_cache_equal_one_rank(
    hd64, alone, tmp_path, parallel, layout
):
    requests = prefix_turns(alone)
    prompts = [r["prompt"] for r in requests]
    spec = {
        "model": str(hd64),
        "parallel": parallel,
        "prefill_chunk": 16,
        "kv_bits": 8,
        "prefix_cache_tokens": 4096,
        "requests": requests,
        **layout,
    }
    got = run_ranks(spec, tmp_path)["out"]
    assert [o["tokens"] for o in got] == [alone(p) for p in prompts]
    assert [o["cached"] for o in got] == [0, 40, 48, 40]


@pytest.mark.slow
def test_expert_parallel_batching_equals_one_rank(tmp_path_factory, tmp_path):
    moe = make_tiny("qwen3_moe", tmp_path_factory.mktemp("kv") / "moe-hd64", head_dim=64)
    runner, _, _ = load_shard(moe, mx.distributed.init(), Layout(kv_bits=8))
    prompts = [tokens(20, 12), tokens(9, 13)]
    want = []
    for prompt in prompts:
        want.append([])
        Engine(runner, Control(runner.group), prefill_chunk=16).generate(
            prompt, SamplingParams(**GREEDY), lambda ev: want[-1].append(ev.token)
        )
    spec = {
        "model": str(moe),
        "parallel": "ep",
        "prefill_chunk": 16,
        "kv_bits": 8,
        "requests": [{"prompt": p, "params": GREEDY} for p in prompts],  # batched
    }
    assert [o["tokens"] for o in run_ranks(spec, tmp_path)["out"]] == want


@pytest.mark.slow
def test_a_rank_job_with_kv_bits_quantizes(hd64, alone, tmp_path):
    prompts = [tokens(20, 7), tokens(9, 8)]
    got = run_trace(hd64, tmp_path / "t.npz", 1, prompts=prompts, max_tokens=8, kv_bits=8)
    assert got["tokens"].tolist() == [alone(p, 8) for p in prompts]
    plain = run_trace(hd64, tmp_path / "p.npz", 1, prompts=prompts, max_tokens=8)
    # The quantized cache moves the logits: the job did not run on the plain cache.
    assert not np.array_equal(got["logits"], plain["logits"])


def test_a_kept_quantized_prefix_restores_exactly(hd64):
    runner, _, _ = load_shard(hd64, mx.distributed.init(), Layout(kv_bits=4))
    cache = runner.make_cache()
    assert all(type(c) is QuantizedKVCache and c.bits == 4 for c in cache)
    runner.forward(mx.array([tokens(30, 9)]), cache)
    store = PrefixStore()
    store.keep(0, cache)
    restored = store.restore(0, 20, runner.make_cache())
    for c, r in zip(cache, restored, strict=True):
        assert r.offset == 20
        for a, b in zip((*c.keys, *c.values), (*r.keys, *r.values), strict=True):
            assert mx.array_equal(a[..., :20, :], b)
    with pytest.raises(RuntimeError, match="kept from a quantized cache"):
        store.restore(0, 20, [KVCache() for _ in cache])


def test_merging_quantized_rows_equals_extending_by_each():
    rows = []
    for n, seed in ((5, 1), (11, 2), (8, 3)):
        c = QuantizedKVCache(64, 8)
        k, v = (mx.random.normal((1, 2, n, 64), key=mx.random.key(seed + i)) for i in (0, 9))
        c.update_and_fetch(k, v)
        rows.append(c)
    merged = kv_quant.merge(rows)
    grown = kv_quant.merge(rows[:1])
    for c in rows[1:]:
        grown.extend(kv_quant.merge([c]))
    assert merged.left_padding.tolist() == grown.left_padding.tolist() == [6, 0, 3]
    assert merged.offset.tolist() == grown.offset.tolist() == [5, 11, 8]
    for a, b in zip((*merged.keys, *merged.values), (*grown.keys, *grown.values), strict=True):
        assert mx.array_equal(a, b[..., : merged._idx, :])


def test_speculation_on_a_quantized_cache_gives_the_plain_tokens(hd64, alone, tmp_path):
    runner, _, _ = load_shard(hd64, mx.distributed.init(), Layout(kv_bits=8))
    drafter = Drafter(load_model(write_truncated(hd64, 2, tmp_path / "cut"))[0], k=3)
    for prompt in (tokens(12, 10), tokens(25, 11)):
        engine, out = Engine(runner, Control(runner.group), drafter=drafter), []
        params = SamplingParams(temperature=0.0, max_tokens=16)
        engine.generate(prompt, params, lambda ev, out=out: out.append(ev.token))
        assert out == alone(prompt, 16)
        assert engine.executor.spec_stats.steps > 0
    # Three rows at once: a batched verify step cuts each row's rejected tail (trim_rows).
    drafter.max_rows = 4  # more rows than the default speculate together
    prompts = [tokens(n, 30 + n) for n in (7, 19, 13)]
    engine, out = Engine(runner, Control(runner.group), drafter=drafter), {}
    for i, prompt in enumerate(prompts):
        out[i] = []
        params = SamplingParams(temperature=0.0, max_tokens=16)
        engine.submit(prompt, params, lambda ev, i=i: out[i].append(ev.token))
    while engine.step():
        pass
    assert [out[i] for i in range(3)] == [alone(p, 16) for p in prompts]
    stats = engine.executor.spec_stats
    assert stats.steps > 0 and 0 < stats.accepted < stats.proposed  # uneven tails were cut


def test_pp_quantizes_only_its_own_layers(hd64):
    runner, _, _ = load_shard(hd64, mx.distributed.init(), Layout(kv_bits=8))
    runner.stage = type("Stage", (), {"local": range(2, 4)})()  # what make_cache reads
    kinds = [type(c) for c in runner.make_cache()]
    assert kinds == [KVCache, KVCache, QuantizedKVCache, QuantizedKVCache]


def build(kind: str, tiny: dict | None = None):
    """A lazily built model of one of tests/families.py's tiny configs."""
    from families import FAMILIES
    from mlx_lm.utils import _get_classes

    config = {**FAMILIES[kind].config, **(tiny or {})}
    model_cls, args_cls = _get_classes(config)
    return model_cls(args_cls.from_dict(config))


@pytest.mark.parametrize(
    "kind, message",
    [
        ("gemma3_text", "gemma3_text keeps its layer 0 state in a RotatingKVCache"),
        ("gpt_oss", "gpt_oss keeps its layer 0 state in a RotatingKVCache"),
        ("qwen3_next", "qwen3_next keeps its layer 0 state in a ArraysCache"),
        ("deepseek_v32", "deepseek_v32 keeps its layer 0 state in a CacheList"),
        ("deepseek_v3", "deepseek_v3 caches a compressed latent \\(MLA\\)"),
        ("qwen3", "qwen3's head width 16 is not a multiple of --kv-group-size 64; drop"),
    ],
)
def test_caches_that_cannot_be_quantized_are_refused(kind, message):
    with pytest.raises(ShardingError, match=f"^--kv-bits 8: {message}"):
        kv_quant.check(build(kind), 8)
    kv_quant.check(build(kind), None)  # unquantized, every family runs


def test_an_attention_that_reads_its_cache_itself_is_refused():
    """mlx-lm's gemma2 soft-caps its scores in its own attention: a quantized cache would
    reach it as (words, scales, biases)."""
    from mlx_lm.utils import _get_classes

    config = {
        "model_type": "gemma2",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": 256,
    }
    model_cls, args_cls = _get_classes(config)
    with pytest.raises(ShardingError, match="^--kv-bits 4: gemma2's attention does not read"):
        kv_quant.check(model_cls(args_cls.from_dict(config)), 4)


def test_a_group_that_fits_the_head_is_named():
    model = build("qwen3", {"head_dim": 32})
    with pytest.raises(ShardingError, match="use --kv-group-size 32$"):
        kv_quant.check(model, 4, 64)
    kv_quant.check(model, 4, 32)


def test_a_quantized_batch_equals_each_row_alone(hd64, alone):
    """Rows join a running batch and leave it (filter, extend, merge of quantized rows)."""
    runner, _, _ = load_shard(hd64, mx.distributed.init(), Layout(kv_bits=4))
    engine = Engine(runner, Control(runner.group), prefill_chunk=16)
    prompts = [tokens(n, 20 + n) for n in (9, 30, 17)]
    lengths, out, seen = (12, 5, 9), {}, set()

    def submit(i: int) -> None:
        out[i] = []
        params = SamplingParams(temperature=0.0, max_tokens=lengths[i])
        engine.submit(prompts[i], params, lambda ev: on_token(i, ev.token))

    def on_token(i: int, token: int) -> None:
        out[i].append(token)
        seen.add(type(engine.executor.state.batch[0]) if engine.executor.state.batch else None)
        if i == 0 and len(out[0]) == 3:
            submit(2)  # joins the running batch mid-burst

    submit(0)
    submit(1)
    while engine.step():
        pass
    assert kv_quant.BatchQuantizedKVCache in seen
    for i, prompt in enumerate(prompts):
        one, got = Engine(runner, Control(runner.group), prefill_chunk=16), []
        params = SamplingParams(temperature=0.0, max_tokens=lengths[i])
        one.generate(prompt, params, lambda ev, got=got: got.append(ev.token))
        assert out[i] == got


def test_generate_refuses_before_any_rank_starts(tiny_models, capsys):
    from thunderpool.cli import main

    argv = ["generate", "--model", str(tiny_models["qwen3"]), "--nodes", "1", "--prompt", "x"]
    assert main([*argv, "--kv-bits", "8"]) == 2
    err = capsys.readouterr().err
    assert "--kv-bits 8: qwen3's head width 16 is not a multiple of --kv-group-size 64" in err
