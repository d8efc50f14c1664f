"""A fused one-token forward of a GQA decoder (llama, qwen2, qwen3, qwen3_moe), for the
compiled decode step (engine/compiled.py).

mlx-lm's forward launches each projection, RoPE, norm and attention as separate ops (on
MLX's CPU backend RoPE, RMSNorm and sdpa are chains of ops). Here, per layer:
- q|k|v are one matmul and gate|up another: their weights are concatenated once at load
  (per rank, after TP sharding), and the mlx-lm modules' weights become views of the fused
  ones, so prefill and every other path read the same memory, never a second copy (with a
  CPU rank's input-major weights, engine/kmajor.py, they stay separate products: `Joined`);
- RoPE's angles are computed once per step, not twice per layer; one elementwise pass
  rotates q and k, leaves v (cos 1, sin 0) and folds in the attention scale;
- attention is scores (plus the additive mask, in the matmul), softmax, values;
- the output projections add the residual in their matmul where no all_sum comes between
  (TP's row-parallel o and down: product, all_sum, bias, residual, as the modules do);
- on a CPU rank with several cores every product is split over them (Projection.split,
  engine/rowsplit.py): by output rows, or by input blocks whose products are summed where the
  weights are input-major.
Only the model structure below is taken; anything else (other RoPE kinds, partial rotary,
sliding windows) keeps mlx-lm's forward (`fusable` is False).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from thunderpool.engine import cpu_exp, rowsplit
from thunderpool.engine.projections import (
    Joined,
    Projection,
    Reduced,
    _linear,
    _plain,
    _projection,
    fuse,
)

FAMILIES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe"})
# Cache positions from which a decode step's attention splits over the CPU streams.
SPLIT_KEYS = 1024


@dataclass(frozen=True, slots=True)
class Layer:
    """What the fused forward needs of one decoder layer."""

    module: nn.Module
    qkv: Projection | Joined
    o: Projection | Reduced | None  # None: call the module
    gate_up: Projection | Joined | None  # None: call the MLP module (MoE, or unfusable)
    down: Projection | Reduced | None
    n_heads: int
    n_kv: int
    inter: int  # the MLP's (local) intermediate width


def _rope_inv_freqs(rope: nn.Module, head_dim: int) -> mx.array | None:
    """RoPE's inverse frequencies as mx.fast.rope's fallback computes them, for the kinds
    this forward rotates exactly (full, non-traditional): nn.RoPE and mlx-lm's Llama3RoPE."""
    if getattr(rope, "traditional", True) or getattr(rope, "dims", 0) != head_dim:
        return None
    half = head_dim // 2
    if type(rope).__name__ == "Llama3RoPE":
        return 1.0 / rope._freqs.astype(mx.float32)
    if type(rope) is not nn.RoPE or rope.scale != 1.0:
        return None
    step = mx.array(math.log(rope.base) / half, mx.float32)
    return mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * step)


class FusedForward:
    """`forward(tokens (B, L), caches) -> h (B, L, D)`: the inner model's forward of a decode
    step (L = 1) or a verify window, for caches that take update_and_fetch and carry idx/left
    (compiled._StepCache)."""

    def __init__(
        self, model: nn.Module, layers: list[Layer], inv_freqs: mx.array, dims: int, ways: int = 1
    ):
        self.model, self.inner = model, model.model
        self.ways = ways  # CPU streams the products (and long attention) split over
        # On a CPU, exp from plain arithmetic (engine/cpu_exp.py): MLX's x86 exp is scalar.
        self.cpu = cpu_exp.wanted()
        # Evaluated now: a lazy array is tied to the loading thread's stream, and the engine
        # may step in another thread ("no Stream(cpu, 0) in current thread").
        mx.eval(inv_freqs)
        self.layers, self.inv_freqs, self.head_dim = layers, inv_freqs, dims

    def __call__(self, tokens: mx.array, caches: list) -> mx.array:
        return self.inner.norm(self.layers_forward(self.inner.embed_tokens(tokens), caches))

    def layers_forward(self, h: mx.array, caches: list) -> mx.array:
        """h (B, L, D) through the fused layers (a PP stage's own), one cache each: a decode
        step (L = 1), or a verify window of L positions written at once, each attending to
        the cache and to the window's positions up to its own."""
        first, width = caches[0], h.shape[1]
        # The tables and the mask take the dtype of the products they meet (q, k, scores),
        # not h's: an mx/nv-quantized embedding gives bfloat16 rows to a float32 model.
        tables = {}  # (heads, kv heads, dtype) -> rotation tables and mask, shared by layers

        def rotation(n_heads: int, n_kv: int, dtype):
            if (key := (n_heads, n_kv, dtype)) not in tables:
                mask = self._mask(first.keys.shape[2], first.idx, first.left, width, dtype)
                if width > 1:  # the scores' rows are (query head of a KV head, position)
                    B, cap, group = mask.shape[0], mask.shape[-1], n_heads // n_kv
                    mask = mx.broadcast_to(mask, (B, group, width, cap))
                    mask = mask.reshape(B, 1, group * width, cap)
                cos_t, sin_t = self._tables(first.offset, width, n_heads, n_kv, dtype)
                tables[key] = (mask, cos_t, sin_t)
            return tables[key]

        for layer, cache in zip(self.layers, caches, strict=True):
            h = self._layer(h, layer, cache, rotation)
        return h

    def _mask(self, capacity: int, idx: mx.array, left: mx.array, width: int, dtype):
        """(B, 1, width, capacity): 0 where a window position may attend (each row's written
        positions, up to its own), a large negative elsewhere."""
        pos = mx.arange(capacity)[None, None]
        # (1, width, 1); a decode step's one position needs no second range
        last = idx[:, None, None] + (mx.arange(width)[None, :, None] if width > 1 else 0)
        keep = (pos >= left[:, None, None]) & (pos <= last)
        return mx.where(keep, 0.0, mx.finfo(dtype).min).astype(dtype)[:, None]

    def _tables(self, offset: mx.array, width: int, n_heads: int, n_kv: int, dtype):
        """cos and sin-with-sign tables (B, width, heads, 2, half) rotating q (scaled by
        1/sqrt(d)) and k at each window position, identity on v."""
        pos = offset.astype(mx.float32)[:, None]
        pos = pos + mx.arange(width, dtype=mx.float32)[None] if width > 1 else pos
        theta = pos[..., None] * self.inv_freqs  # (B, width, half)
        cos, sin = mx.cos(theta), mx.sin(theta)
        B, _, half = theta.shape
        c = mx.stack([cos, cos], axis=2)[:, :, None]  # (B, width, 1, 2, half)
        s = mx.stack([-sin, sin], axis=2)[:, :, None]
        scale = self.head_dim**-0.5
        shape = (B, width, n_kv, 2, half)
        one, zero = mx.ones(shape), mx.zeros(shape)
        rep = lambda t, n: mx.broadcast_to(t, (B, width, n, 2, half))  # noqa: E731
        cos_t = mx.concatenate([rep(c * scale, n_heads), rep(c, n_kv), one], axis=2)
        sin_t = mx.concatenate([rep(s * scale, n_heads), rep(s, n_kv), zero], axis=2)
        return cos_t.astype(dtype), sin_t.astype(dtype)

    def _attend(self, q: mx.array, keys: mx.array, values: mx.array, mask: mx.array):
        """softmax(q k^T + mask) v, q (B, K, H/K, d) against the cache's (B, K, capacity, d).
        From SPLIT_KEYS positions on, the keys are split over the CPU streams, each part's
        softmax kept unnormalized with its max and sum, and the parts merged: on a CPU every
        exp costs (MLX's x86 build has no SIMD exp), and the products' other cores are idle."""
        cap = keys.shape[2]
        if self.ways < 2 or cap < SPLIT_KEYS:
            scores = mx.addmm(mask, q, keys.swapaxes(-1, -2))  # (B, K, H/K, capacity)
            if self.cpu and scores.size >= cpu_exp.SOFTMAX_SCORES:
                return cpu_exp.attend(scores, values)
            return mx.softmax(scores, axis=-1, precise=True) @ values
        parts = []
        cuts = rowsplit.bounds(cap, self.ways)
        for (a, b), s in zip(cuts, rowsplit.streams(len(cuts)), strict=True):
            with mx.stream(s):
                k, v = keys[..., a:b, :], values[..., a:b, :]
                scores = mx.addmm(mask[..., a:b], q, k.swapaxes(-1, -2))
                top = mx.max(scores, axis=-1, keepdims=True)
                e = mx.exp(scores - top)  # (the arithmetic exp's kernels cost more here)
                total = mx.sum(e, axis=-1, keepdims=True)
                parts.append((top, total, e @ v))
        top = parts[0][0]
        for m, _, _ in parts[1:]:
            top = mx.maximum(top, m)
        weights = [mx.exp(m - top) for m, _, _ in parts]
        num = sum(w * o for w, (_, _, o) in zip(weights, parts, strict=True))
        den = sum(w * t for w, (_, t, _) in zip(weights, parts, strict=True))
        return num / den

    def _layer(self, h, layer: Layer, cache, rotation) -> mx.array:
        m, attn = layer.module, layer.module.self_attn
        (B, L), H, K, d = h.shape[:2], layer.n_heads, layer.n_kv, self.head_dim
        x = m.input_layernorm(h)
        qkv = layer.qkv(x).reshape(B, L, H + 2 * K, d)
        mask, cos_t, sin_t = rotation(H, K, qkv.dtype)
        if hasattr(attn, "q_norm"):  # qwen3: per-head RMS norms of q and k before RoPE
            q = attn.q_norm(qkv[:, :, :H])
            k = attn.k_norm(qkv[:, :, H : H + K])
            qkv = mx.concatenate([q, k, qkv[:, :, H + K :]], axis=2)
        # RoPE (non-traditional): [x1, x2] -> [x1 c - x2 s, x2 c + x1 s] on the halves.
        r = qkv.reshape(B, L, H + 2 * K, 2, d // 2)
        r = (r * cos_t + r[..., ::-1, :] * sin_t).reshape(B, L, H + 2 * K, d)
        # (B, heads, L, d); one position needs no transpose, only a reshape.
        r = r.reshape(B, H + 2 * K, 1, d) if L == 1 else r.swapaxes(1, 2)
        keys, values = cache.update_and_fetch(r[:, H : H + K], r[:, H + K :])
        # GQA: each KV head's query heads (and positions) as the rows of one product.
        q = r[:, :H].reshape(B, K, H // K * L, d)
        o = self._attend(q, keys, values, mask)
        if L > 1:  # (B, K, group, L, d) -> (B, L, heads, d)
            o = o.reshape(B, K, H // K, L, d).transpose(0, 3, 1, 2, 4)
        o = o.reshape(B, L, H * d)
        h = layer.o(o, h) if layer.o is not None else h + attn.o_proj(o)
        x = m.post_attention_layernorm(h)
        if layer.gate_up is None:
            return h + m.mlp(x)
        gu = layer.gate_up(x)
        glu = cpu_exp.swiglu if self.cpu else swiglu
        y = glu(gu[..., : layer.inter], gu[..., layer.inter :])
        return layer.down(y, h) if layer.down is not None else h + m.mlp.down_proj(y)


def build(model: nn.Module, local: range | None = None, ways: int = 1) -> FusedForward | None:
    """Fuses the projections of `model` (this rank's shards; of its `local` layers on a PP
    stage) and returns its fused forward, each product split over `ways` CPU streams; None,
    leaving the values as they were, where its structure is not the one above."""
    inner = getattr(model, "model", None)
    args = getattr(model, "args", None)
    if getattr(args, "model_type", None) not in FAMILIES or inner is None:
        return None
    if any(getattr(layer, "use_sliding", False) for layer in inner.layers):
        return None
    plans = []
    for i, layer in enumerate(inner.layers):
        if local is not None and i not in local:
            continue
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            return None
        projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if not all(p is not None and _plain(p) for p in projs):
            return None
        H, K = attn.n_heads, attn.n_kv_heads
        d = projs[0].weight.shape[0] // H  # output rows, quantized or not
        if H % K or d * H != projs[0].weight.shape[0]:
            return None
        inv = _rope_inv_freqs(attn.rope, d)
        if inv is None:
            return None
        plans.append((layer, attn, mlp, projs, H, K, d, inv))
    if not plans or len({p[6] for p in plans}) > 1:
        return None  # the step's RoPE tables take one head width for every layer
    layers = []
    for layer, attn, mlp, projs, H, K, _, _ in plans:
        if (qkv := fuse(projs)) is None:
            return None  # the layers fused so far stay views: the same values, unused
        dense = all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
        gate_up = fuse([mlp.gate_proj, mlp.up_proj]) if dense else None
        inter = mlp.gate_proj.weight.shape[0] if gate_up is not None else 0
        mx.clear_cache()  # hand the unfused arrays' memory back layer by layer
        o, down = _linear(attn.o_proj), _linear(mlp.down_proj) if gate_up is not None else None
        layers.append(
            Layer(
                module=layer,
                qkv=qkv.split(ways),
                o=o.split(ways) if o is not None else None,
                gate_up=gate_up.split(ways) if gate_up is not None else None,
                down=down.split(ways) if down is not None else None,
                n_heads=H,
                n_kv=K,
                inter=inter,
            )
        )
    _, _, _, _, _, _, d, inv = plans[0]
    return FusedForward(model, layers, inv, d, ways)


def head(model: nn.Module, ways: int) -> Projection | None:
    """The output head as a projection split over `ways` CPU streams: a plain lm_head, or the
    tied embedding (as_linear is x @ E.T); None where it is anything else (a TP-split head)
    or where `ways` is 1."""
    if ways < 2:
        return None
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None:
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if type(embed).__name__ not in ("Embedding", "QuantizedEmbedding"):
            return None
        lm_head = embed
    elif not _plain(lm_head):
        return None
    return _projection(lm_head).split(ways)
