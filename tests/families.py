"""Tiny random checkpoints of every model family we shard, each keeping its structural features.

A checkpoint is built by transformers from the family's config (the same config.json fields
mlx-lm's ModelArgs reads), re-initialised with peaked weights, and saved in the Hugging Face
hub layout; mlx-lm loads it through its own `sanitize`, so one folder serves both
implementations and the transformers comparison checks mlx-lm's port too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HIDDEN, VOCAB = 64, 256
WINDOW = 16  # sliding window of the windowed families; the long prompt is far longer

BASE = {
    "hidden_size": HIDDEN,
    "vocab_size": VOCAB,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "initializer_range": 0.15,  # peaked logits, so greedy ties are not a coin flip
    "torch_dtype": "float32",
    # No special tokens: traces run their full length, and phi3's default pad id (32000)
    # would not fit the tiny vocabulary.
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


@dataclass(frozen=True)
class Family:
    """One family's tiny config and the layouts it is tested on."""

    config: dict
    # Per-stage layer counts for PP2 and PP3, cutting across its sliding/full and
    # dense/MoE boundaries (None: the default even split).
    pp2: tuple[int, ...] | None
    pp3: tuple[int, ...] | None
    features: str = ""
    # Layouts tensor.check refuses for this family, with a word on why (the test asserts
    # the refusal and its message).
    refuses: dict[str, str] = field(default_factory=dict)
    # Standard deviation of the embedding where initializer_range's would make the model
    # just repeat its input (Gemma: sqrt(hidden)-scaled embeddings and a tied head).
    embed_std: float | None = None
    # fp32 logits of the engine's cached decode against the full forward (any layout).
    tol: float = 1e-4


def _types(n: int, full_every: int, full: str = "full_attention", other: str = "") -> list:
    other = other or "sliding_attention"
    return [full if (i + 1) % full_every == 0 else other for i in range(n)]


FAMILIES: dict[str, Family] = {
    # 8 query / 2 KV heads: TP2 even (mlx-lm's shard), TP3 replicates KV heads.
    "llama": Family(
        {
            **BASE,
            "model_type": "llama",
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
        },
        pp2=(1, 3),
        pp3=None,
        features="GQA, untied head (stands for mistral)",
    ),
    # Qwen2.5: q/k/v biases, tied head; what the GGUF importer produces.
    "qwen2": Family(
        {
            **BASE,
            "model_type": "qwen2",
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
        },
        pp2=(3, 1),
        pp3=(1, 1, 2),
        features="qkv biases, tied head",
    ),
    # 6 query / 3 KV heads like SmolLM2: TP2 splits KV heads 2+1, TP3 is even.
    "qwen3": Family(
        {
            **BASE,
            "model_type": "qwen3",
            "num_hidden_layers": 4,
            "num_attention_heads": 6,
            "num_key_value_heads": 3,
            "head_dim": 16,
            "tie_word_embeddings": True,
        },
        pp2=(2, 2),
        pp3=(1, 2, 1),
        features="QK-norm, tied head",
    ),
    "qwen3_moe": Family(
        {
            **BASE,
            "model_type": "qwen3_moe",
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
        pp2=(1, 3),
        pp3=(2, 1, 1),
        features="routed experts, a dense first layer (mlp_only_layers), QK-norm",
    ),
    # Layers 2 and 5 are global, the rest slide over WINDOW tokens; embeddings are scaled
    # by sqrt(hidden). The splits put a global layer first on a later stage.
    "gemma3_text": Family(
        {
            **BASE,
            "model_type": "gemma3_text",
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": WINDOW,
            "sliding_window_pattern": 3,
            "layer_types": _types(6, 3),
            "rope_local_base_freq": 10000.0,
            "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
        },
        pp2=(2, 4),
        pp3=(2, 3, 1),
        embed_std=0.05,
        features="sliding/global pattern, embedding scaling, QK-norm, (1+w) norms, tied head",
    ),
    # MLA (low-rank q and kv, split rope/nope head dims), one shared + routed experts with
    # grouped top-k routing, a dense first layer: DeepSeek V3/V3.1 and Kimi K2's architecture.
    "deepseek_v3": Family(
        {
            **BASE,
            "model_type": "deepseek_v3",
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "rope_scaling": None,
            "tie_word_embeddings": False,
        },
        pp2=(2, 2),
        pp3=(1, 1, 2),
        features="MLA, shared + routed experts, dense-then-MoE (first_k_dense_replace)",
        refuses={"tp3": r"deepseek_v3 \(MLA attention\) .* tp=3 .* use tp in \[2, 4\]"},
    ),
    # GLM-5: deepseek_v3's MLA and MoE plus DeepSeek Sparse Attention, whose indexer (its own
    # heads, a key cache beside the latent one) keeps the index_topk best keys per query:
    # 32, far fewer than the long prompt, so the selection decides the output. 16 indexer heads,
    # not 8: with 8, whole rows of relu'd scores tie at 0 on the top-k boundary and the chosen
    # keys depend on summation order (16: the closest boundary gap is 1.4e-4 relative).
    "glm_moe_dsa": Family(
        {
            **BASE,
            "model_type": "glm_moe_dsa",
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "index_n_heads": 16,
            "index_head_dim": 16,
            "index_topk": 32,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": False,
        },
        pp2=(2, 2),
        pp3=(1, 1, 2),
        features="MLA, sparse-attention indexer, shared experts, dense-then-MoE",
        refuses={"tp3": r"glm_moe_dsa \(MLA attention\) .* tp=3 .* use tp in \[2, 4\]"},
    ),
    # DeepSeek V3.2: deepseek_v3 plus the same sparse-attention indexer (half-split RoPE in the
    # indexer where GLM-5's is interleaved), grouped routing as in V3.
    "deepseek_v32": Family(
        {
            **BASE,
            "model_type": "deepseek_v32",
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "index_n_heads": 16,
            "index_head_dim": 16,
            "index_topk": 32,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": False,
        },
        pp2=(1, 3),
        pp3=(2, 1, 1),
        features="MLA, sparse-attention indexer, shared + routed experts, dense-then-MoE",
        refuses={"tp3": r"deepseek_v32 \(MLA attention\) .* tp=3 .* use tp in \[2, 4\]"},
    ),
    # GLM-4.5: partial rotary, QK-norm, attention biases, shared experts, dense first layer.
    "glm4_moe": Family(
        {
            **BASE,
            "model_type": "glm4_moe",
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "partial_rotary_factor": 0.5,
            "use_qk_norm": True,
            "attention_bias": True,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.5,
            "norm_topk_prob": True,
            "rope_scaling": None,
            "tie_word_embeddings": False,
        },
        pp2=(1, 3),
        pp3=(1, 2, 1),
        features="partial rotary, QK-norm, attention biases, shared experts, dense-then-MoE",
    ),
    # Attention sinks, alternating sliding/full layers, biased experts with clamped SwiGLU.
    "gpt_oss": Family(
        {
            **BASE,
            "model_type": "gpt_oss",
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "experts_per_token": 2,
            "sliding_window": WINDOW,
            "layer_types": _types(4, 2),
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": False,
        },
        pp2=(1, 3),
        pp3=(1, 2, 1),
        features="attention sinks, alternating sliding/full, biased experts",
        refuses={"tp3": r"gpt_oss \(attention sinks\) .* tp=3 .* use tp in \[2\]"},
    ),
    "mixtral": Family(
        {
            **BASE,
            "model_type": "mixtral",
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": False,
        },
        pp2=(2, 2),
        pp3=(1, 2, 1),
        features="routed experts (block_sparse_moe)",
    ),
    # Fused qkv_proj and gate_up_proj.
    "phi3": Family(
        {
            **BASE,
            "model_type": "phi3",
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
        },
        pp2=(1, 3),
        pp3=(2, 1, 1),
        features="fused qkv and gate_up projections (TP: each rank a fused share of its own)",
    ),
    # Gated DeltaNet linear attention on three of four layers, gated full attention on the
    # fourth, routed + shared experts.
    "qwen3_next": Family(
        {
            **BASE,
            "model_type": "qwen3_next",
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "partial_rotary_factor": 0.25,
            "full_attention_interval": 2,
            "layer_types": _types(4, 2, other="linear_attention"),
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
        pp2=(2, 2),
        pp3=(1, 2, 1),
        features="hybrid linear (Gated DeltaNet) / gated full attention, shared + routed experts",
        # mlx-lm's step-by-step DeltaNet recurrence against its full-sequence form differs
        # by up to 1.5e-4 on one rank already; every layout gives the same logits.
        tol=5e-4,
        # 2 DeltaNet key heads: TP2 splits them (parallel/linear_attn.py), TP3 cannot.
        refuses={"tp3": r"tp=3 cannot give every rank whole key heads of a Gated DeltaNet"},
    ),
}


def hf_config(kind: str) -> dict:
    return {**FAMILIES[kind].config, "architectures": [_architecture(kind)]}


def _architecture(kind: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind]


def make_family(kind: str, path: Path, seed: int = 0, layers: int | None = None) -> Path:
    """Write family `kind`'s tiny random checkpoint (HF hub layout, fp32) to `path`
    (with `layers` decoder layers instead of the family's own count)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = dict(FAMILIES[kind].config)
    if layers is not None:
        config["num_hidden_layers"] = layers
    cfg = CONFIG_MAPPING[config.pop("model_type")](**config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for _, p in model.named_parameters():
            # transformers zeroes biases and sets norms to one: jitter them so they count.
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
        if (std := FAMILIES[kind].embed_std) is not None:
            embed = model.get_input_embeddings().weight
            embed.copy_(torch.randn_like(embed) * std)
    hf = transformers_dir(kind, path)
    model.save_pretrained(hf)
    # Keep the fields as we wrote them too, so mlx-lm's ModelArgs reads exactly these.
    saved = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**saved, **FAMILIES[kind].config}, indent=2))
    if hf != path:
        _write_mlx_layout(kind, hf, path)
    return path


def transformers_dir(kind: str, path: Path) -> Path:
    """Where transformers reads family `kind`'s checkpoint: `path` itself, except where
    mlx-lm cannot read the HF layout (gpt-oss: it reads only MXFP4 blocks or its own names)."""
    return path / "hf" if kind == "gpt_oss" else path


def _write_mlx_layout(kind: str, hf: Path, path: Path) -> None:
    """gpt-oss's fused, interleaved (E, in, out) experts as mlx-lm's (E, out, in) gate/up/down."""
    import mlx.core as mx

    weights = {}
    for name, w in mx.load(str(hf / "model.safetensors")).items():
        base = name.removesuffix("_bias")
        if base.endswith("experts.gate_up_proj"):
            for part, cols in (("gate_proj", w[..., ::2]), ("up_proj", w[..., 1::2])):
                key = base.replace("gate_up_proj", part)
                if name.endswith("_bias"):
                    weights[f"{key}.bias"] = mx.contiguous(cols)
                else:
                    weights[f"{key}.weight"] = mx.contiguous(cols.swapaxes(-1, -2))
        elif base.endswith("experts.down_proj"):
            suffix = "bias" if name.endswith("_bias") else "weight"
            weights[f"{base}.{suffix}"] = mx.contiguous(
                w if suffix == "bias" else w.swapaxes(-1, -2)
            )
        else:
            weights[name] = w
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text((hf / "config.json").read_text())


def family_prompts() -> list[list[int]]:
    """A short prompt and one far longer than WINDOW (and than one 128-token prefill chunk)."""
    short = np.random.default_rng(1).integers(0, VOCAB, size=29).tolist()
    return [short, np.random.default_rng(7).integers(0, VOCAB, 300).tolist()]


def make_mtp_family(kind: str, path: Path, seed: int = 0, damp: float = 1.0) -> Path:
    """Family `kind`'s tiny checkpoint with one multi-token-prediction layer stored as DeepSeek
    V3 stores it: model.layers.{n}.* holds a decoder layer plus enorm, hnorm, eh_proj,
    shared_head.norm, shared_head.head and embed_tokens (copies of the model's), and config.json
    says num_nextn_predict_layers=1. `damp` < 1 scales every layer's writes into the residual
    stream (o_proj, down_proj), so the model and the MTP layer (whose eh_proj keeps the
    embedding half whole) both mostly follow the current token: drafts are often accepted."""
    import mlx.core as mx

    n = FAMILIES[kind].config["num_hidden_layers"]
    make_family(kind, path, seed, layers=n + 1)
    file = path / "model.safetensors"
    w = dict(mx.load(str(file)))
    rng = np.random.default_rng(seed + 100)

    def rand(*shape, std=0.1, mean=0.0):
        return mx.array(mean + std * rng.standard_normal(shape), mx.float32)

    for name in list(w):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = w[name] * damp
    mtp = f"model.layers.{n}."
    if damp < 1:  # the embedding half whole, a small say for the hidden state
        eh = mx.concatenate([mx.eye(HIDDEN), rand(HIDDEN, HIDDEN, std=0.02)], 1)
    else:
        eh = rand(HIDDEN, 2 * HIDDEN)
    w |= {
        mtp + "enorm.weight": rand(HIDDEN, mean=1.0),
        mtp + "hnorm.weight": rand(HIDDEN, mean=1.0),
        mtp + "eh_proj.weight": eh,
        mtp + "shared_head.norm.weight": w["model.norm.weight"] * 1.0,
        mtp + "shared_head.head.weight": w["lm_head.weight"] * 1.0,
        mtp + "embed_tokens.weight": w["model.embed_tokens.weight"] * 1.0,
    }
    if damp < 1:  # the MTP layer's enorm keeps the embedding's direction as the model's does
        w[mtp + "enorm.weight"] = mx.ones((HIDDEN,))
    mx.save_safetensors(str(file), w, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config |= {"num_hidden_layers": n, "num_nextn_predict_layers": 1}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
