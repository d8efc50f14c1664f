"""The edge that streams text, for serve and generate alike: a request's token events become
Deltas (detokenized as tokens arrive, held back and cut at stop strings) and counters."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.scheduler import Emitted
from thunderpool.engine.service import Delta


@dataclass
class Counters:
    requests_total: int = 0
    prompt_tokens_total: int = 0
    # The prompt tokens the prefix cache reused; the hit rate is this / prompt_tokens_total.
    prefix_cache_hit_tokens_total: int = 0
    tokens_generated_total: int = 0
    ttft_seconds: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=1024))  # (time, tokens)

    def decode_tps(self, window: float = 5.0) -> float:
        now = time.perf_counter()
        steps = [(t, n) for t, n in self.recent if now - t <= window]
        if len(steps) < 2:
            return 0.0
        return sum(n for _, n in steps[1:]) / max(steps[-1][0] - steps[0][0], 1e-9)


class TextRequests:
    """An engine (engine.py) behind the text edge: `submit(prompt, params, emit)` streams
    Deltas to `emit`; what the engine link (link_server.py) and the tests drive."""

    def __init__(self, engine, tokenizer, counters: Counters | None = None):
        self.engine, self.tokenizer, self.counters = engine, tokenizer, counters

    def submit(self, prompt: list[int], params: SamplingParams, emit: Callable[[Delta], None]):
        edge = TextEdge(self.tokenizer, params, emit, self.engine.cancel, self.counters)
        return self.engine.submit(prompt, params, edge)

    def cancel(self, sid: int) -> None:
        self.engine.cancel(sid)


class TextEdge:
    """One request's token events (engine.py) -> `emit(Delta)`. A stop string ends the
    request here: the last delta says "stop" and the engine is told to `cancel(sid)`."""

    def __init__(
        self,
        tokenizer,
        params: SamplingParams,
        emit: Callable[[Delta], None],
        cancel: Callable[[int], None],
        counters: Counters | None = None,
    ):
        self.text = TextStream(tokenizer, params.stop) if tokenizer is not None else None
        self.emit, self.cancel, self.counters = emit, cancel, counters
        self.submitted = time.perf_counter()
        self.first_at = self.last_at = 0.0
        self.done = False

    def __call__(self, ev: Emitted) -> None:
        if self.done:
            return
        if ev.finish_reason == "error":
            self.done = True
            self.emit(Delta("", "error", ev.prompt_tokens, ev.completion_tokens, error=ev.error))
            return
        self._count(ev)
        tokens = () if ev.token is None else (ev.token,)
        delta = self.text.add(ev.token) if self.text is not None and tokens else ""
        reason = ev.finish_reason
        if self.text is not None and self.text.stopped:
            if reason is None:
                self.cancel(ev.sid)
            reason = "stop"
        if reason is None:
            self.emit(Delta(delta, tokens=tokens))
            return
        self.done = True
        tail = self.text.finish() if self.text is not None else ""
        counts = (ev.prompt_tokens, ev.completion_tokens)
        self.emit(
            Delta(delta + tail, reason, *counts, tokens=tokens, cached_tokens=ev.cached_tokens)
        )

    def _count(self, ev: Emitted) -> None:
        self.last_at = now = time.perf_counter()
        if ev.completion_tokens == 1:
            self.first_at = now
        c = self.counters
        if c is None:
            return
        if ev.completion_tokens == 1:
            c.requests_total += 1
            c.prompt_tokens_total += ev.prompt_tokens
            c.prefix_cache_hit_tokens_total += ev.cached_tokens
            c.ttft_seconds = now - self.submitted
        c.tokens_generated_total += 1
        c.recent.append((now, 1))


class TextStream:
    """Feeds tokens to a streaming detokenizer; `add` returns only text that is final."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.stop = tuple(s for s in stop if s)
        self.emitted = 0
        self.stopped = False

    def add(self, token: int) -> str:
        self.detok.add_token(token)
        return self._advance(self.detok.text, final=False)

    def finish(self) -> str:
        """Flush what was held back (the sequence ended without a stop string)."""
        if self.stopped:
            return ""
        self.detok.finalize()
        return self._advance(self.detok.text, final=True)

    def _advance(self, text: str, final: bool) -> str:
        if self.stopped:
            return ""
        start = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        cut = min((i for s in self.stop if (i := text.find(s, start)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            end = cut
        elif final:
            end = len(text)
        else:
            end = len(text) - self._held(text)
        out = text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out

    def _held(self, text: str) -> int:
        """Length of the longest suffix of text that could start a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
