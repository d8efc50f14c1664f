"""Random-weight llama checkpoints of a realistic shape, for benchmarks where no real one can
be downloaded. Decode speed depends on the shapes and the dtype, never on the values.

"1b" is TinyLlama-1.1B's shape in float32 (4.4 GB): 22 layers, hidden 2048, 32 query and
4 KV heads, MLP 5632, vocab 32000, untied head. It splits evenly for TP2/TP4 and PP2, and
its vocabulary is small enough that the replicated output head does not dominate TP.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from thunderpool.errors import ThunderpoolError

SHARD_BYTES = 1 << 30  # one safetensors file per ~1 GiB bounds the memory used to write them

PRESETS: dict[str, dict] = {
    "1b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
    # A MoE small enough for this machine, large enough to be memory-bound (0.96 GB):
    # Qwen3-MoE's layout, 16 experts of which 4 are routed per token, stored stacked.
    "moe": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "moe_intermediate_size": 512,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
}
# "1b-draftable": the 1b shape whose layers after the first write small updates into the
# residual stream, so that a draft cut from its first layer (bench --draft-layers 1) agrees
# with it often: on random weights acceptance comes from this construction, not learning.
PRESETS["1b-draftable"] = PRESETS["1b"] | {"residual_scale": 0.008}


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of a llama checkpoint with this config (a
    qwen3_moe one: QK-norms and stacked experts, as mlx-lm stores them)."""
    if config["model_type"] == "qwen3_moe":
        return _moe_shapes(config)
    D, F, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or D // n_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (n_heads * head_dim, D),
            p + "self_attn.k_proj.weight": (n_kv * head_dim, D),
            p + "self_attn.v_proj.weight": (n_kv * head_dim, D),
            p + "self_attn.o_proj.weight": (D, n_heads * head_dim),
            p + "post_attention_layernorm.weight": (D,),
            p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        }
    shapes["model.norm.weight"] = (D,)
    if not config.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (V, D)
    return shapes


def _moe_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    D, H, V = config["hidden_size"], config["moe_intermediate_size"], config["vocab_size"]
    n_heads, n_kv, hd = config["num_attention_heads"], config["num_key_value_heads"], 64
    E = config["num_experts"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (n_heads * hd, D),
            p + "self_attn.k_proj.weight": (n_kv * hd, D),
            p + "self_attn.v_proj.weight": (n_kv * hd, D),
            p + "self_attn.o_proj.weight": (D, n_heads * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "post_attention_layernorm.weight": (D,),
            p + "mlp.gate.weight": (E, D),
            p + "mlp.switch_mlp.gate_proj.weight": (E, H, D),
            p + "mlp.switch_mlp.up_proj.weight": (E, H, D),
            p + "mlp.switch_mlp.down_proj.weight": (E, D, H),
        }
    shapes["model.norm.weight"] = (D,)
    shapes["lm_head.weight"] = (V, D)
    return shapes


def parameter_count(config: dict) -> int:
    return sum(int(np.prod(s)) for s in tensor_shapes(config).values())


def write_synthetic(config: dict, out: Path, seed: int = 0) -> Path:
    """Write a random float32 checkpoint (norms 1, matrices N(0, 0.02)) into `out`.

    Written to a sibling temp dir and renamed, so a half-written model is never used.
    """
    from safetensors.numpy import save_file

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    scale = config.get("residual_scale", 1.0)
    index: dict[str, str] = {}
    for part, names in enumerate(_shards(tensor_shapes(config)), start=1):
        file = f"model-{part:05d}.safetensors"
        tensors = {}
        for name, shape in names:
            if len(shape) == 1:
                tensors[name] = np.ones(shape, np.float32)
            else:
                later = not name.startswith("model.layers.0.")
                writes = name.endswith(("o_proj.weight", "down_proj.weight"))
                std = 0.02 * (scale if later and writes else 1)
                tensors[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
            index[name] = file
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
    total = parameter_count(config) * 4
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1)
    )
    config = {k: v for k, v in config.items() if k != "residual_scale"}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _shards(shapes: dict[str, tuple[int, ...]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive tensors grouped into files of about SHARD_BYTES."""
    shards, size = [[]], 0
    for name, shape in shapes.items():
        if size >= SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += int(np.prod(shape)) * 4
    return shards


def synthetic_model(name: str, cache_dir: Path | None = None, console=None) -> Path:
    """The cached random checkpoint `name` (see PRESETS), written on first use."""
    from thunderpool.models.source import default_cache_dir

    if name not in PRESETS:
        raise ThunderpoolError(
            f"--synthetic {name!r} is not a known shape; use one of {', '.join(PRESETS)}"
        )
    config = PRESETS[name]
    kind = "llama" if config["model_type"] == "llama" else config["model_type"]
    out = (cache_dir or default_cache_dir()) / "models" / f"synthetic-{kind}-{name}-f32"
    if (out / "config.json").is_file():
        return out
    if console is not None:
        gb = parameter_count(config) * 4 / 1e9
        console.print(f"[dim]writing a random {name} {kind} checkpoint ({gb:.1f} GB) to {out}[/]")
    return write_synthetic(config, out)


def write_truncated(model_dir: Path, layers: int, out: Path) -> Path:
    """A draft for speculative decoding cut from `model_dir`: its embedding, output head,
    final norm and first `layers` layers (the same tokenizer by construction)."""
    import mlx.core as mx

    config = json.loads((model_dir / "config.json").read_text())
    if not 0 < layers < config["num_hidden_layers"]:
        raise ThunderpoolError(
            f"a draft of {layers} layers must keep fewer than the model's "
            f"{config['num_hidden_layers']} layers and at least one"
        )
    weights = {}
    for file in sorted(model_dir.glob("model*.safetensors")):
        for name, w in mx.load(str(file)).items():
            parts = name.split(".")
            if parts[:2] != ["model", "layers"] or int(parts[2]) < layers:
                weights[name] = w
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers}, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out
