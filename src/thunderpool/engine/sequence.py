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

# A silence longer than this many usual gaps between steps (and than the window) reads as idle.
IDLE_GAPS = 4.0
SAME_STEP_S = 1e-3  # tokens this close together came from one step (the rows of a batch)


@dataclass
class Counters:
    """The leader's running totals for /metrics; `clock` is what every time here is read from."""

    requests_total: int = 0
    prompt_tokens_total: int = 0
    # The prompt tokens the prefix cache reused; the hit rate is this / prompt_tokens_total.
    prefix_cache_hit_tokens_total: int = 0
    tokens_generated_total: int = 0
    # The prefix cache adds the prompt tokens it reused (via `prompted`); the hit rate is
    # prefix_cache_hit_tokens_total / prompt_tokens_total.
    prefix_cache_hit_tokens_total: int = 0
    ttft_seconds: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # (time, tokens) per step
    clock: Callable[[], float] = time.perf_counter

    def prompted(self, tokens: int, cached: int = 0) -> None:
        """A request's prompt was prefilled; `cached` of its `tokens` came from the prefix cache."""
        self.requests_total += 1
        self.prompt_tokens_total += tokens
        self.prefix_cache_hit_tokens_total += cached

    def generated(self, now: float, tokens: int = 1) -> None:
        self.tokens_generated_total += tokens
        if self.recent and now - self.recent[-1][0] < SAME_STEP_S:
            tokens += self.recent.pop()[1]
        self.recent.append((now, tokens))

    def decode_tps(self, now: float | None = None, window: float = 10.0) -> float:
        """Tokens per second lately: the steps of the last `window` seconds (at least the last
        two steps, however slow), over their span plus any silence since the last step that is
        longer than the usual gap, so a slow stream reads its true rate and a stopped one decays."""
        now = self.clock() if now is None else now
        steps = [s for s in self.recent if s[0] > now - window]
        if len(steps) < 2:
            steps = list(self.recent)[-2:]
        if len(steps) < 2:
            return 0.0
        first, last = steps[0][0], steps[-1][0]
        span, silence = last - first, now - last
        gap = span / (len(steps) - 1)
        if silence > max(window, IDLE_GAPS * gap):
            return 0.0
        tokens = sum(n for _, n in steps[1:])
        return tokens / max(span + max(silence - gap, 0.0), 1e-9)


class TextRequests:
    """An engine (engine.py) behind the text edge: `submit(prompt, params, emit)` streams
    Deltas to `emit`; what the engine link (link.py) and the tests drive."""

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
        text = TextStream(tokenizer, params.stop, params.min_tokens) if tokenizer else None
        self.text = text
        self.emit, self.cancel, self.counters = emit, cancel, counters
        self.clock = counters.clock if counters is not None else time.perf_counter
        self.submitted = self.clock()
        self.first_at = self.last_at = 0.0
        self.done = False

    def __call__(self, ev: Emitted) -> None:
        if self.done:
            return
        if ev.finish_reason == "error":
            self.done = True
            self.emit(Delta("", "error", ev.prompt_tokens, ev.completion_tokens, error=ev.error))
            return
        timing = self._count(ev)
        tokens = () if ev.token is None else (ev.token,)
        logprobs = () if ev.logprob is None else (ev.logprob,)
        delta = self.text.add(ev.token) if self.text is not None and tokens else ""
        reason = ev.finish_reason
        if self.text is not None and self.text.stopped:
            if reason is None:
                self.cancel(ev.sid)
            reason = "stop"
        if reason is None:
            self.emit(Delta(delta, tokens=tokens, logprobs=logprobs, **timing))
            return
        self.done = True
        tail = self.text.finish() if self.text is not None else ""
        counts = (ev.prompt_tokens, ev.completion_tokens)
        timing["elapsed_s"] = self.last_at - self.submitted
        kw = {"tokens": tokens, "logprobs": logprobs, "cached_tokens": ev.cached_tokens, **timing}
        self.emit(Delta(delta + tail, reason, *counts, **kw))

    def _count(self, ev: Emitted) -> dict[str, float | None]:
        """Counts the token; returns its Delta's timing: queue time and TTFT on the first token,
        the gap since the previous token on the others."""
        previous, now = self.last_at, self.clock()
        self.last_at = now
        first = ev.completion_tokens == 1
        if first:
            self.first_at = now
            timing = {"queued_s": ev.queued_s, "ttft_s": now - self.submitted}
        else:
            timing = {"gap_s": now - previous}
        c = self.counters
        if c is None:
            return timing
        if first:
            c.prompted(ev.prompt_tokens, ev.cached_tokens)
            c.ttft_seconds = now - self.submitted
        c.generated(now)
        return timing


class TextStream:
    """Feeds tokens to a streaming detokenizer; `add` returns only text that is final."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0):
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.stop = tuple(s for s in stop if s)
        self.emitted = 0
        self.stopped = False
        # vLLM's min_tokens: stop strings are looked for from the min_tokens-th token's text on.
        self.min_tokens, self.count, self.floor = min_tokens, 0, 0
        # An end token reaches the text only under ignore_eos; as vLLM, it shows no text.
        self.ends = frozenset(getattr(tokenizer, "eos_token_ids", None) or ())

    def add(self, token: int) -> str:
        if token not in self.ends:
            self.detok.add_token(token)
        self.count += 1
        if self.count < self.min_tokens:
            self.floor = len(self.detok.text)  # where the min_tokens-th token's text starts
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
        if self.count < self.min_tokens:  # no stop string yet: nothing held back
            out = text[self.emitted :]
            self.emitted = len(text)
            return out
        start = max(self.floor, self.emitted - max((len(s) for s in self.stop), default=0))
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
