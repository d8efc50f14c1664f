"""Bytes per weight of every quantization, as the planner, plan and simulate count them.

Reference: the nbytes of the arrays mlx holds: a quantized layer's weight, scales and biases,
and a checkpoint converted by mlx-lm's converter code (quant_formats.py), loaded by mlx-lm.
Expected: equal to the byte, for affine 2..8 bits at groups 32, 64 and 128 with float32 and
bfloat16 scales, mxfp4, nvfp4 and mxfp8 (one 8-bit scale per group, no biases), the mixed
recipes and per-layer overrides; simulate's `:q3`-style suffixes price exactly what the
converter writes.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
from quant_formats import FAMILIES, FORMATS, make_base, make_quantized

from thunderpool.parallel.packing import Packing
from thunderpool.planner.layers import Weights
from thunderpool.planner.simulate import quantized
from thunderpool.planner.spec import model_spec, model_spec_from_config

LAYER = [("affine", b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
LAYER += [("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode,bits,group", LAYER, ids=[f"{m}{b}g{g}" for m, b, g in LAYER])
def test_bytes_per_weight_are_the_layers_arrays(mode, bits, group, dtype):
    out, in_ = 48, 384
    linear = nn.Linear(in_, out, bias=False)
    linear.set_dtype(dtype)
    layer = nn.QuantizedLinear.from_linear(linear, group_size=group, bits=bits, mode=mode)
    held = sum(v.nbytes for _, v in tree_flatten(layer.parameters()))
    scale_bytes = dtype.size
    q = {"bits": bits, "group_size": group, "mode": mode}
    assert Weights(scale_bytes, q).matrix(out, in_) == held
    assert Packing(bits, group, mode).bits_per_weight(scale_bytes) * out * in_ / 8 == held


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    bases = {kind: make_base(kind, root / kind) for kind in FAMILIES}
    return {
        (kind, fmt): make_quantized(bases[kind], fmt, root / f"{kind}-{fmt}")
        for kind in FAMILIES
        for fmt in FORMATS
    }


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", FAMILIES)
def test_plan_bytes_are_the_loaded_arrays(kind, fmt, converted):
    """model_spec (what plan and generate's estimates read) equals mlx-lm's loaded arrays,
    and the estimate from config.json alone (simulate's) equals it where the config names
    every module's format (the overrides leave two projections float, which config.json
    does not record: mlx-lm finds them by their missing scales)."""
    model_dir = converted[kind, fmt]
    model, config = load_model(model_dir)
    held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    measured = model_spec(model_dir)
    assert measured.total_bytes == held
    if fmt != "overrides":
        config = json.loads((model_dir / "config.json").read_text())
        assert model_spec_from_config(config, dtype_bytes=4.0) == measured


SUFFIXES = [f for f in FORMATS if f not in ("overrides", "nvfp4-gs")]


@pytest.mark.parametrize("fmt", SUFFIXES)
def test_simulate_suffix_prices_what_the_converter_writes(fmt, converted):
    # llama: mlx-lm's qwen3_moe keeps its router at 8 bits, which a suffix does not know.
    plain = json.loads(json.dumps(FAMILIES["llama"]))
    config, dtype = quantized(plain, fmt)
    assert dtype == 2.0  # published checkpoints keep bfloat16 scales; these are float32
    estimate = model_spec_from_config(config, dtype_bytes=4.0)
    measured = model_spec(converted["llama", fmt])
    assert estimate.total_bytes == measured.total_bytes
    # Each layer's bytes, so the bytes a decode token reads are the format's too.
    assert estimate.bytes_per_layer == measured.bytes_per_layer
    assert estimate.active_bytes_per_token == measured.active_bytes_per_token


def test_mixed_recipe_puts_high_bits_where_mlx_lm_does(converted):
    from thunderpool.planner.layers import mixed_bits

    written = json.loads((converted["llama", "mixed_3_6"] / "config.json").read_text())
    q = written["quantization"]
    for path, entry in q.items():
        if isinstance(entry, dict):
            assert mixed_bits(path, (3, 6), 4) == entry["bits"], path
    assert {e["bits"] for e in q.values() if isinstance(e, dict)} == {3, 6}
