"""Every family the installed mlx-lm ships, on one rank, PP2, TP2 and EP2, against the
unsharded model (tests/all_families.py builds them from mlx-lm's own ModelArgs).

models/verified.json is what discovery found. Each run proves its "ok" cells again: identical
greedy tokens and fp32 logits within all_families.TOL of mlx-lm's own full forward, every
cell of a world size in one launch of its ranks. A cell that is not "ok" must be refused
before any rank starts (families.check_layout), with the reason discovery recorded.
"""

from __future__ import annotations

import json

import mlx_lm
import pytest
from all_families import (
    LAYOUTS,
    STEPS,
    VERIFIED_JSON,
    cell_job,
    compare,
    make_checkpoint,
    preflight_reason,
    prompts,
)
from fast_reference import FullForwards
from matrix_ranks import run_matrix, trace_result
from test_family_matrix import Built

from thunderpool.errors import UnverifiedLayoutError
from thunderpool.models import families, tiny

TABLE = json.loads(VERIFIED_JSON.read_text())
CELLS = [(f, lay) for f, row in TABLE["families"].items() for lay in row]
LAUNCH_S = 1200


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("all-families")
    return Built(lambda family: make_checkpoint(family, root / family))


@pytest.fixture(scope="module")
def references(dirs, tmp_path_factory):
    """Every family's mlx-lm full forward, all in one child on the ranks' fast BLAS, running
    beside the launch of one rank (the first cell waits for both)."""
    items = {f: (dirs[f], prompts(), STEPS) for f in TABLE["families"]}
    refs = FullForwards(items, tmp_path_factory.mktemp("references"))
    yield refs
    refs.close()


@pytest.fixture(scope="module")
def launches(dirs, tmp_path_factory):
    """Every "ok" cell of a world size in one launch: {cell: trace}."""

    def launch(nodes: int) -> dict:
        tmp = tmp_path_factory.mktemp(f"all{nodes}")
        cells = [(f, lay) for f, lay in CELLS if TABLE["families"][f][lay] == "ok"
                 and LAYOUTS[lay][1] == nodes]
        jobs = [{"id": f"{f}-{lay}", **cell_job(dirs[f], lay, tmp / f"{f}-{lay}.npz")}
                for f, lay in cells]
        events = run_matrix(jobs, tmp / "run", nodes, LAUNCH_S)
        return {j["id"]: trace_result(events[j["id"]], tmp / f"{j['id']}.npz") for j in jobs}

    return Built(launch)


def _checkpoint_bytes(model_dir) -> int:
    import mlx.core as mx

    return sum(v.nbytes for v in mx.load(str(model_dir / "model.safetensors")).values())


def test_table_covers_the_installed_mlx_lm():
    # A family mlx-lm ships is in the table or named, with its reason, as one we cannot build.
    assert TABLE["mlx_lm"] == mlx_lm.__version__, "rerun: python tests/all_families.py"
    shipped = set(tiny.model_types())
    assert set(TABLE["families"]) | set(tiny.CANNOT_BUILD) == shipped
    for family, why in sorted(tiny.CANNOT_BUILD.items()):
        print(f"not built: {family}: {why}")


@pytest.mark.timeout(LAUNCH_S)
@pytest.mark.parametrize("family,layout", CELLS, ids=[f"{f}-{lay}" for f, lay in CELLS])
def test_cell(family, layout, dirs, references, launches):
    found = TABLE["families"][family][layout]
    parallel, nodes = LAYOUTS[layout]
    if found == "ok":
        got = launches[nodes][f"{family}-{layout}"]
        want = references[family][:2]
        if layout != "one" and TABLE["families"][family].get("one") == "ok":
            one = launches[1][f"{family}-one"]  # "equal to one rank"
            want = (one["tokens"], one["logits"])
        assert compare(got, want) == "ok"
        loaded = got["loaded"]
        if layout == "pp":  # our cut, or mlx-lm's own pipeline() (parallel/native.py)
            assert {e["method"] for e in loaded} in ({"pp"}, {"pp-mlx-lm"})
        if layout != "one":  # every rank holds a strict part of the weights
            held = [e["param_bytes"] for e in loaded]
            assert max(held) < _checkpoint_bytes(dirs[family]), held
        return
    if found.startswith("ShardingError"):  # the loader's own preflight refuses it still
        assert preflight_reason(dirs[family], layout) == found
    if layout != "one":
        config = json.loads((dirs[family] / "config.json").read_text())
        with pytest.raises(UnverifiedLayoutError, match="not verified"):
            families.check_layout(config, nodes, parallel)
