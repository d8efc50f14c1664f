"""Speculative decoding's rules, apart from the lockstep (engine/verify.py runs the verify
steps): drafting a step's proposals (drafter.py's drafts, batched where the draft can), the
accept rules, and the counts bench and /metrics read.

Accept rules follow Leviathan et al. 2023 (greedy: longest agreeing prefix plus the target's
own next token; sampling: accept d with min(1, p(d)/q(d)), else draw from (p-q)+). Rows whose
sampling the accept rule cannot keep exact (SamplingParams.speculable) get no drafts from the
scheduler; their own sampler draws one token from position 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from thunderpool.engine.drafter import distribution, row_rng

if TYPE_CHECKING:
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


def propose(drafter, sids: list[int], n: int, params: list[SamplingParams]) -> list:
    """Each row's (drafts, q): batched where the drafter can (Drafter.propose_rows), else one
    row at a time (a drafter with only `propose`, e.g. a model's own MTP head)."""
    if hasattr(drafter, "propose_rows"):
        return drafter.propose_rows(sids, n, params)
    return [drafter.propose(sid, n, p) for sid, p in zip(sids, params, strict=True)]


def accept_rows(ex, sids, samplers, drafted, proposals, logits) -> list[list[int]]:
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
