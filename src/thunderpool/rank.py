"""A rank process: `python -m thunderpool.rank JOB.json`, started by the launcher.

Events for the launcher go to stdout as `TPEV {json}` lines; logs and errors go to stderr.
A failure exits non-zero so that the launcher stops every other rank of the instance. This is
the one place that picks the task's code, so the engine imports neither serving nor bench.
"""

from __future__ import annotations

import sys

import thunderpool

if __name__ == "__main__":
    thunderpool.hide_torch()

import json
import os
import traceback
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from thunderpool.config import lifeline_fd
from thunderpool.engine.job import EVENT_PREFIX, BenchTask, RankJob, ServeTask
from thunderpool.errors import ThunderpoolError
from thunderpool.launch.lifeline import hold


def emit(kind: str, **fields) -> None:
    print(EVENT_PREFIX + json.dumps({"kind": kind, **fields}), flush=True)


def load_progress(rank: int):
    """Report each rank's loading to the launcher, which draws one progress bar."""
    return lambda fraction: emit("progress", rank=rank, fraction=round(fraction, 3))


def runtime(job: RankJob) -> dict:
    """What this rank runs on, for /v1/cluster and serve's startup lines: its BLAS (the
    preloaded fast one, or the wheel's slow reference one) and its collective backend."""
    from thunderpool.engine.blas import in_use

    return {**in_use(), "backend": job.backend if job.mlx_world() > 1 else None}


def run(job: RankJob) -> None:
    from thunderpool.cluster.node.metal import raise_wired_limit

    raise_wired_limit()  # on Metal: keep the shard wired, as mlx-lm does (no-op elsewhere)
    world = job.mlx_world()
    if world > 1:
        group = mx.distributed.init(backend=job.backend, strict=True)
    else:
        group = mx.distributed.init()
    if group.size() != world:
        raise ThunderpoolError(f"MLX formed a group of {group.size()}, expected {world}")
    emit("runtime", **runtime(job))
    # An MTP draft reads every prefill position's hidden state (engine/mtp.py).
    layout = replace(job.layout, every_position=job.draft_model == "mtp")
    # Hybrid: events name the global rank (stage by stage), as the launcher counts them.
    progress = load_progress(group.rank() + sum((layout.groups or ())[: layout.stage]))
    match job.task:
        case ServeTask() as task:
            from thunderpool.engine.serve import serve

            serve(job, task, group, layout, emit, progress)
        case BenchTask() as task:
            from thunderpool.bench.engine_bench import bench_leader
            from thunderpool.bench.speculative import bench_spec_leader
            from thunderpool.engine import oneshot

            def lead(engine) -> None:
                if engine.executor.drafter is not None:
                    bench_spec_leader(engine, task, emit)
                else:
                    bench_leader(engine, task, group, emit, Path(job.model_dir))

            oneshot.run(job, group, layout, emit, progress, lead)
        case _:
            from thunderpool.engine import oneshot

            oneshot.run(job, group, layout, emit, progress)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    hold(lifeline_fd())  # die with the launcher, on every OS
    try:
        job = RankJob.model_validate_json(Path(argv[0]).read_text())
        run(job)
        return 0
    except ThunderpoolError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    code = main()
    if code:
        # A failed rank leaves at once: a normal exit runs MPI_Finalize, which under mpirun waits
        # for peers that wait in a collective for us, so the run hung until its silence timeout.
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
