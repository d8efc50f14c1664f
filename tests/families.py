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
}


@dataclass(frozen=True)
class Family:
    """One family's tiny config and the layouts it is tested on."""

    config: dict
    # Per-stage layer counts for PP2 and PP3, cutting across its sliding/full and
    # dense/MoE boundaries.
    pp2: tuple[int, ...]
    pp3: tuple[int, ...]
    features: str = ""
    # Layouts tensor.check refuses for this family, with a word on why (the test asserts
    # the refusal and its message).
    refuses: dict[str, str] = field(default_factory=dict)


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
        pp3=(1, 2, 1),
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
        features="sliding/global pattern, embedding scaling, QK-norm, (1+w) norms, tied head",
    ),
}


def hf_config(kind: str) -> dict:
    return {**FAMILIES[kind].config, "architectures": [_architecture(kind)]}


def _architecture(kind: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind]


def make_family(kind: str, path: Path, seed: int = 0) -> Path:
    """Write family `kind`'s tiny random checkpoint (HF hub layout, fp32) to `path`."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = dict(FAMILIES[kind].config)
    cfg = CONFIG_MAPPING[config.pop("model_type")](**config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for _, p in model.named_parameters():
            # transformers zeroes biases and sets norms to one: jitter them so they count.
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    # Keep the fields as we wrote them too, so mlx-lm's ModelArgs reads exactly these.
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, **FAMILIES[kind].config}, indent=2))
    return path


def family_prompts() -> list[list[int]]:
    """Two short prompts and one far longer than WINDOW (and than one 128-token prefill chunk)."""
    rng = np.random.default_rng(1)
    short = [rng.integers(0, VOCAB, size=n).tolist() for n in (7, 29)]
    return short + [np.random.default_rng(7).integers(0, VOCAB, 300).tolist()]
