"""One decoder layer's bytes, parameters and matmuls per architecture, from config values only.

Shapes follow mlx-lm's model definitions (llama/mistral, qwen2, qwen3, qwen3_moe, deepseek_v3,
deepseek_v32, glm_moe_dsa) and, for deepseek_v4, the tensor listing of DeepSeek-V4-Flash's
model.safetensors.index.json (https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from thunderpool.parallel.packing import from_config
from thunderpool.planner import dispatch

# Modules an HF fp8 checkpoint (DeepSeek's) keeps in bf16: embedding, output head, router.
_HF_FP8_PLAIN = ("embed_tokens", "lm_head", ".mlp.gate")


@dataclass(frozen=True, slots=True)
class Weights:
    """Stored bytes of weights at a dtype, or quantized: MLX affine/mx formats with per-group
    scales, or fp8 with one scale per block; `experts` overrides the scheme for routed experts."""

    dtype_bytes: float
    quantization: dict | None
    experts: dict | None = None
    plain: tuple[str, ...] = ()

    def matrix(self, out: int, in_: int, path: str = "") -> int:
        """Bytes of an out x in_ weight; `path` picks mlx-lm's per-module quantization override."""
        q = self._scheme(path)
        if q is None:
            return round(out * in_ * self.dtype_bytes)
        if "block" in q:  # one 1-byte scale per block (fp8 with ue8m0 scales)
            b0, b1 = q["block"]
            return round(out * in_ * q["bits"] / 8 + math.ceil(out / b0) * math.ceil(in_ / b1))
        group = q.get("group_size", 64)
        if in_ % group:
            return round(out * in_ * self.dtype_bytes)
        # affine stores a scale and a bias per group; mxfp4/nvfp4/mxfp8 one 8-bit scale
        # (and nvfp4 experts may keep one float32 tensor scale each).
        per_group = 2 * self.dtype_bytes if q.get("mode", "affine") == "affine" else 1
        tensor_scale = 4 if q.get("global_scale") else 0
        return round(out * in_ * q["bits"] / 8 + out * in_ // group * per_group) + tensor_scale

    def vector(self, n: int) -> int:
        return round(n * self.dtype_bytes)

    def _scheme(self, path: str) -> dict | None:
        if any(path.endswith(p) for p in self.plain):
            return None
        if self.experts and (".switch_mlp." in path or ".experts." in path):
            return self.experts
        q = self.quantization
        if q and isinstance(q.get(path), dict):
            # A module's own entry stands alone: mlx's to_quantized reads a missing mode as
            # affine (mlx-lm's qwen3_moe router: {"group_size": 64, "bits": 8} in an mxfp4
            # model), missing bits and group as that mode's defaults.
            p = from_config(q[path])
            q = {**q[path], "bits": p.bits, "group_size": p.group_size, "mode": p.mode}
        elif q and q.get("recipe"):
            q = {**q, "bits": mixed_bits(path, q["recipe"], q["layers"])}
        return q


def mixed_bits(path: str, recipe: tuple[int, int], n_layers: int) -> int:
    """The width mlx-lm's mixed recipe (mlx_lm.convert.mixed_quant_predicate_builder) gives
    the module at `path`: the high width for the head, and for v and down projections in the
    first and last eighth of the layers and every third layer between; the low one elsewhere."""
    low, high = recipe
    if "lm_head" in path:
        return high
    m = re.search(r"layers\.(\d+)\.", path)
    i = int(m.group(1)) if m else 0
    more = i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2
    v = any(k in path for k in ("v_proj", "v_a_proj", "v_b_proj"))
    return high if more and (v or "down_proj" in path) else low


def weights_for(config: dict, dtype_bytes: float) -> Weights:
    """How a checkpoint stores its weights: MLX `quantization`, HF fp8 blocks, or plain floats.

    DeepSeek's fp8 checkpoints mark fp4 routed experts with `"expert_dtype": "fp4"` (one
    ue8m0 scale per 32 values); their embedding, head and router stay bf16.
    """
    if isinstance(config.get("quantization"), dict):
        q = config["quantization"]
        if q.get("recipe"):  # simulate's mixed_L_H: the recipe needs the layer count
            q = {**q, "layers": config["num_hidden_layers"]}
        return Weights(dtype_bytes, q)
    hf = config.get("quantization_config") or {}
    if hf.get("quant_method") == "fp8":
        main = {"bits": 8, "block": list(hf.get("weight_block_size") or (128, 128))}
        fp4 = {"bits": 4, "group_size": 32, "mode": "mxfp4"}
        experts = fp4 if config.get("expert_dtype") == "fp4" else None
        return Weights(dtype_bytes, main, experts, _HF_FP8_PLAIN)
    return Weights(dtype_bytes, None)


@dataclass(frozen=True, slots=True)
class Part:
    """A block of a layer: stored bytes, parameters, the parameters one token uses, matmuls,
    and the bytes every TP rank holds whole (projections mlx-lm's shard() leaves unsplit)."""

    bytes: int
    params: int
    active: int
    matmuls: int
    replicated: int = 0

    def __add__(self, other: Part) -> Part:
        return Part(
            self.bytes + other.bytes,
            self.params + other.params,
            self.active + other.active,
            self.matmuls + other.matmuls,
            self.replicated + other.replicated,
        )


NOTHING = Part(0, 0, 0, 0)


def gqa_attention(config: dict, w: Weights, at: str, heads: int, kv: int, head_dim: int) -> Part:
    """A standard GQA block; its k/v projections are replicated when TP exceeds the KV heads."""
    hidden, model_type = config["hidden_size"], config["model_type"]
    q_out, kv_out = heads * head_dim, kv * head_dim
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    elif model_type in ("qwen3", "qwen3_moe"):
        qkv_bias = o_bias = False
    else:
        qkv_bias = o_bias = bool(config.get("attention_bias", False))
    q = w.matrix(q_out, hidden, at + "q_proj") + (w.vector(q_out) if qkv_bias else 0)
    kvb = w.matrix(kv_out, hidden, at + "k_proj") + w.matrix(kv_out, hidden, at + "v_proj")
    kvb += 2 * w.vector(kv_out) if qkv_bias else 0
    o = w.matrix(hidden, q_out, at + "o_proj") + (w.vector(hidden) if o_bias else 0)
    params = 2 * q_out * hidden + 2 * kv_out * hidden
    params += (q_out + 2 * kv_out) * qkv_bias + hidden * o_bias
    if model_type in ("qwen3", "qwen3_moe"):
        # Per-head RMS norms on q and k.
        q += w.vector(head_dim)
        kvb += w.vector(head_dim)
        params += 2 * head_dim
    return Part(q + kvb + o, params, params, 4, replicated=kvb)


def mla_attention(config: dict, w: Weights, at: str) -> Part:
    """DeepSeek multi-head latent attention (+ the DSA indexer of deepseek_v32/glm_moe_dsa).

    mlx-lm's shard() splits q_b, o and the per-head kv_b halves (embed_q, unembed_out); the
    q_a/kv_a latent projections and the indexer stay whole on every rank.
    """
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    kv_rank, q_rank = config["kv_lora_rank"], config.get("q_lora_rank")
    q_out = heads * (nope + rope)
    whole = w.matrix(kv_rank + rope, hidden, at + "kv_a_proj_with_mqa") + w.vector(kv_rank)
    whole_p = (kv_rank + rope) * hidden + kv_rank
    if q_rank:
        whole += w.matrix(q_rank, hidden, at + "q_a_proj") + w.vector(q_rank)
        whole_p += q_rank * hidden + q_rank
        split = w.matrix(q_out, q_rank, at + "q_b_proj")
        split_p = q_out * q_rank
    else:
        split, split_p = w.matrix(q_out, hidden, at + "q_proj"), q_out * hidden
    split += w.matrix(heads * (nope + v_dim), kv_rank, at + "kv_b_proj")
    split += w.matrix(hidden, heads * v_dim, at + "o_proj")
    split_p += heads * (nope + v_dim) * kv_rank + hidden * heads * v_dim
    matmuls = 6 if q_rank else 5  # q_a, q_b, kv_a, embed_q, unembed_out, o
    if config.get("index_n_heads"):  # wq_b, wk, weights_proj and a LayerNorm on the keys
        n, d = config["index_n_heads"], config["index_head_dim"]
        whole += w.matrix(n * d, q_rank, at + "indexer.wq_b") + w.matrix(
            d, hidden, at + "indexer.wk"
        )
        whole += w.matrix(n, hidden, at + "indexer.weights_proj") + w.vector(2 * d)
        whole_p += n * d * q_rank + d * hidden + n * hidden + 2 * d
        matmuls += 3
    return Part(whole + split, whole_p + split_p, whole_p + split_p, matmuls, replicated=whole)


def v4_attention(config: dict, w: Weights, at: str, ratio: int) -> Part:
    """DeepSeek-V4 attention: one 512-wide KV head, grouped low-rank output, a KV compressor
    on layers with a compress ratio, and a lightning indexer on the ratio-4 (CSA) layers.

    Compressor widths (two head_dim-wide windows on CSA layers) are our reading of the
    reference code; they are under 1% of the model's bytes.
    """
    hidden, heads, hd = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
    q_rank, groups, o_rank = config["q_lora_rank"], config["o_groups"], config["o_lora_rank"]
    whole = w.matrix(q_rank, hidden, at + "wq_a") + w.vector(q_rank)
    whole += w.matrix(hd, hidden, at + "wkv") + w.vector(hd)
    whole_p = q_rank * hidden + q_rank + hd * hidden + hd
    split = w.matrix(heads * hd, q_rank, at + "wq_b") + groups * w.matrix(
        o_rank, heads * hd // groups
    )
    split += w.matrix(hidden, groups * o_rank, at + "wo_b") + 4 * heads  # + fp32 attention sinks
    split_p = heads * hd * q_rank + o_rank * heads * hd + hidden * groups * o_rank + heads
    matmuls = 5
    if ratio:
        width = hd * (2 if ratio == 4 else 1)
        whole += 2 * w.matrix(width, hidden, at + "compressor") + w.vector(hd)
        whole_p += 2 * width * hidden + hd
        matmuls += 2
    if ratio == 4:
        n, d = config["index_n_heads"], config["index_head_dim"]
        whole += w.matrix(n * d, q_rank, at + "indexer.wq_b") + w.matrix(n, hidden, at + "idx.w")
        whole += 2 * w.matrix(2 * d, hidden, at + "indexer.compressor") + w.vector(d)
        whole_p += n * d * q_rank + n * hidden + 4 * d * hidden + d
        matmuls += 4
    # Hyper-connections: two fp32 mixing matrices per layer, (2+m)m x m*hidden for m streams.
    m = config.get("hc_mult", 1)
    if m > 1:
        hc = 2 * ((2 + m) * m * m * hidden + (2 + m) * m + 3)
        whole += 4 * hc
        whole_p += hc
        matmuls += 2
    return Part(whole + split, whole_p + split_p, whole_p + split_p, matmuls, replicated=whole)


def glu(w: Weights, hidden: int, inter: int, at: str, bias: bool = False) -> Part:
    """A SwiGLU MLP: gate and up (inter x hidden), down (hidden x inter)."""
    b = w.matrix(inter, hidden, at + "gate_proj") + w.matrix(inter, hidden, at + "up_proj")
    b += w.matrix(hidden, inter, at + "down_proj")
    p = 3 * hidden * inter
    if bias:
        b += 2 * w.vector(inter) + w.vector(hidden)
        p += 2 * inter + hidden
    return Part(b, p, p, 3)


def moe(config: dict, w: Weights, at: str, family: str, layer: int) -> tuple[Part, int]:
    """A routed-expert block: (the whole block, the routed experts' bytes alone).

    `family` is "qwen" (num_experts, a quantized router), "mla" (n_routed_experts, shared
    experts, a plain router with a correction bias) or "v4" (like mla; its first
    num_hash_layers route by a token -> experts table instead).
    """
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    n, top_k = experts_of(config)
    expert = glu(w, hidden, inter, at + "mlp.switch_mlp.")
    block = Part(n * expert.bytes, n * expert.params, top_k * expert.params, 3)
    shared = (config.get("n_shared_experts") or 0) if family != "qwen" else 0
    if shared:
        block += glu(w, hidden, inter * shared, at + "mlp.shared_experts.")
    if family == "qwen":
        router = Part(w.matrix(n, hidden, at + "mlp.gate"), n * hidden, n * hidden, 1)
    else:  # a plain weight plus e_score_correction_bias, never quantized
        router_b = w.vector(n * hidden) + w.vector(n)
        if family == "v4" and layer < config.get("num_hash_layers", 0):
            router_b += config["vocab_size"] * top_k * 8  # int64 token -> experts table
        router = Part(router_b, n * hidden + n, n * hidden + n, 1)
    return block + router, n * expert.bytes


def experts_of(config: dict) -> tuple[int, int]:
    """(routed experts per MoE layer, experts per token); (0, 0) for a dense model."""
    # num_local_experts: what transformers 5 writes for Qwen MoE (and Mixtral always did).
    n = config.get("num_experts") or config.get("n_routed_experts")
    n = n or config.get("num_local_experts") or 0
    return (n, config.get("num_experts_per_tok", 1)) if n else (0, 0)


def is_moe(config: dict, layer: int, family: str) -> bool:
    if family == "v4":
        return True
    if family == "mla":
        freq = config.get("moe_layer_freq", 1)
        return layer >= config.get("first_k_dense_replace", 0) and layer % freq == 0
    step = config.get("decoder_sparse_step", 1)
    return layer not in config.get("mlp_only_layers", []) and (layer + 1) % step == 0


def _attention(config: dict, w, family: str, at: str, ratio: int) -> Part:
    """Layer `at`'s attention: MLA's, DeepSeek-V4's (its compress `ratio`), or GQA's."""
    if family == "mla":
        return mla_attention(config, w, at + "self_attn.")
    if family == "v4":
        return v4_attention(config, w, at + "self_attn.", ratio)
    kv_heads, head_dim, _, _ = _attention_shape(config, family, ())
    heads = config["num_attention_heads"]
    return gqa_attention(config, w, at + "self_attn.", heads, kv_heads, head_dim)


def _attention_shape(config: dict, family: str, ratios: tuple[int, ...]) -> tuple:
    """(kv_heads, head_dim, cached elements per token per layer, attention's dot width)."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    if family == "mla":
        kv_heads, head_dim = 1, config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        kv_elems = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        kv_elems += config.get("index_head_dim", 0) if config.get("index_n_heads") else 0
        # Decode attends in the latent space: q.k over kv_rank + rope, p.v over kv_rank.
        return kv_heads, head_dim, kv_elems, 2 * config["kv_lora_rank"] + config["qk_rope_head_dim"]
    if family == "v4":
        head_dim = config["head_dim"]
        return 1, head_dim, _v4_cached_per_token(config, ratios), 2 * head_dim
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return kv_heads, head_dim, 2 * kv_heads * head_dim, 2 * head_dim


def _kernels(
    config: dict, family: str, matmuls: int, fused: bool, moe_layer: bool, ratio: int | None
) -> float:
    """One layer's kernels in matmul equivalents (planner/dispatch.py)."""
    # DeepSeek-V4's indexer runs on its compress-ratio-4 layers only.
    indexer = (ratio == 4) if family == "v4" else True
    indexer = indexer and bool(config.get("index_n_heads"))
    shared = family != "qwen" and bool(config.get("n_shared_experts"))
    count = dispatch.BLOCK_WRAP * 2
    count += dispatch.attention_kernels(family, config["model_type"], matmuls, fused, indexer)
    count += dispatch.mlp_kernels(family, moe_layer, shared)
    return dispatch.matmul_equivalents(count)


def _v4_cached_per_token(config: dict, ratios: tuple[int, ...]) -> float:
    """Cached elements per token, averaged over layers: one head_dim latent per `ratio` tokens,
    plus the indexer's keys on CSA layers (the 128-token sliding window is a constant)."""
    hd, d = config["head_dim"], config.get("index_head_dim", 0)
    total = sum(hd / r + (d / r if r == 4 else 0) for r in ratios if r)
    return total / max(len(ratios), 1)
