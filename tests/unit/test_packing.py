"""Cutting quantized matrices along their input: whole groups and whole packed words, for
every MLX format, and the head/channel shares that TP moves onto those boundaries.

Reference: mx.dequantize of the whole matrix, then the same columns. Expected: the cut
matrix dequantizes to exactly those columns (bit for bit), for affine 2..8 bits at groups
32, 64 and 128 and for mxfp4, nvfp4 and mxfp8 (no biases); a cut off the boundaries is refused
with a message naming the format; preflight refuses a layout the boundaries cannot take with
one line naming the format, the layout and the tp that work.
"""

from __future__ import annotations

import json
import re

import mlx.core as mx
import mlx.nn as nn
import pytest

from thunderpool.engine.loader import Layout, build_lazy, preflight
from thunderpool.errors import ShardingError
from thunderpool.parallel import tensor
from thunderpool.parallel.heads import HeadShare, split_heads
from thunderpool.parallel.packing import Packing, head_unit
from thunderpool.parallel.slicing import slice_cols

AFFINE = [("affine", bits, group) for bits in (2, 3, 4, 5, 6, 8) for group in (32, 64, 128)]
FORMATS = AFFINE + [("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)]
IN = 384  # three groups of 128


def _layer(mode: str, bits: int, group: int) -> nn.QuantizedLinear:
    mx.random.seed(bits * 1000 + group)
    return nn.QuantizedLinear.from_linear(
        nn.Linear(IN, 8, bias=False), group_size=group, bits=bits, mode=mode
    )


def _dequantized(m: nn.QuantizedLinear) -> mx.array:
    return mx.dequantize(
        m["weight"], m["scales"], m.get("biases"), group_size=m.group_size, bits=m.bits, mode=m.mode
    )


def test_steps_are_whole_words_and_groups():
    # 32 values are 3 words at 3 bits and 5 at 5; 16 values are 3 words at 6 bits.
    runs = {bits: Packing(bits, 1).step for bits in (2, 3, 4, 5, 6, 8)}
    assert runs == {2: 16, 3: 32, 4: 8, 5: 32, 6: 16, 8: 4}
    assert {Packing(b, g, m).step for m, b, g in FORMATS} == {16, 32, 64, 128}
    assert Packing(3, 32).words(96) == 9 and Packing(6, 64).words(64) == 12
    with pytest.raises(ShardingError, match="do not fill whole uint32 words"):
        Packing(3, 32).words(8)


@pytest.mark.parametrize("mode,bits,group", FORMATS, ids=[f"{m}{b}g{g}" for m, b, g in FORMATS])
def test_cut_columns_dequantize_to_the_same_columns(mode, bits, group):
    full = _dequantized(_layer(mode, bits, group))
    step = Packing(bits, group, mode).step
    for a, b in [(0, step), (step, IN), (IN - step, IN), (0, IN)]:
        m = _layer(mode, bits, group)
        slice_cols(m, a, b)
        assert ("biases" in m) == (mode == "affine")
        assert mx.array_equal(_dequantized(m), full[:, a:b]).item(), (a, b)
        x = mx.random.normal((2, b - a))
        want = x @ full[:, a:b].T
        assert mx.allclose(m(x), want, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize(
    "mode,bits,group", [("affine", 3, 32), ("affine", 6, 64), ("nvfp4", 4, 16)]
)
def test_cut_off_the_boundaries_is_refused(mode, bits, group):
    m = _layer(mode, bits, group)
    name = f"{bits}-bit affine (group {group})" if mode == "affine" else mode
    want = rf"\({re.escape(name)}\): cuts must fall every {group} features"
    with pytest.raises(ShardingError, match=want):
        slice_cols(m, 0, group // 2)


def test_head_shares_move_to_whole_runs_of_heads():
    # head_dim 64 cut every 128 features: heads in pairs.
    assert head_unit(64, [128]) == 2 and head_unit(128, [64]) == 1 and head_unit(8, [32]) == 4
    # 8 heads, 4 KV groups of 2 on 3 ranks: whole KV groups (2 + 1 + 1) already fall on pairs.
    assert split_heads(8, 4, [1, 1, 1], unit=2) == [
        HeadShare(0, 4, 0, 2),
        HeadShare(4, 6, 2, 3),
        HeadShare(6, 8, 3, 4),
    ]
    # 8 heads, 2 KV groups on 2 ranks weighted 3:1: a share of KV groups never splits a pair.
    assert split_heads(8, 2, [3, 1], unit=4) == [HeadShare(0, 4, 0, 1), HeadShare(4, 8, 1, 2)]
    # 16 heads, 2 KV groups on 4 ranks weighted 3:1 within each: 6 + 2 with unit 2, 4 + 4
    # (the nearest whole runs of 4) with unit 4.
    assert [s.q1 - s.q0 for s in split_heads(16, 2, [3, 1, 3, 1], unit=2)] == [6, 2, 6, 2]
    assert [s.q1 - s.q0 for s in split_heads(16, 2, [3, 1, 3, 1], unit=4)] == [4, 4, 4, 4]
    with pytest.raises(ShardingError, match="tp=3 cannot give each rank whole runs of 4"):
        split_heads(8, 2, [1, 1, 1], unit=4)


def _quantized_checkpoint(tmp_path, config: dict, group: int, bits: int = 4):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model, config = quantize_model(model, dict(config), group, bits)
    save_model(tmp_path, model)
    save_config(config, config_path=tmp_path / "config.json")
    assert any(n.endswith("o_proj.scales") for n, _ in tree_flatten(model.parameters()))
    return tmp_path


def test_preflight_names_format_layout_and_what_works(tmp_path):
    from families import FAMILIES

    # The family matrix's llama: 8 heads of 8 channels, 2 KV heads. At group 32, o_proj is
    # cut every 4 heads: TP2 runs (uneven path), TP3 cannot.
    config = {**FAMILIES["llama"].config, "architectures": ["LlamaForCausalLM"]}
    model_dir = _quantized_checkpoint(tmp_path, config, 32)
    preflight(model_dir, 2, Layout("tp"))
    with pytest.raises(ShardingError) as e:
        preflight(model_dir, 3, Layout("tp"))
    text = str(e.value)
    assert "\n" not in text
    assert text == (
        "llama quantized as 4-bit affine (group 32): tp=3 with weights [1.0, 1.0, 1.0] cannot "
        "give each rank whole runs of 4 of the 8 query heads (o_proj is cut only on whole "
        "groups and packed words, every 32 inputs); use tp in [2] (equal weights) or "
        "--parallel pp"
    )
    preflight(model_dir, 3, Layout("pp"))  # what works, works


def test_experts_too_narrow_for_tp3_still_take_ep3(tmp_path):
    from quant_formats import FAMILIES

    # 256 expert channels in groups of 128 cannot go to 3 ranks; expert parallelism keeps
    # each expert whole, so it is not refused.
    config = json.loads(json.dumps(FAMILIES["qwen3_moe"]))
    model_dir = _quantized_checkpoint(tmp_path, config, 128)
    with pytest.raises(ShardingError) as e:
        preflight(model_dir, 3, Layout("tp"))
    assert str(e.value) == (
        "tp=3 with weights [1.0, 1.0, 1.0] cannot split the routed experts' 256 channels on "
        "the boundaries of their 4-bit affine (group 128) down_proj (every 128); use tp of at "
        "most 2 in equal shares, --parallel ep (whole experts) or --parallel pp"
    )
    preflight(model_dir, 3, Layout("ep"))
    model, _ = build_lazy(model_dir)
    tensor.check(model, 3, routed=False)


def test_planner_shares_heads_in_the_same_runs():
    """The planner's head shares (cost.shares) take the unit the loader cuts in: 8 heads of
    64 channels, 2 KV groups, o_proj at group 128 -> pairs of heads; weights 3:1 within a
    KV group's two ranks give 2 + 2 heads, not 3 + 1."""
    from quant_formats import FAMILIES

    from thunderpool.planner.cost import Stage, shares
    from thunderpool.planner.spec import model_spec_from_config

    config = {**FAMILIES["llama"], "num_key_value_heads": 2}
    plain = model_spec_from_config(config, dtype_bytes=4.0)
    q = {**config, "quantization": {"group_size": 128, "bits": 4, "mode": "affine"}}
    spec = model_spec_from_config(q, dtype_bytes=4.0)
    assert (plain.head_unit, spec.head_unit) == (1, 2)
    stage = Stage(("a", "b", "c", "d"), (0, 4), (3.0, 1.0, 3.0, 1.0))
    assert [s.q * 8 for s in shares(plain, stage)] == [3, 1, 3, 1]
    assert [s.q * 8 for s in shares(spec, stage)] == [2, 2, 2, 2]
    # The loader agrees (tensor.split_heads with the unit it computes from the o_projs).
    loader = split_heads(8, 2, [3, 1, 3, 1], unit=2)
    assert [h.q1 - h.q0 for h in loader] == [2, 2, 2, 2]


def test_nvfp4_tensor_scales_go_with_their_experts(tmp_path):
    """nvfp4 with one tensor scale per expert (quantize_model's global_scale; mx.gather_qmm
    runs it on the GPU only, so here the cut is checked, not the product): EP gives each rank
    its experts' scales, TP's channel split keeps them all, and mlx-lm's even shard() (which
    would cut the (E,) scales as channels) is not used."""
    from types import SimpleNamespace

    from quant_formats import make_base, make_quantized

    from thunderpool.parallel import experts

    model_dir = make_quantized(make_base("qwen3_moe", tmp_path / "b"), "nvfp4-gs", tmp_path / "q")
    full, _ = build_lazy(model_dir)
    want = full.layers[1].mlp.switch_mlp.down_proj.global_scale
    assert want.shape == (4,)
    for rank in range(2):
        model, _ = build_lazy(model_dir)
        group = SimpleNamespace(size=lambda: 2, rank=lambda r=rank: r)
        share = experts.shard(model, group)
        local = experts.unwrap(model.layers[1].mlp, "switch_mlp").down_proj
        assert mx.array_equal(local.global_scale, want[share.e0 : share.e1]).item()
        model, _ = build_lazy(model_dir)
        assert tensor.shard(model, group) == "uneven"  # not mlx-lm's shard()
        kept = model.layers[1].mlp.switch_mlp.down_proj
        assert mx.array_equal(kept.global_scale, want).item()
        assert kept.weight.shape[-1] == 256 // 2 * 4 // 32  # half the channels, packed
