"""A rank process: `python -m thunderpool.engine.worker JOB.json`, started by the launcher.

Events for the launcher go to stdout as `TPEV {json}` lines; logs and errors go to stderr.
A failure exits non-zero so that the launcher stops every other rank of the instance.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from thunderpool.engine.control import Control
from thunderpool.engine.engine import Engine, follow
from thunderpool.engine.job import BenchTask, GenerateTask, RankJob, ServeTask, TraceTask
from thunderpool.engine.loader import Layout, load_shard, peak_rss_bytes
from thunderpool.engine.sequence import TextEdge
from thunderpool.errors import ThunderpoolError

EVENT_PREFIX = "TPEV "
NO_CONTEXT_LIMIT = 1 << 62  # generate, trace and bench stop at max_tokens only


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

        return serve(job, job.task, group, layout, emit, load_progress(group.rank()))
    runner, config, stats = load_shard(
        Path(job.model_dir), group, layout, load_progress(group.rank())
    )
    emit("loaded", **stats.as_event())
    control = Control(group)
    if not runner.is_leader:
        follow(runner, control)
    else:
        eos = set()
        if isinstance(job.task, GenerateTask):
            tokenizer = _tokenizer(job)
            eos = set(tokenizer.eos_token_ids or [])
        engine = Engine(
            runner,
            control,
            prefill_chunk=job.prefill_chunk,
            max_context=NO_CONTEXT_LIMIT,
            eos=eos,
        )
        try:
            match job.task:
                case GenerateTask() as task:
                    _generate(engine, tokenizer, task)
                case TraceTask() as task:
                    _trace(engine, task)
                case BenchTask() as task:
                    from thunderpool.bench.engine_bench import bench_leader

                    bench_leader(engine, task, group, emit)
        finally:
            engine.shutdown()
    emit(
        "rank_done",
        rank=group.rank(),
        peak_rss_bytes=peak_rss_bytes(),
        peak_mlx_bytes=mx.get_peak_memory(),
    )


def _tokenizer(job: RankJob):
    from mlx_lm.utils import load_tokenizer

    from thunderpool.engine.loader import read_config

    config = read_config(Path(job.model_dir))
    return load_tokenizer(Path(job.model_dir), eos_token_ids=config.get("eos_token_id"))


def _generate(engine: Engine, tokenizer, task: GenerateTask) -> None:
    if task.chat and tokenizer.chat_template:
        messages = [{"role": "user", "content": task.prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    else:
        prompt = tokenizer.encode(task.prompt)
    params = task.sampling
    last = []

    def on_delta(d) -> None:
        if d.text:
            emit("text", text=d.text)
        if d.finish_reason:
            last.append(d)

    edge = TextEdge(tokenizer, params, on_delta, engine.cancel)
    engine.generate(list(prompt), params, edge)
    end, ttft = last[0], edge.first_at - edge.submitted
    decode_s = edge.last_at - edge.first_at
    steps = end.completion_tokens - 1
    emit(
        "done",
        prompt_tokens=end.prompt_tokens,
        generated_tokens=end.completion_tokens,
        ttft_s=ttft,
        prefill_tps=end.prompt_tokens / ttft if ttft else 0.0,
        decode_tps=steps / decode_s if steps > 0 and decode_s else 0.0,
        finish_reason=end.finish_reason,
    )


def _trace(engine: Engine, task: TraceTask) -> None:
    params = replace(task.sampling, max_tokens=task.max_tokens)
    tokens, logits = [], []
    for prompt in task.prompts:
        mine, rows = [], []
        if task.keep_logits:
            engine.executor.on_logits = lambda sids, out, rows=rows: rows.append(
                np.array(out[0].astype(mx.float32))
            )
        engine.generate(list(prompt), params, lambda ev, mine=mine: mine.append(ev.token))
        tokens.append(mine)
        if task.keep_logits:
            logits.append(np.stack(rows))
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
