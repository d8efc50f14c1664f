"""TP pools the vocabulary: each rank holds its share of the embedding and head, nothing twice.

On checkpoints whose vocabulary dominates (4096 x 64 embedding, 2 small layers), plain and
4-bit, every TP rank's parameter bytes as the engine counts them (the "loaded" events) must
be at most total / N + 5%, total being the single-rank load's count. Holding the embedding
whole (the layout before this test) put a TP2 rank at 125% of total (tied: the whole
embedding plus a copy of its rows for the head) and 71% (untied). The sharded runs must also
decode the single rank's greedy tokens, with logits within 1e-4, on prompts whose ids fall in
every rank's rows. The cells of one world size share one launch (matrix_ranks.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import BASE
from matrix_ranks import run_traces
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes

VOCAB = 4096
# 6 query and 6 KV heads, 96 channels: TP2 and TP3 split heads and channels evenly, so the
# only slack left per rank is the replicated norms and the uneven vocabulary rows (TP3).
SHAPE = {
    **BASE,
    "vocab_size": VOCAB,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "head_dim": 16,
}
CONFIGS = {
    "tied": {**SHAPE, "model_type": "qwen3", "tie_word_embeddings": True},
    "untied": {**SHAPE, "model_type": "llama", "tie_word_embeddings": False},
    # 4-bit (QuantizedEmbedding, packed rows): 4 heads and 128 channels keep each TP2 rank's
    # slices whole quantization groups of 32.
    "tied-q4": {
        **SHAPE,
        "model_type": "qwen3",
        "tie_word_embeddings": True,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "quantization": {"group_size": 32, "bits": 4},
    },
}
CASES = [(k, n) for k in CONFIGS for n in (2, 3) if (k, n) != ("tied-q4", 3)]
PROMPTS = [np.random.default_rng(s).integers(0, VOCAB, 24).tolist() for s in (3, 4)]
STEPS = 8
TOL = 1e-4


def write_checkpoint(config: dict, path: Path, seed: int = 0) -> Path:
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # Bigger-than-default weights give peaked logits, so greedy ties are not a coin flip.
    params = tree_flatten(model.parameters())
    model.update(
        tree_unflatten([(n, w * 2.0) for n, w in params if w.ndim == 2 and "embed" not in n])
    )
    if q := config.get("quantization"):
        nn.quantize(model, group_size=q["group_size"], bits=q["bits"])
    weights = dict(tree_flatten(model.parameters()))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[tuple[str, int], dict]:
    """Each checkpoint's trace on 1 rank (the reference and the total bytes) and on every TP
    case: one launch per world size runs all of its cells."""
    root = tmp_path_factory.mktemp("vocab")
    paths = {kind: write_checkpoint(config, root / kind) for kind, config in CONFIGS.items()}
    cells = {(kind, 1) for kind in CONFIGS} | set(CASES)
    common = {"prompts": PROMPTS, "max_tokens": STEPS, "parallel": "tp"}
    jobs = {f"{k}-{n}": {**common, "model_dir": paths[k], "nodes": n} for k, n in cells}
    got = run_traces(jobs, root / "traces")
    return {(k, n): {**got[f"{k}-{n}"], "path": paths[k]} for k, n in cells}


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "nodes"), CASES, ids=[f"{k}-tp{n}" for k, n in CASES])
def test_tp_rank_holds_its_share_of_the_vocabulary(kind, nodes, traces):
    single, got = traces[kind, 1], traces[kind, nodes]
    (total,) = [e["param_bytes"] for e in single["loaded"]]
    stored = mx.load(str(single["path"] / "model.safetensors"))
    vocab_bytes = sum(w.nbytes for n, w in stored.items() if n.startswith(("model.embed", "lm_")))
    assert vocab_bytes > total / 2  # the vocabulary dominates, or the bound proves little

    per_rank = [e["param_bytes"] for e in got["loaded"]]
    assert len(per_rank) == nodes
    assert max(per_rank) <= total / nodes * 1.05, (per_rank, total)
    # Nothing is lost either: the ranks together hold the whole model (norms replicated).
    assert sum(per_rank) >= total

    np.testing.assert_array_equal(got["tokens"], single["tokens"])
    np.testing.assert_allclose(got["logits"], single["logits"], atol=TOL, rtol=TOL)
    assert len({t for row in single["tokens"] for t in row}) >= 4  # not one repeated token
