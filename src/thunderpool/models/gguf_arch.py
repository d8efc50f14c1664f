"""Per-architecture maps from a GGUF file to an mlx-lm checkpoint: config.json fields and tensors.

Each map inverts what llama.cpp's `convert_hf_to_gguf.py` does for that family: the tensor names,
the Q/K row interleave of llama-arch RoPE, Gemma's norm weights stored as 1 + w, stacked experts
and DeepSeek's split MLA up-projection. Names are written as mlx-lm's models hold them
(experts stacked under `switch_mlp`), so `sanitize` passes them through.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from thunderpool.errors import ModelError
from thunderpool.models.gguf_configs import _CONFIGS, OFFLINE_FIX, Meta, Reader, _config_phi3, _yarn
from thunderpool.models.gguf_file import TensorInfo
from thunderpool.models.gguf_rope import llama3_scaling

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3", "deepseek2")


@dataclass(frozen=True, slots=True)
class OutTensor:
    """One tensor of the output checkpoint and how to make it from GGUF tensors."""

    hf_name: str
    sources: tuple[TensorInfo, ...]
    rope_heads: int | None = None  # llama.cpp interleaved each head's RoPE halves: undo it
    shift: float = 0.0  # added after dequantizing (Gemma stores norm weights as 1 + w)
    combine: Callable[[list[np.ndarray]], np.ndarray] | None = None  # several sources -> one
    combined_shape: tuple[int, ...] | None = None  # the shape `combine` returns

    @property
    def shape(self) -> tuple[int, ...]:
        return self.combined_shape or self.sources[0].shape


# GGUF tensor stem (after "blk.N.") -> mlx-lm name (after "model.layers.N."), shared by families.
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3 = _LAYER | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3 = _LAYER | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


def _moe(block: str) -> dict[str, str]:
    return {
        "ffn_gate_inp": f"{block}.gate",
        "ffn_gate_exps": f"{block}.switch_mlp.gate_proj",
        "ffn_up_exps": f"{block}.switch_mlp.up_proj",
        "ffn_down_exps": f"{block}.switch_mlp.down_proj",
    }


_DEEPSEEK2 = (
    _LAYER
    | _moe("mlp")
    | {
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
        "exp_probs_b": "mlp.gate.e_score_correction_bias",
    }
)
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def architecture(arch: Any, path: Any) -> str:
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(
            f"GGUF architecture {arch!r} in {path} is not supported by import-gguf "
            f"(supported: {', '.join(SUPPORTED_ARCHS)}); {OFFLINE_FIX}"
        )
    return arch


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() else None


def _stem(name: str) -> tuple[int | None, str, str]:
    """("blk.3.attn_q.weight") -> (3, "attn_q", "weight"); globals have layer None."""
    body, _, suffix = name.rpartition(".")
    layer = layer_of(name)
    stem = body.split(".", 2)[2] if layer is not None else body
    return layer, stem, suffix


def base_config(m: Meta, names: Mapping[str, TensorInfo], dtype: str) -> dict[str, Any]:
    """The fields every family's mlx-lm ModelArgs shares, from GGUF metadata."""
    hidden, n_heads = int(m.req("embedding_length")), int(m.uniform("attention.head_count"))
    if "token_embd.weight" not in names:
        raise ModelError("GGUF file has no token_embd.weight tensor; it is not a complete model")
    config: dict[str, Any] = {
        "hidden_size": hidden,
        # llama.cpp appends multi-token-prediction blocks after the model's own (DeepSeek V3.2).
        "num_hidden_layers": int(m.req("block_count")) - int(m.get("nextn_predict_layers", 0)),
        "intermediate_size": int(m.uniform("feed_forward_length", 0)),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(m.uniform("attention.head_count_kv", n_heads)),
        "head_dim": int(m.get("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": m.f32("attention.layer_norm_rms_epsilon"),
        "rope_theta": m.f32("rope.freq_base", 10000.0),
        # The embedding's rows, not the token list: llama.cpp trims or pads either.
        "vocab_size": int(names["token_embd.weight"].shape[0]),
        "max_position_embeddings": int(m.req("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": dtype if dtype in ("float16", "bfloat16") else "float32",
    }
    for key in ("bos", "eos", "padding"):
        if (idx := m.meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(idx)
    scaling = m.get("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": m.f32("rope.scaling.factor")}
    elif scaling == "yarn":
        config["rope_scaling"] = _yarn(m)
    elif scaling not in (None, "none"):
        raise ModelError(f"GGUF rope scaling {scaling!r} is not supported (only linear, yarn)")
    return config


def hf_config(
    meta: Mapping[str, Any], arch: str, names: Mapping[str, TensorInfo], dtype: str, read: Reader
) -> dict[str, Any]:
    """An HF-style config.json that mlx-lm's model for `arch` accepts; `read` loads the few
    small tensors that hold config values (Phi-3's longrope factors)."""
    m = Meta(meta, arch)
    config = base_config(m, names, dtype)
    if arch == "phi3":
        _config_phi3(m, names, config, read)
    else:
        _CONFIGS[arch](m, names, config)
    if "rope_freqs.weight" in names:
        if config["model_type"] != "llama":
            kind = config["model_type"]
            raise ModelError(f"{kind} GGUF with rope_freqs.weight is not supported; {OFFLINE_FIX}")
        dims = int(m.get("rope.dimension_count", config["head_dim"]))
        divisors = read(names["rope_freqs.weight"])
        if scaling := llama3_scaling(divisors, config["rope_theta"], dims):
            config["rope_scaling"] = scaling
    if config.get("intermediate_size") == 0 and "blk.0.ffn_up.weight" in names:
        config["intermediate_size"] = int(names["blk.0.ffn_up.weight"].shape[0])
    return config


def _layer_names(arch: str, config: dict) -> dict[str, str]:
    if arch == "gemma3":
        return _GEMMA3
    if arch == "phi3":
        return _PHI3
    if arch == "deepseek2":
        return _DEEPSEEK2
    if arch == "qwen3moe":
        return _LAYER | _moe("mlp")
    if config["model_type"] == "mixtral":
        return _LAYER | _moe("block_sparse_moe")
    return _LAYER


def plan(
    arch: str, config: dict, tensors: list[TensorInfo], path: Any, n_blocks: int
) -> list[OutTensor]:
    """Every output tensor, with its GGUF sources and transforms; unknown tensors are refused.

    `n_blocks` is the file's block_count: blocks past the config's layers are MTP blocks."""
    layer_names = _layer_names(arch, config)
    by_name = {t.name: t for t in tensors}
    out: list[OutTensor] = []
    for t in tensors:
        if t.name == "rope_freqs.weight":
            continue  # Llama 3 rope scaling: in config.json (hf_config checked it)
        if t.name in ("rope_factors_long.weight", "rope_factors_short.weight") and arch == "phi3":
            continue  # in config.json's rope_scaling
        layer, stem, suffix = _stem(t.name)
        if layer is not None and config["num_hidden_layers"] <= layer < n_blocks:
            continue  # a multi-token-prediction block: mlx-lm's models do not run it
        if arch == "deepseek2" and stem in ("attn_k_b", "attn_v_b"):
            if stem == "attn_k_b":
                out.append(_kv_b(by_name, layer, config))
            continue
        names = _GLOBAL if layer is None else layer_names
        if stem not in names or suffix not in ("weight", "bias"):
            raise ModelError(f"unexpected tensor {t.name!r} in {path} for architecture {arch!r}")
        if stem == "exp_probs_b":
            suffix = ""  # e_score_correction_bias is a parameter of its own
        prefix = "" if layer is None else f"model.layers.{layer}."
        hf = f"{prefix}{names[stem]}" + (f".{suffix}" if suffix else "")
        rope = None
        if config["model_type"] in ("llama", "mixtral") and stem in ("attn_q", "attn_k"):
            rope = config["num_attention_heads" if stem == "attn_q" else "num_key_value_heads"]
        shift = -1.0 if arch == "gemma3" and stem.endswith("norm") else 0.0
        out.append(OutTensor(hf, (t,), rope_heads=rope, shift=shift))
    return out


def _kv_b(by_name: Mapping[str, TensorInfo], layer: int | None, config: dict) -> OutTensor:
    """Rebuild DeepSeek's kv_b_proj from llama.cpp's per-head k_b (transposed) and v_b."""
    k_b, v_b = by_name[f"blk.{layer}.attn_k_b.weight"], by_name.get(f"blk.{layer}.attn_v_b.weight")
    if v_b is None:
        raise ModelError(f"blk.{layer}.attn_k_b.weight has no blk.{layer}.attn_v_b.weight")
    heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
    nope, v_dim = config["qk_nope_head_dim"], config["v_head_dim"]

    def combine(arrays: list[np.ndarray]) -> np.ndarray:
        k = arrays[0].reshape(heads, rank, nope).swapaxes(1, 2)  # -> (heads, nope, rank)
        v = arrays[1].reshape(heads, v_dim, rank)
        return np.concatenate([k, v], axis=1).reshape(heads * (nope + v_dim), rank)

    name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
    shape = (heads * (nope + v_dim), rank)
    return OutTensor(name, (k_b, v_b), combine=combine, combined_shape=shape)
