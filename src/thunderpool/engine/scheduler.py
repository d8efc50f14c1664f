"""Continuous batching as a pure state machine: requests in, StepPlans out, tokens back.

No MLX, no threads, no text. `schedule()` makes the next plan: at most one prefill chunk (so a
long prompt never stalls the others for more than a chunk) and a decode burst of every running
row. Finished and cancelled rows leave the batch in the next plan, which frees their KV cache on
every rank. While a burst runs, the executor asks `last_step()` before it issues each step: the
step must be the burst's last when a row is done for sure by max_tokens/max_context once that
step's token is in, a row already finished (eos, cancelled), or a request could join. Rows that
finished mid-burst get their extra tokens discarded by `postprocess`. With a prefix cache
(prefix.py), a request starts prefilling after its longest cached prefix, and its prompt's KV is
kept when its last chunk runs. With a draft (speculation), each decode plan names every row's
most drafts per verify step (`_speculation`), and the burst asks `spec_budget()` instead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from thunderpool.engine.logits import TokenLogprob
from thunderpool.engine.plan import Prefill, StepPlan
from thunderpool.engine.prefix import PrefixIndex
from thunderpool.engine.sampling import SamplingParams


@dataclass(eq=False, slots=True)
class Request:
    sid: int
    prompt: tuple[int, ...]
    params: SamplingParams
    prefilled: int = 0
    generated: int = 0  # tokens delivered
    issued: int = 0  # tokens sampled or in flight (delivered + issued steps)
    finished: bool = False
    cached: int = 0  # prompt tokens reused from the prefix cache


@dataclass(frozen=True, slots=True)
class Emitted:
    """One delivered token of request `sid` (None: eos, which ends it without text), and the
    reason the request ended with it ("stop" | "length" | "error"), if it did."""

    sid: int
    token: int | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    queued_s: float | None = None  # on the first token: from submit to its first prefill plan
    logprob: TokenLogprob | None = None  # the engine adds it where the request asked
    cached_tokens: int = 0  # of prompt_tokens, reused from the prefix cache


# The most decoding rows that still speculate: on a quiet machine, with input-major weights
# (engine/kmajor.py), per-row speculation beat plain batched decoding at 1 to 4 rows (1.98x,
# 1.43x, 1.13x, 1.05x; docs/benchmarks.md section 14); more rows are unmeasured, so plain.
MAX_ROWS = 4


@dataclass(slots=True)
class Speculation:
    """What the scheduler needs to decide speculation: the leader's draft (its `k` and
    `max_rows`, read at each plan) and whether a batch's uneven rejected tails can be cut."""

    drafter: object
    trimmable: bool

    def rows(self) -> int:
        """The most rows that speculate together (a draft without its own limit: MAX_ROWS)."""
        return getattr(self.drafter, "max_rows", MAX_ROWS)


class Scheduler:
    def __init__(
        self,
        prefill_chunk: int = 512,
        max_batch: int = 8,
        max_context: int = 4096,
        eos: frozenset[int] | set[int] = frozenset(),
        prefix: PrefixIndex | None = None,
        speculation: Speculation | None = None,
    ):
        self.prefill_chunk, self.max_batch, self.max_context = prefill_chunk, max_batch, max_context
        self.eos = set(eos)
        self.prefix = prefix
        self.speculation = speculation  # None: plain decode steps only
        self.waiting: deque[Request] = deque()
        self.prefilling: Request | None = None
        self.active: list[Request] = []  # the batch rows, in row order
        self._leaving: list[int] = []  # prefilled rows that never joined (done at token 1)
        self._live: dict[int, Request] = {}

    def add(self, sid: int, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("the prompt is empty; give at least one token")
        req = Request(sid, tuple(prompt), params)
        self._live[sid] = req
        self.waiting.append(req)

    def cancel(self, sid: int) -> bool:
        """The request ends now: it emits nothing more and leaves at the next plan. False
        when `sid` is not (or no longer) a request here."""
        req = self._live.get(sid)
        if req is None:
            return False
        req.finished = True
        if req in self.waiting:
            self.waiting.remove(req)
            del self._live[sid]
        return True

    @property
    def live_sids(self) -> set[int]:
        return set(self._live)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.active or self._leaving)

    @property
    def running(self) -> int:
        return len(self.active) + (1 if self.prefilling else 0)

    def prompt(self, sid: int) -> tuple[int, ...]:
        return self._live[sid].prompt

    def live(self) -> list[Request]:
        return list(self._live.values())

    def schedule(self) -> StepPlan | None:
        """The next plan, or None when there is nothing to do."""
        drop = [r.sid for r in self.active if r.finished] + self._leaving
        self.active = [r for r in self.active if not r.finished]
        self._leaving = []
        if self.prefilling is not None and self.prefilling.finished:
            drop.append(self.prefilling.sid)
            self.prefilling = None
        for sid in drop:
            self._live.pop(sid, None)
        reuse = None
        if self.prefilling is None and self.waiting and len(self.active) < self.max_batch:
            self.prefilling = self.waiting.popleft()
            if self.prefix is not None and (hit := self.prefix.lookup(self.prefilling.prompt)):
                self.prefilling.prefilled = self.prefilling.cached = hit.tokens
                reuse = (hit.entry, hit.tokens)
        prefill, join = None, ()
        if (req := self.prefilling) is not None:
            chunk = req.prompt[req.prefilled : req.prefilled + self.prefill_chunk]
            first, req.prefilled = req.prefilled == req.cached, req.prefilled + len(chunk)
            last = req.prefilled == len(req.prompt)
            kept = self.prefix.store(req.prompt) if last and self.prefix is not None else None
            prefill = Prefill(
                req.sid,
                chunk,
                last,
                req.params if first else None,
                reuse=reuse,
                store=kept.entry if kept else None,
                evict=kept.evict if kept else (),
            )
            if last:
                self.prefilling, req.issued = None, 1
                if self._at_limit(req, 1):
                    self._leaving.append(req.sid)  # its first token is its last
                else:
                    join = (req.sid,)
                    self.active.append(req)
        if prefill is None and not self.active and not drop:
            return None
        decode = bool(self.active)
        spec = self._speculation() if decode else ()
        return StepPlan(drop=tuple(drop), prefill=prefill, join=join, decode=decode, spec=spec)

    def _speculation(self) -> tuple[int, ...]:
        """Each row's most drafts per verify step: the draft's k for rows whose sampling the
        accept rule keeps exact (SamplingParams.speculable), 0 for the others (one token of
        their own sampler per step); none for more than the draft's max_rows rows, for a
        batch whose caches cannot cut uneven tails, or when no row can speculate."""
        s = self.speculation
        rows = self.active
        if s is None or not 0 < len(rows) <= s.rows():
            return ()
        if len(rows) > 1 and not s.trimmable:
            return ()
        spec = tuple(s.drafter.k if r.params.speculable else 0 for r in rows)
        return spec if any(spec) else ()

    def _must_end(self, news: bool) -> bool:
        """The burst's rule: end when a request could join (`news`: one waits in the inbox)
        or a prompt is being prefilled."""
        room = len(self.active) < self.max_batch
        return (room and (news or bool(self.waiting))) or self.prefilling is not None

    def last_step(self, news: bool = False) -> bool:
        """Called once before each decode step is issued: whether it must be the burst's last.
        `news`: a request waits to join. Counts the step as issued."""
        last = self._must_end(news) or any(
            r.finished or self._at_limit(r, r.issued + 1) for r in self.active
        )
        for r in self.active:
            r.issued += 1
        return last

    def spec_budget(self, news: bool = False) -> tuple[bool, dict[int, int]]:
        """A verify burst (speculate.py) asks before each step: whether it must be the last,
        and how many tokens each row may still take (empty: issue no step). A verify step
        runs only once the previous one is delivered, so the issued count catches up here."""
        for r in self.active:
            r.issued = r.generated
        if any(r.finished for r in self.active) or not self.active:
            return True, {}
        rooms = {
            r.sid: min(
                r.params.max_tokens - r.generated,
                self.max_context - len(r.prompt) - r.generated,
            )
            for r in self.active
        }
        return self._must_end(news), rooms

    def postprocess(self, sids: list[int], tokens: list[int]) -> list[Emitted]:
        """Tokens delivered for the rows `sids` (one decode step, or a first token)."""
        out = []
        for sid, token in zip(sids, tokens, strict=True):
            req = self._live.get(sid)
            if req is None or req.finished:
                continue  # a burst ran it a step or two past its end
            req.generated += 1
            if token in self.eos and not req.params.ignore_eos:
                reason, token = "stop", None
            elif self._at_limit(req, req.generated):
                reason = "length"
            else:
                reason = None
            req.finished = reason is not None
            n = (len(req.prompt), req.generated)
            out.append(Emitted(sid, token, reason, *n, cached_tokens=req.cached))
        return out

    def _at_limit(self, req: Request, generated: int) -> bool:
        return generated >= req.params.max_tokens or len(req.prompt) + generated >= self.max_context
