"""A rank of a serving instance: the leader runs the engine, the others follow.

The HTTP API lives in the serve process (serving/gateway.py), which outlives any rank: the
leader takes requests from it over the engine link and streams deltas back.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from thunderpool.config import link_token_from_env
from thunderpool.engine.control import control_for
from thunderpool.engine.draft_load import drafter_for
from thunderpool.engine.engine import Engine, follow
from thunderpool.engine.job import RankJob, ServeTask
from thunderpool.engine.loader import Layout, load_shard, on_metal, peak_rss_bytes
from thunderpool.engine.speculate import spec_metrics
from thunderpool.errors import LaunchError


def gather(group: mx.distributed.Group, values: list[float]) -> np.ndarray:
    """Every rank's `values` as a (ranks, len(values)) array, on every rank."""
    n, rank = group.size(), group.rank()
    mine = np.zeros((n, len(values)), dtype=np.float32)
    mine[rank] = values
    if n == 1:
        return mine
    return np.array(mx.distributed.all_sum(mx.array(mine), group=group, stream=mx.cpu))


def serve(
    job: RankJob,
    task: ServeTask,
    group: mx.distributed.Group,
    layout: Layout,
    emit: Callable[..., None],
    progress: Callable[[float], None],
) -> None:
    token = link_token_from_env()
    if group.rank() == 0 and job.layout.stage == 0 and not token:  # hybrid: stage 0 leads
        raise LaunchError("no engine-link token in the environment; start ranks with `serve`")
    runner, config, stats = load_shard(Path(job.model_dir), group, layout, progress)
    emit("loaded", **stats.as_event())
    report_memory(emit)
    memory = gather(group, [stats.param_bytes, peak_rss_bytes()])
    control = control_for(runner)
    drafter = drafter_for(job, runner, control, layout)  # every rank: may be sharded
    # The loaded modules' ~330K objects move out of the collector's reach: a full collection of
    # them takes 0.15 s, a stall of every rank's step whenever one comes mid-stream.
    gc.collect()
    gc.freeze()
    if not runner.is_leader:
        follow(runner, control, drafter)
        return
    from mlx_lm.utils import load_tokenizer

    from thunderpool.engine.link import LeaderServer
    from thunderpool.engine.prefix import budget_tokens
    from thunderpool.engine.sequence import Counters, TextRequests

    tokenizer = load_tokenizer(Path(job.model_dir), eos_token_ids=config.get("eos_token_id"))
    limit = config.get("max_position_embeddings") or 4096
    max_context = min(task.max_context or limit, limit)
    engine = Engine(
        runner,
        control,
        prefill_chunk=job.prefill_chunk,
        max_batch=task.max_batch,
        max_context=max_context,
        eos=set(tokenizer.eos_token_ids or []),
        tokenizer=tokenizer,
        drafter=drafter,
        prefix_cache_tokens=budget_tokens(
            task.prefix_cache_bytes, config, job.layout.kv_bits, job.layout.kv_group_size
        ),
    )
    warm_up(engine, tokenizer, max_context, task.max_batch)
    counters = Counters()
    loaded_memory = {f"rank{r}_memory_bytes": float(rss) for r, (_, rss) in enumerate(memory)}

    def metrics() -> dict[str, float]:
        c = counters
        return loaded_memory | {
            "requests_total": c.requests_total,
            "tokens_generated_total": c.tokens_generated_total,
            "prompt_tokens_total": c.prompt_tokens_total,
            "prefix_cache_hit_tokens_total": c.prefix_cache_hit_tokens_total,
            "ttft_seconds": c.ttft_seconds,
            "decode_tokens_per_second": c.decode_tps(),
            "queue_depth": engine.queue_depth,
            "active_requests": engine.scheduler.running,
            "wake_seconds": engine.wake_s,
            "leader_mlx_active_bytes": mx.get_active_memory(),
            "leader_rss_bytes": current_rss_bytes(),
            "leader_time": time.time(),
            **spec_metrics(engine),
        }

    requests = TextRequests(engine, tokenizer, counters)
    server = LeaderServer(task.link_host, token, requests, max_context, metrics).start()
    emit("ready", link_port=server.port)
    try:
        engine.run()
    finally:
        server.shutdown()


WARM_UP_PROMPT = "Count from one to twenty:"
WARM_UP_TOKENS = 10
WARM_UP_ROWS = 3  # the embedded model built new kernels for batches of 2 and of 3 rows


def warm_up(engine: Engine, tokenizer, max_context: int, max_batch: int) -> None:
    """Short greedy answers before the instance says ready: batches of 3, 2 and 1 rows, as their
    rows leave one by one. A batch's first decode steps trace its compiled step and, on the CPU,
    have the C++ compiler build its fused kernels: 4.7 s on a cold 2-core machine for one row,
    2.6-2.8 s more for 2 and for 3, a stall in a user's stream otherwise."""
    from thunderpool.engine.sampling import SamplingParams
    from thunderpool.engine.speculate import SpecStats

    prompt = tokenizer.encode(WARM_UP_PROMPT)
    longest = min(WARM_UP_TOKENS, max_context - len(prompt) - 1)
    if longest < 1:
        return
    for row in range(max(1, min(WARM_UP_ROWS, max_batch))):
        params = SamplingParams(max_tokens=max(1, longest - 3 * row))
        engine.submit(prompt, params, lambda _: None)
    while engine.step():
        pass
    if getattr(engine.executor, "spec_stats", None) is not None:
        engine.executor.spec_stats = SpecStats()  # /metrics counts users' tokens only


def current_rss_bytes() -> float:
    """This process's resident memory now (Linux /proc; on Metal, MLX's active memory; 0
    where unavailable)."""
    if on_metal():
        return float(mx.get_active_memory())
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    import os

    return float(pages * os.sysconf("SC_PAGE_SIZE"))


MEMORY_EVERY_S = 5.0


def report_memory(emit: Callable[..., None]) -> None:
    """This rank's RSS and peak for the serve process's view: now, then whenever RSS moves."""

    def report() -> float:
        rss = current_rss_bytes()
        emit("memory", rss_bytes=int(rss), peak_rss_bytes=peak_rss_bytes())
        return rss

    def watch(last: float) -> None:
        while True:
            time.sleep(MEMORY_EVERY_S)
            # Only changes are sent: an idle rank stays silent (agents keep every event).
            if abs(current_rss_bytes() - last) >= max(0.02 * last, 1 << 20):
                last = report()

    threading.Thread(target=watch, args=(report(),), name="memory", daemon=True).start()
