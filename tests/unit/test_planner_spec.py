"""ModelSpec from configs and from safetensors headers: exact byte and parameter counts."""

import json

import pytest
from conftest import SMOLLM2, TINY

from thunderpool.errors import ModelError
from thunderpool.planner.spec import model_spec, model_spec_from_config, read_safetensors_header


def test_smollm2_parameter_count_and_kv_bytes():
    spec = model_spec_from_config(SMOLLM2)
    # Per layer: q,o 576*576 each, k,v 576*192 each, MLP 3*576*1536, two norms of 576.
    layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
    assert layer == 3_540_096
    assert spec.params == 30 * layer + 49152 * 576 + 576 == 134_515_008
    assert spec.total_bytes == 2 * 134_515_008
    assert spec.head_bytes == 0 and spec.embed_bytes == 2 * 49152 * 576
    assert spec.kv_bytes_per_token_per_layer == 2 * 3 * 64 * 2 == 768
    assert spec.head_dim == 64
    assert spec.flops_per_token == 2 * 134_515_008


def _header_bytes(path):
    header = read_safetensors_header(path / "model.safetensors")
    return sum(
        v["data_offsets"][1] - v["data_offsets"][0]
        for k, v in header.items()
        if k != "__metadata__"
    )


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_header_spec_matches_tensors_and_config_estimate(tiny_models, kind):
    measured = model_spec(tiny_models[kind])
    assert measured.total_bytes == _header_bytes(tiny_models[kind])
    # The tiny checkpoints are float32: the config-only estimate must agree field by field.
    assert model_spec_from_config(TINY[kind], dtype_bytes=4.0) == measured


def test_sharded_checkpoint_reads_every_file_in_the_index(tiny_models, tmp_path):
    import mlx.core as mx

    weights = mx.load(str(tiny_models["llama"] / "model.safetensors"))
    names = sorted(weights)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half]}
    parts["model-00002-of-00002.safetensors"] = names[half:]
    weight_map = {}
    for file, keys in parts.items():
        mx.save_safetensors(str(tmp_path / file), {k: weights[k] for k in keys})
        weight_map.update(dict.fromkeys(keys, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(TINY["llama"]))
    assert model_spec(tmp_path) == model_spec(tiny_models["llama"])


def test_quantized_checkpoint_matches_config_estimate(tiny_models, tmp_path):
    from mlx_lm import convert

    out = tmp_path / "q4"
    convert(str(tiny_models["qwen3_moe"]), mlx_path=str(out), quantize=True, q_group_size=32)
    config = json.loads((out / "config.json").read_text())
    measured = model_spec(out)
    # mlx-lm keeps the router at 8 bits: per-module overrides must be honoured.
    assert config["quantization"]["model.layers.0.mlp.gate"]["bits"] == 8
    assert model_spec_from_config(config, dtype_bytes=4.0) == measured
    assert measured.total_bytes < model_spec(tiny_models["qwen3_moe"]).total_bytes / 2


def test_moe_reads_only_active_experts():
    spec = model_spec_from_config(TINY["qwen3_moe"], dtype_bytes=4.0)
    expert = 3 * 64 * 48 * 4  # one expert's gate, up, down in fp32
    assert spec.expert_bytes_per_layer == (4 * expert,) * 4
    # 2 of 4 experts per token: half of the routed expert bytes are not read.
    assert spec.active_bytes_per_token == spec.total_bytes - spec.embed_bytes - 4 * 2 * expert
    assert spec.active_bytes_per_token < spec.total_bytes
    assert spec.active_params < spec.params
    # A batch of 3 touches 4 * (1 - (1/2)^3) = 3.5 experts on average.
    assert spec.layer_read_bytes(0, batch=3) == spec.bytes_per_layer[0] - 0.5 * expert


def test_deepseek_v3_mla_cache_and_active_parameters():
    config = {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "vocab_size": 129280,
    }
    spec = model_spec_from_config(config)
    # The published sizes: 671B total (without the MTP layer), 37B active.
    assert round(spec.params / 1e9) == 671
    assert round(spec.active_params / 1e9) == 37
    assert spec.kv_bytes_per_token_per_layer == (512 + 64) * 2
    assert spec.expert_bytes_per_layer[:3] == (0, 0, 0)


def test_unknown_model_type_is_named():
    with pytest.raises(ModelError, match="'gpt_neox'"):
        model_spec_from_config({**SMOLLM2, "model_type": "gpt_neox"})


def test_missing_config_names_the_directory(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        model_spec(tmp_path)


def _bundled(name):
    from importlib import resources

    folder = resources.files("thunderpool.planner").joinpath("configs")
    return json.loads(folder.joinpath(f"{name}.json").read_text())


def test_glm5_matches_its_published_sizes():
    config = _bundled("glm-5")
    spec = model_spec_from_config(config)
    # GLM-5 README: 744B parameters, 40B active.
    assert round(spec.params / 1e9) == 744 and round(spec.active_params / 1e9) == 41
    # MLA latent + rope, plus the DSA indexer's 128-wide keys, per layer.
    assert spec.kv_bytes_per_token_per_layer == (512 + 64 + 128) * 2
    assert spec.attn_fused is False and spec.attn_dim == 2 * 512 + 64
    # mlx-community/GLM-5-8bit-MXFP8 is 767 GB: 8 bits + one 8-bit scale per 32 weights.
    mx = model_spec_from_config(
        {**config, "quantization": {"bits": 8, "group_size": 32, "mode": "mxfp8"}}
    )
    assert mx.total_bytes / 1e9 == pytest.approx(767, rel=0.01)
    assert mx.total_bytes == pytest.approx(spec.total_bytes * 8.25 / 16, rel=1e-3)


def test_deepseek_v4_flash_native_storage():
    spec = model_spec_from_config(_bundled("deepseek-v4-flash"))
    # Model card: 284B total, 13B active.
    assert round(spec.params / 1e9) == 284 and round(spec.active_params / 1e9) == 13
    # model.safetensors.index.json: 159.6 GB including the ~3.6 GB MTP block we leave out.
    assert spec.total_bytes / 1e9 == pytest.approx(159.6 - 3.6, rel=0.02)
    # fp4 experts with a 1-byte scale per 32 values: 4.25 bits per routed weight.
    expert = 3 * 4096 * 2048
    assert spec.expert_bytes_per_layer[5] == 256 * expert * 4.25 / 8
    # Attention over compressed entries: ratio-4 layers see the window + top-512, ratio 128
    # layers the window + kv_len / 128, ratio-0 layers the window only.
    assert [spec.attended(i, 65536) for i in (0, 2, 3)] == [128, 128 + 512, 128 + 512]
    assert spec.attended(3, 1024) == 128 + 8


def test_hf_fp8_blocks_and_mlx_formats_count_scales():
    from thunderpool.planner.layers import Weights, weights_for

    fp8 = weights_for(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, 2
    )
    # One byte per weight plus one ue8m0 scale per 128x128 block (rounded up).
    assert fp8.matrix(512, 4096, "model.layers.0.self_attn.wkv") == 512 * 4096 + 4 * 32
    assert fp8.matrix(129280, 4096, "model.embed_tokens") == 129280 * 4096 * 2  # kept bf16
    mx4 = Weights(2, {"bits": 4, "group_size": 32, "mode": "mxfp4"})
    assert mx4.matrix(64, 64) == 64 * 64 // 2 + 64 * 64 // 32
