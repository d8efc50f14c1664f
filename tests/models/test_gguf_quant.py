"""GGUF import with --dtype q4 / q8: MLX affine whatever the source type, and a config.json that
describes exactly the tensors stored; refused source types."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_export import make_hf, write_gguf
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from thunderpool.errors import ModelError
from thunderpool.models.gguf import import_gguf

PROMPT = mx.array([[5, 77, 130, 9, 200, 41, 3, 250, 18, 66, 101, 7]])
# Loose bounds on |logits_q - logits_fp32| / |logits_fp32| (Frobenius). Random weights have no
# structure for 4 bits to keep, and these tiny models amplify the noise: measured up to 0.024
# (q8) and 0.55 (q4, from Q6_K); 0 for the lossless sources. The per-weight bound in
# check_truth is the tight test.
REL_TOL = {"q8": 0.05, "q4": 0.75}


def stored_quantization(out: Path, ref: dict[str, mx.array]) -> tuple[dict, dict]:
    """(config's quantization block, {module: (group_size, bits)} read from the tensors, using
    the float32 import `ref` of the same file for each weight's input size)."""
    config = json.loads((out / "config.json").read_text())
    weights = mx.load(str(out / "model.safetensors"))
    stored = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            base = name.removesuffix(".scales")
            w, in_dims = weights[f"{base}.weight"], ref[f"{base}.weight"].shape[-1]
            assert w.dtype == mx.uint32, base
            stored[base] = (in_dims // scales.shape[-1], w.shape[-1] * 32 // in_dims)
    return config["quantization"], stored


def check_truth(out: Path, f32_dir: Path, dtype: str) -> None:
    """config.json names each stored quantized tensor's bits, mlx-lm builds exactly those
    modules quantized, and each weight dequantizes to within one quantization step of the
    float32 import of the same file."""
    ref = mx.load(str(f32_dir / "model.safetensors"))
    quant, stored = stored_quantization(out, ref)
    default = (quant["group_size"], quant["bits"])
    assert default == (32, {"q4": 4, "q8": 8}[dtype])
    assert stored, "nothing was quantized"
    for module, (group, bits) in stored.items():
        override = quant.get(module)
        want = (override["group_size"], override["bits"]) if override else default
        assert (group, bits) == want, module
    model, _ = load_model(out)
    built = {p for p, m in model.named_modules() if type(m).__name__.startswith("Quantized")}
    assert built == set(stored)
    # The only float matrices left are those MLX cannot quantize (rows not a multiple of 32,
    # like these MoE tests' 48-wide expert down projections).
    params = dict(tree_flatten(model.parameters()))
    left = [v for k, v in params.items() if k.endswith(".weight") and v.dtype == mx.float32]
    assert all(v.shape[-1] % 32 for v in left if v.ndim >= 2)
    got = mx.load(str(out / "model.safetensors"))
    for module, (group, bits) in stored.items():
        w, s, b = (got[f"{module}.{k}"] for k in ("weight", "scales", "biases"))
        deq = np.array(mx.dequantize(w, s, b, group_size=group, bits=bits))
        want = np.array(ref[f"{module}.weight"])
        step = np.repeat(np.abs(np.array(s)), group, axis=-1)
        # One step, not half: MLX's quantizer snaps zero and the wider edge onto its grid.
        assert np.all(np.abs(deq - want) <= step * 1.001 + 1e-6), module


def import_pair(kind: str, tmp_path: Path, qtype, dtype: str) -> tuple[Path, Path]:
    src = tmp_path / f"{kind}.gguf"
    write_gguf(kind, make_hf(kind, tmp_path / "hf"), src, qtype=qtype)
    f32 = import_gguf(src, tmp_path / "f32", progress=False)
    return import_gguf(src, tmp_path / dtype, dtype=dtype, progress=False), f32


@pytest.mark.parametrize("dtype", ["q4", "q8"])
@pytest.mark.parametrize(
    "kind,qtype",
    [
        ("llama", None),  # F32 source
        ("llama", Q.Q5_0),
        ("llama-256", Q.Q4_K),
        ("llama-256", Q.Q6_K),
        ("qwen3_moe", Q.F16),  # stacked experts -> QuantizedSwitchLinear
        ("llama", Q.Q4_0),  # lossless paths
        ("llama", Q.Q4_1),
        ("llama", Q.Q8_0),
    ],
    ids=lambda v: getattr(v, "name", v),
)
def test_config_tells_the_truth(kind, qtype, dtype, tmp_path):
    out, f32 = import_pair(kind, tmp_path, qtype, dtype)
    check_truth(out, f32, dtype)
    model_q, _ = load_model(out)
    model_f, _ = load_model(f32)
    a, b = np.array(model_f(PROMPT)), np.array(model_q(PROMPT))
    rel = float(np.linalg.norm(a - b) / np.linalg.norm(a))
    assert rel <= REL_TOL[dtype]


@pytest.mark.parametrize(
    "qtype,dtype,bits",
    [(Q.Q4_0, "q4", 4), (Q.Q4_1, "q4", 4), (Q.Q8_0, "q8", 8), (Q.Q8_0, "q4", 8), (Q.Q4_1, "q8", 8)],
    ids=lambda v: getattr(v, "name", v),
)
def test_lossless_sources_stay_exact(qtype, dtype, bits, tmp_path):
    """Q4_0/Q4_1/Q8_0 blocks map onto MLX affine exactly; under q4 a Q8_0 source stays 8-bit
    only for the vocabulary matrices (the rest is re-quantized to 4 bits)."""
    out, f32 = import_pair("llama", tmp_path, qtype, dtype)
    ref, got = (mx.load(str(d / "model.safetensors")) for d in (f32, out))
    quant, stored = stored_quantization(out, ref)
    kept = {m for m, (_, b) in stored.items() if b == bits}
    if bits == quant["bits"]:
        assert kept == set(stored)
    else:
        assert kept == {"model.embed_tokens", "lm_head"}
        assert all(quant[m] == {"group_size": 32, "bits": bits} for m in kept)
    for module in kept:
        w, s, z = (got[f"{module}.{k}"] for k in ("weight", "scales", "biases"))
        deq = mx.dequantize(w, s, z, group_size=32, bits=bits)
        np.testing.assert_array_equal(np.array(deq), np.array(ref[f"{module}.weight"]), module)


def test_refuses_a_type_it_cannot_dequantize(tmp_path):
    """Q8_1 is a llama.cpp-internal type the gguf package cannot dequantize."""
    src = tmp_path / "llama.gguf"
    write_gguf("llama", make_hf("llama", tmp_path / "hf"), src, qtype=Q.Q8_1)
    with pytest.raises(ModelError, match=r"tensor 'token_embd\.weight' uses quantization Q8_1"):
        import_gguf(src, tmp_path / "out", dtype="q4", progress=False)
    assert not (tmp_path / "out").exists()
