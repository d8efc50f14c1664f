"""Every family the installed mlx-lm ships, as a tiny random checkpoint, on each layout.

One rank (our engine: chunked prefill, then cached decode) is compared with mlx-lm's own full
forward of the whole sequence at every step; each sharded layout with one rank where that
agreed (else with the full forward too).

The checkpoints come from mlx-lm's own ModelArgs (thunderpool.models.tiny): built by mlx-lm,
saved in its own layout, loaded back through its own sanitize, so nothing here knows a family.
A cell is (family, layout): "one" (one rank), "pp" (PP2), "tp" (TP2), "ep" (EP2, MoE only).

`python tests/all_families.py` discovers: it runs every cell in a launch of its own (a cell that
hangs or dies costs only itself), compares it with the one-process full forward, and writes
src/thunderpool/models/verified.json: "ok" where tokens are identical and logits within TOL, the
one-line reason otherwise. tests/parallel/test_all_families.py then proves every "ok" cell again
on each run, in one shared launch per world size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from thunderpool.models import tiny
from thunderpool.models.checkpoint import write_checkpoint

STEPS = 6  # greedy tokens per prompt
TOL = 2e-4  # fp32 logits, sharded or cached against the full forward (measured ~1e-6)
LAYOUTS = {"one": ("tp", 1), "pp": ("pp", 2), "tp": ("tp", 2), "ep": ("ep", 2)}
# Run by hand for the issue notes (`--tp3`), not proven again in CI: at run time a layout on
# more ranks than the matrix's is gated by the day-0 proof (cli/proof.py).
EXTRA = {"one": ("tp", 1), "tp3": ("tp", 3)}
VERIFIED_JSON = Path(__file__).parents[1] / "src/thunderpool/models/verified.json"


def prompts() -> list[list[int]]:
    """One prompt, longer than the tiny window (16) and than one prefill chunk (16)."""
    rng = np.random.default_rng(7)
    return [rng.integers(1, tiny.VOCAB, 28).tolist()]


def make_checkpoint(model_type: str, path: Path, seed: int = 0) -> Path:
    """Write `model_type`'s tiny random checkpoint (mlx-lm layout, fp32) to `path`."""
    return write_checkpoint(tiny.family_config(model_type), path, seed)


def reference(model_dir: Path, steps: int = STEPS) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens and last-position logits, recomputing the whole sequence every step
    with mlx-lm's own Model.__call__."""
    from conftest import greedy_full_forward

    return greedy_full_forward(model_dir, prompts(), steps)


def cell_job(model_dir: Path, layout: str, out: Path) -> dict:
    from matrix_ranks import trace_job

    parallel, nodes = {**LAYOUTS, **EXTRA}[layout]
    return trace_job(model_dir, out, nodes, prompts(), STEPS, parallel=parallel, prefill_chunk=16)


def compare(got: dict, want: tuple[np.ndarray, np.ndarray]) -> str:
    """"ok", or what differs."""
    tokens, logits = want
    if not np.array_equal(got["tokens"], tokens):
        return f"greedy tokens differ from the unsharded model's ({got['tokens'].tolist()})"
    diff = float(np.max(np.abs(got["logits"] - logits)))
    if not np.allclose(got["logits"], logits, atol=TOL, rtol=TOL):
        return f"logits differ from the unsharded model's by up to {diff:.2g} (tolerance {TOL})"
    return "ok"


def preflight_reason(model_dir: Path, layout: str) -> str | None:
    """Why the production preflight refuses this cell, or None."""
    from thunderpool.engine.loader import Layout, preflight

    parallel, nodes = {**LAYOUTS, **EXTRA}[layout]
    try:
        preflight(model_dir, nodes, Layout(parallel))
    except Exception as e:  # noqa: BLE001 - every refusal is recorded as its message
        return first_line(e)
    return None


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:300]


def discover(root: Path, only: list[str], layouts: dict | None = None) -> dict:
    """Run every cell alone; {family: {layout: "ok" | reason}}."""
    from matrix_ranks import launch_backend, run_matrix, trace_result

    layouts = layouts or LAYOUTS

    table = {}
    for model_type in only or tiny.model_types():
        if model_type in getattr(tiny, "CANNOT_BUILD", {}):
            continue
        row = table[model_type] = {}
        folder = root / model_type
        try:
            make_checkpoint(model_type, folder / "ckpt")
            want = reference(folder / "ckpt")
        except Exception as e:  # noqa: BLE001
            row["one"] = f"mlx-lm's own model does not run: {first_line(e)}"
            continue
        for layout, (_, nodes) in layouts.items():
            if layout == "ep" and not _moe(folder / "ckpt"):
                continue
            if (why := preflight_reason(folder / "ckpt", layout)) is not None:
                row[layout] = why
                continue
            out = folder / f"{layout}.npz"
            jobs = [{"id": layout, **cell_job(folder / "ckpt", layout, out)}]
            try:
                run = folder / f"run-{layout}"
                events = run_matrix(jobs, run, nodes, 90, launch_backend(nodes))
                got = trace_result(events[layout], out)
                row[layout] = compare(got, want)
                if layout == "one" and row[layout] == "ok":
                    want = (got["tokens"], got["logits"])  # the layouts: against one rank
            except BaseException as e:  # noqa: BLE001 - a dead or hung launch
                log = folder / f"run-{layout}" / "rank0.log"
                tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
                row[layout] = f"the ranks failed: {(tail or [first_line(e)])[0][:250]}"
        print(model_type, row, flush=True)
    return table


def _moe(model_dir: Path) -> bool:
    from thunderpool.engine.loader import build_lazy
    model, _ = build_lazy(model_dir)
    return any(
        "switch" in type(m).__name__.lower() or name.endswith("experts")
        for name, m in model.named_modules()
    )


if __name__ == "__main__":
    import mlx_lm

    sys.path.insert(0, str(Path(__file__).parent))
    # python tests/all_families.py [FOLDER [FAMILY ...]]: only FAMILY's rows are rewritten;
    # python tests/all_families.py FOLDER --tp3: one rank and TP3, to FOLDER/tp3.json only.
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/all-families")
    if "--tp3" in sys.argv:
        found = discover(root, [a for a in sys.argv[2:] if a != "--tp3"], EXTRA)
        (root / "tp3.json").write_text(json.dumps(found, indent=1))
        sys.exit(0)
    families = discover(root, sys.argv[2:])
    old = json.loads(VERIFIED_JSON.read_text()) if VERIFIED_JSON.exists() else {}
    merged = {**old.get("families", {}), **families} if sys.argv[2:] else families
    VERIFIED_JSON.write_text(
        json.dumps({"mlx_lm": mlx_lm.__version__, "families": dict(sorted(merged.items()))},
                   indent=1) + "\n"
    )
