"""How tensor parallelism reads a model's layers: head counts under their many names, which
layers our slicing can split (softmax attention with q/k/v/o, Gated DeltaNet, feed-forward
blocks of any shape) and, where it cannot, the one-line reason naming the layer."""

from __future__ import annotations

import inspect

import mlx.core as mx
import mlx.nn as nn

from thunderpool.parallel import blocks, linear_attn
from thunderpool.parallel.anatomy import anatomy, width
from thunderpool.parallel.blocks import _mlp_refusal, fused_glu
from thunderpool.parallel.wide_norm import wide_norms

HEAD_NAMES = (
    ("n_heads", "n_kv_heads"),
    ("num_heads", "num_key_value_heads"),
    ("num_attention_heads", "num_key_value_heads"),
    ("num_attention_heads", "num_kv_heads"),
    ("num_heads", "num_kv_heads"),
)


def _head_names(attn: nn.Module) -> tuple[str, str] | None:
    return next((n for n in HEAD_NAMES if hasattr(attn, n[0]) and hasattr(attn, n[1])), None)


def _family(model: nn.Module) -> str:
    args = getattr(model, "args", None) or getattr(model, "config", None)
    return getattr(args, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]


def _heads(attn: nn.Module) -> tuple[int, int]:
    """(query heads, KV heads); MLA attention (num_heads only) has as many KV heads."""
    names = _head_names(attn)
    if names is not None:
        return getattr(attn, names[0]), getattr(attn, names[1])
    heads = getattr(attn, "num_heads", 0)
    return heads, heads


def _even_only(model: nn.Module) -> str | None:
    """Why only mlx-lm's own even shard() can split this model, or None where our uneven
    slicing can too."""
    attn = _first_attn(model)
    if hasattr(attn, "kv_a_proj_with_mqa"):
        return "MLA attention"
    if any(hasattr(layer.get("self_attn"), "sinks") for layer in model.layers):
        return "attention sinks"  # on some layers only, in MiMo-V2's sliding ones
    if _head_names(attn) is None:
        return "non-standard attention"
    return None


def _structural(model: nn.Module, n: int) -> str | None:
    """Why our slicing cannot read this model's layers (then only mlx-lm's shard() can)."""
    family, layers = _family(model), model.layers
    odd = next((i for i, layer in enumerate(layers) if not _splittable_attn(layer)), None)
    if odd is not None:
        kinds = [k for k, v in layers[odd].items() if isinstance(v, nn.Module)]
        return (
            f"{family}: tensor parallelism (tp={n}) splits attention with q/k/v/o projections; "
            f"layer {odd} ({type(layers[odd]).__name__}: {', '.join(kinds)}) has none"
        )
    if _even_only(model) in ("MLA attention", "attention sinks"):
        return None  # mlx-lm's shard() splits these where _even says the shares divide
    hidden = _hidden(model)
    for i, layer in enumerate(layers):
        if (why := _layer_refusal(layer, hidden)) is not None:
            return f"{family}: tensor parallelism (tp={n}) cannot split layer {i}: {why}"
    return None


_QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
_OUT = ("o_proj", "out_proj")  # AFM names its output projection out_proj


def o_name(attn: nn.Module) -> str:
    """The name of the attention's output projection ("o_proj" where it has none)."""
    return next((n for n in _OUT if n in attn), "o_proj")


def kv_reuse(attn: nn.Module | None) -> bool:
    """Attention that is handed an earlier layer's keys and values (AFM's KV-reuse layers,
    called with them): a q_proj and an output projection, n_heads, no K/V projections."""
    if attn is None or "q_proj" not in attn or o_name(attn) not in attn:
        return False
    if any(p in attn for p in ("k_proj", "v_proj", "qkv_proj")):
        return False
    called = inspect.signature(type(attn).__call__).parameters
    return isinstance(getattr(attn, "n_heads", None), int) and {"keys", "values"} <= set(called)


def _norm_width(m) -> int:
    w = m.get("weight") if isinstance(m, nn.Module) and "norm" in type(m).__name__.lower() else None
    return w.shape[0] if isinstance(w, mx.array) and w.ndim == 1 else -1


def _first_attn(model: nn.Module) -> nn.Module:
    """The first layer's softmax attention (Qwen3-Next's first layers are linear)."""
    return next((layer.self_attn for layer in model.layers if "self_attn" in layer), nn.Module())


def _splittable_attn(layer: nn.Module) -> bool:
    """Softmax attention (checked by _layer_refusal), or a Gated DeltaNet we split."""
    la = layer.get("linear_attn")
    return "self_attn" in layer or (la is not None and linear_attn.is_gated_deltanet(la))


def _layer_refusal(layer: nn.Module, hidden: int) -> str | None:
    """What in this layer our slicing (shard_attention, then shard_mlp or a feed-forward
    block of any shape: blocks.py) cannot split, or None."""
    attn = layer.get("self_attn")
    if attn is None:  # a Gated DeltaNet layer (_splittable_attn): linear_attn.py splits it
        return None if _mlp_refusal(layer) is None or blocks.ffn_child(layer, hidden) else (
            "its feed-forward has no projections to and from the hidden width"
        )
    if kv_reuse(attn):  # its query heads are cut like the layer's whose KV it reads (tensor.py)
        return _ffn_refusal(layer, hidden)
    o = o_name(attn)
    need = ("qkv_proj", o) if "qkv_proj" in attn else (*_QKVO[:3], o)
    missing = [p for p in need if p not in attn]
    if missing or _head_names(attn) is None:
        what = f"no {', '.join(missing)}" if missing else "no head counts we read"
        return f"its attention ({type(attn).__name__}) has {what}"
    heads, kv = _heads(attn)
    if (rows := qkv_rows(attn)) is None:
        return f"its fused qkv_proj does not read as {heads} query and {kv} KV heads"
    q_rows, k_rows, _ = rows
    wide = [
        k
        for k, v in attn.items()
        if (_norm_width(v) == q_rows and heads > 1) or (_norm_width(v) == k_rows and kv > 1)
    ]
    if wide and wide_norms(attn, heads, kv, rows) is None:  # OLMo 2's: wide_norm.py splits
        return f"its {', '.join(wide)} normalises over every head at once (not a q/k RMSNorm)"
    other = [
        k
        for k, v in attn.items()
        if k not in (*_QKVO, *_OUT, "qkv_proj") and blocks.projection(v)
        and gate_rows(attn, k) is None
    ]
    if other:  # not a per-head gate on the heads' outputs (gate_rows), which we cut with them
        return f"its attention ({type(attn).__name__}) has projections we do not split: {other}"
    return _ffn_refusal(layer, hidden)


def _ffn_refusal(layer: nn.Module, hidden: int) -> str | None:
    if _mlp_refusal(layer) is None or fused_glu(layer) or blocks.ffn_child(layer, hidden):
        return None
    why = _mlp_refusal(layer)
    return f"its feed-forward ({why}) has no projections to and from the hidden width"


def qkv_rows(attn: nn.Module) -> tuple[int, int, int] | None:
    """Rows of the query, key and value projections, or of those parts of a fused qkv_proj
    (q|k|v, in that order, as Phi-3 and AFM split it); None where they do not read as heads."""
    if "qkv_proj" not in attn:
        return tuple(attn[p].weight.shape[-2] for p in ("q_proj", "k_proj", "v_proj"))
    heads, kv = _heads(attn)
    rows, head_dim = attn.qkv_proj.weight.shape[-2], getattr(attn, "head_dim", 0)
    if isinstance(indices := getattr(attn.qkv_proj, "indices", None), list) and len(indices) == 2:
        parts = (indices[0], indices[1] - indices[0], rows - indices[1])  # AFM's FusedLinear
    elif isinstance(head_dim, int) and head_dim > 0:
        parts = (heads * head_dim, kv * head_dim, kv * head_dim)
    else:
        return None
    if sum(parts) != rows or parts[0] % heads or parts[1] % kv or parts[2] % kv:
        return None
    return parts


# Attention projections that gate the heads' outputs before o_proj, one row (Laguna's g_proj,
# softplus) or one row per channel (AFMoE's and Muse Glimmer's gate_proj, sigmoid) per head.
_GATES = ("g_proj", "gate_proj")


def gate_rows(attn: nn.Module, name: str) -> int | None:
    """Rows per query head of an output gate `name` of this attention, or None where it is not
    one we cut with the heads."""
    gate, o = attn.get(name), attn.get(o_name(attn))
    heads = _heads(attn)[0]
    if name not in _GATES or not blocks.projection(gate) or not blocks.projection(o) or not heads:
        return None
    rows, o_in = blocks._dims(gate)[0], blocks._dims(o)[1]
    return rows // heads if rows in (heads, o_in) and rows % heads == 0 else None


def head_counts(model: nn.Module) -> list[tuple[int, int]]:
    """The distinct (query, KV) head counts of the model's softmax attention layers."""
    attns = [layer.self_attn for layer in model.layers if "self_attn" in layer]
    return sorted({_heads(a) for a in attns if not kv_reuse(a)})


def per_layer_refusal(model: nn.Module, n: int, weights: list[float]) -> str | None:
    """Layers with different (query, KV) head counts (MiMo-V2's sliding and full layers) get
    each their own share of heads: proven in equal shares that divide every count only."""
    counts = head_counts(model)
    reuse = {a.n_heads for layer in model.layers if kv_reuse(a := layer.get("self_attn"))}
    if reuse and (len(counts) != 1 or reuse != {counts[0][0]}):
        return (
            f"{_family(model)}: tensor parallelism (tp={n}) cuts KV-reuse layers' {reuse} query "
            f"heads like the layers whose KV they read, which have {counts}; use --parallel pp"
        )
    if len(counts) < 2:
        return None
    ok = [d for d in range(2, min(h for h, _ in counts) + 1)
          if all(h % d == 0 and kv % d == 0 for h, kv in counts)]
    if len(set(weights)) == 1 and n in ok:
        return None
    fix = f"use tp in {ok} with equal weights, or --parallel pp" if ok else "use --parallel pp"
    return (
        f"{_family(model)}: tensor parallelism (tp={n}, weights {weights}) gives each layer its "
        f"own share of heads only in equal shares that divide every layer's (query, KV) head "
        f"counts {counts}; {fix}"
    )


def wide_k_refusal(model: nn.Module, n: int) -> str | None:
    """A k_norm over every KV head at once sums each rank's channels once: refused where ranks
    share (replicate) a KV head, which would count its channels on each of them."""
    for i, layer in enumerate(model.layers):
        attn = layer.get("self_attn")
        if attn is None or _head_names(attn) is None or (rows := qkv_rows(attn)) is None:
            continue
        heads, kv = _heads(attn)
        if n > kv and "k" in (wide_norms(attn, heads, kv, rows) or {}).values():
            return (
                f"{_family(model)}: tensor parallelism (tp={n}) cannot split layer {i}'s k_norm "
                f"(over all {kv} KV heads at once) on more ranks than KV heads; use tp of at "
                f"most {kv} or --parallel pp"
            )
    return None


def _hidden(model: nn.Module) -> int:
    embedding = anatomy(model).embedding()
    return width(embedding[1])[1] if embedding is not None else 0
