"""What a model costs to hold and to run, read from config.json and safetensors headers only.

`model_spec(dir)` measures bytes from the safetensors headers (never the tensor data);
`model_spec_from_config(config)` estimates the same numbers for models too large to download;
the per-architecture shapes live in layers.py.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from thunderpool.errors import ModelError
from thunderpool.parallel.packing import config_head_unit
from thunderpool.planner.layers import (
    Part,
    _attention,
    _attention_shape,
    _kernels,
    experts_of,
    glu,
    is_moe,
    moe,
    weights_for,
)
from thunderpool.planner.structure import spec_fields

SUPPORTED = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "glm_moe_dsa",
    "kimi_k2",
    "deepseek_v4",
)
# Head widths MLX's fused decode attention takes (scaled_dot_product_attention.cpp in mlx's
# Metal backend). MLA decodes over a 576-wide latent, so it runs unfused; deepseek_v4 counts
# as fused: its runtimes bring their own sparse kernels.
_FUSED_HEAD_DIMS = (64, 72, 80, 96, 128, 192, 256)
# Attention/MoE family per model type (the rest: GQA attention, qwen-style experts).
_FAMILY = {
    "deepseek_v2": "mla",
    "deepseek_v3": "mla",
    "deepseek_v32": "mla",
    "glm_moe_dsa": "mla",
    "kimi_k2": "mla",
    "deepseek_v4": "v4",
}

# mlx-lm's defaults where a config leaves tie_word_embeddings out.
_TIED_DEFAULT = {"llama": True, "mistral": True, "qwen2": True}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Attention tensors every TP rank holds whole: k/v (when replicated) and MLA's latent projections.
_KV_PROJ = (".k_proj.", ".v_proj.", ".k_norm.", ".kv_a_proj_with_mqa.", ".kv_a_layernorm.")
_KV_PROJ += (".q_a_proj.", ".q_a_layernorm.", ".indexer.")
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Sizes in bytes as stored (quantized weights at their packed size), per decoder layer.

    MLA models (deepseek) cache one latent per token shared by all heads: kv_heads is 1 and
    every TP rank holds the whole cache. DeepSeek-V4 attends to a sliding window plus
    compressed entries (`compress_ratios`), so its attention cost grows slowly with context.
    """

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int  # MLP channels one token passes through (routed + shared for MoE)
    experts: int  # routed experts per MoE layer; 0 for dense models
    experts_per_tok: int
    bytes_per_layer: tuple[int, ...]
    attn_bytes_per_layer: tuple[int, ...]  # all self_attn tensors
    kv_proj_bytes_per_layer: tuple[int, ...]  # attention bytes TP replicates (k/v, MLA latents)
    expert_bytes_per_layer: tuple[int, ...]  # routed experts only; shared experts are dense
    embed_bytes: int
    head_bytes: int  # 0 when the output head is tied to the embedding
    norm_bytes: int  # final norm and any other tensor outside the layers
    kv_bytes_per_token_per_layer: float
    kv_dtype_bytes: float
    active_params_per_layer: tuple[int, ...]  # with experts_per_tok routed experts
    params: int
    active_params: int  # per token: the layers' active parameters plus the output head
    matmuls_per_layer: tuple[int, ...] = ()  # weight matmuls per decode token (dispatch cost)
    # Kernels per decode token in llama-matmul units (planner/dispatch.py); () -> matmuls.
    dispatches_per_layer: tuple[float, ...] = ()
    routed_active_per_layer: tuple[int, ...] = ()  # routed experts' params one token uses
    attn_dim: int = 0  # FLOPs / 2 per head per attended cached token (2 x head_dim for GQA)
    attn_fused: bool = True  # MLX's fused decode kernel takes this head width (64..256)
    sliding_window: int = 0  # deepseek_v4: tokens every layer attends to uncompressed
    compress_ratios: tuple[int, ...] = ()  # deepseek_v4: one cached entry per `ratio` tokens
    index_topk: int = 0  # deepseek_v4: compressed entries a CSA (ratio 4) layer attends to
    # Query heads per TP cut: a quantized o_proj is cut on whole groups and packed words only
    # (parallel/packing.py), so uneven head shares move to multiples of this.
    head_unit: int = 1

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_layer) + self.embed_bytes + self.head_bytes + self.norm_bytes

    @property
    def output_bytes(self) -> int:
        """Bytes of the output matrix read per token: the head, or the tied embedding."""
        return self.head_bytes or self.embed_bytes

    @property
    def active_bytes_per_token(self) -> float:
        """Weight bytes one decode token reads (one embedding row is negligible)."""
        layers = sum(self.layer_read_bytes(i) for i in range(self.layers))
        return layers + self.output_bytes + self.norm_bytes

    @property
    def flops_per_token(self) -> float:
        """Matmul FLOPs per token, ~2 per active parameter (attention over the cache excluded)."""
        return 2.0 * self.active_params

    def layer_read_bytes(self, layer: int, batch: int = 1) -> float:
        """Weight bytes layer `layer` reads for a batch of tokens.

        A batch touches the union of its tokens' experts: E * (1 - (1 - k/E)^batch) of them.
        """
        experts = self.expert_bytes_per_layer[layer]
        if not experts:
            return float(self.bytes_per_layer[layer])
        touched = 1.0 - (1.0 - self.experts_per_tok / self.experts) ** batch
        return self.bytes_per_layer[layer] - experts + experts * touched

    def attended(self, layer: int, kv_len: float) -> float:
        """Cached tokens (or compressed entries) layer `layer` attends to at `kv_len`."""
        ratio = self.compress_ratios[layer] if layer < len(self.compress_ratios) else 0
        if not self.compress_ratios:
            return kv_len
        seen = min(kv_len, self.sliding_window) if self.sliding_window else kv_len
        if ratio == 4 and self.index_topk:
            return seen + min(kv_len / ratio, self.index_topk)
        return seen + (kv_len / ratio if ratio else 0)

    def kv_bytes_per_token(self, kv_dtype_bytes: float | None = None) -> float:
        """KV-cache bytes per token over all layers, at `kv_dtype_bytes` if given."""
        scale = 1.0 if kv_dtype_bytes is None else kv_dtype_bytes / self.kv_dtype_bytes
        return self.kv_bytes_per_token_per_layer * scale * self.layers


def kv_element_bytes(dtype_bytes: float, bits: int | None = None, group_size: int = 64) -> float:
    """Bytes one cached key or value element takes: its float type's, or quantized (--kv-bits,
    mlx-lm's QuantizedKVCache) bits / 8 plus a scale and a bias in the float type per group."""
    if bits is None:
        return dtype_bytes
    return bits / 8 + 2 * dtype_bytes / group_size


def model_spec(model_dir: Path) -> ModelSpec:
    """Measure a local HF/MLX model directory: config.json plus safetensors headers."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelError(f"{model_dir} has no config.json; pass a Hugging Face or MLX model dir")
    config = json.loads(config_path.read_text())
    tensors = _read_headers(model_dir)
    dtype_bytes = _main_dtype_bytes(tensors)
    estimate = model_spec_from_config(config, dtype_bytes=dtype_bytes)
    if config.get("model_type") not in SUPPORTED:
        return estimate  # read from the model's own structure, names and all
    n = estimate.layers
    per_layer = [0] * n
    attn, kv_proj, experts = [0] * n, [0] * n, [0] * n
    embed = head = other = 0
    for name, (_, size) in tensors.items():
        if m := _LAYER.search(name):
            i = int(m.group(1))
            if i >= n:
                continue  # multi-token-prediction layers that mlx-lm drops on load
            per_layer[i] += size
            if ".self_attn." in name:
                attn[i] += size
                kv_proj[i] += size if any(k in name for k in _KV_PROJ) else 0
            if ".experts." in name or ".switch_mlp." in name:
                experts[i] += size
        elif "embed_tokens" in name:
            embed += size
        elif name.startswith("lm_head") or ".lm_head." in name:
            head += size
        else:
            other += size
    return replace(
        estimate,
        bytes_per_layer=tuple(per_layer),
        attn_bytes_per_layer=tuple(attn),
        kv_proj_bytes_per_layer=tuple(kv_proj),
        expert_bytes_per_layer=tuple(experts),
        embed_bytes=embed,
        head_bytes=head,
        norm_bytes=other,
    )


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of one .safetensors file: 8-byte little-endian length, then JSON."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelError(f"{path} is too short to be a safetensors file; re-download it")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER:
            raise ModelError(f"{path} claims a {length}-byte header; the file is corrupt")
        return json.loads(f.read(length))


def _read_headers(model_dir: Path) -> dict[str, tuple[str, int]]:
    """Tensor name -> (dtype, stored bytes) over every shard of the checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [model_dir / f for f in files]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise ModelError(f"{model_dir} has no .safetensors files; convert the model first")
    tensors = {}
    for path in paths:
        if not path.is_file():
            raise ModelError(f"{path} is listed in the index but missing; re-download the model")
        for name, info in read_safetensors_header(path).items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                tensors[name] = (info["dtype"], end - start)
    return tensors


_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def _main_dtype_bytes(tensors: dict[str, tuple[str, int]]) -> float:
    """Width of the float dtype holding the most bytes (the scales' dtype when quantized)."""
    by_dtype: dict[str, int] = {}
    for dtype, size in tensors.values():
        if dtype in _FLOAT_BYTES:
            by_dtype[dtype] = by_dtype.get(dtype, 0) + size
    if not by_dtype:
        return 2.0
    return float(_FLOAT_BYTES[max(by_dtype, key=by_dtype.__getitem__)])


def model_spec_from_config(
    config: dict, dtype_bytes: float = 2.0, kv_dtype_bytes: float = 2.0
) -> ModelSpec:
    """Estimate a model's spec from its HF config alone, weights at `dtype_bytes` each.

    A `"quantization": {"bits", "group_size"}` entry (MLX format) stores each matmul and
    embedding weight at bits/8 bytes plus a scale and a bias per group at `dtype_bytes`; an
    HF `quantization_config` with `quant_method: fp8` stores them at one byte plus a scale
    per block (and fp4 routed experts where `expert_dtype` says so).
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        return structural_spec(config, dtype_bytes, kv_dtype_bytes)
    family = _FAMILY.get(model_type, "qwen")
    w = weights_for(config, dtype_bytes)
    hidden, n_layers = config["hidden_size"], config["num_hidden_layers"]
    heads, vocab = config["num_attention_heads"], config["vocab_size"]
    ratios = tuple(config.get("compress_ratios", ())[:n_layers]) if family == "v4" else ()
    kv_heads, head_dim, kv_elems, attn_dim = _attention_shape(config, family, ratios)
    norms = Part(2 * w.vector(hidden), 2 * hidden, 2 * hidden, 0)
    dense_i = config.get("intermediate_size", 0)
    n_experts, top_k = experts_of(config)
    parts, routed, kernels, routed_active = [], [], [], []
    widest = dense_i
    attn_fused = family == "v4" or (family != "mla" and head_dim in _FUSED_HEAD_DIMS)
    for i in range(n_layers):
        at = f"model.layers.{i}."
        attn = _attention(config, w, family, at, ratios[i] if i < len(ratios) else 0)
        if n_experts and is_moe(config, i, family):
            mlp, experts_b = moe(config, w, at, family, i)
            moe_i = config["moe_intermediate_size"]
            shared_i = moe_i * (config.get("n_shared_experts") or 0)
            widest = max(widest, top_k * moe_i + shared_i * (family != "qwen"))
        else:
            mlp, experts_b = glu(w, hidden, dense_i, at + "mlp.", config.get("mlp_bias", False)), 0
        parts.append((attn, attn + mlp + norms))
        routed.append(experts_b)
        moe_layer = bool(experts_b)
        expert_i = config.get("moe_intermediate_size", 0)
        routed_active.append(top_k * 3 * hidden * expert_i * moe_layer)
        ratio = ratios[i] if i < len(ratios) else None
        kernels.append(_kernels(config, family, attn.matmuls, attn_fused, moe_layer, ratio))

    embed_b, head_b, other_b, params, active = _outer(config, w, family, parts)
    return ModelSpec(
        model_type=model_type,
        layers=n_layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        intermediate=widest,
        experts=n_experts,
        experts_per_tok=top_k,
        bytes_per_layer=tuple(p.bytes for _, p in parts),
        attn_bytes_per_layer=tuple(a.bytes for a, _ in parts),
        kv_proj_bytes_per_layer=tuple(a.replicated for a, _ in parts),
        expert_bytes_per_layer=tuple(routed),
        embed_bytes=embed_b,
        head_bytes=head_b,
        norm_bytes=other_b,
        kv_bytes_per_token_per_layer=kv_elems * kv_dtype_bytes,
        kv_dtype_bytes=kv_dtype_bytes,
        active_params_per_layer=tuple(p.active for _, p in parts),
        params=params,
        active_params=active,
        matmuls_per_layer=tuple(p.matmuls for _, p in parts),
        dispatches_per_layer=tuple(kernels),
        routed_active_per_layer=tuple(routed_active),
        attn_dim=attn_dim,
        attn_fused=attn_fused,
        sliding_window=(config.get("sliding_window") or 0) if family == "v4" else 0,
        compress_ratios=ratios,
        index_topk=config.get("index_topk", 0) if family == "v4" else 0,
        head_unit=config_head_unit(config) if family not in ("mla", "v4") else 1,
    )


def structural_spec(
    config: dict, dtype_bytes: float = 2.0, kv_dtype_bytes: float = 2.0
) -> ModelSpec:
    """Any family mlx-lm builds: priced from its own model, built lazily (structure.py)."""
    return ModelSpec(**spec_fields(config, dtype_bytes, kv_dtype_bytes))


def _outer(config: dict, w, family: str, parts: list) -> tuple:
    """(embedding bytes, output head bytes, final norm's bytes, parameters, active
    parameters): the layers' `parts` and what lies outside them."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    tied = config.get("tie_word_embeddings", _TIED_DEFAULT.get(config["model_type"], False))
    embed_b = w.matrix(vocab, hidden, "model.embed_tokens")
    head_b = 0 if tied else w.matrix(vocab, hidden, "lm_head")
    other_b, other_p = w.vector(hidden), hidden
    m = config.get("hc_mult", 1) if family == "v4" else 1
    if m > 1:  # the hyper-connection head that folds the m streams back into one
        other_p += m * m * hidden + m + 1
        other_b += 4 * (m * m * hidden + m + 1)
    params = sum(p.params for _, p in parts) + vocab * hidden * (1 if tied else 2) + other_p
    active = sum(p.active for _, p in parts) + vocab * hidden + other_p
    return embed_b, head_b, other_b, params, active
