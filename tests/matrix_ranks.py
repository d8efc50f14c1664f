"""Rank processes that run many jobs in turn, so a matrix of (model, layout) cells pays for
starting its ranks once per world size instead of once per cell (the family matrix).

A job is a RankJob with a trace task, run through the production one-shot path (oneshot.run:
load this rank's shard, lead or follow, done), or a batch scenario (batch_ranks.run_batch).
`python matrix_ranks.py SPEC.json OUT.json`: rank 0 writes OUT.json, rank r OUT.json.r, each
job's events on that rank (its "loaded" stats; the batch scenario's result on the leader).
Its log names the job it is on, so a failure says which cell broke.
"""

from __future__ import annotations

import thunderpool

if __name__ == "__main__":  # this rank program, not a test importing it
    thunderpool.hide_torch()

import gc
import json
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from batch_ranks import run_batch, run_mpi_ranks, run_ranks

from thunderpool.engine import oneshot
from thunderpool.engine.job import RankJob, TraceTask
from thunderpool.engine.sampling import SamplingParams
from thunderpool.launch.blas import fast_blas_env


def recorder(events: list):
    """oneshot's `emit`, keeping the events instead of printing them for a launcher."""
    return lambda kind, **fields: events.append({"kind": kind, **fields})


def main(spec_path: str, out_path: str, stage: str = "0") -> None:
    spec = json.loads(Path(spec_path).read_text())
    backend = spec.get("backend", "ring")
    # Hybrid (spec["groups"]): this rank's stage is its own world, joined by hand-offs.
    groups = spec.get("groups") or [spec["nodes"]]
    world = groups[int(stage)]
    group = mx.distributed.init(backend=backend, strict=True) if world > 1 else None
    group = group or mx.distributed.init()
    results: dict[str, list] = {}
    for item in spec["jobs"]:
        print(f"job {item['id']}", file=sys.stderr, flush=True)
        events = results[item["id"]] = []
        if "batch" in item:
            events.append({"kind": "batch", "result": run_batch(item["batch"], group)})
        else:
            job = RankJob.model_validate(item["job"])
            layout = replace(job.layout, stage=int(stage), handoff=tuple(spec.get("handoff", ())))
            oneshot.run(job, group, layout, recorder(events), lambda fraction: None)
        gc.collect()  # the next job's shard replaces this one's
        gc.freeze()  # what outlived it (modules, caches) the next collect need not walk again
        mx.clear_cache()
    gc.unfreeze()  # exit as before: what the jobs left (the group among it) is freed as ever
    rank = sum(groups[: int(stage)]) + group.rank()  # the global rank
    Path(f"{out_path}.{rank}" if rank else out_path).write_text(json.dumps(results))


def run_matrix(
    jobs: list[dict],
    tmp: Path,
    nodes: int,
    timeout: float = 600,
    backend: str = "ring",
    groups: tuple[int, ...] | None = None,
) -> dict:
    """Runs `jobs` ({"id", "job": RankJob dict | "batch": batch spec}) on `nodes` ranks in one
    launch (MLX ring on loopback, or "mpi": under mpirun; hybrid `groups`: a ring world per
    stage, joined by hand-offs); returns {id: [that job's events on each rank]}."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = {"nodes": nodes, "jobs": jobs}
    if groups:
        spec["groups"] = list(groups)
    launch = run_mpi_ranks if backend == "mpi" else run_ranks
    leader = launch(spec, tmp, timeout, nodes, script=__file__, env=fast_blas_env())
    ranks = [leader] + [json.loads((tmp / f"out.json.{r}").read_text()) for r in range(1, nodes)]
    return {job["id"]: [rank[job["id"]] for rank in ranks] for job in jobs}


def trace_job(model_dir, out, nodes: int, prompts, max_tokens: int, sampling=None, **fields):
    """A job decoding `prompts`, greedily unless `sampling` says otherwise (conftest.run_trace's
    job: `fields` are RankJob's)."""
    task = TraceTask(
        prompts=tuple(map(tuple, prompts)),
        max_tokens=max_tokens,
        out=str(out),
        sampling=sampling or SamplingParams(),
    )
    job = RankJob(model_dir=str(model_dir), world_size=nodes, task=task, **fields)
    return {"job": job.model_dump()}


def launch_backend(nodes: int) -> str:
    """More ranks than CI's 2 cores run under mpirun, whose ranks yield the core while they
    wait (ring's busy-poll: ~4x slower there); ring where Open MPI is missing."""
    from thunderpool.launch.mpi import mpi_available

    return "mpi" if nodes > 2 and mpi_available() else "ring"


def run_traces(cells: dict[str, dict], tmp: Path, timeout: float = 600) -> dict[str, dict]:
    """Trace jobs ({id: trace_job's arguments but `out`}), one launch per world size (under
    launch_backend); returns {id: trace_result}."""
    tmp.mkdir(parents=True, exist_ok=True)
    results = {}
    for nodes in sorted({cell["nodes"] for cell in cells.values()}):
        ids = [i for i, cell in cells.items() if cell["nodes"] == nodes]
        jobs = [{"id": i, **trace_job(out=tmp / f"{i}.npz", **cells[i])} for i in ids]
        events = run_matrix(jobs, tmp / f"run{nodes}", nodes, timeout, launch_backend(nodes))
        results |= {i: trace_result(events[i], tmp / f"{i}.npz") for i in ids}
    return results


def trace_result(events: list[list[dict]], out) -> dict:
    """A trace job's tokens and logits, and each rank's "loaded" event in rank order."""
    loaded = [[e for e in rank if e["kind"] == "loaded"] for rank in events]
    assert [[e["rank"] for e in x] for x in loaded] == [[r] for r in range(len(events))], loaded
    data = np.load(out)
    return {"tokens": data["tokens"], "logits": data["logits"], "loaded": [x[0] for x in loaded]}


if __name__ == "__main__":
    main(*sys.argv[1:4])
