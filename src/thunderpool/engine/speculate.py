"""Speculative decoding in lockstep: a draft proposes up to k tokens per row (drafter.py),
every rank verifies all rows in one forward of the sharded target, the leader accepts by the
standard rule per row.

With the draft whole on the leader, a verify burst (plan.spec = k) of B rows is a loop of
exchanges of 2 + B(k+2) int32 (Control.share_ints) after each drafting: [go, n, trim of each
row, t0 of each row, k drafts of each row]. With a draft sharded like the target, every rank
drafts, so the exchange comes before the drafting and carries what the other ranks' drafts
need instead of the drafts (`_header`); the draft tokens are shared per position as they are
drawn. Either way every rank first cuts each row's rejected tail of the previous verify from
its KV cache (batch.trim_rows; uneven tails become left padding); with go=1 it then runs the
target on (B, n+1) tokens [t0, d1..dn]; go=0 ends the burst. So followers learn each accept
decision one exchange later, and every rank issues the same collectives in the same order.
Rows whose sampling the accept rule cannot keep exact (SamplingParams.speculable) ride along
with k=0: their drafts are padding, cut again, and their own sampler draws one token from
position 0. Batches of more than Drafter.max_rows rows decode plainly (choose_k). Accept rules
follow Leviathan et al. 2023 (greedy: longest agreeing prefix plus the target's own next
token; sampling: accept d with min(1, p(d)/q(d)), else draw from (p-q)+).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from thunderpool.engine.drafter import MAX_ROWS, distribution, row_rng

if TYPE_CHECKING:
    from thunderpool.engine.executor import Executor
    from thunderpool.engine.plan import StepPlan
    from thunderpool.engine.sampling import SamplingParams


@dataclass(slots=True)
class SpecStats:
    """Running counts of one engine's verify steps (bench and /metrics read them)."""

    steps: int = 0  # verify forwards
    proposed: int = 0  # draft tokens offered
    accepted: int = 0  # draft tokens the target kept
    emitted: int = 0  # tokens delivered by verify steps (accepted + one of the target's own)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


def spec_fields(engine) -> dict:
    """An engine's speculation counts for an event or a report (none without a draft)."""
    stats = getattr(engine.executor, "spec_stats", None)
    if stats is None:
        return {}
    return {
        "spec_steps": stats.steps,
        "spec_acceptance": stats.acceptance,
        "spec_tokens_per_step": stats.tokens_per_step,
        "spec_draft_ranks": draft_ranks(engine.executor.drafter),
    }


def draft_ranks(drafter) -> int:
    """How many ranks run the draft: a sharded one every TP rank, else the leader alone."""
    shard = getattr(drafter, "shard", None)
    return shard.runner.size if shard is not None else 1


def spec_metrics(engine) -> dict[str, float]:
    """/metrics keys of speculative decoding (api/metrics.py), none without a draft."""
    stats = getattr(engine.executor, "spec_stats", None)
    if stats is None:
        return {}
    return {
        "spec_verify_steps_total": stats.steps,
        "spec_draft_tokens_total": stats.proposed,
        "spec_accepted_tokens_total": stats.accepted,
        "spec_acceptance_rate": stats.acceptance,
        "spec_tokens_per_step": stats.tokens_per_step,
    }


def accept_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """drafts d1..dn and the target's argmax at each of the n+1 positions -> emitted tokens."""
    n = next((i for i, (d, t) in enumerate(zip(drafts, target, strict=False)) if d != t), None)
    n = len(drafts) if n is None else n
    return [*drafts[:n], target[n]]


def accept_sampled(
    drafts: list[int], p: np.ndarray, q: np.ndarray, rng: np.random.Generator
) -> list[int]:
    """Rejection sampling: drafts drawn from q (n, V), target p (n+1, V) -> emitted tokens,
    distributed exactly as sampling p token by token."""
    out = []
    for i, d in enumerate(drafts):
        if rng.random() * q[i, d] < p[i, d]:  # u < p/q without dividing by zero
            out.append(d)
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        total = residual.sum()
        out.append(int(rng.choice(len(residual), p=residual / total)) if total > 0 else d)
        return out
    out.append(int(rng.choice(p.shape[-1], p=p[len(drafts)])))
    return out


def choose_k(executor: Executor, plan: StepPlan) -> int:
    """Leader: the plan's draft length: the drafter's k when 1 to drafter.max_rows rows will
    decode and at least one of them samples in a way the accept rule keeps exact
    (SamplingParams.speculable); the others decode one token per verify step (k=0)."""
    drafter = executor.drafter
    if drafter is None or not plan.decode:
        return 0
    rows = [r for r in executor.state.rows if r not in plan.drop] + list(plan.join)
    if not 0 < len(rows) <= getattr(drafter, "max_rows", MAX_ROWS):
        return 0
    if len(rows) > 1 and not executor.rows_trimmable:
        return 0
    fresh = plan.prefill.sampling if plan.join and plan.prefill else None
    params = [executor.samplers[r].params if r in executor.samplers else fresh for r in rows]
    return drafter.k if any(p is not None and p.speculable for p in params) else 0


def _propose(drafter, sids: list[int], n: int, params: list[SamplingParams]) -> list:
    """Each row's (drafts, q): batched where the drafter can (Drafter.propose_rows), else one
    row at a time (a drafter with only `propose`, e.g. a model's own MTP head)."""
    if hasattr(drafter, "propose_rows"):
        return drafter.propose_rows(sids, n, params)
    return [drafter.propose(sid, n, p) for sid, p in zip(sids, params, strict=True)]


def _width(rows: int, k: int) -> int:
    """Ints of one verify exchange: [go, n, trim of each row, t0 of each row, k drafts each]."""
    return 2 + rows * (2 + k)


def lead(executor: Executor, k: int, sink, fresh: int | None) -> None:
    """The leader's verify burst (module docstring). `fresh`: the row that joined this plan,
    whose first token (sampled at prefill) is not delivered yet."""
    ex, drafter, stats = executor, executor.drafter, executor.spec_stats
    sids = list(ex.state.rows)
    B = len(sids)
    samplers = [ex.samplers[sid] for sid in sids]
    drafted = [i for i, s in enumerate(samplers) if s.params.speculable]
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
        own = [min(lengths.length(sid, k), rooms.get(sid, room) - 1) for sid in sids]
        n = max((own[i] for i in drafted), default=0)
        if acct:  # the host's part: since the last step's end, the budget's question included
            acct.begin(B, n + 1)
        if sharded:  # the other ranks draft alike: they learn the step before it
            mine = [own[i] if i in drafted else -1 for i in range(B)]
            news = [drafter.unsent(sids[i]) for i in drafted]
            ex.control.send(_header(1, n, trims, t0s, mine, news))
            if acct:
                acct.mark("exchange")
        proposals = _propose(
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
            ex.control.share_ints([1, n, *trims, *t0s, *flat], _width(B, k))
            if acct:
                acct.mark("exchange")
        ex.state.trim_rows(trims)
        if acct:
            acct.mark("trim", *[a for c in ex.state.batch for a in (c.keys, c.values)])
        tokens = mx.array([[t0, *d] for t0, d in zip(t0s, drafts, strict=True)])
        logits = ex.state.verify(tokens)  # (B, n+1, V)
        if acct:
            acct.mark("forward", logits)
        outs = _accept(ex, sids, samplers, drafted, proposals, logits)
        if acct:
            acct.mark("accept")
        for j in range(max(len(o) for o in outs)):  # one delivery per position
            at = [i for i, o in enumerate(outs) if j < len(o)]
            token = mx.array([outs[i][j] for i in at])
            ex._deliver(sink, [sids[i] for i in at], token, logits[mx.array(at), j])
        if acct:
            acct.mark("deliver")
        for i, (d, _) in zip(drafted, proposals, strict=True):
            accepted = len(outs[i]) - 1
            drafter.settle(sids[i], n, accepted)
            lengths.observe(sids[i], len(d), accepted)
            stats.steps, stats.proposed = stats.steps + 1, stats.proposed + len(d)
            stats.accepted, stats.emitted = stats.accepted + accepted, stats.emitted + len(outs[i])
        if acct:
            acct.mark("settle")
        if ex.runner.keep_hidden:  # an MTP draft reads every row's kept positions' states
            for i, o in enumerate(outs):
                drafter.observe(sids[i], ex.runner.hidden[i, : len(o)])
        trims, t0s, go = [n + 1 - len(o) for o in outs], [o[-1] for o in outs], not last
    if sharded:
        ex.control.send(_header(0, 0, trims, [0] * B, [-1] * B, []))
    else:
        ex.control.share_ints([0, 0, *trims, *[0] * (B * (k + 1))], _width(B, k))
    ex.state.trim_rows(trims)
    ex.next, ex._first_logits = mx.array(t0s), None
    if acct:
        acct.end()


def _accept(ex, sids, samplers, drafted, proposals, logits) -> list[list[int]]:
    """Each row's emitted tokens: the accept rule on drafted rows (on the row's own drafts,
    not the padding after them), and one token of the row's own sampler (penalties,
    grammar, logprobs) at the first position on the others."""
    outs: list[list[int] | mx.array] = []
    greedy = mx.argmax(logits, axis=-1)
    proposed = dict(zip(drafted, proposals, strict=True))
    for i, sampler in enumerate(samplers):
        if i not in proposed:
            outs.append(sampler(logits[i : i + 1, 0]))
            continue
        params, (d, q) = sampler.params, proposed[i]
        if params.greedy:
            outs.append(accept_greedy(d, greedy[i].tolist()))
            continue
        p = distribution(logits[i], params)
        if q.shape[-1] < p.shape[-1]:  # a draft with a smaller (unpadded) vocabulary
            q = np.pad(q, ((0, 0), (0, p.shape[-1] - q.shape[-1])))
        rng = ex.drafter.rngs.setdefault(sids[i], row_rng(params))
        outs.append(accept_sampled(d, p, q, rng))
    return [o.tolist() if isinstance(o, mx.array) else o for o in outs]


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


def _follow_sharded(ex: Executor) -> None:
    """A follower of a sharded draft: each step's header, the same draft forwards as the
    leader's (its draft tokens shared per position, Drafter.pick), then the same verify."""
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
        proposals = _propose(drafter, [sids[i] for i in drafted], n, [None] * len(drafted))
        drafts = [[0] * n for _ in sids]
        for i, (d, _) in zip(drafted, proposals, strict=True):
            drafts[i] = [*d[: own[i]], *[0] * (n - own[i])]
        out = ex.state.verify(mx.array([[t0, *d] for t0, d in zip(t0s, drafts, strict=True)]))
        if out is not None:
            mx.eval(out)
        before = (drafted, n)


def follow(executor: Executor, k: int) -> None:
    """A follower's verify burst: the same exchanges and forwards as the leader's."""
    ex = executor
    if ex.drafter is not None:
        return _follow_sharded(ex)
    B = len(ex.state.rows)
    while True:
        go, n, *rest = ex.control.share_ints(None, _width(B, k))
        trims, t0s, flat = rest[:B], rest[B : 2 * B], rest[2 * B :]
        ex.state.trim_rows(trims)
        if not go:
            return
        tokens = [[t0, *flat[i * k : i * k + n]] for i, t0 in enumerate(t0s)]
        out = ex.state.verify(mx.array(tokens))
        if out is not None:
            mx.eval(out)
