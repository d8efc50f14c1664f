"""The quantization matrix: every format a Mac user downloads, on every layout, against one rank.

Checkpoints: tiny llama and qwen3_moe models converted by mlx-lm's own converter code
(quant_formats.py): affine 2, 3, 4, 5, 6 and 8 bits at groups 32, 64 and 128; mxfp4, nvfp4
and mxfp8 (no biases); the mixed recipes mixed_2_6, mixed_3_4, mixed_3_6 and mixed_4_6; and
per-layer overrides (float, 5-bit group 32, mxfp4 and 8-bit group 128 modules in one model).
Layouts: llama on one rank, TP2 (even: mlx-lm's shard), TP3 (4 KV heads 2+1+1: our uneven
slicing of packed words, 3 ranks under mpirun) and PP2; qwen3_moe on EP2 (whole experts, TP
attention), hybrid (groups 2,1: a TP2 stage then a one-rank stage) and TP3 (uneven expert
channels). Every format runs on every layout but the last two, whose expert matrices share
slice_cols with TP2's and TP3's 2-D ones: they run one format per way of packing (SUBSETS).
The formats of one world size run in one launch of its ranks (matrix_ranks.py), each rank
loading one format after another.

Reference: mlx-lm's own model on one rank in one child process, full forward at every step (no KV
cache). Expected: identical greedy tokens and fp32 logits within TOL (the quantized weights
are the same on every layout; only the summation order of the split products differs, measured
< 1e-5). A cell the layout cannot take must be refused by preflight (before any rank starts)
with one line naming the format, the layout and what works (REFUSED); every other cell runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from fast_reference import FullForwards
from matrix_ranks import launch_backend, run_matrix, trace_job, trace_result
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
from quant_formats import FAMILIES, FORMATS, make_base, make_quantized, prompts, quantized_modules
from test_family_matrix import Built

from thunderpool.engine.loader import Layout, preflight
from thunderpool.errors import ShardingError

STEPS = 6
TOL = 1e-4
PROMPTS = prompts()
LAUNCH_S = 600
# layout -> (family, parallel, ranks, job fields)
LAYOUTS = {
    "one": ("llama", "tp", 1, {}),
    "tp2": ("llama", "tp", 2, {}),
    "tp3": ("llama", "tp", 3, {}),
    "pp2": ("llama", "pp", 2, {"layer_split": (2, 2)}),
    "ep2": ("qwen3_moe", "ep", 2, {}),
    "hybrid": ("qwen3_moe", "hybrid", 3, {"groups": (2, 1), "layer_split": (2, 2)}),
    "tp3-moe": ("qwen3_moe", "tp", 3, {}),
}
# Layouts that run a subset of the formats, the others sharing their code: tp3-moe cuts the
# experts' (E, out, in) matrices with the very slice_cols and steps tp3 proves on every format
# for 2-D ones; it runs one format per way of packing (words straddling values at 3/5 bits
# and at 6, biases or none, group 16, mixed widths and modes) and one refused (group 128).
SUBSETS = {
    "tp3-moe": ("q3g32", "q5g64", "q6g64", "q4g128", "mxfp4", "nvfp4", "mxfp8", "mixed_3_6"),
}
SUBSETS["tp3-moe"] += ("overrides",)
# hybrid's TP2 stage cuts with the same slice_cols tp2 (2-D) and tp3-moe (experts) prove, and
# its hand-off passes hidden states, whatever the format: one format per way of packing too
# (at group 128 TP2 cuts the experts' 256 channels on group boundaries, so it runs).
SUBSETS["hybrid"] = SUBSETS["tp3-moe"]
# How each layout loads: mlx-lm's even shard() where it applies, our slicing otherwise.
METHOD: dict = {"one": "single", "tp2": "mlx-lm", "tp3": "uneven", "pp2": "pp", "ep2": "ep"}
METHOD["hybrid"] = "hybrid"
METHOD["tp3-moe"] = "uneven"
# At group 128 the MLP's 384 channels do not halve on group boundaries (192): TP2 takes our
# uneven path there, 256 + 128 channels.
METHOD |= {("tp2", f"q{bits}g128"): "uneven" for bits in (2, 3, 4, 5, 6, 8)}
# (layout, format) -> the refusal preflight must give; every cell not listed must run.
REFUSED: dict[tuple[str, str], str] = {
    # 4 experts of 256 channels in groups of 128: two groups cannot go to three ranks.
    ("tp3-moe", "q4g128"): (
        r"^tp=3 with weights \[1.0, 1.0, 1.0\] cannot split the routed experts' 256 channels on "
        r"the boundaries of their 4-bit affine \(group 128\) down_proj \(every 128\); use tp "
        r"of at most 2 in equal shares, --parallel ep \(whole experts\) or --parallel pp$"
    ),
}
# nvfp4 with a tensor scale per expert: mx.gather_qmm takes it on the GPU only, so no CPU
# rank can run it; tests/unit/test_packing.py checks EP and TP cut its scales right.
GPU_ONLY = ("nvfp4-gs",)


def formats(layout: str) -> tuple[str, ...]:
    return tuple(f for f in SUBSETS.get(layout, FORMATS) if f not in GPU_ONLY)


CELLS = [(layout, fmt) for layout in LAYOUTS for fmt in formats(layout)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    bases = {kind: make_base(kind, root / kind) for kind in FAMILIES}
    return Built(lambda key: make_quantized(bases[key[0]], key[1], root / f"{key[0]}-{key[1]}"))


@pytest.fixture(scope="module")
def references(checkpoints, tmp_path_factory):
    """greedy_full_forward of every checkpoint a cell or the degeneracy check reads, in one
    child (fast_reference.py) that runs beside the launch of one rank the first cell waits for."""
    keys = {(LAYOUTS[layout][0], fmt) for layout, fmt in CELLS} | set(DEGENERACY)
    items = {key: (checkpoints[key], PROMPTS, STEPS) for key in sorted(keys)}
    refs = FullForwards(items, tmp_path_factory.mktemp("references"))
    yield refs
    refs.close()


def _layout(layout: str) -> tuple[int, Layout]:
    _, parallel, nodes, fields = LAYOUTS[layout]
    return nodes, Layout(
        parallel, groups=fields.get("groups"), layer_split=fields.get("layer_split")
    )


def _refusal(checkpoints, layout: str, fmt: str) -> str | None:
    """preflight's refusal of a cell, or None where it may run (asked once per cell)."""
    key = (str(checkpoints[LAYOUTS[layout][0], fmt]), layout)
    if key not in _REFUSALS:
        nodes, lay = _layout(layout)
        try:
            preflight(checkpoints[LAYOUTS[layout][0], fmt], nodes, lay)
            _REFUSALS[key] = None
        except ShardingError as e:
            _REFUSALS[key] = str(e)
    return _REFUSALS[key]


_REFUSALS: dict[tuple[str, str], str | None] = {}


@pytest.fixture(scope="module")
def launches(checkpoints, tmp_path_factory):
    """Every runnable cell of a layout's world in one launch: ({cell: each rank's events},
    the folder of the traces)."""

    def launch(world: tuple) -> tuple[dict, Path]:
        tmp = tmp_path_factory.mktemp("ranks")
        jobs = []
        for layout, (kind, parallel, nodes, fields) in LAYOUTS.items():
            if _world(layout) != world:
                continue
            for fmt in formats(layout):
                if _refusal(checkpoints, layout, fmt) is not None:
                    continue
                cell = f"{layout}-{fmt}"
                job = trace_job(
                    checkpoints[kind, fmt],
                    tmp / f"{cell}.npz",
                    nodes,
                    PROMPTS,
                    STEPS,
                    parallel=parallel,
                    prefill_chunk=16,  # the longer prompt prefills in two chunks
                    **fields,
                )
                jobs.append({"id": cell, **job})
        nodes, groups = world
        backend = "ring" if groups else launch_backend(nodes)
        try:
            return run_matrix(jobs, tmp / "run", nodes, LAUNCH_S, backend, groups), tmp
        except Exception as e:  # every cell of this world fails with it: launched once
            return e, tmp

    return Built(launch)


def _world(layout: str) -> tuple[int, tuple[int, ...] | None]:
    _, _, nodes, fields = LAYOUTS[layout]
    return nodes, fields.get("groups")


def _expected_packings(kind: str, fmt: str) -> set[tuple[int, int, str]]:
    """The (bits, group, mode) the converter must have written for a format."""
    args = FORMATS[fmt]
    router = {(8, 64, "affine")} if kind == "qwen3_moe" else set()  # mlx-lm's own override
    if fmt.startswith("q"):
        return {(args["q_bits"], args["q_group_size"], "affine")} | router
    if fmt.startswith("mx") or fmt.startswith("nv"):
        mode = args["q_mode"]
        return {{"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}[mode] + (mode,)} | router
    if fmt.startswith("mixed"):
        low, high = map(int, fmt.split("_")[1:])
        return {(low, 64, "affine"), (high, 64, "affine")}
    return {(4, 64, "affine"), (5, 32, "affine"), (4, 32, "mxfp4"), (8, 128, "affine")}


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoint_is_quantized_as_named(kind, fmt, checkpoints):
    # Every projection, embedding and head quantized (the overrides leave two MLP projections
    # of layer 0 in float), in exactly the format's (bits, group, mode).
    found = quantized_modules(checkpoints[kind, fmt])
    assert set(found.values()) == _expected_packings(kind, fmt)
    float_ones = 2 if fmt == "overrides" else 0
    assert len(found) == {"llama": 30, "qwen3_moe": 34}[kind] - float_ones


@pytest.mark.timeout(LAUNCH_S)
@pytest.mark.parametrize("layout,fmt", CELLS, ids=[f"{lay}-{f}" for lay, f in CELLS])
def test_cell_matches_one_rank(layout, fmt, checkpoints, references, launches):
    kind, parallel, nodes, _ = LAYOUTS[layout]
    refusal = _refusal(checkpoints, layout, fmt)
    if (layout, fmt) in REFUSED:
        assert refusal is not None and re.search(REFUSED[layout, fmt], refusal), refusal
        assert "\n" not in refusal
        return
    assert refusal is None, f"{layout} × {fmt} refused: {refusal}"
    events, tmp = launches[_world(layout)]
    if isinstance(events, Exception):
        raise events
    cell = f"{layout}-{fmt}"
    got = trace_result(events[cell], tmp / f"{cell}.npz")
    tokens, logits, total = references[kind, fmt]
    np.testing.assert_array_equal(got["tokens"], tokens)
    np.testing.assert_allclose(got["logits"], logits, atol=TOL, rtol=TOL)
    loaded = got["loaded"]
    assert {e["method"] for e in loaded} == {METHOD.get((layout, fmt), METHOD[layout])}
    held = [e["param_bytes"] for e in loaded]
    if parallel == "pp":
        assert sum(held) == total  # each layer on exactly one stage
    elif parallel == "tp" and nodes > 1 and kind == "llama":
        # Every quantized array (words, scales, biases) is cut, none is held twice: the
        # ranks together hold the model plus one copy of its norms per extra rank.
        norms = sum(v.nbytes for n, v in _params(checkpoints[kind, fmt]) if "norm" in n)
        assert sum(held) == total + (nodes - 1) * norms
    elif nodes > 1:
        assert max(held) < total * 0.8  # no rank holds the whole model


def _params(model_dir: Path) -> list:
    model, _ = load_model(model_dir, lazy=True)
    return tree_flatten(model.parameters())


DEGENERACY = [(k, f) for f in ("q2g128", "q3g32", "mxfp4", "nvfp4", "mixed_2_6") for k in FAMILIES]


def test_reference_is_not_degenerate(references):
    # Equal tokens prove little where a model repeats one token: the quantized models do not.
    for kind, fmt in DEGENERACY:
        tokens = references[kind, fmt][0]
        assert max(len(set(t)) for t in tokens) >= 3, (kind, fmt, tokens)


def test_bytes_held_are_the_arrays(checkpoints):
    # The reference's byte count (the PP check) is mlx-lm's loaded arrays, scales included.
    model, _ = load_model(checkpoints["llama", "q3g32"])
    names = {n for n, _ in tree_flatten(model.parameters())}
    assert "model.layers.0.self_attn.o_proj.biases" in names
    model, _ = load_model(checkpoints["llama", "mxfp4"])
    names = {n for n, _ in tree_flatten(model.parameters())}
    assert "model.layers.0.self_attn.o_proj.scales" in names
    assert "model.layers.0.self_attn.o_proj.biases" not in names
