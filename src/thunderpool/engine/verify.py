"""Speculative decoding's verify step, a part of the Executor: every rank verifies all rows'
drafts in one forward of the sharded target, in lockstep; the leader drafts and accepts with
speculate.py's rules. The scheduler decides each row's most drafts (plan.spec).

With the draft whole on the leader, a verify burst of B rows is a loop of exchanges
(Control.verify_step, whose width is defined beside a plain step's) after each drafting:
[go, n, trim of each row, t0 of each row, k drafts of each row]. With a draft sharded like the
target, every rank drafts, so the exchange comes before the drafting and carries what the other
ranks' drafts need instead of the drafts (`_header`); the draft tokens are shared per position
as they are drawn. Either way every rank first cuts each row's rejected tail of the previous
verify from its KV cache (batch.trim_rows; uneven tails become left padding); with go=1 it then
runs the target on (B, n+1) tokens [t0, d1..dn]; go=0 ends the burst. So followers learn each
accept decision one exchange later, and every rank issues the same collectives in the same
order. Rows the plan gives no drafts ride along: their drafts are padding, cut again, and their
own sampler draws one token from position 0.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from thunderpool.engine.speculate import accept_rows, propose


class Verifier:
    """The Executor's verify bursts (executor.py mixes this in: same state, same control)."""

    def _lead_verify(self, spec: tuple[int, ...], sink, fresh: int | None) -> None:
        """The leader's verify burst (module docstring). `fresh`: the row that joined this
        plan, whose first token (sampled at prefill) is not delivered yet."""
        ex, drafter = self, self.drafter
        sids = list(ex.state.rows)
        B, k = len(sids), max(spec)
        assert len(spec) == B, f"the plan speculates {len(spec)} rows of {B}"
        samplers = [ex.samplers[sid] for sid in sids]
        drafted = [i for i, cap in enumerate(spec) if cap > 0]
        if fresh is not None:
            mx.eval(ex.next)
            ex._deliver(sink, [fresh], ex.next[-1:], ex._first_logits)
        t0s, trims = ex.next.tolist(), [0] * B
        acct = ex.account  # bench's step account: each part evaluated at its end (account.py)
        sharded = getattr(drafter, "shard", None) is not None
        go = True
        while go:
            last, rooms = sink.spec_budget()
            room = min(rooms.values(), default=0)
            if room <= 0:
                break
            # Each row drafts within its own room and its measured acceptance (draft_length.py);
            # the step verifies the longest row's drafts, the others padded.
            lengths = ex.draft_lengths
            own = [
                min(lengths.length(sid, spec[i]), rooms.get(sid, room) - 1)
                for i, sid in enumerate(sids)
            ]
            n = max((own[i] for i in drafted), default=0)
            if acct:  # the host's part: since the last step's end, the budget's question included
                acct.begin(B, n + 1)
            if sharded:  # the other ranks draft alike: they learn the step before it
                mine = [own[i] if i in drafted else -1 for i in range(B)]
                news = [drafter.unsent(sids[i]) for i in drafted]
                ex.control.send(_header(1, n, trims, t0s, mine, news))
                if acct:
                    acct.mark("exchange")
            proposals = propose(
                drafter, [sids[i] for i in drafted], n, [samplers[i].params for i in drafted]
            )
            cut = zip(drafted, proposals, strict=True)
            proposals = [(d[: own[i]], q[: own[i]]) for i, (d, q) in cut]
            if acct:
                acct.mark("draft")
            drafts = [[0] * n for _ in range(B)]
            for i, (d, _) in zip(drafted, proposals, strict=True):
                drafts[i] = [*d, *[0] * (n - len(d))]
            if not sharded:
                flat = [x for d in drafts for x in (*d, *[0] * (k - n))]
                ex.control.verify_step([1, n, *trims, *t0s, *flat], B, k)
                if acct:
                    acct.mark("exchange")
            ex.state.trim_rows(trims)
            if acct:
                acct.mark("trim", *[a for c in ex.state.batch for a in (c.keys, c.values)])
            tokens = mx.array([[t0, *d] for t0, d in zip(t0s, drafts, strict=True)])
            logits = ex.state.verify(tokens)  # (B, n+1, V)
            if acct:
                acct.mark("forward", logits)
            outs = accept_rows(ex, sids, samplers, drafted, proposals, logits)
            if acct:
                acct.mark("accept")
            for j in range(max(len(o) for o in outs)):  # one delivery per position
                at = [i for i, o in enumerate(outs) if j < len(o)]
                token = mx.array([outs[i][j] for i in at])
                ex._deliver(sink, [sids[i] for i in at], token, logits[mx.array(at), j])
            if acct:
                acct.mark("deliver")
            ex._settle(sids, dict(zip(drafted, proposals, strict=True)), outs, n)
            if acct:
                acct.mark("settle")
            trims, t0s, go = [n + 1 - len(o) for o in outs], [o[-1] for o in outs], not last
        if sharded:
            ex.control.send(_header(0, 0, trims, [0] * B, [-1] * B, []))
        else:
            ex.control.verify_step([0, 0, *trims, *[0] * (B * (k + 1))], B, k)
        ex.state.trim_rows(trims)
        ex.next, ex._first_logits = mx.array(t0s), None
        if acct:
            acct.end()

    def _settle(self, sids: list[int], proposed: dict, outs: list[list[int]], n: int) -> None:
        """After a verify step: each drafted row's draft and draft length learn how many of
        its drafts were kept, the stats count them; an MTP draft reads the kept states."""
        stats, drafter = self.spec_stats, self.drafter
        for i, (d, _) in proposed.items():
            accepted = len(outs[i]) - 1
            drafter.settle(sids[i], n, accepted)
            self.draft_lengths.observe(sids[i], len(d), accepted)
            stats.steps, stats.proposed = stats.steps + 1, stats.proposed + len(d)
            stats.accepted, stats.emitted = stats.accepted + accepted, stats.emitted + len(outs[i])
        if self.runner.keep_hidden:  # an MTP draft reads every row's kept positions' states
            for i, o in enumerate(outs):
                drafter.observe(sids[i], self.runner.hidden[i, : len(o)])

    def _follow_sharded(self) -> None:
        """A follower of a sharded draft: each step's header, the same draft forwards as the
        leader's (its draft tokens shared per position, Drafter.pick), then the same verify."""
        ex = self
        drafter, sids = ex.drafter, list(ex.state.rows)
        before: tuple[list[int], int] = ([], 0)  # the last verify's drafted rows and n
        while True:
            go, n, trims, t0s, own, news = _read_header(ex.control.receive())
            drafted, n_before = before
            for i in drafted:  # the leader's accept decision: n - trim drafts kept
                drafter.settle(sids[i], n_before, n_before - trims[i])
            ex.state.trim_rows(trims)
            if not go:
                return
            drafted = [i for i, o in enumerate(own) if o >= 0]
            for i, tokens in zip(drafted, news, strict=True):
                drafter.extend(sids[i], tokens)
            proposals = propose(drafter, [sids[i] for i in drafted], n, [None] * len(drafted))
            drafts = [[0] * n for _ in sids]
            for i, (d, _) in zip(drafted, proposals, strict=True):
                drafts[i] = [*d[: own[i]], *[0] * (n - own[i])]
            out = ex.state.verify(mx.array([[t0, *d] for t0, d in zip(t0s, drafts, strict=True)]))
            if out is not None:
                mx.eval(out)
            before = (drafted, n)

    def _follow_verify(self, spec: tuple[int, ...]) -> None:
        """A follower's verify burst: the same exchanges and forwards as the leader's."""
        ex = self
        if ex.drafter is not None:
            return ex._follow_sharded()
        B, k = len(ex.state.rows), max(spec)
        while True:
            go, n, *rest = ex.control.verify_step(None, B, k)
            trims, t0s, flat = rest[:B], rest[B : 2 * B], rest[2 * B :]
            ex.state.trim_rows(trims)
            if not go:
                return
            tokens = [[t0, *flat[i * k : i * k + n]] for i, t0 in enumerate(t0s)]
            out = ex.state.verify(mx.array(tokens))
            if out is not None:
                mx.eval(out)


def _header(go: int, n: int, trims, t0s, own, news: list[list[int]]) -> bytes:
    """A sharded draft's exchange, before the step's drafting: [go, n, B, trim, t0 and own
    draft length (-1: none) of each row, then each drafted row's count and tokens new to
    the other ranks' drafts] as int32 (a row's first draft sends its whole prompt)."""
    counts = [len(t) for t in news]
    ints = [go, n, len(trims), *trims, *t0s, *own, *counts, *(x for t in news for x in t)]
    return np.asarray(ints, np.int32).tobytes()


def _read_header(data: bytes) -> tuple:
    a = np.frombuffer(data, np.int32).tolist()
    go, n, B = a[:3]
    trims, t0s, own = a[3 : 3 + B], a[3 + B : 3 + 2 * B], a[3 + 2 * B : 3 + 3 * B]
    counts = a[3 + 3 * B : 3 + 3 * B + sum(o >= 0 for o in own)]
    at, news = 3 + 3 * B + len(counts), []
    for c in counts:
        news.append(a[at : at + c])
        at += c
    return go, n, trims, t0s, own, news
