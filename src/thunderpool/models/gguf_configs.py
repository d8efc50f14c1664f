"""Each GGUF architecture's own config.json keys, over the base every family shares
(gguf_arch.base_config), read through Meta (the GGUF metadata of one architecture): MoE sizes,
sliding-window patterns, MLA and YaRN, Phi-3's longrope."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from thunderpool.errors import ModelError
from thunderpool.models.gguf_file import TensorInfo

OFFLINE_FIX = (
    "pass the model's Hugging Face safetensors directory as --model instead (offline, "
    "transformers writes one from a GGUF it can read: AutoModelForCausalLM.from_pretrained(dir, "
    "gguf_file=name).save_pretrained(out))"
)


Reader = Callable[[TensorInfo], np.ndarray]


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
