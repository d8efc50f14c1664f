"""Tiny random checkpoints in mlx-lm's own layout, from a config (models/tiny.py shrinks it).

mlx-lm builds the model, its arrays are saved as they are named in the model, and loading
runs the family's own sanitize on them, as for any converted MLX checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from thunderpool.errors import ModelError


def write_checkpoint(config: dict, path: Path, seed: int = 0) -> Path:
    """Write a random fp32 model of `config` (model.safetensors + config.json) to `path`."""
    from mlx_lm.utils import _get_classes

    try:
        model_cls, args_cls = _get_classes(config)
        mx.random.seed(seed)
        model = model_cls(args_cls.from_dict(config))
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        raise ModelError(
            f"mlx-lm cannot build {config.get('model_type')!r} from the shrunk config "
            f"({type(e).__name__}: {e})"
        ) from e
    params = dict(tree_flatten(model.parameters()))
    # Peaked logits, so greedy ties are not a coin flip: widen every matrix a little.
    params = {
        k: (v * 2.0 if v.ndim >= 2 and mx.issubdtype(v.dtype, mx.floating) else v)
        for k, v in params.items()
    }
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path
