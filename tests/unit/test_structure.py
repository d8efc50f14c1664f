"""The planner prices any family from mlx-lm's own lazily built model (planner/structure.py).

Checked three ways: against the per-architecture table (planner/layers.py) on the bundled
configs, where both must agree to the byte; against published parameter counts; and against
the arrays' nbytes of every tiny checkpoint mlx-lm's families build.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from thunderpool.models import tiny
from thunderpool.planner.spec import SUPPORTED, model_spec_from_config, structural_spec
from thunderpool.planner.structure import build_lazy

CONFIGS = Path(__file__).parents[2] / "src/thunderpool/planner/configs"
# Published totals (and active parameters per token), in billions, from the model cards.
PUBLISHED = {
    "llama-3.3-70b": (70.6, None),
    "deepseek-v3": (671.0, 37.0),
    "kimi-k2": (1040.0, 32.0),
    "qwen3-235b-a22b": (235.0, 22.0),
    "qwen3-30b-a3b": (30.5, 3.3),
    "qwen3-4b": (4.0, None),
}
TABLE_KNOWN = [p.stem for p in sorted(CONFIGS.glob("*.json"))
               if json.loads(p.read_text())["model_type"] in SUPPORTED
               and p.stem not in ("glm-5", "deepseek-v4-flash")]


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.mark.parametrize("name", TABLE_KNOWN)
def test_structure_prices_known_families_as_the_table(name):
    config = _config(name)
    table, built = model_spec_from_config(config), structural_spec(config)
    assert built.params == table.params
    assert built.active_params == table.active_params
    assert built.bytes_per_layer == table.bytes_per_layer
    assert built.expert_bytes_per_layer == table.expert_bytes_per_layer
    assert (built.embed_bytes, built.head_bytes) == (table.embed_bytes, table.head_bytes)
    assert built.kv_bytes_per_token() == table.kv_bytes_per_token()
    assert (built.experts, built.experts_per_tok) == (table.experts, table.experts_per_tok)


@pytest.mark.parametrize("name", PUBLISHED)
def test_structure_matches_published_parameter_counts(name):
    spec = structural_spec(_config(name))
    total, active = PUBLISHED[name]
    assert spec.params / 1e9 == pytest.approx(total, rel=0.02)
    if active is not None:  # model cards round, and some count the embedding
        assert spec.active_params / 1e9 == pytest.approx(active, rel=0.1)


BUILT = [t for t in tiny.model_types() if t not in tiny.CANNOT_BUILD]


@pytest.mark.parametrize("model_type", BUILT)
def test_structure_counts_every_tiny_checkpoints_bytes(model_type):
    """fp32: the spec's bytes are the arrays' nbytes, layer by layer; KV elements per token
    are what one token adds to the caches mlx-lm makes."""
    config = tiny.family_config(model_type)
    spec = structural_spec(config, dtype_bytes=4.0)
    model = build_lazy(config)
    arrays = dict(tree_flatten(model.parameters()))
    assert spec.total_bytes == sum(v.nbytes for v in arrays.values())
    assert spec.params == sum(v.size for v in arrays.values())
    for i, layer in enumerate(model.layers):
        assert spec.bytes_per_layer[i] == sum(v.nbytes for _, v in tree_flatten(layer.parameters()))
    assert spec.layers == len(model.layers)


def test_planner_takes_a_family_no_table_lists():
    # gpt2 is none of planner/spec.py's SUPPORTED: the plan still prices it.
    from thunderpool.planner.placement import place  # noqa: F401 - the planner imports

    config = tiny.family_config("gpt2")
    assert config["model_type"] not in SUPPORTED
    spec = model_spec_from_config(config, dtype_bytes=4.0)
    assert spec.layers == 4 and spec.params > 0
    mx.eval(mx.array(0))  # nothing above evaluated the model's arrays
