"""The API's handle on the leader's scheduler: asyncio on one side, the MLX thread on the other.

Deltas cross from the scheduler thread to the event loop with call_soon_threadsafe; closing a
request's async iterator cancels it, so a client that disconnects leaves the batch next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.scheduler import Scheduler
from thunderpool.engine.service import Delta, EngineInfo, EngineStatus


class SchedulerClient:
    """Implements engine.service.EngineClient for a Scheduler in this process."""

    def __init__(self, info: EngineInfo, tokenizer: Any):
        self.info, self.tokenizer = info, tokenizer
        self.scheduler: Scheduler | None = None
        self.progress = 0.0
        self.failed: str | None = None
        self.rank_memory: dict[int, float] = {}

    def attach(self, scheduler: Scheduler) -> None:
        """The model is loaded: start accepting requests."""
        self.scheduler = scheduler
        self.progress = 1.0

    def status(self) -> EngineStatus:
        if self.failed:
            return EngineStatus("failed", self.progress, self.failed)
        if self.scheduler is None:
            return EngineStatus("loading", self.progress, "loading model shards")
        return EngineStatus("ready", 1.0)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {f"rank{r}_memory_bytes": b for r, b in self.rank_memory.items()}
        s = self.scheduler
        if s is None:
            return out
        c = s.counters
        return out | {
            "requests_total": c.requests_total,
            "tokens_generated_total": c.tokens_generated_total,
            "prompt_tokens_total": c.prompt_tokens_total,
            "ttft_seconds": c.ttft_seconds,
            "decode_tokens_per_second": c.decode_tps(),
            "queue_depth": s.queue_depth,
            "active_requests": len(s.active) + (1 if s.prefilling else 0),
        }

    async def generate(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[Delta]:
        if self.scheduler is None:
            raise RuntimeError("the engine is not ready")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        sid = self.scheduler.submit(
            prompt, params, lambda d: loop.call_soon_threadsafe(queue.put_nowait, d)
        )
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:
                self.scheduler.cancel(sid)
