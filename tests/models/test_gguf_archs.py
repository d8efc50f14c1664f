"""GGUF import per family: a tiny random HF checkpoint, the GGUF llama.cpp would make of it,
and the imported model against the same weights loaded from safetensors by mlx-lm."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf_export import FAMILIES, VOCAB, make_hf, write_gguf
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from thunderpool.models.gguf import import_gguf

# Longer than Gemma's window (8); YaRN's factors apply at every position.
PROMPT = [int(x) for x in np.random.default_rng(7).integers(0, VOCAB, 24)]
STEPS = 16
# Same fp32 weights, same mlx-lm code: measured 0 on this CPU except Gemma, whose norms
# round-trip through 1 + w (measured ~1e-6).
ATOL = 1e-4


def imported_and_reference(
    kind: str, tmp_path: Path, mla: bool = True, mtp: bool = False, **import_kwargs
):
    weights = make_hf(kind, tmp_path / "hf")
    write_gguf(kind, weights, tmp_path / f"{kind}.gguf", mla=mla, mtp=mtp)
    out = import_gguf(tmp_path / f"{kind}.gguf", tmp_path / "out", progress=False, **import_kwargs)
    return out, tmp_path / "hf"


def logits_and_greedy(path: Path) -> tuple[np.ndarray, list[int]]:
    model, _ = load_model(path)
    logits = np.array(model(mx.array([PROMPT]))[0])
    steps = generate_step(mx.array(PROMPT), model, max_tokens=STEPS)
    return logits, [int(tok) for tok, _ in steps]


# Each family once (variants like llama-256 are for the quantization tests), DeepSeek V2 also in
# the pre-MLA layout (one attn_kv_b tensor) older llama.cpp versions wrote.
CASES = [(k, True) for k, c in FAMILIES.items() if c["model_type"] == k]
CASES += [(k, True) for k in ("phi3-longrope", "qwen3-yarn", "llama3-rope")]
CASES += [("deepseek_v2", False)]


@pytest.mark.parametrize("kind,mla", CASES, ids=[f"{k}{'' if m else '-kv_b'}" for k, m in CASES])
def test_family_matches_safetensors(kind, mla, tmp_path):
    out, ref = imported_and_reference(kind, tmp_path, mla=mla)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == FAMILIES[kind]["model_type"]
    got_logits, got_tokens = logits_and_greedy(out)
    ref_logits, ref_tokens = logits_and_greedy(ref)
    assert np.abs(ref_logits).max() > 1.0  # the comparison is not of near-zero outputs
    np.testing.assert_allclose(got_logits, ref_logits, atol=ATOL, rtol=0)
    assert got_tokens == ref_tokens


def test_multi_token_prediction_block_is_skipped(tmp_path):
    """DeepSeek V3.2-style files append an MTP block (nextn_predict_layers); mlx-lm runs none."""
    out, ref = imported_and_reference("deepseek_v3", tmp_path, mtp=True)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4
    got, ref_ = logits_and_greedy(out), logits_and_greedy(ref)
    np.testing.assert_allclose(got[0], ref_[0], atol=ATOL, rtol=0)
    assert got[1] == ref_[1]


def test_config_fields_match_reference(tmp_path):
    """Every ModelArgs field the HF config sets comes back from the GGUF metadata."""
    kinds = ("qwen3_moe", "gemma3_text", "deepseek_v3", "mixtral", "phi3-longrope", "llama3-rope")
    for kind in kinds:
        d = tmp_path / kind
        out, ref = imported_and_reference(kind, d)
        got = json.loads((out / "config.json").read_text())
        want = json.loads((ref / "config.json").read_text())
        skip = {"torch_dtype", "rope_scaling"}
        diff = {k: (got.get(k), v) for k, v in want.items() if k not in skip and got.get(k) != v}
        assert not diff, f"{kind}: {diff}"


@pytest.mark.parametrize(
    "scaling",
    [
        # Llama 3.1 / 3.2 as published, and the test family's own (fitted, not the default).
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "old": 8192, "dims": 128},
        {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "old": 8192, "dims": 64},
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "old": 1024, "dims": 64},
        {"factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 2.5, "old": 4000, "dims": 128},
    ],
)
def test_llama3_rope_scaling_is_recovered(scaling):
    from thunderpool.models.gguf_rope import llama3_divisors, llama3_scaling

    params = {k: v for k, v in scaling.items() if k not in ("old", "dims")}
    params["original_max_position_embeddings"] = scaling["old"]
    divisors = llama3_divisors(params, 500000.0, scaling["dims"])
    got = llama3_scaling(divisors.astype(np.float32), 500000.0, scaling["dims"])
    assert got == {"rope_type": "llama3", **params}


def test_rope_freqs_that_are_not_llama3_are_refused():
    from thunderpool.errors import ModelError
    from thunderpool.models.gguf_rope import llama3_scaling

    with pytest.raises(ModelError, match="does not follow Llama 3's rope scaling"):
        llama3_scaling(np.linspace(1.0, 8.0, 64), 500000.0, 128)
