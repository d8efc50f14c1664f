"""config.json as current transformers writes it, read the way mlx-lm's model classes read it.

transformers 5 writes `rope_parameters` ({"rope_type", "rope_theta", scaling fields}, or one
such dict per layer type) where many of mlx-lm's ModelArgs read `rope_theta`, `rope_scaling`
and `rope_local_base_freq`, and `num_local_experts` where Qwen's MoE classes read
`num_experts`. Left alone, a missing required field is a Python traceback, and a missing
`rope_theta` silently becomes mlx-lm's default (10000 where the model says 500000).
`normalised` returns the fields to add, taken from the ones the config has, never replacing
one it states; a required field it still cannot find is refused in one line naming the key.
"""

from __future__ import annotations

import inspect

from thunderpool.errors import ModelError

# A field mlx-lm reads -> the names other writers give it.
ALIASES = {
    "num_experts": ("num_local_experts", "n_routed_experts"),
    "num_local_experts": ("num_experts", "n_routed_experts"),
}


def _rope(config: dict) -> tuple[dict, dict]:
    """(full-attention rope dict, sliding-attention rope dict) of `rope_parameters`."""
    rp = config.get("rope_parameters")
    if not isinstance(rp, dict):
        return {}, {}
    if rp and all(isinstance(v, dict) for v in rp.values()):  # per layer type
        full = rp.get("full_attention") or next(iter(rp.values()))
        return full, rp.get("sliding_attention") or {}
    return rp, {}


def normalised(config: dict, fields: dict[str, inspect.Parameter], where: str = "") -> dict:
    """The fields to add to `config` so that a ModelArgs taking `fields` reads what the
    checkpoint means; raises ModelError naming a required field found under no name."""
    out: dict = {}
    full, sliding = _rope(config)
    if "rope_theta" in fields and "rope_theta" not in config and "rope_theta" in full:
        out["rope_theta"] = full["rope_theta"]
    scaled = full.get("rope_type", full.get("type", "default")) != "default"
    if "rope_scaling" in fields and config.get("rope_scaling") is None and scaled:
        out["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    if "rope_local_base_freq" in fields and "rope_local_base_freq" not in config:
        if "rope_theta" in sliding:
            out["rope_local_base_freq"] = sliding["rope_theta"]
    for name, others in ALIASES.items():
        if name in fields and config.get(name) is None:
            found = next((config[o] for o in others if config.get(o) is not None), None)
            if found is not None:
                out[name] = found
    for name, p in fields.items():
        required = p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
        if required and name not in config and name not in out:
            also = f" (nor {', '.join(repr(o) for o in ALIASES[name])})" if name in ALIASES else ""
            raise ModelError(
                f"{where or 'config.json'} has no {name!r}{also}, which mlx-lm's "
                f"{config.get('model_type')} model needs; add it to config.json (its value is "
                "in the model card or the original checkpoint's config)"
            )
    return out


def model_fields(config: dict) -> dict[str, inspect.Parameter] | None:
    """The fields mlx-lm's ModelArgs for this config's model_type takes; None where mlx-lm
    has no such model (the loader names that itself)."""
    from mlx_lm.utils import _get_classes

    try:
        _, args_cls = _get_classes(config)
    except (ValueError, ImportError, KeyError):
        return None
    return dict(inspect.signature(args_cls).parameters)
