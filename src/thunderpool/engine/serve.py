"""A rank of a serving instance: the leader runs the HTTP API and the scheduler, others follow.

The leader opens the API before loading, so /health reports load progress; requests are
accepted once every rank has its shard.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from thunderpool.engine.control import Control
from thunderpool.engine.engine import follow
from thunderpool.engine.job import RankJob, ServeTask
from thunderpool.engine.loader import Layout, describe_layout, load_shard, peak_rss_bytes
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
) -> None:
    model_dir = Path(job.model_dir)
    client = _start_api(job, task, emit) if group.rank() == 0 else None
    from thunderpool.engine.worker import load_progress

    report = load_progress(group.rank())

    def progress(fraction: float) -> None:
        report(fraction)
        if client is not None:
            client.progress = fraction

    try:
        runner, config, stats = load_shard(model_dir, group, layout, progress)
    except Exception as e:
        if client is not None:
            client.failed = str(e)
        raise
    emit("loaded", **stats.as_event())
    memory = gather(group, [stats.param_bytes, peak_rss_bytes()])
    control = Control(group)
    if client is None:
        follow(runner, control)
        return
    from thunderpool.engine.scheduler import Scheduler

    client.rank_memory = {r: float(rss) for r, (_, rss) in enumerate(memory)}
    client.info.cluster.update(
        _cluster_info(task.model_name, config, layout, group.size(), memory, stats.method)
    )
    scheduler = Scheduler(
        runner,
        control,
        client.tokenizer,
        prefill_chunk=job.prefill_chunk,
        max_batch=task.max_batch,
        max_context=client.info.max_context,
    )
    client.attach(scheduler)
    emit("ready")
    scheduler.run()


def _start_api(job: RankJob, task: ServeTask, emit: Callable[..., None]):
    import uvicorn
    from mlx_lm.utils import load_tokenizer

    from thunderpool.api.dashboard import mount_dashboard
    from thunderpool.api.routes import create_app
    from thunderpool.engine.client import SchedulerClient
    from thunderpool.engine.loader import read_config
    from thunderpool.engine.service import EngineInfo

    model_dir = Path(job.model_dir)
    config = read_config(model_dir)
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    limit = config.get("max_position_embeddings") or 4096
    max_context = min(task.max_context or limit, limit)
    info = EngineInfo(task.model_name, max_context, int(time.time()), {"model": task.model_name})
    client = SchedulerClient(info, tokenizer)
    app = create_app(client, api_key=task.api_key)
    mount_dashboard(app)
    server = uvicorn.Server(
        uvicorn.Config(app, host=task.host, port=task.port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, name="api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise LaunchError(
                f"cannot listen on {task.host}:{task.port} (in use or not an address of this "
                "host); pass another --port or --host"
            )
        time.sleep(0.02)
    emit("listening", url=f"http://{task.host}:{task.port}")
    return client


def _cluster_info(
    model: str, config: dict, layout: Layout, world: int, memory: np.ndarray, method: str
) -> dict:
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    nodes = [
        {
            "name": f"rank{r}",
            "rank": r,
            "host": "127.0.0.1",
            "memory_total_bytes": total,
            "memory_used_bytes": float(rss),
            "param_bytes": float(params),
            "peak_rss_bytes": float(rss),
            "speed": {"mem_bw_gbps": None},
        }
        for r, (params, rss) in enumerate(memory)
    ]
    links = [
        {
            "a": f"rank{r}",
            "b": f"rank{(r + 1) % world}",
            "latency_ms": None,
            "bandwidth_gbps": None,
            "kind": "loopback",
        }
        for r in range(world if world > 1 else 0)
    ]
    placement = describe_layout(config, layout, world) | {"method": method}
    return {"model": model, "nodes": nodes, "links": links, "placement": placement}
