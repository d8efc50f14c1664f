"""Tiny random models of any mlx-lm family: its own ModelArgs with every width shrunk.

The same shrink serves two callers: the family matrix, which builds each family mlx-lm ships
from its ModelArgs defaults (tests/parallel/test_all_families.py), and the day-0 proof, which
shrinks a real checkpoint's config.json. Widths (hidden size, head and expert widths, LoRA
ranks, vocabulary) become small; what makes a family itself stays: its layer kinds and their
pattern, head counts (so TP's divisibility is the real one), expert counts and top-k, shared
and dense-first layers, windows (shorter than a test prompt), sinks.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
from functools import cache
from typing import Any

HIDDEN, VOCAB, WINDOW, HEAD = 64, 256, 16, 16
MAX_HIDDEN = 1024

# Config keys by what they size. A key in none of these keeps its value.
_HIDDEN = ("hidden_size", "d_model", "n_embd", "hidden_dim", "model_dim", "dim", "block_dim")
_FFN = (
    "intermediate_size", "ffn_hidden_size", "n_inner", "ff_intermediate_size",
    "intermediate_size_mlp", "dense_intermediate_size", "block_ff_dim",
)
_EXPERT_FFN = (
    "moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size",
    "shared_intermediate_size", "moe_shared_expert_intermediate_size", "share_expert_dim",
    "routed_expert_hidden_size", "moe_latent_size", "moe_hidden_size",
)
_HEAD_DIM = (
    "head_dim", "qk_nope_head_dim", "v_head_dim", "linear_key_head_dim",
    "linear_value_head_dim", "mamba_head_dim", "mamba_d_head", "swa_head_dim",
    "swa_v_head_dim", "index_head_dim", "kv_channels", "attention_head_dim",
    "hidden_size_per_layer_input",
)
_ROPE_DIM = ("qk_rope_head_dim", "rotary_dim", "rope_dim", "rotary_emb_dim")
_RANK = ("kv_lora_rank", "q_lora_rank", "o_lora_rank", "time_step_rank", "a_low_rank_dim",
         "v_low_rank_dim", "gate_low_rank_dim", "decay_low_rank_dim", "laurel_rank")
_EXPERTS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
_TOPK = ("num_experts_per_tok", "moe_topk", "moe_top_k", "top_k", "num_experts_per_token",
         "top_k_experts", "n_activated_experts", "num_selected_experts")
_WINDOW = ("sliding_window", "attention_window_size", "sliding_window_size", "window_size",
           "attention_chunk_size")
_VOCAB = ("vocab_size", "padded_vocab_size", "num_vocab", "vocab_size_per_layer_input")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "block_size",
              "model_max_length", "seq_length")
_STATE = ("state_size", "ssm_state_size", "mamba_d_state")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_transformer_layers")
_DENSE_FIRST = ("first_k_dense_replace", "num_dense_layers", "first_dense_layers")
_MAMBA_HEADS = ("mamba_n_heads", "mamba_num_heads")
# A layer kind every N layers: N becomes 2 where N layers would not repeat twice.
_PERIODS = ("sliding_window_pattern", "full_attention_interval", "layer_group_size",
            "attn_layer_period", "expert_layer_period", "interleave_moe_layer_step",
            "dense_attention_every_n_layers", "global_attn_every_n_layers")
_OFFSETS = {"attn_layer_offset": "attn_layer_period",
            "expert_layer_offset": "expert_layer_period"}
# Lists with one entry per layer (also any list as long as the layer count).
_PER_LAYER = (
    "layer_types", "mlp_layer_types", "layers_block_type", "block_types", "is_moe_layer",
    "no_rope_layers", "hybrid_override_pattern", "hybrid_layer_pattern", "moe_layer_freq",
    "activation_sparsity_pattern", "block_configs", "layer_rope_theta", "swiglu_limits",
    "partial_rotary_factors", "num_attention_heads_per_layer", "swiglu_limits_shared",
    "num_query_heads", "num_kv_heads", "ffn_multipliers", "sparse_attention_freq",
)
# Lists of layer indices (value: the first layer's index).
_INDEXES = {"mlp_only_layers": 0, "full_attn_idxs": 0, "full_attention_idx": 0,
            "sliding_window_layers": 0, "kda_layers": 1, "full_attn_layers": 1,
            "moe_layers_enum": 0}
_NESTED = ("text_config", "ffn_config", "attn_config", "linear_attn_config")
# Required fields a family's ModelArgs leaves without default: a plausible value by name.
_REQUIRED: dict[str, Any] = {
    "rms_norm_eps": 1e-5, "norm_eps": 1e-5, "layer_norm_eps": 1e-5, "layer_norm_epsilon": 1e-5,
    "layernorm_epsilon": 1e-5, "rope_theta": 10000.0, "num_attention_heads": 4,
    "num_key_value_heads": 2, "n_head": 4, "n_heads": 4, "num_heads": 4, "num_kv_heads": 2,
    "n_kv_heads": 2, "num_query_heads": 4, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "use_bias": False, "use_conv_bias": True,
    "use_qkv_bias": False, "num_experts_per_tok": 2, "moe_topk": 2, "n_shared_experts": 1,
    "num_shared_experts": 1, "num_shared_expert": 1, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "partial_rotary_factor": 0.5,
    "rope_scaling": None, "use_qk_norm": True, "qk_norm": True, "post_norm": False,
    "conv_kernel": 4, "conv_window": 2, "conv1d_width": 4, "conv_L_cache": 3,
    "conv_bias": False, "n_groups": 1, "hidden_act": "relu2", "logits_scaling": 1.0,
    "attention_multiplier": 0.25, "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
    "scale_depth": 1.0, "scale_emb": 1.0, "dim_model_base": HIDDEN, "rotary_emb_base": 10000,
    "rotary_pct": 0.5, "logits_soft_cap": 30.0, "linear_conv_kernel_dim": 4,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "mamba_num_heads": 8,
    "mamba_expand": 2, "mamba_d_conv": 4, "mamba_proj_bias": False, "use_expert_bias": True,
    "num_dense_layers": 1, "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": False, "use_cla": False, "cla_share_factor": 1,
    "use_mixed_mlp_moe": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "moe_layer_freq": 1, "layer_group_size": 2, "group_norm_size": 1, "gegelu_limit": 20.0,
    "dense_attention_every_n_layers": 2, "ffn_dim_divisor": 16, "num_kv_reuse_layers": 1,
    "time_step_limit": (0.0, float("inf")), "linear_allow_neg_eigval": False,
    "sliding_window": WINDOW, "sliding_window_size": WINDOW, "rope_local_base_freq": 10000.0,
    "swa_rope_theta": 10000.0, "final_logit_softcapping": 30.0, "num_attention_groups": 2,
    "post_norm_eps": 1e-5, "output_multiplier": 1.0, "index_n_heads": 4, "index_topk": 8,
    "mla_scale_q_lora": True, "mla_scale_kv_lora": True, "zero_expert_num": 2,
    "zero_expert_type": "identity", "attention_method": "MLA", "num_kv_shared_layers": 2,
    "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
    "expert_layer_period": 2, "mamba_d_state": 16, "interleave_moe_layer_step": 2,
}

# Per family: config keys merged in before shrinking, where defaults miss what the model needs.
# "_layers" asks for more layers where the family's pattern needs them.
_SWA, _FULL = "sliding_attention", "full_attention"
_ROPE2 = {_SWA: {"rope_theta": 10000.0}, _FULL: {"rope_theta": 1000000.0}}
_YARN = {"type": "yarn", "rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0,
         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 1000000.0,
         "original_max_position_embeddings": 16384, "llama_4_scaling_beta": 0.1}
_KDA = {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 8, "head_dim": 128,
        "short_conv_kernel_size": 4}  # linear (KDA) and MLA layers alternating
_MLA = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128}
_V3 = {"n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
       "topk_group": 4, "first_k_dense_replace": 3, "topk_method": "noaux_tc",
       "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5}
_SWA3 = {"layer_types": [_SWA] * 3 + [_FULL]}
HINTS: dict[str, dict] = {
    "afmoe": {"layer_types": [_SWA] * 3 + [_FULL]},
    "baichuan_m1": {"num_hidden_layers": 4, "sliding_window_layers": [1, 3]},
    "deepseek": {"n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
                 "first_k_dense_replace": 1},
    "deepseek_v3": _V3, "deepseek_v32": _V3, "kimi_k25": {"text_config": _V3},
    "kimi_vl": {"text_config": {**_V3, "n_routed_experts": 64, "n_shared_experts": 2,
                                "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1}},
    "dbrx": {"n_heads": 8, "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0,
                                           "rope_theta": 500000.0},
             "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4}},
    "deepseek_v2": {"n_routed_experts": 160, "n_shared_experts": 2, "num_experts_per_tok": 6,
                    "n_group": 8, "topk_group": 3, "topk_method": "group_limited_greedy",
                    "first_k_dense_replace": 1,
                    "rope_scaling": {**_YARN, "factor": 40.0, "mscale": 0.707,
                                     "mscale_all_dim": 0.707}},
    "exaone4": {"sliding_window_pattern": "LLLG", "sliding_window": 4096},
    "exaone_moe": {"layer_types": [_SWA] * 3 + [_FULL], "is_moe_layer": [False] + [True] * 3},
    "gear": {"layer_types": ["conv_mixer", _SWA, _FULL], "_layers": 6},
    "gemma3n": {"text_config": {
        "layer_types": [_SWA] * 4 + [_FULL],
        "activation_sparsity_pattern": [0.95] * 10 + [0.0] * 20,
        "altup_num_inputs": 4, "altup_coef_clip": 120.0, "altup_correct_scale": True,
        "altup_active_idx": 0, "num_kv_shared_layers": 10, "hidden_size_per_layer_input": 256,
        "vocab_size_per_layer_input": 262144, "laurel_rank": 64, "sliding_window": 512}},
    "glm_moe_dsa": {"rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}},
    "granitemoehybrid": {
        "layer_types": ["mamba"] * 3 + ["attention"], "num_local_experts": 64,
        "num_experts_per_tok": 6, "shared_intermediate_size": 1024, "mamba_n_heads": 48,
        "mamba_d_head": 64, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_n_groups": 1,
        "mamba_proj_bias": False, "mamba_conv_bias": True, "position_embedding_type": "nope"},
    "hunyuan": {"rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}},
    "kimi_k3": {"text_config": {"num_hidden_layers": 4, "linear_attn_config": _KDA, **_MLA,
                                "num_experts": 8, "moe_intermediate_size": 2048,
                                "num_shared_experts": 1, "first_k_dense_replace": 1}},
    "kimi_linear": {"num_hidden_layers": 4, "linear_attn_config": _KDA, **_MLA,
                    "num_experts_per_token": 8, "num_shared_experts": 1,
                    "first_k_dense_replace": 1, "mla_use_nope": True},
    "lfm2": {"layer_types": ["conv", "conv", _FULL], "block_ff_dim": 8192},
    "lfm2-vl": {"text_config": {"layer_types": ["conv", "conv", _FULL], "block_ff_dim": 8192}},
    "lfm2_moe": {"layer_types": ["conv", "conv", _FULL]},
    "llama4": {"text_config": {"num_experts_per_tok": 1}},  # its router takes one expert
    "llama4_text": {"no_rope_layers": [1, 1, 1, 0]},
    "mellum": {"layer_types": [_SWA, _FULL], "rope_parameters": _ROPE2},
    "mimo_v2_flash": {
        "hybrid_layer_pattern": [0, 1, 0, 1], "moe_layer_freq": [0, 1, 1, 1],
        "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
        "num_attention_heads": 64, "num_key_value_heads": 4, "swa_num_attention_heads": 64,
        "swa_num_key_value_heads": 8, "partial_rotary_factor": 0.5, "n_routed_experts": 256,
        "n_shared_experts": None},
    "minicpm3": {"rope_scaling": {"type": "longrope", "long_factor": 1.0, "short_factor": 1.0,
                                  "original_max_position_embeddings": 1024}},
    "ministral3": {"rope_parameters": _YARN},
    "mistral4": {"rope_parameters": _YARN},
    "muse_spark": {"text_config": {
        "layer_types": [_SWA] * 3 + [_FULL], "layer_rope_theta": [10000.0] * 3 + [0.0],
        "rope_parameters": {"rope_theta": 10000.0}, "sliding_window": 512}},
    "nemotron-nas": {"_layers": 6, "block_configs": [
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 0.5}},
        {"attention": {"replace_with_linear": True}, "ffn": {"replace_with_linear": True}}]},
    "nemotron_h": {"_layers": 8, "hybrid_override_pattern": "M*-EM*-E", "n_routed_experts": 128,
                   "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 1856,
                   "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "topk_group": 1,
                   "norm_topk_prob": True, "routed_scaling_factor": 2.5},
    "olmo3": _SWA3, "muse_glimmer": _SWA3,
    "olmo_hybrid": {"layer_types": ["linear_attention"] * 3 + [_FULL]},
    "openelm": {"num_transformer_layers": 4, "num_query_heads": [4, 4, 8, 8],
                "num_kv_heads": [2, 2, 4, 4], "ffn_multipliers": [0.5, 1.0, 2.0, 4.0]},
    "plamo": {"num_attention_heads": 16},  # whole groups of n_shared_head (8)
    "qwen3": {"rope_theta": 1000000.0},
    "qwen3_5_moe": {"text_config": {"num_experts": 256, "num_experts_per_tok": 8,
                                    "moe_intermediate_size": 512,
                                    "shared_expert_intermediate_size": 512}},
    "qwen3_vl": {"text_config": {"rope_theta": 5000000.0}},
    "recurrent_gemma": {"block_types": ["recurrent", "recurrent", "attention"]},
    "spark2_5": {"layer_types": [_SWA] * 3 + [_FULL], "rope_parameters": _ROPE2},
    "step3p5": {"layer_types": [_FULL] + [_SWA] * 3, "moe_layers_enum": "1,2,3",
                "attention_other_setting": {"num_attention_heads": 8, "num_attention_groups": 2}},
}

CANNOT_BUILD: dict[str, str] = {
    "bitnet": "BitLinear's forward is a Metal kernel only (no CPU back-end)",
    "prism_hadamard_qwen35": "needs a Hadamard rotation pack shipped with the checkpoint",
    "muse_spark": "its qk-norm/rope, norms and expert routing are Metal kernels only",
    "phi3small": "its forward segfaults in about half the runs on mlx's CPU back-end",
}


def text_args_class(module) -> type | None:
    """The dataclass a multimodal wrapper's `text_config` is read into, if any."""
    args = module.ModelArgs
    if "text_config" not in {f.name for f in dataclasses.fields(args)}:
        return None
    for name in ("TextModelArgs", "TextArgs", "TextConfig"):
        if inspect.isclass(cls := getattr(module, name, None)):
            return cls
    # e.g. gemma3: gemma3_text.ModelArgs.from_dict(args.text_config); mistral3: llama's
    if m := re.search(r"(\w+)\.ModelArgs\.from_dict\(\s*args\.text_config",
                      inspect.getsource(module)):
        return getattr(module, m[1]).ModelArgs
    for base in module.Model.__mro__[1:]:  # e.g. qwen3_5_moe: qwen3_5's Model
        if base.__module__.startswith("mlx_lm.models.") and base.__module__ != module.__name__:
            return text_args_class(importlib.import_module(base.__module__))
    return None


def defaults(cls: type) -> dict:
    """The values a ModelArgs dataclass gives its fields, `_REQUIRED`'s where it gives none."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        elif f.name in _REQUIRED:
            out[f.name] = _REQUIRED[f.name]
        elif (size := _size(f.name, 1 << 20, 4, 4)) is not None:
            out[f.name] = size
    return out


def shrink(config: dict, layers: int | None = None) -> dict:
    """A copy of `config` with small widths (and `layers` layers where given); nested
    text_config/ffn_config/attn_config dicts are shrunk alike."""
    return _shrink(config, layers, None)


def _shrink(config: dict, layers: int | None, outer: int | None) -> dict:
    out = dict(config)
    heads = next((out[k] for k in ("num_attention_heads", "n_head", "n_heads", "num_heads",
                                   "num_query_heads") if isinstance(out.get(k), int)), 4)
    count = next((v for k in _LAYERS if isinstance(v := config.get(k), int)), outer)
    for key, value in config.items():
        if isinstance(value, dict) and key in _NESTED:
            out[key] = _shrink(value, layers, count)
        elif isinstance(value, int) and not isinstance(value, bool) and value > 0:
            if (size := _size(key, value, heads, layers)) is not None:
                out[key] = size
        elif layers and isinstance(value, (list, tuple, str)):
            out[key] = _relayer(key, value, count, layers)
    if layers:
        for key in _PERIODS:
            if isinstance(p := out.get(key), int) and p > 2 and 2 * p > layers:
                out[key] = 2
            elif isinstance(p, str) and 2 * len(p) > layers:  # e.g. exaone4's "LLLG"
                out[key] = "".join(_runs(list(p)))
        for key, period in _OFFSETS.items():
            if isinstance(out.get(key), int) and isinstance(out.get(period), int):
                out[key] = out[key] % out[period]
        if isinstance(n := out.get("num_kv_shared_layers"), int):
            out["num_kv_shared_layers"] = min(n, layers // 2)
    if all(isinstance(out.get(k), int) for k in ("mamba_d_ssm", "mamba_n_heads", "mamba_d_head")):
        out["mamba_d_ssm"] = out["mamba_n_heads"] * out["mamba_d_head"]  # falcon_h1's SSM width
    if isinstance(out.get("n_group"), int) and out["n_group"] > 1:
        out["n_group"], out["topk_group"] = 2, 1  # group-limited routing over 8 experts
    return out


def _relayer(key: str, value: Any, count: int | None, layers: int) -> Any:
    """A per-layer list (or pattern string, or index list) for `layers` layers."""
    if key in _INDEXES:
        base, text = _INDEXES[key], isinstance(value, str)
        idx = [int(i) for i in value.split(",") if i.strip()] if text else list(value)
        if not idx or not all(isinstance(i, int) for i in idx):
            return value
        total = count if count and count > max(idx) - base else max(idx) + 1 - base
        mask = _cut([i + base in idx for i in range(total)], layers)
        idx = [i + base for i, m in enumerate(mask) if m]
        return ",".join(map(str, idx)) if text else idx
    if key in _PER_LAYER or (count and len(value) == count and not isinstance(value, str)):
        if not value:
            return value
        cut = _cut(list(value), layers)
        return "".join(cut) if isinstance(value, str) else cut
    return value


def _cut(seq: list, n: int) -> list:
    """`seq` as `n` entries with the same pattern: a leading run, then a repeating period
    (whose runs shrink to one entry each where the period would not fit twice)."""
    head, period = min(
        ((seq[:o], seq[o:o + p]) for o in range(len(seq)) for p in range(1, len(seq) - o + 1)
         if all(seq[i] == seq[o + (i - o) % p] for i in range(o, len(seq)))),
        key=lambda hp: len(hp[0]) + len(hp[1]),
    )
    if len(head) + 2 * len(period) > n:  # each kind twice, so a PP cut keeps them all
        head, period = _runs(head), _runs(period)
    out = (head + period * n)[:n]
    kinds = [x for i, x in enumerate(seq) if x not in seq[:i]]
    if any(k not in out for k in kinds):  # no short pattern (e.g. nemotron_h's): kinds in turn
        out = (kinds * n)[:n]
    return out


def _runs(seq: list) -> list:
    return [x for i, x in enumerate(seq) if i == 0 or x != seq[i - 1]]


def _size(key: str, value: int, heads: int, layers: int | None = None) -> int | None:
    """The small value of a width, count or length config key; None: keep `value`."""
    if key in _HIDDEN:
        return min(max(HIDDEN, heads * HEAD), MAX_HIDDEN)
    if key in _FFN:
        return 96
    if key in _EXPERT_FFN:
        return 32
    if key in _ROPE_DIM:
        return min(value, 8)
    if key in _HEAD_DIM or key == "global_head_dim":
        return 2 * HEAD if key.startswith("global") else HEAD
    if key in _RANK:
        return 16
    if key in _EXPERTS:
        return min(value, 8)
    if key in _TOPK:
        return min(value, 2)
    if key in _MAMBA_HEADS:
        return min(value, 8)
    if key in _DENSE_FIRST:
        return min(value, 1)
    if key in _WINDOW:
        return min(value, WINDOW)
    if key in _VOCAB:
        return VOCAB
    if key in _POSITIONS:
        return min(value, 1024)
    if key in _STATE:
        return min(value, 16)
    if key in _LAYERS:
        return layers or value
    return None


@cache
def model_types() -> tuple[str, ...]:
    """Every model module the installed mlx-lm ships with a Model and a ModelArgs."""
    import mlx_lm.models as models

    names = []
    for info in pkgutil.iter_modules(models.__path__):
        try:
            module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except BaseException:  # noqa: BLE001 - e.g. olmo exits when ai2-olmo is missing
            continue
        if hasattr(module, "Model") and hasattr(module, "ModelArgs"):
            names.append(info.name)
    return tuple(sorted(names))


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        both = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = _merge(base[key], value) if both else value
    return out


def family_config(model_type: str, layers: int = 4) -> dict:
    """A tiny config.json for `model_type` from its mlx-lm ModelArgs' own defaults."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = {**defaults(module.ModelArgs), "model_type": model_type}
    text = text_args_class(module)
    if text is not None:
        config["text_config"] = {**defaults(text), "model_type": model_type}
    hint = dict(HINTS.get(model_type, {}))
    layers = max(layers, hint.pop("_layers", 0))
    return shrink(_merge(config, hint), layers)
