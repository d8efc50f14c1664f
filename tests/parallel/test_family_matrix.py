"""The family matrix: every family we accept, sharded every way, against the unsharded model.

Reference: mlx-lm's own model, one process, full forward of the whole sequence at every step
(no KV cache). Expected: identical greedy tokens over 20 steps and fp32 logits within
atol=rtol=1e-4 (measured differences are ~1e-5, from the different summation order; 5e-4 for
qwen3_next, whose cached recurrence differs from the full form on one rank already), with a
300-token prompt, far longer than the sliding window of the windowed families, prefilled in
128-token chunks. The batched cell runs continuous batching (staggered arrivals, rows joining
and leaving) on PP2 and expects the same tokens. Transformers, on the same weights, checks
mlx-lm's port of each family. Layouts a family cannot take must be refused with a clear
message (Family.refuses), never run.

Every cell's job runs through the production one-shot path (oneshot.run), but the cells of one
world size share one launch of their ranks (matrix_ranks.py), which load one cell's shard after
another: starting ranks cost more than most cells' decoding. The 3-rank cells run under mpirun
(MLX's mpi backend, the default for local ranks) where Open MPI is installed: its ranks yield
the core while they wait, where ring's busy-poll, and 3 ranks share 2 cores in CI (measured
38 s against 176 s on a loaded machine, the same tokens). The 2-rank cells run on MLX ring.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from families import FAMILIES, family_prompts, make_family, transformers_dir
from fast_reference import FullForwards
from matrix_ranks import launch_backend, run_matrix, trace_job, trace_result
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from thunderpool.engine.loader import Layout, preflight
from thunderpool.errors import ShardingError
from thunderpool.parallel.pipeline import split_layers

STEPS = 20  # greedy tokens per prompt; the batch cell's rows join at tokens 3 and 5
HF_TOL = 2e-4  # transformers (torch fp32) against mlx-lm (mlx fp32): measured <= 3e-5
PROMPTS = family_prompts()
# One rank and PP2 of every family are proven by the all-families matrix
# (test_all_families.py); here: TP2's uneven shares, 3 ranks, and continuous batching.
LAYOUTS = {"tp2": ("tp", 2), "tp3": ("tp", 3), "pp3": ("pp", 3)}
# The first cell of a world size waits for the launch that runs all of them.
LAUNCH_S = 1200
NODES = {"tp2": 2, "batch": 2, "tp3": 3, "pp3": 3}
# mlx-lm's own shard() where the split is even and the family has one, our slicing otherwise.
TP_METHOD = {
    ("llama", 2): "mlx-lm",
    ("llama", 3): "uneven",  # 2 KV heads on 3 ranks: replicated KV heads
    ("qwen2", 2): "mlx-lm",
    ("qwen2", 3): "uneven",
    ("qwen3", 2): "uneven",  # 3 KV heads on 2 ranks: 2 + 1, like SmolLM2
    ("qwen3", 3): "mlx-lm",
    ("qwen3_moe", 2): "mlx-lm",
    ("qwen3_moe", 3): "uneven",  # experts' channels split unevenly
    ("gemma3_text", 2): "uneven",  # mlx-lm's gemma3_text has no shard()
    ("gemma3_text", 3): "uneven",
    ("deepseek_v3", 2): "mlx-lm",
    ("glm_moe_dsa", 2): "mlx-lm",
    ("deepseek_v32", 2): "mlx-lm",
    ("glm4_moe", 2): "mlx-lm",
    ("glm4_moe", 3): "uneven",  # shared experts split with the routed ones
    ("gpt_oss", 2): "mlx-lm",
    ("mixtral", 2): "uneven",  # no shard(): the whole MoE block sums its partial output
    ("mixtral", 3): "uneven",
    ("phi3", 2): "uneven",  # fused qkv_proj and gate_up_proj: a fused share per rank
    ("phi3", 3): "uneven",  # 2 KV heads on 3 ranks
    ("qwen3_next", 2): "uneven",  # DeltaNet key heads and gated attention heads, 1 + 1 each
}
CELLS = [(kind, layout) for kind in FAMILIES for layout in [*LAYOUTS, "batch"]]


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
    bytes_ = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return np.array(tokens), np.stack(logits), bytes_


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
def references(family_dirs, tmp_path_factory):
    """greedy_full_forward of every family, in one child on the ranks' fast BLAS
    (fast_reference.py): the same mlx-lm forward, without this process's reference BLAS."""
    items = {kind: (family_dirs[kind], PROMPTS, STEPS) for kind in FAMILIES}
    refs = FullForwards(items, tmp_path_factory.mktemp("references"))
    yield refs
    refs.close()


def cell_job(kind: str, layout: str, model_dir, out) -> dict:
    """What one cell runs: the batch scenario, or a trace of the prompts on its layout."""
    if layout == "batch":
        return {"batch": batch_spec(model_dir, FAMILIES[kind].pp2)}
    parallel, nodes = LAYOUTS.get(layout, ("tp", 1))
    split = {"pp3": FAMILIES[kind].pp3}.get(layout)
    fields = {"parallel": parallel, "layer_split": split, "prefill_chunk": 128}
    return trace_job(model_dir, out, nodes, PROMPTS, STEPS, **fields)


@pytest.fixture(scope="module")
def launches(family_dirs, tmp_path_factory):
    """Every cell of a world size in one launch: ({cell id: each rank's events}, the folder
    of the traces)."""

    def launch(nodes: int):
        tmp = tmp_path_factory.mktemp(f"ranks{nodes}")
        jobs = [
            {"id": cell, **cell_job(kind, layout, family_dirs[kind], tmp / f"{cell}.npz")}
            for kind, family in FAMILIES.items()
            for layout, n in NODES.items()
            if n == nodes and layout not in family.refuses
            for cell in [f"{kind}-{layout}"]
        ]
        return run_matrix(jobs, tmp / "run", nodes, LAUNCH_S, launch_backend(nodes)), tmp

    return Built(launch)


def cell_trace(launches, kind: str, layout: str) -> dict:
    events, tmp = launches[NODES[layout]]
    cell = f"{kind}-{layout}"
    return trace_result(events[cell], tmp / f"{cell}.npz")


@pytest.mark.parametrize("kind", FAMILIES)
def test_reference_is_not_degenerate(kind, references):
    # Equality of tokens proves little if the model just repeats one token.
    tokens = references[kind][0]
    assert max(len(set(t)) for t in tokens) >= 4, tokens


@pytest.mark.parametrize("kind", FAMILIES)
def test_mlx_matches_transformers(kind, family_dirs, references):
    """mlx-lm's port against transformers on the same weights: the reference's logits at
    every step equal transformers' over the prompt plus the reference's own tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        transformers_dir(kind, family_dirs[kind]), dtype=torch.float32
    )
    tokens, logits, _ = references[kind]
    for prompt, toks, want in zip(PROMPTS, tokens, logits, strict=True):
        seq = torch.tensor([list(prompt) + toks[:-1].tolist()])
        with torch.no_grad():
            got = hf(seq).logits[0, len(prompt) - 1 :].numpy()
        np.testing.assert_allclose(got, want, atol=HF_TOL, rtol=HF_TOL)


@pytest.mark.timeout(LAUNCH_S)
@pytest.mark.parametrize("kind,layout", CELLS, ids=[f"{k}-{lay}" for k, lay in CELLS])
def test_sharded_matches_unsharded(kind, layout, family_dirs, references, launches):
    family = FAMILIES[kind]
    tokens, logits, total_bytes = references[kind]
    if layout in family.refuses:
        parallel, nodes = LAYOUTS[layout]
        with pytest.raises(ShardingError, match=family.refuses[layout]):
            preflight(family_dirs[kind], nodes, Layout(parallel))
        return
    if layout == "batch":
        events, _ = launches[NODES[layout]]
        got = events[f"{kind}-batch"][0][0]["result"]
        assert [o["tokens"] for o in got["out"]] == [*tokens.tolist(), tokens[0].tolist()]
        assert got["left"] == [[], True, 0]  # every row left the batch
        return
    parallel, nodes = LAYOUTS[layout]
    split = {"pp3": family.pp3}.get(layout)
    n_layers = family.config["num_hidden_layers"]
    got = cell_trace(launches, kind, layout)
    np.testing.assert_array_equal(got["tokens"], tokens)
    np.testing.assert_allclose(got["logits"], logits, atol=family.tol, rtol=family.tol)
    loaded = got["loaded"]
    held = [e["param_bytes"] for e in loaded]
    want = "pp" if parallel == "pp" else TP_METHOD[kind, nodes]
    assert {e["method"] for e in loaded} == {want}
    if parallel == "pp":
        # The stages hold the layers of the split, each exactly once, and no other weights.
        bounds = [tuple(e["layers"]) for e in loaded]
        assert bounds == split_layers(n_layers, nodes, list(split) if split else None)
        assert sum(held) == total_bytes
    else:
        # Each TP rank holds a strict part of the weights.
        assert max(held) < total_bytes / nodes * 1.6


def batch_spec(model_dir, split) -> dict:
    """The prompts greedily, then the first again: the second and third join a running batch
    (rows of different lengths, left-padded) and leave it at different steps."""
    greedy = {"temperature": 0.0, "max_tokens": STEPS}
    requests = [{"prompt": p, "params": greedy} for p in [*PROMPTS, PROMPTS[0]]]
    requests[1]["after"], requests[2]["after"] = [0, 3], [1, 5]
    return {
        "model": str(model_dir),
        "parallel": "pp",
        "layer_split": list(split),
        "requests": requests,
        "eos": [],
        "prefill_chunk": 64,
    }


def test_verified_table_is_what_the_matrix_proves():
    # The plan-time guard offers a sharded layout only where every cell of it passes here.
    from thunderpool.models.families import MATRIX as VERIFIED

    proven = {
        kind: tuple(
            p
            for p, cells in (("tp", ("tp2", "tp3")), ("pp", ("pp3",)))
            if any(c not in family.refuses for c in cells)
        )
        for kind, family in FAMILIES.items()
    }
    # Expert parallelism and hybrid TP×PP have their own cells (test_expert_parallel.py,
    # test_hybrid.py).
    own = ("ep", "hybrid")
    assert {k: tuple(p for p in v if p not in own) for k, v in VERIFIED.items()} == proven
