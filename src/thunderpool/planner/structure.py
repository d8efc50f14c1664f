"""A ModelSpec of any family mlx-lm builds, read from the model's own structure.

mlx-lm builds the full-size model from config.json with lazily initialised arrays: nothing is
allocated or computed (DeepSeek V3's 671 B parameters build in a fraction of a second), yet
every parameter's shape and place is known. So the bytes per layer, the routed experts, the
attention and KV projections and the output head come from the model itself, for families
no table here lists: MLA, linear attention (a state, no per-token cache), sliding windows,
MoE of every routing kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn
from mlx.utils import tree_flatten

from thunderpool.errors import ModelError
from thunderpool.planner.layers import Weights, weights_for

# Parameter paths (inside a layer) of the projections whose outputs a KV cache keeps per token.
_KV_WRITERS = ("k_proj", "v_proj", "kv_a_proj_with_mqa", "wkv", "key", "value")
_ATTENTION = ("attn", "attention", "mixer", "self_attention")
_EXPERTS = ("switch_mlp", "experts", "switch_glu")
_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k", "moe_k", "num_activated_experts")
_FUSED_HEAD_DIMS = (64, 72, 80, 96, 128, 192, 256)


def build_lazy(config: dict) -> nn.Module:
    """The full-size mlx-lm model of `config`, its arrays never evaluated."""
    from mlx_lm.utils import _get_classes

    try:
        model_cls, args_cls = _get_classes(config)
        return model_cls(args_cls.from_dict({**_neutral(args_cls), **config}))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ModelError(
            f"mlx-lm cannot build model_type {config.get('model_type')!r} from this config "
            f"({type(e).__name__}: {e}); check config.json or upgrade mlx-lm"
        ) from e


def _neutral(args_cls: type) -> dict:
    """Values for required fields that shape no parameter (norm epsilons, RoPE bases, flags),
    which a trimmed config (planner/configs) may leave out; a missing width still fails."""
    import dataclasses

    from thunderpool.models.tiny import _REQUIRED

    out = {"max_position_embeddings": 4096}
    for f in dataclasses.fields(args_cls):
        value = _REQUIRED.get(f.name, 0)
        if isinstance(value, float | bool | str) or (f.name in _REQUIRED and value is None):
            out[f.name] = value
    return out


def _bytes(w: Weights, name: str, shape: tuple[int, ...]) -> int:
    """Stored bytes of one parameter; a matrix's quantization follows its module path."""
    path = name.rsplit(".", 1)[0]
    if len(shape) >= 2 and name.endswith("weight"):
        lead = 1
        for d in shape[:-2]:
            lead *= d
        return lead * w.matrix(shape[-2], shape[-1], path)
    n = 1
    for d in shape:
        n *= d
    return w.vector(n)


def _kind(name: str) -> str:
    parts = name.split(".")
    if any(p in _EXPERTS for p in parts) and not any("shared" in p for p in parts):
        return "experts"
    if any(p in _ATTENTION for p in parts) or any("attn" in p for p in parts):
        return "attn"
    return "other"


def _top_k(config: dict) -> int:
    text = config.get("text_config") or {}
    for key in _TOP_K:
        for c in (config, text):
            if isinstance(c.get(key), int) and c[key] > 0:
                return c[key]
    return 1


def _kv_width(layer: nn.Module) -> int:
    """Elements one token adds to this layer's cache: the widths of its k/v (or MLA latent)
    projections; 0 for a layer whose state does not grow (linear attention, SSM)."""
    width = 0
    for name, module in layer.named_modules():
        if name.rsplit(".", 1)[-1] in _KV_WRITERS and "weight" in module:
            width += module["weight"].shape[0]  # built unquantized: the true width
    return width


@dataclass(slots=True)
class _Layer:
    """One layer's stored bytes by kind, its parameters and what one token uses of them."""

    bytes: int = 0
    attn: int = 0
    kv_proj: int = 0
    experts: int = 0
    params: int = 0
    active: int = 0
    matmuls: int = 0
    routed: int = 0
    n_experts: int = 0


def _layer(layer: nn.Module, w: Weights, top_k: int) -> _Layer:
    out = _Layer()
    for name, v in tree_flatten(layer.parameters()):
        b, n = _bytes(w, name, v.shape), v.size
        out.bytes, out.params = out.bytes + b, out.params + n
        kind = _kind(name)
        if kind == "experts" and v.ndim >= 3:
            e = v.shape[0]  # stacked routed experts: a token uses top_k of them
            out.n_experts = max(out.n_experts, e)
            out.experts += b
            out.active += n * min(top_k, e) // e
            out.routed += n * min(top_k, e) // e
            out.matmuls += min(top_k, e)
            continue
        out.active += n
        out.matmuls += v.ndim == 2 and name.endswith("weight")
        if kind == "attn":
            out.attn += b
            out.kv_proj += b if any(f".{k}." in f".{name}" for k in _KV_WRITERS) else 0
    return out


def spec_fields(config: dict, dtype_bytes: float = 2.0, kv_dtype_bytes: float = 2.0) -> dict:
    """ModelSpec's fields for `config`, from its lazily built mlx-lm model. KV bytes per token
    count every layer's k/v (or latent) projections in full: a sliding window's cap is not
    taken off, so long contexts are priced high, never low."""
    from thunderpool.parallel.anatomy import anatomy, width

    model = build_lazy(config)
    body = anatomy(model)
    w = weights_for(config, dtype_bytes)
    embedding = body.embedding()
    if embedding is None:
        raise ModelError(f"{config.get('model_type')}: its decoder has no token embedding")
    vocab, hidden = width(embedding[1])
    top_k = _top_k(config)
    layers = [_layer(layer, w, top_k) for layer in model.layers]
    n_experts = max((x.n_experts for x in layers), default=0)
    widest = max(((x.active - x.attn) // max(3 * hidden, 1) for x in layers), default=0)
    layer_ids = {id(x) for x in model.layers}
    prefixes = tuple(_layer_prefixes(model, layer_ids))
    outer = [(n, v) for n, v in tree_flatten(model.parameters()) if not n.startswith(prefixes)]
    embed_name = f"{body.path}.{embedding[0]}."
    embed_b = sum(_bytes(w, n, v.shape) for n, v in outer if n.startswith(embed_name))
    head_b = sum(_bytes(w, n, v.shape) for n, v in outer if n.startswith("lm_head."))
    other = [(n, v) for n, v in outer if not n.startswith((embed_name, "lm_head."))]
    head_params = sum(v.size for n, v in outer if n.startswith("lm_head.")) or vocab * hidden
    heads, kv_heads, head_dim = _heads(model.layers)
    kv_widths = [_kv_width(layer) for layer in model.layers]
    return dict(
        model_type=str(config.get("model_type")),
        layers=len(layers),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        intermediate=widest,
        experts=n_experts,
        experts_per_tok=top_k if n_experts else 0,
        bytes_per_layer=tuple(x.bytes for x in layers),
        attn_bytes_per_layer=tuple(x.attn for x in layers),
        kv_proj_bytes_per_layer=tuple(x.kv_proj for x in layers),
        expert_bytes_per_layer=tuple(x.experts for x in layers),
        embed_bytes=embed_b,
        head_bytes=head_b,
        norm_bytes=sum(_bytes(w, n, v.shape) for n, v in other),
        kv_bytes_per_token_per_layer=sum(kv_widths) / max(len(layers), 1) * kv_dtype_bytes,
        kv_dtype_bytes=kv_dtype_bytes,
        active_params_per_layer=tuple(x.active for x in layers),
        params=sum(x.params for x in layers) + sum(v.size for _, v in outer),
        active_params=sum(x.active for x in layers) + head_params
        + sum(v.size for _, v in other),
        matmuls_per_layer=tuple(x.matmuls for x in layers),
        routed_active_per_layer=tuple(x.routed for x in layers),
        attn_dim=2 * head_dim,
        attn_fused=head_dim in _FUSED_HEAD_DIMS,
    )


def _layer_prefixes(model: nn.Module, layer_ids: set[int]) -> list[str]:
    return [f"{name}." for name, m in model.named_modules() if id(m) in layer_ids]


def _heads(layers) -> tuple[int, int, int]:
    """(query heads, KV heads, head width) of the first layer with standard attention."""
    from thunderpool.parallel.tp_reading import _heads as heads_of

    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        q = getattr(attn, "q_proj", None) if attn is not None else None
        if attn is None or q is None or "weight" not in q:
            continue
        heads, kv = heads_of(attn)
        if heads:
            return heads, kv or heads, q["weight"].shape[0] // heads
    return 1, 1, 0


def kv_elements(model: nn.Module) -> list[int]:
    """Per layer, the elements one token adds to its cache (for tests and `plan`)."""
    return [_kv_width(layer) for layer in model.layers]

