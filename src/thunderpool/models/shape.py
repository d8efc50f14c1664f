"""The one reader of a config.json's sizes: layer count, widths and head counts.

Families name these differently (num_hidden_layers, n_layer, num_layers; hidden_size, n_embd,
d_model) and multimodal wrappers nest the text model's under `text_config`. Everything of ours
that needs a size asks here, so a family mlx-lm runs never dies on a KeyError of ours; where a
config truly lacks one, the ModelError names the keys that were looked for.
"""

from __future__ import annotations

from thunderpool.errors import ModelError

LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_transformer_layers")
HIDDEN = ("hidden_size", "d_model", "n_embd", "hidden_dim", "model_dim", "dim")
HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "num_query_heads")
KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")
VOCAB = ("vocab_size", "padded_vocab_size")
EXPERTS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "experts_per_token", "moe_topk", "top_k")


def text_view(config: dict) -> dict:
    """The text model's config: a wrapper's `text_config` over its own top level."""
    text = config.get("text_config") or config.get("llm_config")
    return {**config, **text} if isinstance(text, dict) else config


def _first(config: dict, keys: tuple[str, ...], what: str, default: int | None = None) -> int:
    view = text_view(config)
    for k in keys:
        if isinstance(v := view.get(k), int) and not isinstance(v, bool):
            return v
    if default is not None:
        return default
    raise ModelError(
        f"config.json of model_type {config.get('model_type')!r} gives no {what} (looked for "
        f"{', '.join(keys)}, also under text_config)"
    )


def n_layers(config: dict) -> int:
    return _first(config, LAYERS, "layer count")


def hidden(config: dict) -> int:
    return _first(config, HIDDEN, "hidden size")


def heads(config: dict, default: int | None = None) -> int:
    return _first(config, HEADS, "attention head count", default)


def kv_heads(config: dict) -> int:
    return _first(config, KV_HEADS, "KV head count", heads(config, 0))


def head_dim(config: dict) -> int:
    found = text_view(config).get("head_dim")
    if isinstance(found, int) and found > 0:
        return found
    return hidden(config) // max(heads(config, 1), 1)


def vocab(config: dict) -> int:
    return _first(config, VOCAB, "vocabulary size")


def experts(config: dict) -> int:
    return _first(config, EXPERTS, "routed expert count", 0)


def experts_per_token(config: dict) -> int:
    return _first(config, TOP_K, "experts per token", 0)
