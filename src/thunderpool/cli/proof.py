"""The day-0 proof: a family this release never saw runs sharded only once a tiny model of
the same architecture gave the same answer on the layout as on one rank.

A newer mlx-lm brings families models/verified.json does not list, and that file's layouts ran
on 2 ranks: a family proven there runs on more only after the same proof. Before loading the real
weights, `admit` shrinks the checkpoint's own config (models/tiny.py: widths small; layer
kinds, head and expert counts kept), writes a random fp32 checkpoint of it, runs it on one
rank and on the requested layout over the same backend, and compares greedy tokens and
logits. The verdict is kept per family, layout, world size and mlx-lm version.

What it proves: this architecture's code paths on this layout (the cut, the head and expert
splits, the collectives, masks and caches) compute what one rank computes. What it cannot:
the numerics of the real weights (their dtype, quantization, magnitudes) and prompts longer
than its own.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from thunderpool.config import state_dir
from thunderpool.errors import ThunderpoolError, UnverifiedLayoutError
from thunderpool.models import families
from thunderpool.models.families import check_layout, family_of, warn_untested
from thunderpool.parallel.layout import Layout

PROMPTS = ((3, 17, 5, 9, 21), tuple(range(7, 35)))  # the second longer than a tiny window
STEPS = 6
TOL = 2e-4
PROOF_LAYERS = 8  # enough for every layer kind of a pattern, and each stage a few layers
PROOF_S = 300.0
COVERS = (
    "the proof covers this architecture's code on this layout (cuts, head and expert splits, "
    "collectives, masks, caches) in fp32; not the real weights' numerics or longer prompts"
)


def admit(
    config: dict,
    world: int,
    layout: Layout | str,
    allow_untested: bool,
    backend: str = "ring",
    console=None,
) -> None:
    """Let `layout` on `world` ranks run: verified, proven now on a tiny model (a family
    verified.json never saw, or one it proved in equal shares only), or let through loudly
    by --allow-untested; else refused."""
    layout = Layout(layout) if isinstance(layout, str) else layout
    parallel, equal = layout.parallel, layout.equal_shares
    reason = check_layout(config, world, parallel, allow_untested=True, equal=equal)
    if reason is None:
        return
    if allow_untested:
        warn_untested(reason, console)
        return
    family = family_of(config)
    found = families.proven().get(family.name, {}).get(parallel)
    if not family.supported or (family.name in families.proven() and found != "ok"):
        check_layout(config, world, parallel, equal=equal)  # raises the recorded refusal
        return
    if layout.expert_replicas:  # the real model's (layer, expert, rank) name no tiny expert
        raise UnverifiedLayoutError(
            f"{reason}; hot-expert copies are proven for {', '.join(_replicated())} only; "
            "drop --replicate-experts, or --allow-untested to run it anyway"
        )
    verdict = _verdict(config, world, _proof_layout(config, layout), backend, console)
    if verdict != "ok":
        raise UnverifiedLayoutError(
            f"{reason}; the day-0 proof on a tiny model of this architecture found: {verdict}; "
            "use --nodes 1, or --allow-untested to run it anyway"
        )
    if console is not None:
        console.print(
            f"[green]day-0 proof:[/] {family.label} on {parallel} over {world} ranks gives "
            f"the one-rank answer on a tiny model of its architecture ({COVERS})"
        )


def _replicated() -> list[str]:
    return [f for f, layouts in families.MATRIX.items() if "ep" in layouts]


def _proof_layout(config: dict, layout: Layout) -> Layout:
    """The layout's shares as the tiny model takes them: its weights, its expert split scaled
    to the tiny model's experts."""
    from thunderpool.models import tiny
    from thunderpool.models.shape import experts

    split = layout.expert_split
    if split and len(set(split)) > 1:
        n = experts(tiny.shrink(config, layers=PROOF_LAYERS)) or len(split)
        scaled = [max(1, round(n * k / sum(split))) for k in split]
        scaled[scaled.index(max(scaled))] += n - sum(scaled)
        split = tuple(scaled)
    else:
        split = None
    weights = layout.tp_weights if not layout.equal_shares else None
    return Layout(layout.parallel, weights, expert_split=split)


def _key(config: dict, world: int, layout: Layout) -> str:
    import mlx_lm

    shares = ""
    if layout.tp_weights:
        shares += " weights " + ",".join(f"{w:g}" for w in layout.tp_weights)
    if layout.expert_split:
        shares += " experts " + ",".join(map(str, layout.expert_split))
    name = family_of(config).name
    return f"{name}|{layout.parallel}{shares}|{world}|mlx-lm {mlx_lm.__version__}"


def _store() -> Path:
    return state_dir() / "proofs.json"


def _verdict(config: dict, world: int, layout: Layout, backend: str, console) -> str:
    store = _store()
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    key = _key(config, world, layout)
    if key in known:
        return known[key]
    if console is not None:
        console.print(f"day-0 proof: {key} (a family this release never saw) ...")
    verdict = prove(config, world, layout, backend)
    known[key] = verdict
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps(known, indent=1))
    return verdict


def prove(config: dict, world: int, layout: Layout | str, backend: str = "ring") -> str:
    """"ok" where the tiny model of `config` decodes alike on one rank and on the layout,
    else what differs or failed."""
    layout = Layout(layout) if isinstance(layout, str) else layout
    from thunderpool.models import tiny
    from thunderpool.models.checkpoint import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="thunderpool-proof-") as tmp:
        folder = Path(tmp)
        try:
            write_checkpoint(tiny.shrink(config, layers=PROOF_LAYERS), folder / "model")
            one = _trace(folder, 1, Layout(), backend)
            got = _trace(folder, world, layout, backend)
        except ThunderpoolError as e:
            return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    if not np.array_equal(one["tokens"], got["tokens"]):
        return "greedy tokens differ from one rank's"
    diff = float(np.max(np.abs(one["logits"] - got["logits"])))
    return "ok" if diff <= TOL else f"logits differ from one rank's by {diff:.2g} (> {TOL})"


def _trace(folder: Path, world: int, layout: Layout, backend: str) -> dict:
    from thunderpool.engine.job import RankJob, TraceTask
    from thunderpool.launch.mpi import local_instance

    out = folder / f"{layout.parallel}{world}.npz"
    task = TraceTask(prompts=PROMPTS, max_tokens=STEPS, out=str(out))
    job = RankJob(
        model_dir=str(folder / "model"),
        world_size=world,
        layout=layout,
        task=task,
        backend=backend if world > 1 else "ring",
        prefill_chunk=16,
    )
    with local_instance(job, timeout=PROOF_S) as instance:
        for _ in instance.events():
            pass
    data = np.load(out)
    return {"tokens": data["tokens"], "logits": data["logits"]}
