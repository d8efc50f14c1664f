"""The embedded SmolLM2 through our engine (1 rank, TP2, PP2) against transformers on the same GGUF.

Both sides run the same dequantized float32 weights; the first 32 greedy tokens must be equal.
"""

from __future__ import annotations

import numpy as np
import pytest
from matrix_ranks import run_traces

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.reference

STEPS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def smollm2():
    from thunderpool.models.source import default_gguf_path, resolve_model

    return default_gguf_path(), resolve_model(None, progress=False)


@pytest.fixture(scope="module")
def prompts(smollm2_transformers) -> list[list[int]]:
    """The prompts as transformers' own GGUF tokenizer encodes them."""
    tok = smollm2_transformers[1]
    return [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(smollm2_transformers, prompts, ours):
    """transformers' greedy tokens (its own GGUF loader, shared with the GGUF import's tests),
    read from one full forward per prompt over the prompt and our single rank's tokens: the
    argmax at each position. Greedy decoding picks the argmax after the tokens before it
    (causal attention), so where every argmax is our next token, transformers' greedy decode is
    our tokens, exactly; at the first position where ours differs, the argmax is transformers'
    own token there, and the test below fails on it. One forward per prompt instead of one per
    token (its KV-cache decode, which the reference ran before, repeats the full forward)."""
    model, tok, _, _ = smollm2_transformers
    outputs = []
    with torch.no_grad():
        for ids, toks in zip(prompts, ours["single"].tolist(), strict=True):
            assert len(toks) == STEPS
            logits = model(torch.tensor([ids + toks[:-1]])).logits[0, len(ids) - 1 :]
            outputs.append(logits.argmax(-1).tolist())
    return np.array(outputs), tok


def test_our_tokenizer_matches_transformers(smollm2, prompts):
    from mlx_lm.utils import load_tokenizer

    ours = load_tokenizer(smollm2[1])
    assert [ours.encode(p, add_special_tokens=False) for p in PROMPTS] == prompts


def test_transformers_answers_paris(reference):
    outputs, tok = reference
    assert "Paris" in tok.decode(outputs[0])


LAYOUTS = {"single": (1, "tp"), "tp2": (2, "tp"), "pp2": (2, "pp")}


@pytest.fixture(scope="module")
def ours(smollm2, prompts, tmp_path_factory) -> dict[str, np.ndarray]:
    """Our greedy tokens per layout; TP2 and PP2 share one launch of two ranks."""
    common = {"model_dir": smollm2[1], "prompts": prompts, "max_tokens": STEPS}
    cells = {i: {**common, "nodes": n, "parallel": p} for i, (n, p) in LAYOUTS.items()}
    traces = run_traces(cells, tmp_path_factory.mktemp("smollm2"))
    return {i: trace["tokens"] for i, trace in traces.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_tokens_match_transformers(layout, ours, reference):
    expected, _ = reference
    np.testing.assert_array_equal(ours[layout], expected)
