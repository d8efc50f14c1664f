"""The family matrix: every family we accept, sharded every way, against the unsharded model.

Reference: mlx-lm's own model, one process, full forward of the whole sequence at every step
(no KV cache). Expected: identical greedy tokens over 32 steps and fp32 logits within
atol=rtol=1e-4, with a prompt far longer than the sliding window of the windowed families.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import run_trace
from families import FAMILIES, family_prompts, make_family
from mlx_lm.utils import load_model

STEPS = 32
TOL = 1e-4
PROMPTS = family_prompts()


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


class Built(dict):
    """Checkpoints (or references) made on first use, then shared by every cell."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, kind):
        self[kind] = self.make(kind)
        return self[kind]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return Built(lambda kind: make_family(kind, root / kind))


@pytest.fixture(scope="module")
def references(family_dirs):
    return Built(lambda kind: greedy_full_forward(family_dirs[kind], PROMPTS))


@pytest.mark.parametrize("layout", ["pp2", "pp3"])
def test_gemma3_pipeline(layout, family_dirs, references, tmp_path):
    family = FAMILIES["gemma3_text"]
    split = family.pp2 if layout == "pp2" else family.pp3
    got = run_trace(
        family_dirs["gemma3_text"],
        tmp_path / "t.npz",
        len(split),
        "pp",
        prompts=PROMPTS,
        max_tokens=STEPS,
        prefill_chunk=128,
        layer_split=split,
    )
    tokens, logits = references["gemma3_text"]
    np.testing.assert_array_equal(got["tokens"], tokens)
    np.testing.assert_allclose(got["logits"], logits, atol=TOL, rtol=TOL)
