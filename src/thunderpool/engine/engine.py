"""The engine: the leader plans, every rank executes the same plan.

    leader:   plan = scheduler.schedule(); control.send(plan); executor.execute(plan, sink=self)
    follower: while plan := receive(): executor.execute(plan)

Invariant: every rank issues the same collectives in the same order; `Executor.execute` is the
only code that issues them. A rank that fails exits non-zero and the launcher stops the
instance. `generate`, the benchmark and serve are all this engine: one request is a batch of
one row. Requests come in from any thread (`submit`, `cancel`); the engine's thread runs the
steps. With no work, `run` parks the followers (wake.py) and sleeps until a request arrives.
Token events go to each request's callback; text lives at the edge (sequence.py).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import mlx.core as mx

from thunderpool.engine.control import Control
from thunderpool.engine.executor import Executor
from thunderpool.engine.plan import STOP_PLAN, StepPlan
from thunderpool.engine.prefix import PrefixIndex
from thunderpool.engine.prefix_kv import keepable_tokens
from thunderpool.engine.runner import Runner
from thunderpool.engine.sampling import Sampler, SamplingParams
from thunderpool.engine.scheduler import Emitted, Scheduler, Speculation

OnEvent = Callable[[Emitted], None]


class Engine:
    def __init__(
        self,
        runner: Runner,
        control: Control,
        *,
        prefill_chunk: int = 512,
        max_batch: int = 8,
        max_context: int = 4096,
        eos: set[int] | frozenset[int] = frozenset(),
        pipeline: bool | None = None,
        tokenizer=None,
        drafter=None,
        prefix_cache_tokens: int = 0,
    ):
        """`tokenizer` (mlx-lm's, the leader's): lets requests carry a json_schema."""
        self.runner, self.control = runner, control
        # drafter: drafter.Drafter on the leader, for speculative decoding (or None).
        self.executor = Executor(runner, control, pipeline, drafter)
        self.executor.make_sampler = partial(Sampler, eos=frozenset(eos))
        if tokenizer is not None:
            from thunderpool.engine.constraint import Grammars

            self.executor.make_sampler = partial(
                Sampler, grammars=Grammars(tokenizer), eos=frozenset(eos)
            )
        self.scheduler = Scheduler(
            prefill_chunk, max_batch, max_context, eos, prefix_index(runner, prefix_cache_tokens)
        )
        self.use_drafter(drafter)
        self.plans = 0  # sent so far (tests count them)
        self.wake_s = 0.0  # the last wake-up: from waking the followers to the next plan sent
        self._woke_at = 0.0
        self._on_event: dict[int, OnEvent] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._incoming: deque[tuple[int, list[int], SamplingParams]] = deque()
        self._cancelled: set[int] = set()
        self._stopping = False
        self._submitted_at: dict[int, float] = {}  # until its first prefill plan
        self._queued_s: dict[int, float] = {}  # until its first token reports it

    # Thread-safe entry points (the API's threads).
    def submit(self, prompt: list[int], params: SamplingParams, on_event: OnEvent) -> int:
        if not prompt:
            raise ValueError("the prompt is empty; give at least one token")
        sid = next(self._ids)
        with self._lock:
            self._on_event[sid] = on_event
            self._incoming.append((sid, list(prompt), params))
            self._submitted_at[sid] = time.perf_counter()
        self._wake.set()
        return sid

    def cancel(self, sid: int) -> None:
        with self._lock:
            self._cancelled.add(sid)
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    @property
    def queue_depth(self) -> int:
        return len(self.scheduler.waiting) + len(self._incoming)

    @property
    def busy(self) -> bool:
        return self.scheduler.busy or bool(self._incoming)

    # The engine's thread.
    def step(self) -> bool:
        """Plans, sends and executes one step; False when there was nothing to do."""
        with self._lock:
            incoming, self._incoming = self._incoming, deque()
        for sid, prompt, params in incoming:
            self.scheduler.add(sid, prompt, params)
        self._take_cancels()
        plan = self.scheduler.schedule()
        if plan is None:
            return False
        if (pre := plan.prefill) is not None and pre.reuse is not None:
            self.executor.reused_heads[pre.sid] = self.scheduler.prompt(pre.sid)[: pre.reuse[1]]
        self._note_queue_time(plan)
        self._execute(plan)
        for sid in plan.drop:
            self._on_event.pop(sid, None)
            self._queued_s.pop(sid, None)
        return True

    def _note_queue_time(self, plan: StepPlan) -> None:
        """A request's first prefill chunk ends its wait (later chunks find nothing to pop)."""
        if plan.prefill is not None:
            with self._lock:
                since = self._submitted_at.pop(plan.prefill.sid, None)
            if since is not None:
                self._queued_s[plan.prefill.sid] = time.perf_counter() - since

    def run(self) -> None:
        """Serves until stop(); parks every rank while there is nothing to do."""
        parked = False
        try:
            while not self._stopping:
                if self.step():
                    continue
                if not parked:
                    self._execute(StepPlan("park", args=self.executor.waker.address()))
                    parked = True
                self._wake.wait()
                self._wake.clear()
                self._woke_at = time.perf_counter()
                self.executor.waker.wake()
                parked = False
        except BaseException as e:
            # Requests that streamed tokens end here; the rest never started, and the serve
            # process runs them again on the next instance when this one is gone.
            for req in self.scheduler.live():
                if req.generated:
                    n = (len(req.prompt), req.generated)
                    self._emit(Emitted(req.sid, None, "error", *n, error=str(e)))
            raise
        finally:
            if parked:
                self.executor.waker.wake()
            self.shutdown()

    def use_drafter(self, drafter) -> None:
        """Leader: speculate with `drafter` from the next plan on, or decode plainly (None);
        bench alternates the two on one engine."""
        self.executor.drafter = drafter
        trimmable = getattr(self.executor, "rows_trimmable", False)
        self.scheduler.speculation = Speculation(drafter, trimmable) if drafter else None

    def generate(self, prompt: list[int], params: SamplingParams, on_event: OnEvent) -> None:
        """One request, run to its end on this thread (a batch of one row)."""
        self.submit(prompt, params, on_event)
        while self.step():
            pass

    def measure(self, op: str, *args):
        """Every rank runs a measurement (measure.py): "probe" (shape, repeats, collective)
        or "solo" (prompt, steps[, rows, width])."""
        return self._execute(StepPlan(op, args=args))  # type: ignore[arg-type]

    def shutdown(self) -> None:
        self._execute(STOP_PLAN)

    def _execute(self, plan: StepPlan):
        self.control.send(plan.encode())
        if self._woke_at:
            # The send completes once every follower has woken and joined its collective.
            self.wake_s, self._woke_at = time.perf_counter() - self._woke_at, 0.0
        self.plans += 1
        return self.executor.execute(plan, self)

    # The executor's sink: called between the decode steps of a burst.
    def last_step(self) -> bool:
        self._take_cancels()
        with self._lock:
            news = bool(self._incoming)
        return self.scheduler.last_step(news) or self._stopping

    def deliver(self, sids: list[int], tokens: list[int]) -> None:
        self._take_cancels()
        logprobs = self.executor.logprobs_of(sids)
        for event in self.scheduler.postprocess(sids, tokens):
            if event.completion_tokens == 1 and event.sid in self._queued_s:
                event = replace(event, queued_s=self._queued_s.pop(event.sid))
            if event.token is not None and (lp := logprobs.get(event.sid)) is not None:
                event = replace(event, logprob=lp)
            self._emit(event)

    def spec_budget(self) -> tuple[bool, dict[int, int]]:
        self._take_cancels()
        with self._lock:
            news = bool(self._incoming)
        last, rooms = self.scheduler.spec_budget(news)
        return last or self._stopping, rooms

    def _take_cancels(self) -> None:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        for sid in cancelled:
            if self.scheduler.cancel(sid) is False:  # still in the inbox, or never was
                with self._lock:
                    self._incoming = deque(r for r in self._incoming if r[0] != sid)
            if sid not in self.scheduler.live_sids:
                self._on_event.pop(sid, None)
                with self._lock:
                    self._submitted_at.pop(sid, None)

    def _emit(self, event: Emitted) -> None:
        on_event = self._on_event.get(event.sid)
        if on_event is not None:
            on_event(event)


def prefix_index(runner: Runner, budget_tokens: int) -> PrefixIndex | None:
    """The leader's prefix cache index, or None when off (no budget, or caches that cannot be
    cut back to a prefix: prefix_kv.py)."""
    limit = keepable_tokens(runner.make_cache()) if budget_tokens > 0 else 0
    return PrefixIndex(budget_tokens, limit) if limit > 0 else None


def follow(runner: Runner, control: Control, drafter=None) -> None:
    """A follower: executes the leader's plans until it says stop (`drafter`: its shard of a
    draft sharded like the target, draft_load.py)."""
    executor = Executor(runner, control, drafter=drafter)
    while (plan := StepPlan.decode_bytes(control.receive())).op != "stop":
        executor.execute(plan)
    mx.synchronize()
