"""A real EngineClient in the test process: a model dir on one rank, the engine's thread
running its steps, the HTTP app in front (no serve process, no link)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import mlx.core as mx
from mlx_lm.utils import load_tokenizer

from thunderpool.engine.control import Control
from thunderpool.engine.engine import Engine
from thunderpool.engine.loader import Layout, load_shard
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.sequence import TextRequests
from thunderpool.engine.service import Delta, EngineInfo, EngineStatus

MODEL = "SmolLM2-135M-Instruct-f32"  # what the tests ask for


class LocalEngine:
    def __init__(self, source, max_batch: int = 8, max_context: int = 2048):
        group = mx.distributed.init()
        self.runner, config, _ = load_shard(source, group, Layout())
        self.tokenizer = load_tokenizer(source, eos_token_ids=config.get("eos_token_id"))
        self.engine = Engine(
            self.runner,
            Control(group),
            max_batch=max_batch,
            max_context=max_context,
            eos=set(self.tokenizer.eos_token_ids),
            tokenizer=self.tokenizer,
        )
        self.requests = TextRequests(self.engine, self.tokenizer)
        self.info = EngineInfo(model=MODEL, max_context=max_context)
        self.thread = threading.Thread(target=self.engine.run, daemon=True)
        self.thread.start()

    def status(self) -> EngineStatus:
        return EngineStatus("ready", 1.0)

    def metrics(self) -> dict[str, float]:
        return {}

    def generate(
        self, prompt: list[int], params: SamplingParams, *, replayable: bool = False
    ) -> AsyncIterator[Delta]:
        return self._deltas(prompt, params)

    async def _deltas(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[Delta]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        sid = self.requests.submit(
            prompt, params, lambda d: loop.call_soon_threadsafe(queue.put_nowait, d)
        )
        try:
            while True:
                d = await queue.get()
                yield d
                if d.finish_reason is not None:
                    return
        finally:
            self.requests.cancel(sid)

    def close(self) -> None:
        self.engine.stop()
        self.thread.join(timeout=60)
