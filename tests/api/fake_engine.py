"""A fake EngineClient for the API tests: a character tokenizer and scripted deltas.

The prompt's text picks the script: "forever" streams until closed, "explode" raises after
one delta, "fail" ends with an error delta; anything else answers "Hello world". "forever" is
not a generator but an iterator that only `aclose()` ends, so the API must close it itself.
"Hello world" carries the leader's timing as TIMING says (queue, TTFT, gap, elapsed).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.service import Delta, EngineInfo, EngineStatus

MODEL = "fake-model"
CLUSTER = {
    "nodes": [{"name": "a", "memory_bytes": 1024}, {"name": "b", "memory_bytes": 2048}],
    "links": [{"a": "a", "b": "b", "latency_us": 12.5, "rdma": False}],
    "placement": {"tp": 2, "pp": 1},
}
METRICS = {
    "requests_total": 7,
    "tokens_generated_total": 123,
    "prompt_tokens_total": 456,
    "ttft_seconds": 0.25,
    "decode_tokens_per_second": 41.5,
    "queue_depth": 2,
    "active_requests": 3,
    "rank0_memory_bytes": 1000,
    "rank1_memory_bytes": 2000,
}
# What the "Hello world" deltas report: queued 3 ms, first token at 0.3 s, the next 40 ms on.
TIMING = {"queued_s": 0.003, "ttft_s": 0.3, "gap_s": 0.04, "elapsed_s": 0.34}


class CharTokenizer:
    """One token per character; the chat template tags each message with its role."""

    chat_template = "<role>content\\n ... <assistant>"
    eos_token_ids = {0}

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


def chat_text(*messages: tuple[str, str]) -> str:
    """What CharTokenizer's template makes of (role, content) pairs."""
    return "".join(f"<{r}>{c}\n" for r, c in messages) + "<assistant>"


class FakeEngine:
    def __init__(self, max_context: int = 256):
        self.info = EngineInfo(model=MODEL, max_context=max_context, created=1700000000)
        self.info.cluster.update(CLUSTER)
        self.tokenizer = CharTokenizer()
        self.state = EngineStatus("ready", 1.0)
        self.calls: list[tuple[list[int], SamplingParams]] = []
        # Set from the event loop's thread, waited on from the test's.
        self.cancelled = threading.Event()
        self.started = threading.Event()

    def status(self) -> EngineStatus:
        return self.state

    def metrics(self) -> dict[str, float]:
        return dict(METRICS)

    def generate(
        self, prompt: list[int], params: SamplingParams, *, replayable: bool = False
    ) -> AsyncIterator[Delta]:
        self.calls.append((prompt, params))
        if "forever" in self.tokenizer.decode(prompt):
            return Ticker(self)
        return self._script(prompt, params)

    async def _script(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[Delta]:
        text = self.tokenizer.decode(prompt)
        finished = False
        try:
            if "explode" in text:
                yield Delta("Hello")
                raise RuntimeError("rank 1 lost its link")
            if "fail" in text:
                finished = True
                yield Delta("", "error", len(prompt), 0, error="out of KV cache")
                return
            words = ["Hello", " world"][: params.max_tokens]
            first = {"queued_s": TIMING["queued_s"], "ttft_s": TIMING["ttft_s"]}
            for i, w in enumerate(words):
                yield Delta(w, tokens=(i + 1,), **(first if i == 0 else {"gap_s": TIMING["gap_s"]}))
            finished = True
            reason = "stop" if len(words) == 2 else "length"
            yield Delta("", reason, len(prompt), len(words), elapsed_s=TIMING["elapsed_s"])
        finally:
            if not finished:
                self.cancelled.set()


class Ticker:
    """Yields "tick " every 10 ms until `aclose()`; a cancelled `__anext__` records nothing."""

    def __init__(self, engine: FakeEngine):
        self.engine = engine

    def __aiter__(self) -> Ticker:
        return self

    async def __anext__(self) -> Delta:
        self.engine.started.set()
        await asyncio.sleep(0.01)
        return Delta("tick ")

    async def aclose(self) -> None:
        self.engine.cancelled.set()
