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
from thunderpool.models.gguf_file import TensorInfo
from thunderpool.models.gguf_rope import llama3_scaling

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3", "deepseek2")
OFFLINE_FIX = (
    "pass the model's Hugging Face safetensors directory as --model instead (offline, "
    "transformers writes one from a GGUF it can read: AutoModelForCausalLM.from_pretrained(dir, "
    "gguf_file=name).save_pretrained(out))"
)


Reader = Callable[[TensorInfo], np.ndarray]


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


class Meta:
    """`<arch>.*` metadata with errors that name the missing key."""

    def __init__(self, meta: Mapping[str, Any], arch: str):
        self.meta, self.arch = meta, arch

    def get(self, name: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{name}", default)

    def req(self, name: str) -> Any:
        value = self.get(name)
        if value is None:
            raise ModelError(f"GGUF metadata lacks {self.arch}.{name}; the file is incomplete")
        return value

    def f32(self, name: str, default: float | None = None) -> float:
        """A float32 field as the decimal it was written from (1e-05, not 9.9999997e-06)."""
        value = self.req(name) if default is None else self.get(name, default)
        return float(f"{float(value):.7g}")

    def uniform(self, name: str, default: Any = None) -> Any:
        """A value some files store once per layer; only a uniform one maps onto HF configs."""
        value = self.get(name, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ModelError(
                    f"per-layer {self.arch}.{name} {sorted(set(value))} is not supported"
                )
            value = value[0]
        return value


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


def _experts(m: Meta, names: Mapping[str, TensorInfo], n_layers: int) -> tuple[int, list[int]]:
    """(expert count, layers without experts); old per-expert GGUF layouts are refused."""
    if any(".ffn_gate.0." in n or ".ffn_down.0." in n for n in names):
        raise ModelError(
            "this GGUF stores experts one tensor each (a pre-2024 llama.cpp layout); "
            f"re-convert it with a current llama.cpp, or {OFFLINE_FIX}"
        )
    dense = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    return int(m.get("expert_count", 0) or 0), dense


def _config_llama(m: Meta, names: Mapping[str, TensorInfo], config: dict) -> None:
    n_experts, dense = _experts(m, names, config["num_hidden_layers"])
    if n_experts and len(dense) < config["num_hidden_layers"]:
        # Mixtral-style: llama architecture with experts in every layer.
        if dense:
            raise ModelError(f"llama-arch MoE with dense layers {dense} is not supported")
        if config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
            raise ModelError(
                f"llama-arch MoE with head_dim {config['head_dim']} != hidden/heads cannot be "
                f"expressed as an mlx-lm mixtral config; {OFFLINE_FIX}"
            )
        config |= {
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": n_experts,
            "num_experts_per_tok": int(m.req("expert_used_count")),
        }
        return
    config |= {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "mlp_bias": "blk.0.ffn_up.bias" in names,
    }


def _config_qwen2(m: Meta, names: Mapping[str, TensorInfo], config: dict) -> None:
    config |= {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    config["use_sliding_window"] = False


def _config_qwen3(m: Meta, names: Mapping[str, TensorInfo], config: dict) -> None:
    config |= {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}


def _config_qwen3moe(m: Meta, names: Mapping[str, TensorInfo], config: dict) -> None:
    n_experts, dense = _experts(m, names, config["num_hidden_layers"])
    moe_ff = int(m.req("expert_feed_forward_length"))
    config |= {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": n_experts,
        "num_experts_per_tok": int(m.req("expert_used_count")),
        "moe_intermediate_size": moe_ff,
        "intermediate_size": config["intermediate_size"] or moe_ff,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        # llama.cpp's qwen3moe graph always renormalizes the top-k weights.
        "norm_topk_prob": bool(m.get("expert_weights_norm", True)),
    }


def _sliding_pattern(m: Meta, n_layers: int) -> int:
    """Gemma 3's period of sliding layers (every n-th layer global); llama.cpp's default is 6."""
    pattern = m.get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        # One bool per layer, True = sliding; mlx-lm can express only "every n-th is global".
        globals_ = [i for i, sliding in enumerate(pattern) if not sliding]
        period = globals_[0] + 1 if globals_ else n_layers + 1
        if any(bool(s) != ((i + 1) % period != 0) for i, s in enumerate(pattern)):
            raise ModelError(f"Gemma 3 sliding-window pattern {pattern} is not periodic")
        return period
    return int(pattern)


def _config_gemma3(m: Meta, names: Mapping[str, TensorInfo], config: dict) -> None:
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if m.get(cap):
            # mlx-lm's gemma3_text has no soft-capping: it would run, silently wrong.
            raise ModelError(f"Gemma 3 GGUF with {cap} is not supported; {OFFLINE_FIX}")
    n_layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    # llama.cpp's gemma3 graph: the 27B (62 layers) scales queries by hidden/heads, others by
    # head_dim (HF's query_pre_attn_scalar, which GGUF does not store).
    scalar = config["hidden_size"] // config["num_attention_heads"] if n_layers == 62 else head_dim
    config |= {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(m.req("attention.sliding_window")),
        "sliding_window_pattern": _sliding_pattern(m, n_layers),
        "rope_local_base_freq": m.f32("rope.freq_base_swa", 10000.0),
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _config_phi3(m: Meta, names: Mapping[str, TensorInfo], config: dict, read: Reader) -> None:
    rope_dims = int(m.get("rope.dimension_count", config["head_dim"]))
    config |= {
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        "partial_rotary_factor": rope_dims / config["head_dim"],
    }
    if original := m.get("rope.scaling.original_context_length"):
        config["original_max_position_embeddings"] = int(original)
    if "rope_factors_long.weight" in names:
        # Long-context Phi-3 (longrope): llama.cpp stores the per-frequency factors as tensors.
        factors = {
            f"{k}_factor": [float(x) for x in read(names[f"rope_factors_{k}.weight"])]
            for k in ("long", "short")
        }
        config["rope_scaling"] = {"type": "longrope", **factors}


def _config_deepseek2(m: Meta, names: Mapping[str, TensorInfo], config: dict) -> None:
    n_experts, dense = _experts(m, names, config["num_hidden_layers"])
    first_dense = int(m.get("leading_dense_block_count", 0))
    if dense != list(range(first_dense)):
        raise ModelError(f"DeepSeek2 dense layers {dense} are not the first {first_dense}")
    rope = int(m.req("rope.dimension_count"))
    mla = m.get("attention.key_length_mla") is not None
    # A current llama.cpp writes MLA as one shared KV head of kv_lora_rank + rope dims.
    qk = int(m.req("attention.key_length_mla" if mla else "attention.key_length"))
    v_dim = int(m.req("attention.value_length_mla" if mla else "attention.value_length"))
    gating = int(m.get("expert_gating_func", 1))  # llama.cpp: 1 softmax, 2 sigmoid
    if config["tie_word_embeddings"]:
        raise ModelError("DeepSeek2 GGUF without output.weight is not supported")
    config |= {
        "q_lora_rank": int(q) if (q := m.get("attention.q_lora_rank")) else None,
        "kv_lora_rank": int(m.req("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": qk - rope,
        "v_head_dim": v_dim,
        "head_dim": qk,
        "num_key_value_heads": config["num_attention_heads"],
        "n_routed_experts": n_experts,
        "n_shared_experts": int(m.get("expert_shared_count", 0)) or None,
        "num_experts_per_tok": int(m.req("expert_used_count")),
        "moe_intermediate_size": int(m.req("expert_feed_forward_length")),
        "routed_scaling_factor": m.f32("expert_weights_scale", 1.0),
        "first_k_dense_replace": first_dense,
        "moe_layer_freq": 1,
        "norm_topk_prob": bool(m.get("expert_weights_norm", False)),
        "rope_scaling": _yarn(m, mla_mscale=True),
    }
    groups = (int(m.get("expert_group_count", 1)), int(m.get("expert_group_used_count", 1)))
    if gating == 2:
        config |= {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}
        config |= {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
        config |= {"n_group": groups[0], "topk_group": groups[1]}
        return
    if config["norm_topk_prob"]:
        raise ModelError("DeepSeek2 softmax routing with renormalized top-k is not supported")
    config |= {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"]}
    if groups[0] > 1:
        config |= {"topk_method": "group_limited_greedy", "n_group": groups[0]}
        config["topk_group"] = groups[1]
    else:
        config["topk_method"] = "greedy"


def _yarn(m: Meta, mla_mscale: bool = False) -> dict[str, Any]:
    """YaRN as mlx-lm's rope_scaling. DeepSeek's attention always reads one (factor 1 is plain
    RoPE) and scales by mscale: llama.cpp stores 0.1 * mscale_all_dim, and DeepSeek configs
    set mscale == mscale_all_dim."""
    if m.get("rope.scaling.type") != "yarn":
        return {"type": "yarn", "factor": 1.0}
    config = {
        "type": "yarn",
        "factor": m.f32("rope.scaling.factor"),
        "original_max_position_embeddings": int(m.req("rope.scaling.original_context_length")),
    }
    for key in ("beta_fast", "beta_slow"):
        if m.get(f"rope.scaling.yarn_{key}") is not None:
            config[key] = m.f32(f"rope.scaling.yarn_{key}")
    if mla_mscale and m.get("rope.scaling.yarn_log_multiplier") is not None:
        mscale = float(f"{m.f32('rope.scaling.yarn_log_multiplier') / 0.1:.7g}")
        config |= {"mscale": mscale, "mscale_all_dim": mscale}
    return config


_CONFIGS: dict[str, Callable[..., None]] = {
    "llama": _config_llama,
    "qwen2": _config_qwen2,
    "qwen3": _config_qwen3,
    "qwen3moe": _config_qwen3moe,
    "gemma3": _config_gemma3,
    "deepseek2": _config_deepseek2,
}


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
