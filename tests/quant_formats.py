"""The quantizations Mac users download, written by mlx-lm's own converter code.

A tiny float32 checkpoint per family (shapes a Mac model has in small: head_dim 64, hidden and
MLP widths multiples of 128, so every group size quantizes every projection), then one
conversion per format (convert()'s own steps): affine 2..8 bits at groups 32, 64 and 128, the
microscaling formats (mxfp4, nvfp4, mxfp8), mlx-lm's mixed recipes (--quant-predicate
mixed_2_6 ...) and a predicate with per-layer overrides (formats and widths mixed by module,
a layer's up and down projections left in float), as gpt-oss-style checkpoints ship.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

VOCAB = 256
BASE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
}
# Dense: TP2 is even (mlx-lm's shard), TP3 splits 4 KV heads 2+1+1 (uneven, 64-wide heads:
# o_proj is cut every 128 features at most, which every group size allows).
FAMILIES = {
    "llama": {**BASE, "model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    # Routed experts and a quantized router (mlx-lm keeps it at 8 bits).
    "qwen3_moe": {
        **BASE,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 256,
        "norm_topk_prob": True,
    },
}


def _overrides(path: str, module) -> bool | dict:
    """Per-layer overrides, as a hand-tuned convert script passes them: layer 0's up and down
    projections left in float, 5-bit attention output at group 32 in layer 1, mxfp4 MLP (or
    experts) in layer 2, an 8-bit head at group 128; the rest at the default 4-bit, group 64."""
    if path.startswith("model.layers.0.mlp.") and path.endswith(("up_proj", "down_proj")):
        return False
    if path == "model.layers.1.self_attn.o_proj":
        return {"group_size": 32, "bits": 5, "mode": "affine"}
    if path.startswith("model.layers.2.mlp.") and path.endswith("_proj"):
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    if path == "lm_head":
        return {"group_size": 128, "bits": 8, "mode": "affine"}
    return True


def _formats() -> dict[str, dict]:
    """Format name -> convert()'s quantization arguments."""
    out = {}
    for bits in (2, 3, 4, 5, 6, 8):
        for group in (32, 64, 128):
            out[f"q{bits}g{group}"] = {"q_bits": bits, "q_group_size": group}
    for mode in ("mxfp4", "nvfp4", "mxfp8"):
        out[mode] = {"q_mode": mode}
    # nvfp4 with one tensor scale per expert (quantize_model's global_scale): MoE only.
    out["nvfp4-gs"] = {"q_mode": "nvfp4", "global_scale": True}
    for recipe in ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6"):
        out[recipe] = {"quant_predicate": recipe, "q_group_size": 64}
    out["overrides"] = {"quant_predicate": _overrides, "q_group_size": 64, "q_bits": 4}
    return out


FORMATS = _formats()


def make_base(kind: str, path: Path, seed: int = 0) -> Path:
    """A random float32 checkpoint of `kind` in mlx-lm's own layout, peaked so that greedy
    ties are not a coin flip."""
    config = FAMILIES[kind]
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = {
        n: w * 2.0 if w.ndim >= 2 and "embed" not in n else w
        for n, w in tree_flatten(model.parameters())
    }
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def make_quantized(base: Path, fmt: str, out: Path) -> Path:
    """`base` converted to format `fmt` (FORMATS) as `mlx_lm.convert` converts: its loader,
    recipe builder, quantize_model and writers (all but the tokenizer, which `base` lacks)."""
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    args = dict(FORMATS[fmt])
    model, config = load_model(base, lazy=True)
    predicate = args.pop("quant_predicate", None)
    if isinstance(predicate, str):
        predicate = mixed_quant_predicate_builder(predicate, model, args["q_group_size"])
    model, config = quantize_model(
        model,
        config,
        args.get("q_group_size"),
        args.get("q_bits"),
        mode=args.get("q_mode", "affine"),
        global_scale=args.get("global_scale", False),
        quant_predicate=predicate,
    )
    save_model(out, model, donate_model=True)
    save_config(config, config_path=out / "config.json")
    return out


def quantized_modules(model_dir: Path) -> dict[str, tuple[int, int, str]]:
    """Each quantized module of a checkpoint as stored: (bits, group_size, mode) read back
    from the shapes of its weight and scales (proof the converter did quantize it)."""
    from thunderpool.parallel.packing import from_shapes

    tensors = {}
    for f in model_dir.glob("model*.safetensors"):
        tensors.update(mx.load(str(f)))
    config = json.loads((model_dir / "config.json").read_text())
    q = config["quantization"]
    out = {}
    for name, scales in tensors.items():
        if not name.endswith(".scales"):
            continue
        module = name.removesuffix(".scales")
        entry = q.get(module) if isinstance(q.get(module), dict) else q
        mode = entry.get("mode", "affine")
        w = tensors[f"{module}.weight"]
        in_features = w.shape[-1] * 32 // entry["bits"]
        p = from_shapes(in_features, w.shape[-1], scales.shape[-1], mode)
        out[module] = (p.bits, p.group_size, p.mode)
    return out


def prompts() -> list[list[int]]:
    """A short prompt and one longer than a 16-token prefill chunk."""
    rng = np.random.default_rng(3)
    return [rng.integers(0, VOCAB, 7).tolist(), rng.integers(0, VOCAB, 21).tolist()]
