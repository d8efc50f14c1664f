"""`Executor.execute(plan)`: the one place that issues collectives, run alike on every rank.

The leader sends a plan, then executes it; a follower is `while plan := receive(): execute`.
A step plan drops rows, runs a prefill chunk, joins the prefilled row, then runs a decode burst:
step k is the exchange of [last, each row's token] (one int32 all_sum inside the graph,
Control.burst_step) and the batch forward on the exchanged tokens. The leader decides `last`
when it issues a step (the sink asks the scheduler); followers read it after issuing the step's
forward, so every rank runs the same forwards. Where batch.overlaps says so (a GPU, one rank,
PP, or cores to spare), the leader builds step k on step k-1's lazily sampled tokens before it
delivers them; CPU TP ranks pinned to one core build step k once step k-1 is done. Either way
is one rank's own choice: the collectives are the same. A plan whose `spec` names drafts runs
verify steps instead (verify.py), whose command width Control defines beside a plain step's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx

from thunderpool.engine.account import StepAccount
from thunderpool.engine.batch import BatchState, overlaps
from thunderpool.engine.control import Control
from thunderpool.engine.draft_length import DraftLengths
from thunderpool.engine.logits import TokenLogprob
from thunderpool.engine.measure import collective_latency, solo_compute
from thunderpool.engine.plan import Prefill, StepPlan
from thunderpool.engine.prefix_kv import PrefixStore
from thunderpool.engine.runner import Runner
from thunderpool.engine.sampling import Sampler, SamplingParams, sample_rows
from thunderpool.engine.verify import Verifier
from thunderpool.engine.wake import Waker

if TYPE_CHECKING:
    from thunderpool.engine.drafter import Drafter


class Sink(Protocol):
    """The leader's side of a step: the scheduler behind the engine's inbox."""

    def last_step(self) -> bool: ...

    def deliver(self, sids: list[int], tokens: list[int]) -> None: ...

    def spec_budget(self) -> tuple[bool, dict[int, int]]: ...


class Executor(Verifier):
    def __init__(
        self,
        runner: Runner,
        control: Control,
        pipeline: bool | None = None,
        drafter: Drafter | None = None,
    ):
        self.runner, self.control = runner, control
        # The draft of speculative decoding (drafter.py): the leader's, or every TP rank's shard.
        self.drafter = drafter
        self.draft_lengths = DraftLengths()  # each row's draft length from its acceptance
        if drafter is not None:
            from thunderpool.engine.batch import rows_trimmable
            from thunderpool.engine.drafter import check_speculable
            from thunderpool.engine.speculate import SpecStats

            check_speculable(runner.make_cache(), "model")
            self.spec_stats = SpecStats()
            # Leader: whether a batch of rows may speculate (uneven rejected tails cut).
            self.rows_trimmable = rows_trimmable(runner.make_cache())
            # An MTP draft reads the target's final hidden states (engine/mtp.py).
            runner.keep_hidden = getattr(drafter, "wants_hidden", False)
        self.leads = control.rank == 0
        self.state = BatchState(runner)
        self.pipeline = overlaps(runner) if pipeline is None else pipeline
        # Hybrid TP×PP parks stage 0's world only (control.HybridControl.parks).
        self.waker = Waker(getattr(control, "parks", control))
        self.samplers: dict[int, Sampler] = {}  # leader: each request's sampler
        # Leader: makes a request's sampler (the engine binds its tokenizer's grammars).
        self.make_sampler: Callable[[SamplingParams], Sampler] = Sampler
        self.prefix = PrefixStore()  # this rank's share of the prefix cache
        # Leader: the prompt tokens a plan's prefix-cache reuse skips, by request (engine.py).
        self.reused_heads: dict[int, tuple[int, ...]] = {}
        self.next: mx.array | None = None  # leader: each row's next input token (B,), lazy
        self._first_logits: mx.array | None = None
        # Leader: called with (sids, logits (B, V)) as their tokens are delivered (traces).
        self.on_logits: Callable[[list[int], mx.array], None] | None = None
        # Leader: where each decode step's time goes, part by part (bench turns it on).
        self.account: StepAccount | None = None

    def execute(self, plan: StepPlan, sink: Sink | None = None):
        """Runs `plan` on this rank; `sink` (leader only) takes the sampled tokens."""
        self._drop(plan.drop)
        match plan.op:
            case "step":
                first = self._prefill(plan.prefill, plan.join, sink) if plan.prefill else None
                if plan.join:
                    self.state.join(plan.join[0])
                    if self.leads:
                        rows = [first] if self.next is None else [self.next, first]
                        self.next = mx.concatenate(rows)
                if plan.spec:
                    if self.leads:
                        self._lead_verify(plan.spec, sink, plan.join[0] if plan.join else None)
                    else:
                        self._follow_verify(plan.spec)
                elif plan.decode:
                    if self.leads:
                        self._lead_burst(sink, plan.join[0] if plan.join else None)
                    else:
                        self._follow_burst()
            case "park":
                self.waker.park(plan.args)
            case "probe":
                shape, repeats, op = plan.args
                return collective_latency(self.control.group, tuple(shape), repeats, op)
            case "solo":  # (prompt, steps) or (prompt, steps, rows, width)
                prompt, steps, *shape = plan.args
                return solo_compute(self.runner, self.control.group, prompt, steps, *shape)
        return None

    def _drop(self, drop: tuple[int, ...]) -> None:
        if not drop:
            return
        keep = self.state.drop(set(drop))
        for sid in drop:
            self.samplers.pop(sid, None)
            if self.drafter is not None:
                self.drafter.drop(sid)
                self.draft_lengths.drop(sid)
        if self.next is not None and keep is not None:
            self.next = self.next[mx.array(keep)] if keep else None

    def _prefill(self, p: Prefill, join: tuple[int, ...], sink: Sink | None) -> mx.array | None:
        """Runs the chunk; on the prompt's last chunk the leader samples the first token
        lazily (delivered by the burst, or here when the request ends with it)."""
        if self.leads and p.sampling is not None:
            self.samplers[p.sid] = self.make_sampler(p.sampling)
        # The leader's penalties and draft see the whole prompt, the reused head included.
        seen = (*self.reused_heads.pop(p.sid, ()), *p.tokens) if self.leads else p.tokens
        if self.leads and (sampler := self.samplers.get(p.sid)) is not None:
            sampler.observe_prompt(seen)  # the repetition penalty covers the prompt
        if self.drafter is not None and self.leads:  # a sharded draft's followers: _header
            self.drafter.extend(p.sid, list(seen))
        if p.reuse is not None:
            entry, n = p.reuse
            self.state.start(p.sid, self.prefix.restore(entry, n, self.runner.make_cache()))
        out = self.state.prefill(p.sid, list(p.tokens))
        if self._feeds_hidden():
            self.drafter.observe(p.sid, self.runner.hidden[0], tail=True)
        self.prefix.evict(p.evict)
        if p.store is not None:
            self.prefix.keep(p.store, self.state.pending[p.sid])
        if not (p.last and self.leads):
            # Every rank's prefill completes before any exchange (the collectives' order).
            if out is not None:
                mx.eval(out)
            if not p.last:
                mx.clear_cache()
            return None
        y = self.samplers[p.sid](out)
        if not join:
            mx.eval(y)
            self._deliver(sink, [p.sid], y, out)
            return None
        self._first_logits = out
        return y

    def logprobs_of(self, sids: list[int]) -> dict[int, TokenLogprob]:
        """Leader: the logprob records of the tokens being delivered for `sids` (rows that
        asked for them), in the order they were sampled."""
        out = {}
        for sid in sids:
            s = self.samplers.get(sid)
            if s is not None and (lp := s.take_logprob()) is not None:
                out[sid] = lp
        return out

    def _lead_burst(self, sink: Sink, fresh: int | None) -> None:
        """Decode steps until the sink says last (module docstring). `fresh`: the row that
        joined this plan, whose first token (the last of self.next) is not delivered yet."""
        samplers = [self.samplers[sid] for sid in self.state.rows]
        rows, y = len(samplers), self.next
        logits = self._first_logits if fresh is not None else None
        pending = ([fresh], y[-1:], logits) if fresh is not None else None
        acct = self.account  # accounted steps run one part after the other (account.py)
        pipeline = self.pipeline and acct is None
        if pipeline:
            mx.async_eval(y)
        last = False
        while not last:
            if acct:
                acct.begin(rows)
            if not pipeline and pending:
                self._deliver(sink, *pending)
                if acct:
                    acct.mark("deliver")
            last = sink.last_step()
            if acct:
                acct.mark("host")
            exchanged = self.control.burst_step(y, rows, last)
            if acct:
                acct.mark("exchange", exchanged)
            logits = self.state.decode(exchanged[1:])
            if acct:
                acct.mark("forward", logits)
            if self._feeds_hidden():
                for row, sid in enumerate(self.state.rows):
                    self.drafter.observe(sid, self.runner.hidden[row])
            nxt = sample_rows(logits, samplers)
            if acct:
                acct.mark("sample", nxt)
            if pipeline:
                mx.async_eval(nxt)
                if pending:
                    self._deliver(sink, *pending)
            pending, y = (list(self.state.rows), nxt, logits), nxt
        self._deliver(sink, *pending)
        if acct:
            acct.mark("deliver")
            acct.end()
        self.next, self._first_logits = y, None

    def _feeds_hidden(self) -> bool:
        """Leader: whether the draft reads the target's hidden states (an MTP draft)."""
        return self.leads and self.drafter is not None and self.runner.keep_hidden

    def _deliver(self, sink: Sink, sids: list[int], y: mx.array, logits) -> None:
        tokens = y.tolist()
        if self.account is not None:
            self.account.delivered(len(tokens))
        if self.drafter is not None:
            for sid, token in zip(sids, tokens, strict=True):
                self.drafter.extend(sid, [token])
        if self.on_logits is not None and logits is not None:
            self.on_logits(sids, logits)
        sink.deliver(sids, tokens)

    def _follow_burst(self) -> None:
        """The same decode steps as the leader's, until its exchange says last."""
        rows, out = len(self.state.rows), None
        while True:
            exchanged = self.control.burst_step(None, rows)
            if self.runner.stage is not None:
                # PP: the exchange must complete before this stage's recv, as on the leader.
                mx.eval(exchanged)
            out = self.state.decode(exchanged[1:])
            step = [exchanged, *([out] if out is not None else [])]
            # Not pipelined: this step's compute has the core before the next one is built.
            (mx.async_eval if self.pipeline else mx.eval)(*step)
            if exchanged[0].item():
                break
        if out is not None:
            mx.eval(out)
