"""What a model costs to hold and to run, read from config.json and safetensors headers only.

`model_spec(dir)` measures bytes from the safetensors headers (never the tensor data);
`model_spec_from_config(config)` estimates the same numbers for models too large to download.
Shapes follow mlx-lm's model definitions (llama/mistral, qwen2, qwen3, qwen3_moe, deepseek_v3).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from thunderpool.errors import ModelError

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3")

# mlx-lm's defaults where a config leaves tie_word_embeddings out.
_TIED_DEFAULT = {"llama": True, "mistral": True, "qwen2": True}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_KV_PROJ = (".k_proj.", ".v_proj.", ".k_norm.", ".kv_a_proj_with_mqa.", ".kv_a_layernorm.")
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Sizes in bytes as stored (quantized weights at their packed size), per decoder layer.

    MLA models (deepseek) cache one latent per token shared by all heads: kv_heads is 1 and
    every TP rank holds the whole cache.
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
    kv_proj_bytes_per_layer: tuple[int, ...]  # k/v projections, replicated when TP > kv_heads
    expert_bytes_per_layer: tuple[int, ...]  # routed experts only; shared experts are dense
    embed_bytes: int
    head_bytes: int  # 0 when the output head is tied to the embedding
    norm_bytes: int  # final norm and any other tensor outside the layers
    kv_bytes_per_token_per_layer: float
    kv_dtype_bytes: float
    active_params_per_layer: tuple[int, ...]  # with experts_per_tok routed experts
    params: int
    active_params: int  # per token: the layers' active parameters plus the output head

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

    def kv_bytes_per_token(self, kv_dtype_bytes: float | None = None) -> float:
        """KV-cache bytes per token over all layers, at `kv_dtype_bytes` if given."""
        scale = 1.0 if kv_dtype_bytes is None else kv_dtype_bytes / self.kv_dtype_bytes
        return self.kv_bytes_per_token_per_layer * scale * self.layers


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
    embedding weight at bits/8 bytes plus a scale and a bias per group at `dtype_bytes`.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise ModelError(
            f"model_type {model_type!r} is not known to the planner (known: "
            f"{', '.join(SUPPORTED)}); describe it with one of these or add it to planner/spec.py"
        )
    w = _Weights(dtype_bytes, config.get("quantization"))
    hidden, n_layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    vocab = config["vocab_size"]
    mla = model_type.startswith("deepseek")
    if mla:
        kv_heads, head_dim = 1, config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        kv_elems = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    else:
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        kv_elems = 2 * kv_heads * head_dim
    norms_b, norms_p = 2 * w.vector(hidden), 2 * hidden

    experts, top_k = _experts(config, mla)
    dense_i = config.get("intermediate_size", 0)
    moe_i = config.get("moe_intermediate_size", 0)
    shared_i = moe_i * (config.get("n_shared_experts") or 0) if mla else 0
    per_layer, attn, kv_proj, routed, active_per_layer = [], [], [], [], []
    params = 0
    widest = dense_i
    for i in range(n_layers):
        at = f"model.layers.{i}."
        if mla:
            attn_b, kv_b, attn_p = _mla_attention(config, w, at + "self_attn.")
        else:
            attn_b, kv_b, attn_p = _gqa_attention(
                config, w, at + "self_attn.", heads, kv_heads, head_dim
            )
        if experts and _is_moe(config, i, mla):
            expert_b, expert_p = _glu(w, hidden, moe_i, at + "mlp.switch_mlp.")
            shared_b, shared_p = (0, 0)
            if shared_i:
                shared_b, shared_p = _glu(w, hidden, shared_i, at + "mlp.shared_experts.")
            if mla:  # a plain weight plus e_score_correction_bias, never quantized
                router_b = w.vector(experts * hidden) + w.vector(experts)
                router_p = experts * hidden + experts
            else:
                router_b = w.matrix(experts, hidden, at + "mlp.gate")
                router_p = experts * hidden
            mlp_b = experts * expert_b + shared_b + router_b
            mlp_p = experts * expert_p + shared_p + router_p
            mlp_active_p = top_k * expert_p + shared_p + router_p
            routed.append(experts * expert_b)
            widest = max(widest, top_k * moe_i + shared_i)
        else:
            mlp_b, mlp_p = _glu(w, hidden, dense_i, at + "mlp.", config.get("mlp_bias", False))
            mlp_active_p = mlp_p
            routed.append(0)
        per_layer.append(attn_b + mlp_b + norms_b)
        attn.append(attn_b)
        kv_proj.append(kv_b)
        params += attn_p + mlp_p + norms_p
        active_per_layer.append(attn_p + mlp_active_p + norms_p)

    tied = config.get("tie_word_embeddings", _TIED_DEFAULT.get(model_type, False))
    embed_b = w.matrix(vocab, hidden, "model.embed_tokens")
    head_b = 0 if tied else w.matrix(vocab, hidden, "lm_head")
    params += vocab * hidden * (1 if tied else 2) + hidden
    active = sum(active_per_layer) + vocab * hidden + hidden
    return ModelSpec(
        model_type=model_type,
        layers=n_layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        intermediate=widest,
        experts=experts,
        experts_per_tok=top_k,
        bytes_per_layer=tuple(per_layer),
        attn_bytes_per_layer=tuple(attn),
        kv_proj_bytes_per_layer=tuple(kv_proj),
        expert_bytes_per_layer=tuple(routed),
        embed_bytes=embed_b,
        head_bytes=head_b,
        norm_bytes=w.vector(hidden),
        kv_bytes_per_token_per_layer=kv_elems * kv_dtype_bytes,
        kv_dtype_bytes=kv_dtype_bytes,
        active_params_per_layer=tuple(active_per_layer),
        params=params,
        active_params=active,
    )


@dataclass(frozen=True, slots=True)
class _Weights:
    """Stored bytes of weights at a dtype, or MLX-quantized with per-group scales (and biases)."""

    dtype_bytes: float
    quantization: dict | None

    def matrix(self, out: int, in_: int, path: str = "") -> int:
        """Bytes of an out x in_ weight; `path` picks mlx-lm's per-module quantization override."""
        q = self.quantization
        if q and isinstance(q.get(path), dict):
            q = {**q, **q[path]}
        if not q or in_ % q.get("group_size", 64):
            return round(out * in_ * self.dtype_bytes)
        groups = out * in_ // q.get("group_size", 64)
        # affine stores a scale and a bias per group; mxfp4/nvfp4/mxfp8 one 8-bit scale.
        per_group = 2 * self.dtype_bytes if q.get("mode", "affine") == "affine" else 1
        return round(out * in_ * q["bits"] / 8 + groups * per_group)

    def vector(self, n: int) -> int:
        return round(n * self.dtype_bytes)


def _gqa_attention(
    config: dict, w: _Weights, at: str, heads: int, kv_heads: int, head_dim: int
) -> tuple[int, int, int]:
    """(bytes, k/v bytes, params) of one standard GQA attention block."""
    hidden, model_type = config["hidden_size"], config["model_type"]
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    elif model_type in ("qwen3", "qwen3_moe"):
        qkv_bias = o_bias = False
    else:
        qkv_bias = o_bias = bool(config.get("attention_bias", False))
    q = w.matrix(q_out, hidden, at + "q_proj") + (w.vector(q_out) if qkv_bias else 0)
    kv = w.matrix(kv_out, hidden, at + "k_proj") + w.matrix(kv_out, hidden, at + "v_proj")
    kv += 2 * w.vector(kv_out) if qkv_bias else 0
    o = w.matrix(hidden, q_out, at + "o_proj") + (w.vector(hidden) if o_bias else 0)
    params = 2 * q_out * hidden + 2 * kv_out * hidden
    params += (q_out + 2 * kv_out) * qkv_bias + hidden * o_bias
    if model_type in ("qwen3", "qwen3_moe"):
        # Per-head RMS norms on q and k.
        q += w.vector(head_dim)
        kv += w.vector(head_dim)
        params += 2 * head_dim
    return q + kv + o, kv, params


def _mla_attention(config: dict, w: _Weights, at: str) -> tuple[int, int, int]:
    """(bytes, latent-projection bytes, params) of one DeepSeek multi-head latent attention."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    kv_rank, q_rank = config["kv_lora_rank"], config.get("q_lora_rank")
    q_out = heads * (nope + rope)
    if q_rank:
        q = w.matrix(q_rank, hidden, at + "q_a_proj") + w.vector(q_rank)
        q += w.matrix(q_out, q_rank, at + "q_b_proj")
        q_p = q_rank * hidden + q_rank + q_out * q_rank
    else:
        q, q_p = w.matrix(q_out, hidden, at + "q_proj"), q_out * hidden
    kv_a = w.matrix(kv_rank + rope, hidden, at + "kv_a_proj_with_mqa") + w.vector(kv_rank)
    kv_b = w.matrix(heads * (nope + v_dim), kv_rank, at + "kv_b_proj")
    o = w.matrix(hidden, heads * v_dim, at + "o_proj")
    params = q_p + (kv_rank + rope) * hidden + kv_rank
    params += heads * (nope + v_dim) * kv_rank + hidden * heads * v_dim
    return q + kv_a + kv_b + o, kv_a, params


def _glu(w: _Weights, hidden: int, inter: int, at: str, bias: bool = False) -> tuple[int, int]:
    """(bytes, params) of a SwiGLU MLP: gate and up (inter x hidden), down (hidden x inter)."""
    b = w.matrix(inter, hidden, at + "gate_proj") + w.matrix(inter, hidden, at + "up_proj")
    b += w.matrix(hidden, inter, at + "down_proj")
    p = 3 * hidden * inter
    if bias:
        b += 2 * w.vector(inter) + w.vector(hidden)
        p += 2 * inter + hidden
    return b, p


def _experts(config: dict, mla: bool) -> tuple[int, int]:
    """(routed experts per MoE layer, experts per token); (0, 0) for a dense model."""
    n = config.get("n_routed_experts" if mla else "num_experts") or 0
    return (n, config.get("num_experts_per_tok", 1)) if n else (0, 0)


def _is_moe(config: dict, layer: int, mla: bool) -> bool:
    if mla:
        freq = config.get("moe_layer_freq", 1)
        return layer >= config.get("first_k_dense_replace", 0) and layer % freq == 0
    step = config.get("decoder_sparse_step", 1)
    return layer not in config.get("mlp_only_layers", []) and (layer + 1) % step == 0
