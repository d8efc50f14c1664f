"""A rank process: `python -m thunderpool.engine.worker JOB.json`, started by the launcher.

Events for the launcher go to stdout as `TPEV {json}` lines; logs and errors go to stderr.
A failure exits non-zero so that the launcher stops every other rank of the instance.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import mlx.core as mx
import numpy as np

from thunderpool.engine.control import Control
from thunderpool.engine.engine import Leader, follow
from thunderpool.engine.job import BenchTask, GenerateTask, RankJob, ServeTask, TraceTask
from thunderpool.engine.loader import Layout, load_shard, peak_rss_bytes
from thunderpool.engine.sampling import SamplingParams
from thunderpool.errors import ThunderpoolError

EVENT_PREFIX = "TPEV "


def emit(kind: str, **fields) -> None:
    print(EVENT_PREFIX + json.dumps({"kind": kind, **fields}), flush=True)


def load_progress(rank: int):
    """Report each rank's loading to the launcher, which draws one progress bar."""
    return lambda fraction: emit("progress", rank=rank, fraction=round(fraction, 3))


def run(job: RankJob) -> None:
    if job.world_size > 1:
        group = mx.distributed.init(backend=job.backend, strict=True)
    else:
        group = mx.distributed.init()
    if group.size() != job.world_size:
        raise ThunderpoolError(f"MLX formed a group of {group.size()}, expected {job.world_size}")
    layout = Layout(job.parallel, job.tp_weights, job.layer_split)
    if isinstance(job.task, ServeTask):
        from thunderpool.engine.serve import serve

        return serve(job, job.task, group, layout, emit)
    runner, config, stats = load_shard(
        Path(job.model_dir), group, layout, load_progress(group.rank())
    )
    emit("loaded", **stats.as_event())
    control = Control(group)
    if not runner.is_leader:
        follow(runner, control)
    else:
        leader = Leader(runner, control, job.prefill_chunk)
        try:
            match job.task:
                case GenerateTask() as task:
                    _generate(leader, job, task)
                case TraceTask() as task:
                    _trace(leader, task)
                case BenchTask() as task:
                    from thunderpool.bench.engine_bench import bench_leader

                    bench_leader(leader, task, group, emit)
        finally:
            leader.shutdown()
    emit(
        "rank_done",
        rank=group.rank(),
        peak_rss_bytes=peak_rss_bytes(),
        peak_mlx_bytes=mx.get_peak_memory(),
    )


def _generate(leader: Leader, job: RankJob, task: GenerateTask) -> None:
    from mlx_lm.utils import load_tokenizer

    from thunderpool.engine.loader import read_config

    model_dir = Path(job.model_dir)
    config = read_config(model_dir)
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    if task.chat and tokenizer.chat_template:
        messages = [{"role": "user", "content": task.prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    else:
        prompt = tokenizer.encode(task.prompt)
    params = SamplingParams(**task.sampling.model_dump())
    for delta in leader.generate_text(list(prompt), params, tokenizer):
        emit("text", text=delta)
    emit("done", **leader.stats.as_dict())


def _trace(leader: Leader, task: TraceTask) -> None:
    fields = task.sampling.model_dump() | {"max_tokens": task.max_tokens}
    params = SamplingParams(**fields)
    tokens, logits = [], []
    for prompt in task.prompts:
        steps = list(leader.generate_ids(list(prompt), params, keep_logits=task.keep_logits))
        tokens.append([s.token for s in steps])
        if task.keep_logits:
            logits.append(np.stack([np.array(s.logits[0].astype(mx.float32)) for s in steps]))
    arrays = {"tokens": np.array(tokens, dtype=np.int64)}
    if task.keep_logits:
        arrays["logits"] = np.stack(logits)
    np.savez(task.out, **arrays)
    emit("done", out=task.out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
        time.sleep(0)


if __name__ == "__main__":
    sys.exit(main())
