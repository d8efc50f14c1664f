"""What the API sees of each request: latency histograms fed from the engine's timing, and one
access-log line per request.

Timings come with the deltas (measured on the leader, engine/sequence.py), not from this
process's clock: a non-streamed answer's deltas are held back until its end (gateway.py), so
timing them here would make every TTFT equal the whole request. Every endpoint's generation
goes through `RecordingEngine`, so an endpoint needs nothing of its own to be counted.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from thunderpool.api.metrics import Histogram
from thunderpool.api.sse import close_quietly
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.service import Delta, EngineClient

access_log = logging.getLogger("thunderpool.access")

# Bucket bounds in seconds: a 135M model on a laptop and a 235B one over Thunderbolt both fit.
TTFT_BOUNDS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BOUNDS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)
LATENCY_BOUNDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BOUNDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)


class Latencies:
    """The four request-latency histograms /metrics exports."""

    def __init__(self) -> None:
        self.ttft = Histogram(
            "time_to_first_token_seconds",
            "From submit to the first token, on the leader.",
            TTFT_BOUNDS,
        )
        self.itl = Histogram(
            "inter_token_latency_seconds",
            "Gap between consecutive tokens of a request.",
            ITL_BOUNDS,
        )
        self.e2e = Histogram(
            "request_latency_seconds",
            "From submit to the last token of a request that finished.",
            LATENCY_BOUNDS,
        )
        self.queue = Histogram(
            "queue_time_seconds",
            "From submit to the first step that prefills the request.",
            QUEUE_BOUNDS,
        )

    def all(self) -> tuple[Histogram, ...]:
        return (self.ttft, self.itl, self.e2e, self.queue)

    def observe(self, d: Delta) -> None:
        for value, h in (
            (d.queued_s, self.queue),
            (d.ttft_s, self.ttft),
            (d.gap_s, self.itl),
            (d.elapsed_s, self.e2e),
        ):
            if value is not None:
                h.observe(value)


@dataclass(slots=True)
class Record:
    """One HTTP request as its access-log line tells it; generation fills in the tokens."""

    status: int | None = None
    generated: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    finish: str | None = None
    prompt: str | None = None  # only with --log-prompts


# The request being served; the middleware sets it, generation (any endpoint) fills it in.
CURRENT: contextvars.ContextVar[Record | None] = contextvars.ContextVar("record", default=None)


class RecordingEngine:
    """An EngineClient that counts each generation into `latencies` and the current Record;
    everything else is the wrapped engine's (read through, so a gateway's `info` stays live)."""

    def __init__(self, engine: EngineClient, latencies: Latencies, log_prompts: bool = False):
        self._engine, self.latencies, self.log_prompts = engine, latencies, log_prompts

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def generate(
        self, prompt: list[int], params: SamplingParams, *, replayable: bool = False
    ) -> AsyncIterator[Delta]:
        # Several generations for one request (n > 1, say) add up in its record.
        record = CURRENT.get() or Record()
        record.generated = True
        record.prompt_tokens += len(prompt)
        if self.log_prompts:
            record.prompt = (record.prompt or "") + self._engine.tokenizer.decode(prompt)
        deltas = self._engine.generate(prompt, params, replayable=replayable)
        tokens = 0  # the engine's count comes with the last delta; a cut-off stream has none
        try:
            async for d in deltas:
                self.latencies.observe(d)
                tokens += len(d.tokens)
                if d.ttft_s is not None and record.ttft_s is None:
                    record.ttft_s = d.ttft_s
                if d.finish_reason is not None:
                    tokens = d.completion_tokens
                    record.finish = record.finish or d.finish_reason
                yield d
        finally:
            record.completion_tokens += tokens
            await close_quietly(deltas)


# Dashboard polls and static files: logged at DEBUG unless they fail.
QUIET_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class AccessLog:
    """ASGI middleware: one line per request on the `thunderpool.access` logger, after its
    last byte. The query string is never logged (the dashboard's ?key= would leak)."""

    def __init__(self, app: ASGIApp, clock: Callable[[], float] = time.perf_counter):
        self.app, self.clock = app, clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record, start = Record(), self.clock()
        token = CURRENT.set(record)

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            CURRENT.reset(token)
            status = record.status or 500
            quiet = scope["method"] in QUIET_METHODS and not record.generated and status < 400
            level = logging.DEBUG if quiet else logging.INFO
            if access_log.isEnabledFor(level):
                duration = self.clock() - start
                access_log.log(level, access_line(scope, status, record, duration))


def access_line(scope: Scope, status: int, r: Record, duration_s: float) -> str:
    """`POST /v1/chat/completions 200 prompt_tokens=37 completion_tokens=16 ttft_s=0.412
    finish=stop duration_s=1.203`, then `prompt="..."` with --log-prompts."""
    parts = [scope["method"], scope["path"], str(status)]
    if r.generated:
        ttft = "-" if r.ttft_s is None else f"{r.ttft_s:.3f}"
        parts += [
            f"prompt_tokens={r.prompt_tokens}",
            f"completion_tokens={r.completion_tokens}",
            f"ttft_s={ttft}",
            f"finish={r.finish or '-'}",
        ]
    parts.append(f"duration_s={duration_s:.3f}")
    if r.prompt is not None:
        parts.append(f"prompt={json.dumps(r.prompt, ensure_ascii=False)}")
    return " ".join(parts)
