"""Checkpoints whose config.json current transformers wrote (rope_parameters, num_local_experts).

Reference: the same weights with the config fields mlx-lm's ModelArgs read (rope_theta,
rope_scaling, rope_local_base_freq, num_experts). Expected: the transformers-written config
builds the same model (logits equal bit for bit over a 40-token prompt, past the llama3 RoPE
scaling's original context), where mlx-lm alone would use its default RoPE base or fail with a
traceback; a required field under no known name is refused in one line naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY, make_tiny

from thunderpool.engine.loader import Layout, build_lazy, preflight
from thunderpool.errors import ModelError

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# kind -> (the fields mlx-lm reads, written as transformers' config class for that family)
CASES = {
    "llama": {"rope_theta": 500000.0, "rope_scaling": LLAMA3},
    "qwen3_moe": {"rope_theta": 1000000.0},
}


def _transformers_config(config: dict) -> dict:
    """`config` as transformers 5 saves it (its config class's own to_dict)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fields = {k: v for k, v in config.items() if k != "model_type"}
    return CONFIG_MAPPING[config["model_type"]](**fields).to_dict()


def _logits(model_dir: Path) -> np.ndarray:
    model, _ = build_lazy(model_dir)
    tokens = mx.array([np.random.default_rng(0).integers(0, 256, 40).tolist()])
    return np.array(model(tokens)[0])


def _pair(kind: str, tmp_path: Path) -> tuple[Path, Path]:
    """The same weights under mlx-lm's field names and under transformers' config.json."""
    ours = make_tiny(kind, tmp_path / "ours")
    config = {**TINY[kind], **CASES[kind]}
    (ours / "config.json").write_text(json.dumps(config))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "model.safetensors").symlink_to(ours / "model.safetensors")
    (theirs / "config.json").write_text(json.dumps(_transformers_config(config)))
    return ours, theirs


@pytest.mark.parametrize("kind", CASES)
def test_transformers_config_builds_the_same_model(kind, tmp_path):
    ours, theirs = _pair(kind, tmp_path)
    written = json.loads((theirs / "config.json").read_text())
    # What current transformers writes: the keys mlx-lm's classes read are gone.
    assert "rope_theta" not in written and "rope_parameters" in written
    if kind == "qwen3_moe":
        assert "num_experts" not in written and written["num_local_experts"] == 4
    np.testing.assert_array_equal(_logits(theirs), _logits(ours))


def test_the_rope_base_matters(tmp_path):
    # Guard for the test above: mlx-lm's default base (what a lost rope_theta becomes) and no
    # llama3 scaling give other logits.
    ours, _ = _pair("llama", tmp_path)
    want = _logits(ours)
    (ours / "config.json").write_text(json.dumps(TINY["llama"] | {"rope_theta": 10000.0}))
    assert np.abs(_logits(ours) - want).max() > 1e-3


def test_gemma3_rope_per_layer_type(tmp_path):
    from families import FAMILIES, make_family

    config = FAMILIES["gemma3_text"].config | {"rope_theta": 20000.0}
    config["rope_local_base_freq"] = 5000.0
    written = _transformers_config(config)
    assert set(written["rope_parameters"]) == {"full_attention", "sliding_attention"}
    ours = make_family("gemma3_text", tmp_path / "ours")
    (ours / "config.json").write_text(json.dumps(config))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "model.safetensors").symlink_to(ours / "model.safetensors")
    (theirs / "config.json").write_text(json.dumps(written))
    model, _ = build_lazy(theirs)
    assert model.args.rope_theta == 20000.0 and model.args.rope_local_base_freq == 5000.0
    np.testing.assert_array_equal(_logits(theirs), _logits(ours))


def test_a_field_under_no_known_name_is_one_line(tmp_path):
    ours, theirs = _pair("qwen3_moe", tmp_path)
    config = json.loads((theirs / "config.json").read_text())
    del config["num_local_experts"]
    (theirs / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError) as e:
        preflight(theirs, 2, Layout("tp"))
    text = str(e.value)
    assert "\n" not in text
    assert "config.json has no 'num_experts' (nor 'num_local_experts', 'n_routed_experts')" in text
    assert "mlx-lm's qwen3_moe model needs" in text
