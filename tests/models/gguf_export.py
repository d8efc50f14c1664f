"""Test helper: tiny random HF checkpoints per family, and GGUF files made from them the way
llama.cpp's convert_hf_to_gguf.py makes them.

The GGUF side is written independently of the importer: tensor names come from the gguf
package's own HF -> GGUF map (`gguf.get_tensor_name_map`, llama.cpp's table), and each family's
transforms and metadata keys follow convert_hf_to_gguf.py (Q/K RoPE interleave for llama arch,
Gemma norms stored as 1 + w, experts stacked, DeepSeek's kv_b split into k_b (transposed) and
v_b, Phi-3's rope dimension count).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
MOE = {"moe_intermediate_size": 48, "num_experts_per_tok": 2}
DEEPSEEK = {
    **BASE,
    **MOE,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "rope_scaling": {"type": "yarn", "factor": 1.0},
}
# mlx-lm ModelArgs fields per family, keeping each family's structural features.
FAMILIES: dict[str, dict] = {
    "llama": {**BASE, "model_type": "llama", "attention_bias": False},
    "qwen3": {**BASE, "model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True},
    "qwen3_moe": {
        **BASE,
        **MOE,
        "model_type": "qwen3_moe",
        "head_dim": 16,
        "num_experts": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "mixtral": {**BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    # llama.cpp's fixed pattern: five sliding layers, then a global one; a window of 8.
    "gemma3_text": {
        **BASE,
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 8,
        "sliding_window_pattern": 6,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,  # mlx-lm ties Gemma 3 whenever lm_head is absent
    },
    "phi3": {**BASE, "model_type": "phi3", "partial_rotary_factor": 0.5},
    # Phi-3.5 / Phi-4-mini style long context: per-frequency factors (rope dims 8 -> 4 each).
    "phi3-longrope": {
        **BASE,
        "model_type": "phi3",
        "partial_rotary_factor": 0.5,
        "max_position_embeddings": 256,
        "original_max_position_embeddings": 64,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": [1.0, 1.5, 3.0, 7.5],
            "short_factor": [1.0, 1.1, 1.2, 1.3],
        },
    },
    # Long-context Qwen3 (YaRN past the trained 128 positions, here).
    "qwen3-yarn": {
        **BASE,
        "model_type": "qwen3",
        "head_dim": 16,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    },
    # Llama 3.1-style rope scaling (llama.cpp stores it as rope_freqs.weight); head_dim 64 so
    # that several frequencies fall in the smooth band.
    "llama3-rope": {
        **BASE,
        "model_type": "llama",
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    },
    # Rows of 256: what K-quant blocks need.
    "llama-256": {**BASE, "model_type": "llama", "hidden_size": 256, "intermediate_size": 512},
    # V2-Lite shape: no q LoRA, softmax routing, one dense layer first.
    "deepseek_v2": {**DEEPSEEK, "model_type": "deepseek_v2", "q_lora_rank": None},
    # V3 shape: q LoRA, sigmoid routing with a correction bias, grouped experts.
    "deepseek_v3": {
        **DEEPSEEK,
        "model_type": "deepseek_v3",
        "q_lora_rank": 24,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    },
}
# mlx-lm model_type -> llama.cpp architecture name.
GGUF_ARCH = {
    "llama": "llama",
    "mixtral": "llama",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
}


def byte_vocab() -> tuple[list[str], list[int], list[str]]:
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = sorted(ByteLevel.alphabet())
    merges = ["h e", "l l", "he ll", "Ġ w"]
    tokens += ["he", "ll", "hell", "Ġw", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return tokens, [1] * (len(tokens) - 3) + [3, 3, 3], merges


VOCAB = len(byte_vocab()[0])


def make_hf(kind: str, path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """Write a random checkpoint with Hugging Face tensor names; return its weights."""
    # A deep copy: mlx-lm's ModelArgs rewrite rope_scaling in place.
    config = copy.deepcopy({**FAMILIES[kind], "vocab_size": VOCAB})
    kind = config["model_type"]
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, w in tree_flatten(model.parameters()):
        w = np.array(w)
        # Peaked logits (greedy ties are not a coin flip) and norms/biases away from their init,
        # so that a norm map or offset mistake shows.
        if w.ndim >= 2 and "embed" not in name:
            w = w * 2.0
        elif w.ndim == 1:
            w = w + rng.standard_normal(w.shape).astype(np.float32) * 0.2
        weights.update(_hf_names(kind, name, w))
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    if kind == "deepseek_v3":
        _merge_kv_b(weights, config)
    path.mkdir(parents=True, exist_ok=True)
    arrays = {k: mx.array(v) for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), arrays, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return weights


def _hf_names(kind: str, name: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """mlx-lm's stacked experts -> HF's one tensor per expert."""
    if ".switch_mlp." not in name:
        return {name: w}
    prefix, proj = name.split(".switch_mlp.")
    if kind == "mixtral":
        proj = proj.replace("gate_proj", "w1").replace("down_proj", "w2").replace("up_proj", "w3")
    return {f"{prefix}.experts.{e}.{proj}": w[e] for e in range(w.shape[0])}


def _merge_kv_b(weights: dict[str, np.ndarray], c: dict) -> None:
    """mlx-lm's DeepSeek V3 holds kv_b_proj split per head; HF holds it whole."""
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        k = weights.pop(p + "embed_q.weight").swapaxes(1, 2)  # (heads, nope, rank)
        v = weights.pop(p + "unembed_out.weight")  # (heads, v, rank)
        weights[p + "kv_b_proj.weight"] = np.concatenate([k, v], 1).reshape(-1, c["kv_lora_rank"])


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py `LlamaModel.permute`."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _stack_experts(weights: dict[str, np.ndarray], c: dict) -> dict[str, np.ndarray]:
    """HF per-expert tensors -> one (experts, out, in) tensor per projection, as llama.cpp."""
    out, groups = {}, {}
    for name, w in weights.items():
        if ".experts." not in name:
            out[name] = w
            continue
        head, rest = name.split(".experts.")
        e, proj = rest.split(".", 1)
        groups.setdefault(f"{head}.experts.{proj}", {})[int(e)] = w
    for name, by_e in groups.items():
        out[name] = np.stack([by_e[e] for e in sorted(by_e)])
    return out


def write_gguf(
    kind: str, weights: dict[str, np.ndarray], path: Path, qtype=None, mla=True, mtp=False
):
    """The GGUF llama.cpp would make of this checkpoint (F32 tensors, or `qtype` for 2D+ ones);
    `mtp` appends a multi-token-prediction block as llama.cpp does for DeepSeek V3.2."""
    import gguf

    c = copy.deepcopy({**FAMILIES[kind], "vocab_size": VOCAB})
    kind = c["model_type"]
    arch = GGUF_ARCH[kind]
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(model_arch, c["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), arch)
    _write_metadata(w, kind, c, mla, mtp)
    tensors = _stack_experts(weights, c)
    if (scaling := c.get("rope_scaling")) and scaling.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(c))
    if (scaling := c.get("rope_scaling")) and scaling.get("type") == "longrope":
        # Phi3MiniModel.generate_extra_tensors: the factors become tensors.
        for k in ("long", "short"):
            w.add_tensor(f"rope_factors_{k}.weight", np.array(scaling[f"{k}_factor"], np.float32))
    for name, value in tensors.items():
        for gguf_name, data in _transform(kind, name, value, c, mla):
            if gguf_name is None:
                gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            data = np.ascontiguousarray(data, dtype=np.float32)
            if qtype is not None and data.ndim >= 2:
                data = _quantize(data, qtype)
                w.add_tensor(gguf_name, data, raw_dtype=qtype)
            else:
                w.add_tensor(gguf_name, data)
    if mtp:
        n, d = c["num_hidden_layers"], c["hidden_size"]
        for name, shape in (
            ("nextn.eh_proj", (d, 2 * d)),
            ("nextn.enorm", (d,)),
            ("attn_norm", (d,)),
        ):
            w.add_tensor(f"blk.{n}.{name}.weight", np.ones(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _llama3_rope_freqs(c: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: one divisor per rotary frequency."""
    s, dim = c["rope_scaling"], c["hidden_size"] // c["num_attention_heads"]
    freqs = 1.0 / (c["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wl:
            out.append(1.0)
        elif wavelen > low_wl:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, np.float32)


def _quantize(data: np.ndarray, qtype) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import quantize

    try:
        return quantize(data, qtype)
    except NotImplementedError:
        # gguf-py cannot quantize K-quants: write valid random blocks of that type instead.
        block, size = GGML_QUANT_SIZES[qtype]
        rng = np.random.default_rng(int(data.size))
        raw = rng.integers(0, 256, (*data.shape[:-1], data.shape[-1] // block, size), np.uint8)
        # Small positive fp16 super-block scales (d, dmin lead every K-quant block but Q6_K).
        scales = np.full(raw.shape[:-1] + (2,), 1e-3, np.float16).view(np.uint8)
        at = size - 2 if qtype.name == "Q6_K" else 0
        raw[..., at : at + 2] = scales[..., 0:2]
        if qtype.name != "Q6_K":
            raw[..., 2:4] = scales[..., 0:2]
        return raw.reshape(*data.shape[:-1], -1)


def _transform(kind: str, name: str, w: np.ndarray, c: dict, mla: bool):
    """convert_hf_to_gguf.py's modify_tensors for the families under test."""
    if kind in ("llama", "mixtral") and name.endswith("q_proj.weight"):
        return [(None, llama_cpp_permute(w, c["num_attention_heads"]))]
    if kind in ("llama", "mixtral") and name.endswith("k_proj.weight"):
        return [(None, llama_cpp_permute(w, c["num_key_value_heads"]))]
    if kind == "gemma3_text" and name.endswith("norm.weight"):
        return [(None, w + 1.0)]  # Gemma3RMSNorm computes x * (1 + w); llama.cpp stores 1 + w
    if name.endswith("e_score_correction_bias"):
        return [(f"blk.{name.split('.')[2]}.exp_probs_b.bias", w)]
    if name.endswith("kv_b_proj.weight") and mla:
        heads, nope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"]
        kv_b = w.reshape(heads, nope + v, -1)
        bid = name.split(".")[2]
        k_b = kv_b[:, :nope].swapaxes(1, 2)  # llama.cpp keeps k_b transposed for absorption
        return [(f"blk.{bid}.attn_k_b.weight", k_b), (f"blk.{bid}.attn_v_b.weight", kv_b[:, nope:])]
    return [(None, w)]


def _write_metadata(w, kind: str, c: dict, mla: bool, mtp: bool) -> None:
    tokens, types, merges = byte_vocab()
    w.add_block_count(c["num_hidden_layers"] + mtp)
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    if not (kind.startswith("deepseek") and mla):
        w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(VOCAB)
    if "head_dim" in c:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    if n := c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts"):
        w.add_expert_count(n)
        w.add_expert_used_count(c["num_experts_per_tok"])
    if kind in ("qwen3_moe", "deepseek_v2", "deepseek_v3"):
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if kind == "gemma3_text":
        w.add_sliding_window(c["sliding_window"])
    if kind == "phi3":
        w.add_rope_scaling_orig_ctx_len(c.get("original_max_position_embeddings", 4096))
        rope = int(c["partial_rotary_factor"] * c["hidden_size"]) // c["num_attention_heads"]
        w.add_rope_dimension_count(rope)
        w.add_sliding_window(0)
    if (scaling := c.get("rope_scaling")) and scaling.get(
        "type", scaling.get("rope_type")
    ) == "yarn":
        _yarn_metadata(w, kind, scaling)
    if kind.startswith("deepseek"):
        _deepseek_metadata(w, c, mla)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)


def _yarn_metadata(w, kind: str, scaling: dict) -> None:
    """TextModel.set_gguf_parameters for YaRN; DeepSeek adds 0.1 * mscale_all_dim."""
    from gguf import RopeScalingType

    if scaling["factor"] == 1.0:
        return
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(scaling["factor"])
    w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    if "beta_fast" in scaling:
        w.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
    if kind.startswith("deepseek") and "mscale_all_dim" in scaling:
        w.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])


def _deepseek_metadata(w, c: dict, mla: bool) -> None:
    from gguf import ExpertGatingFuncType

    rank, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    if c.get("q_lora_rank"):
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_rope_dimension_count(rope)
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_weights_scale(c.get("routed_scaling_factor", 1.0))
    w.add_expert_weights_norm(c.get("norm_topk_prob", False))
    if mla:  # current llama.cpp: MLA as one KV head of kv_lora_rank + rope dims
        w.add_head_count_kv(1)
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(c["qk_nope_head_dim"] + rope)
        w.add_value_length_mla(c["v_head_dim"])
    else:
        w.add_key_length(c["qk_nope_head_dim"] + rope)
        w.add_value_length(c["v_head_dim"])
    if c["model_type"] == "deepseek_v3":
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(c["n_group"])
        w.add_expert_group_used_count(c["topk_group"])
    else:
        w.add_expert_gating_func(ExpertGatingFuncType.SOFTMAX)
