"""TP and PP on real rank processes (MLX ring over loopback) against the unsharded model.

Reference: mlx-lm's own model, one process, full forward of the whole sequence at every step
(no KV cache). Expected: identical greedy tokens over 32 steps and fp32 logits within
atol=rtol=1e-4 (measured differences are ~5e-6, from the different summation order).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import run_trace, tiny_prompts
from mlx_lm.utils import load_model

STEPS = 32
TOL = 1e-4
# A 300-token prompt with 128-token prefill chunks exercises chunked prefill and commands
# longer than the control header (a second collective).
PROMPTS = tiny_prompts(2) + [np.random.default_rng(7).integers(0, 256, 300).tolist()]
CASES = [
    # (model, parallel, nodes, expected sharding method on the ranks)
    ("llama", "tp", 2, "mlx-lm"),
    ("llama", "tp", 3, "uneven"),  # 2 KV heads on 3 ranks: replicated KV heads
    ("llama", "pp", 2, "pp"),
    ("llama", "pp", 3, "pp"),
    ("qwen3", "tp", 2, "uneven"),  # 3 KV heads on 2 ranks: 2 + 1, like SmolLM2
    ("qwen3", "tp", 3, "mlx-lm"),
    ("qwen3", "pp", 2, "pp"),
    ("qwen3", "pp", 3, "pp"),
    ("qwen3_moe", "tp", 2, "mlx-lm"),
    ("qwen3_moe", "tp", 3, "uneven"),  # experts' channels split unevenly
    ("qwen3_moe", "pp", 2, "pp"),
    ("qwen3_moe", "pp", 3, "pp"),
]


def greedy_full_forward(model_dir, prompts, steps=STEPS):
    """Tokens and last-position logits, recomputing the whole sequence every step."""
    model, _ = load_model(model_dir)
    tokens, logits = [], []
    for prompt in prompts:
        seq, toks, lgs = list(prompt), [], []
        for _ in range(steps):
            out = model(mx.array([seq]))[0, -1].astype(mx.float32)
            tok = int(mx.argmax(out).item())
            toks.append(tok)
            lgs.append(np.array(out))
            seq.append(tok)
        tokens.append(toks)
        logits.append(np.stack(lgs))
    return np.array(tokens), np.stack(logits)


@pytest.fixture(scope="module")
def references(tiny_models):
    return {kind: greedy_full_forward(path, PROMPTS) for kind, path in tiny_models.items()}


def test_reference_is_not_degenerate(references):
    # Equality of tokens proves little if every model just repeats one token.
    for kind, (tokens, _) in references.items():
        assert max(len(set(t)) for t in tokens) >= 4, kind


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_single_rank_engine_matches_full_forward(kind, tiny_models, references, tmp_path):
    got = run_trace(
        tiny_models[kind],
        tmp_path / "t.npz",
        1,
        prompts=PROMPTS,
        max_tokens=STEPS,
        prefill_chunk=128,
    )
    tokens, logits = references[kind]
    np.testing.assert_array_equal(got["tokens"], tokens)
    np.testing.assert_allclose(got["logits"], logits, atol=TOL, rtol=TOL)


@pytest.mark.parametrize(
    "kind,parallel,nodes,method", CASES, ids=[f"{k}-{p}{n}" for k, p, n, _ in CASES]
)
def test_sharded_matches_unsharded(
    kind, parallel, nodes, method, tiny_models, references, tmp_path
):
    got = run_trace(
        tiny_models[kind],
        tmp_path / "t.npz",
        nodes,
        parallel,
        prompts=PROMPTS,
        max_tokens=STEPS,
        prefill_chunk=128,
    )
    loaded = [e.event for e in got["events"] if e.event["kind"] == "loaded"]
    assert {e["method"] for e in loaded} == {method}
    tokens, logits = references[kind]
    np.testing.assert_array_equal(got["tokens"], tokens)
    np.testing.assert_allclose(got["logits"], logits, atol=TOL, rtol=TOL)
    if parallel == "pp":
        # Every layer is held by exactly one stage.
        spans = sorted(tuple(e["layers"]) for e in loaded)
        assert spans[0][0] == 0 and spans[-1][1] == 4
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    else:
        # Each TP rank holds a strict part of the layer weights.
        total = sum(e["param_bytes"] for e in loaded)
        assert max(e["param_bytes"] for e in loaded) < total / nodes * 1.6
