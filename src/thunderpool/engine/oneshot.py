"""One-shot jobs on a loaded instance (generate, trace, bench): the leader runs the engine, the
other ranks follow its plans. The rank process (thunderpool/rank.py) calls `run`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from thunderpool.engine.control import control_for
from thunderpool.engine.draft_load import drafter_for
from thunderpool.engine.engine import Engine, follow
from thunderpool.engine.job import GenerateTask, RankJob, TraceTask
from thunderpool.engine.loader import Layout, load_shard, peak_rss_bytes
from thunderpool.engine.prefix import kv_bytes_per_token
from thunderpool.engine.sequence import TextEdge
from thunderpool.engine.speculate import spec_fields

NO_CONTEXT_LIMIT = 1 << 62  # generate, trace and bench stop at max_tokens only
Emit = Callable[..., None]


def run(
    job: RankJob,
    group: mx.distributed.Group,
    layout: Layout,
    emit: Emit,
    progress: Callable[[float], None],
    lead: Callable[[Engine], None] | None = None,
) -> None:
    """Load this rank's shard, then lead (generate, trace, or `lead` for other tasks) or follow."""
    runner, config, stats = load_shard(Path(job.model_dir), group, layout, progress)
    emit("loaded", **stats.as_event())
    control = control_for(runner)
    drafter = drafter_for(job, runner, control, layout)  # every rank: may be sharded
    if not runner.is_leader:
        follow(runner, control, drafter)
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
            drafter=drafter,
        )
        try:
            match job.task:
                case GenerateTask() as task:
                    kv = {
                        "kv_bytes_per_token": kv_bytes_per_token(
                            config, job.layout.kv_bits, job.layout.kv_group_size
                        ),
                        "kv_bits": job.layout.kv_bits,
                    }
                    _generate(engine, tokenizer, task, emit, kv)
                case TraceTask() as task:
                    _trace(engine, task, emit)
                case _:
                    assert lead is not None, f"no leader for {type(job.task).__name__}"
                    lead(engine)
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


def _generate(engine: Engine, tokenizer, task: GenerateTask, emit: Emit, kv: dict) -> None:
    """`kv`: the KV cache's bytes per context token over all ranks and its bits, for the
    summary."""
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
        **kv,
        **spec_fields(engine),
    )


def _trace(engine: Engine, task: TraceTask, emit: Emit) -> None:
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
    emit("done", out=task.out, **spec_fields(engine))
