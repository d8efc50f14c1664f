"""Kernels one decode token dispatches per layer, counted from the architecture.

A decode step's fixed cost is paid per kernel launch, not per matmul: norms, RoPE, cache
writes, attention, routing (softmax/sigmoid, top-k, gathers, the weighted sum) each launch
their own. Counts follow mlx-lm's forwards with MLX's fused kernels (rms_norm, rope, sdpa:
one launch each; elementwise chains mlx-lm compiles, e.g. swiglu: one). The cost model turns
a count into matmul-equivalents of a plain llama layer (REFERENCE_KERNELS for its 7 matmuls),
the unit op_latency_us is calibrated and measured in, so every constant keeps its meaning.

A compiled decode step (engine/compiled.py with engine/fused.py) runs fewer kernels on the
families and layouts it takes (`compiles`); `compiled_layer_kernels` counts them alike.
"""

from __future__ import annotations

# Pre-norm + residual add around each of the two blocks of a layer.
BLOCK_WRAP = 2
# GQA attention: q, k, v, o matmuls; RoPE on q and k; key and value cache writes; fused sdpa.
GQA = 4 + 2 + 2 + 1
QK_NORM = 2  # qwen3's per-head RMS norms on q and k
# Unfused attention (head widths the fused kernel lacks): scores matmul, scale+mask, softmax, PV.
UNFUSED_ATTENTION = 4
# MLA (absorbed, as mlx-lm decodes): q_a, q_b (or q), kv_a, embed_q, unembed_out, o matmuls;
# q_a and kv_a norms; RoPE on q_pe and k_pe; the two concatenations; latent and pe cache writes.
# DeepSeek-V4's low-rank attention is counted alike (its compressor's matmuls included).
MLA_FIXED = 2 + 2 + 2 + 2  # plus its matmuls and attention
# DSA lightning indexer: wq_b, wk, weights_proj matmuls; k LayerNorm; RoPE; cache write; the
# index scores (matmul, relu, weight multiply, head sum); top-k; the sparse mask (2).
INDEXER = 3 + 1 + 1 + 1 + 4 + 1 + 2
# SwiGLU MLP: gate, up, down matmuls and the compiled swiglu.
GLU = 3 + 1
# Routed experts: gather_mm gate, up, down; swiglu; weight by the scores; sum over the k.
EXPERTS = 3 + 1 + 1 + 1
# Qwen routing: router matmul, softmax, argpartition, take_along_axis, renormalise (sum, divide).
QWEN_ROUTER = 1 + 1 + 1 + 1 + 2
# DeepSeek routing: router matmul, sigmoid, + correction bias, group scores (top-2 partition,
# take, sum), group top-k, masking the other groups, argpartition, take, renormalise (2), scale.
DEEPSEEK_ROUTER = 1 + 1 + 1 + 3 + 1 + 1 + 1 + 1 + 2 + 1
SHARED_ADD = 1  # the shared experts' output added to the routed ones

# A plain llama layer (no q/k norms): the layer the per-matmul constants were measured on.
REFERENCE_KERNELS = BLOCK_WRAP * 2 + GQA + GLU
REFERENCE_MATMULS = 7


def attention_kernels(family: str, model_type: str, matmuls: int, fused: bool, indexer: bool):
    """Kernels of a layer's attention block (without its pre-norm and residual add)."""
    attend = 1 if fused else UNFUSED_ATTENTION
    if family in ("mla", "v4"):  # `matmuls` already counts the indexer's
        return matmuls + MLA_FIXED + attend + (INDEXER - 3 if indexer else 0)
    qk = QK_NORM if model_type in ("qwen3", "qwen3_moe") else 0
    return GQA - 1 + attend + qk


def mlp_kernels(family: str, routed: bool, shared: bool) -> int:
    """Kernels of a layer's MLP block (without its pre-norm and residual add)."""
    if not routed:
        return GLU
    router = QWEN_ROUTER if family == "qwen" else DEEPSEEK_ROUTER
    return router + EXPERTS + (GLU + SHARED_ADD if shared else 0)


def matmul_equivalents(kernels: int) -> float:
    """A layer's kernels in units of a plain llama layer's matmuls (op_latency_us's unit)."""
    return kernels * REFERENCE_MATMULS / REFERENCE_KERNELS


# The compiled, fused decode step: families (mlx-lm model_type, as engine/compiled.py's
# COMPILED_FAMILIES) and plan kinds (hybrid and EP ranks decode eagerly).
COMPILED_FAMILIES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe"})
COMPILED_KINDS = frozenset({"single", "tp", "pp"})
# Fused GQA attention: the q|k|v matmul; one rotation pass over q and k; key and value cache
# writes; scores (mask added in the matmul), softmax, values; the o matmul.
FUSED_GQA = 1 + 1 + 2 + 3 + 1
FUSED_QK_NORM = 2 + 1  # qwen3's q and k norms, and rejoining them with v
FUSED_GLU = 1 + 1 + 1  # the gate|up matmul, swiglu, down


def compiles(model_type: str, kind: str) -> bool:
    """Whether the engine runs a compiled decode step for this family and plan kind."""
    return model_type in COMPILED_FAMILIES and kind in COMPILED_KINDS


def compiled_layer_kernels(model_type: str, routed: bool, tp: bool) -> float:
    """A compiled layer's kernels in llama-matmul units: each block's norm; its residual add
    runs inside the output matmul on one rank, apart after TP's all_sum or a whole MoE block."""
    qk = FUSED_QK_NORM if model_type in ("qwen3", "qwen3_moe") else 0
    attention = 1 + tp + FUSED_GQA + qk
    mlp = 1 + 1 + QWEN_ROUTER + EXPERTS if routed else 1 + tp + FUSED_GLU
    return matmul_equivalents(attention + mlp)
