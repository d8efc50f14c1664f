"""Continuous batching on the leader: requests join the running batch as they arrive.

Each iteration the leader sends at most one prefill chunk (so a long prompt never stalls the
others for more than a chunk) and one decode step for every running row. Finished and
cancelled requests leave the batch at the next step, which frees their KV cache on every rank.

Decode bursts: when the batch only has decoding to do, the "step" command says `more`, and the
steps after it carry no JSON: burst step k is one int32 all_sum inside the graph of [last, each
row's token] (Control.burst_step), then the batch forward on the exchanged tokens. The leader
sets `last` when it issues a step: a row done for sure by max_tokens/max_context once this
step's token is in, a row already finished (eos, stop string), a cancellation or a request
that could join. Followers read `last` after issuing the step's forward, so every rank runs
the same forwards, each a real step for every row still running (a finished or cancelled row's
extra step or two is discarded, and the next "step" command drops it). Where batch.overlaps
says so (a GPU, one rank, PP, or more than one core) a burst is pipelined: step k is built on
step k-1's lazily sampled tokens before they are delivered, so Python builds a step while the
last computes. On CPU TP ranks pinned to one core step k is built once step k-1's tokens are
delivered. Either way is one rank's own choice: the collectives are the same.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from thunderpool.engine.batch import BatchState, overlaps
from thunderpool.engine.control import Control
from thunderpool.engine.runner import Runner
from thunderpool.engine.sampling import Sampler, SamplingParams, sample_rows
from thunderpool.engine.sequence import TextStream
from thunderpool.engine.service import Delta


@dataclass(eq=False)
class Sequence:
    sid: int
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Delta], None]
    sampler: Sampler
    text: TextStream | None
    submitted: float = field(default_factory=time.perf_counter)
    prefilled: int = 0
    generated: int = 0
    next_token: int = -1
    finished: bool = False


@dataclass
class Counters:
    requests_total: int = 0
    prompt_tokens_total: int = 0
    tokens_generated_total: int = 0
    ttft_seconds: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (time, tokens) per step

    def decode_tps(self, window: float = 5.0) -> float:
        now = time.perf_counter()
        steps = [(t, n) for t, n in self.recent if now - t <= window]
        if len(steps) < 2:
            return 0.0
        return sum(n for _, n in steps[1:]) / max(steps[-1][0] - steps[0][0], 1e-9)


class Scheduler:
    def __init__(
        self,
        runner: Runner,
        control: Control,
        tokenizer=None,
        *,
        prefill_chunk: int = 512,
        max_batch: int = 8,
        max_context: int = 4096,
        pipeline: bool | None = None,
    ):
        self.runner, self.control, self.tokenizer = runner, control, tokenizer
        self.prefill_chunk, self.max_batch, self.max_context = prefill_chunk, max_batch, max_context
        self.state = BatchState(runner)
        self.pipeline = overlaps(runner) if pipeline is None else pipeline
        self.eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
        self.counters = Counters()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._incoming: deque[Sequence] = deque()
        self._cancelled: set[int] = set()
        self._stopping = False
        self.waiting: deque[Sequence] = deque()
        self.prefilling: Sequence | None = None
        self.active: list[Sequence] = []

    # Thread-safe entry points (called from the API's thread).
    def submit(
        self, prompt: list[int], params: SamplingParams, emit: Callable[[Delta], None]
    ) -> int:
        if not prompt:
            raise ValueError("the prompt is empty; give at least one token")
        text = TextStream(self.tokenizer, params.stop) if self.tokenizer is not None else None
        seq = Sequence(next(self._ids), list(prompt), params, emit, Sampler(params), text)
        with self._lock:
            self._incoming.append(seq)
        self._wake.set()
        return seq.sid

    def cancel(self, sid: int) -> None:
        with self._lock:
            self._cancelled.add(sid)
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting) + len(self._incoming)

    # The loop (the leader's MLX thread).
    def run(self) -> None:
        try:
            while not self._stopping:
                if not self.step():
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:
            # Requests that streamed tokens end here; the rest never started, and the serve
            # process runs them again on the next instance when this one is gone.
            for seq in self._all():
                if seq.generated:
                    seq.emit(Delta("", "error", len(seq.prompt), seq.generated, error=str(e)))
            raise
        finally:
            self.control.send({"op": "stop"})

    def step(self) -> bool:
        """One iteration (a decode burst counts as one); False when there was nothing to do."""
        drop = self._take_incoming()
        join: list[int] = []
        if self.prefilling is None and self.waiting and len(self.active) < self.max_batch:
            self.prefilling = self.waiting.popleft()
        if self.prefilling is not None:
            seq = self._prefill_chunk(self.prefilling)
            if seq is not None:
                self.prefilling = None
                if seq.finished:
                    drop.append(seq.sid)
                else:
                    join.append(seq.sid)
                    self.active.append(seq)
        tokens = [s.next_token for s in self.active]
        if not tokens and not drop:
            return self.prefilling is not None
        more = bool(tokens) and not self._burst_ends(ahead=1)
        command = {"op": "step", "drop": drop, "join": join, "t": tokens}
        if more:
            command["more"] = 1
        self.control.send(command)
        logits = self.state.step(drop, join, tokens)
        if logits is None:
            return True
        samplers = [s.sampler for s in self.active]
        y = sample_rows(logits, samplers)
        if more:
            y = self._burst(y, samplers)
        self._deliver_rows(y.tolist())
        return True

    def _burst(self, y: mx.array, samplers: list[Sampler]) -> mx.array:
        """Decode steps after a "step" command that said `more` (module docstring); returns
        the last step's lazy tokens. Pipelined: issue step k on step k-1's lazy tokens y, then
        deliver y. Otherwise deliver y first, and step k knows it."""
        if self.pipeline:
            mx.async_eval(y)
        last = False
        while not last:
            if not self.pipeline:
                self._deliver_rows(y.tolist())
            # Tokens per row ahead of the delivered ones once this step's is sampled.
            last = self._burst_ends(ahead=2 if self.pipeline else 1)
            exchanged = self.control.burst_step(y, len(samplers), last)
            nxt = sample_rows(self.state.decode(exchanged[1:]), samplers)
            if self.pipeline:
                mx.async_eval(nxt)
                self._deliver_rows(y.tolist())
            y = nxt
        return y

    def _burst_ends(self, ahead: int) -> bool:
        """Whether the decode step about to be issued must be the burst's last (or, before
        the "step" command, whether no burst may start). `ahead`: tokens each row will have
        beyond its delivered ones once that step's token is sampled."""
        room = len(self.active) < self.max_batch
        with self._lock:
            news = bool(self._cancelled) or (room and bool(self._incoming))
        if news or self._stopping or self.prefilling is not None or (room and self.waiting):
            return True
        return any(s.finished or self._at_limit(s, s.generated + ahead) for s in self.active)

    def _deliver_rows(self, tokens: list[int]) -> None:
        """One decode step's tokens, to the rows still running (a burst may run a finished or
        cancelled row a step or two past its end)."""
        with self._lock:
            cancelled = set(self._cancelled)
        delivered = 0
        for seq, token in zip(self.active, tokens, strict=True):
            if not seq.finished and seq.sid not in cancelled:
                self._deliver(seq, token)
                delivered += 1
        self.counters.recent.append((time.perf_counter(), delivered))

    def _take_incoming(self) -> list[int]:
        """Move new requests to the queue and apply cancellations; returns rows to drop."""
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
            cancelled, self._cancelled = self._cancelled, set()
        self.waiting = deque(s for s in self.waiting if s.sid not in cancelled)
        drop = [s.sid for s in self.active if s.finished or s.sid in cancelled]
        self.active = [s for s in self.active if s.sid not in drop]
        if self.prefilling is not None and self.prefilling.sid in cancelled:
            drop.append(self.prefilling.sid)
            self.prefilling = None
        return drop

    def _prefill_chunk(self, seq: Sequence) -> Sequence | None:
        """Send the next prompt chunk; returns the sequence once its first token is sampled."""
        chunk = seq.prompt[seq.prefilled : seq.prefilled + self.prefill_chunk]
        self.control.send({"op": "pre", "sid": seq.sid, "t": chunk})
        logits = self.state.prefill(seq.sid, chunk)
        seq.prefilled += len(chunk)
        if seq.prefilled < len(seq.prompt):
            mx.eval(logits)
            return None
        token = seq.sampler(logits).item()
        self.counters.requests_total += 1
        self.counters.prompt_tokens_total += len(seq.prompt)
        self.counters.ttft_seconds = time.perf_counter() - seq.submitted
        self._deliver(seq, token)
        return seq

    def _deliver(self, seq: Sequence, token: int) -> None:
        seq.generated += 1
        seq.next_token = token
        self.counters.tokens_generated_total += 1
        if token in self.eos:
            return self._finish(seq, "stop", "", ())
        delta = seq.text.add(token) if seq.text else ""
        if seq.text is not None and seq.text.stopped:
            return self._finish(seq, "stop", delta, (token,))
        if self._at_limit(seq, seq.generated):
            return self._finish(seq, "length", delta, (token,))
        seq.emit(Delta(delta, tokens=(token,)))

    def _at_limit(self, seq: Sequence, generated: int) -> bool:
        return generated >= seq.params.max_tokens or len(seq.prompt) + generated >= self.max_context

    def _finish(self, seq: Sequence, reason: str, delta: str, tokens: tuple[int, ...]) -> None:
        tail = seq.text.finish() if seq.text else ""
        seq.finished = True
        seq.emit(Delta(delta + tail, reason, len(seq.prompt), seq.generated, tokens=tokens))

    def _all(self) -> list[Sequence]:
        pre = [self.prefilling] if self.prefilling else []
        return [*self.active, *pre, *self.waiting, *self._incoming]
