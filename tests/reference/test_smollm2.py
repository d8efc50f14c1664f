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
def reference(smollm2_transformers):
    """transformers' own GGUF loader (shared with the GGUF import's tests); greedy decoding on
    its KV cache, checked against one full forward of the whole sequence: each token must be
    the argmax at the position before it, which is what full-forward greedy decoding picks
    (causal attention), at 1 forward per prompt instead of one per token."""
    model, tok, _, _ = smollm2_transformers
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    import inspect

    # transformers 5 names the cache argument `cache`, 4.x `past_key_values`.
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            cache, step, toks = transformers.DynamicCache(), list(ids), []
            for _ in range(STEPS):
                logits = model(torch.tensor([step]), use_cache=True, **{arg: cache}).logits
                step = [int(logits[0, -1].argmax())]
                toks += step
            full = model(torch.tensor([ids + toks[:-1]])).logits[0, len(ids) - 1 :]
            assert full.argmax(-1).tolist() == toks
            outputs.append(toks)
    return prompts, np.array(outputs), tok


def test_our_tokenizer_matches_transformers(smollm2, reference):
    from mlx_lm.utils import load_tokenizer

    prompts, _, _ = reference
    ours = load_tokenizer(smollm2[1])
    assert [ours.encode(p, add_special_tokens=False) for p in PROMPTS] == prompts


def test_transformers_answers_paris(reference):
    _, outputs, tok = reference
    assert "Paris" in tok.decode(outputs[0])


LAYOUTS = {"single": (1, "tp"), "tp2": (2, "tp"), "pp2": (2, "pp")}


@pytest.fixture(scope="module")
def ours(smollm2, reference, tmp_path_factory) -> dict[str, np.ndarray]:
    """Our greedy tokens per layout; TP2 and PP2 share one launch of two ranks."""
    prompts, _, _ = reference
    common = {"model_dir": smollm2[1], "prompts": prompts, "max_tokens": STEPS}
    cells = {i: {**common, "nodes": n, "parallel": p} for i, (n, p) in LAYOUTS.items()}
    traces = run_traces(cells, tmp_path_factory.mktemp("smollm2"))
    return {i: trace["tokens"] for i, trace in traces.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_tokens_match_transformers(layout, ours, reference):
    _, expected, _ = reference
    np.testing.assert_array_equal(ours[layout], expected)
