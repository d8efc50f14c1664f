"""Speculative decoding in lockstep: a draft model on the leader proposes up to k tokens per
row, every rank verifies all rows in one forward of the sharded target, the leader accepts by
the standard rule per row.

A verify burst (plan.spec = k) of B rows is a loop of exchanges of 2 + B(k+2) int32
(Control.share_ints): [go, n, trim of each row, t0 of each row, k drafts of each row]. Every
rank first cuts each row's rejected tail of the previous verify from its KV cache
(batch.trim_rows; uneven tails become left padding); with go=1 it then runs the target on
(B, n+1) tokens [t0, d1..dn]; go=0 ends the burst. So followers learn each accept decision one
exchange later, and every rank issues the same collectives in the same order. Rows whose
sampling the accept rule cannot keep exact (SamplingParams.speculable) ride along with k=0:
their drafts are padding, cut again, and their own sampler draws one token from position 0.
Batches of more than Drafter.max_rows rows decode plainly (choose_k). Accept rules follow
Leviathan et al. 2023 (greedy: longest agreeing prefix plus the target's own next token;
sampling: accept d with min(1, p(d)/q(d)), else draw from (p-q)+).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from thunderpool.engine import compiled
from thunderpool.engine.sampling import SamplingParams
from thunderpool.errors import ThunderpoolError

if TYPE_CHECKING:
    from thunderpool.engine.executor import Executor
    from thunderpool.engine.plan import StepPlan

DEFAULT_K = 4
# The most decoding rows that still speculate: on a quiet machine, with input-major weights
# (engine/kmajor.py), per-row speculation beat plain batched decoding at 1 to 4 rows (1.98x,
# 1.43x, 1.13x, 1.05x; docs/benchmarks.md section 14); more rows are unmeasured, so plain.
MAX_ROWS = 4
# Cache types whose rejected tail can be cut by trim() at any length (no ring, no recurrence).
TRIMMABLE = {"KVCache", "BatchKVCache", "QuantizedKVCache", "ConcatenateKVCache"}


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
    }


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


def untrimmable(cache: list) -> list[str]:
    """The names of cache types in `cache` that cannot drop a rejected tail."""
    bad = []
    for c in cache:
        for part in getattr(c, "caches", (c,)):
            if type(part).__name__ not in TRIMMABLE:
                bad.append(type(part).__name__)
    return sorted(set(bad))


def check_speculable(cache: list, what: str) -> None:
    if bad := untrimmable(cache):
        raise ThunderpoolError(
            f"speculative decoding needs KV caches that can drop rejected tokens, but the {what} "
            f"uses {', '.join(bad)} (sliding window or recurrent state); run without --draft-model"
        )


def trim(cache: list, n: int) -> None:
    if n > 0:
        for c in cache:
            c.trim(n)


def distribution(logits: mx.array, params: SamplingParams) -> np.ndarray:
    """logits (L, V) -> the sampler's distribution (L, V) as float64: temperature, top-k and
    top-p applied as in sampling.Sampler."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    if params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    probs = np.array(mx.softmax(logprobs * (1 / params.temperature), axis=-1), np.float64)
    return probs / probs.sum(axis=-1, keepdims=True)


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


def draw(
    logits: mx.array, params: SamplingParams, rngs: dict, sid: int
) -> tuple[int, np.ndarray | None]:
    """One draft token: the argmax (greedy), or a draw from the draft's distribution q (then
    returned too, for the accept rule) with the row's own seeded generator."""
    if params.greedy:
        return int(mx.argmax(logits).item()), None
    q = distribution(logits[None], params)[0]
    rng = rngs.setdefault(sid, _rng(params))
    return int(rng.choice(q.shape[-1], p=q)), q


def _rng(params: SamplingParams) -> np.random.Generator:
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
    return np.random.default_rng(seed)


class Drafter:
    """The draft model on the leader: one prefix cache per sequence, fed lazily with the
    sequence's tokens (prompt and delivered ones) the first time that sequence speculates."""

    def __init__(
        self,
        model,
        k: int = DEFAULT_K,
        vocab: int | None = None,
        max_rows: int = MAX_ROWS,
        compile: bool | None = None,
    ):
        if k < 1:
            raise ThunderpoolError(f"--spec-k {k} must be at least 1")
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.k, self.vocab = model, k, vocab
        self.max_rows = max_rows  # batches of more rows decode plainly (choose_k)
        self._make_cache = lambda: make_prompt_cache(model)
        # One-token draft steps take the compiled, fused step where the family has one: on a
        # CPU its products then use every core, as the target's decode does (runner.py).
        self.runner = _draft_runner(model, compile)
        check_speculable(self._make_cache(), "draft model")
        self.seqs: dict[int, list[int]] = {}
        self.fed: dict[int, int] = {}  # tokens of seqs[sid] in the draft cache
        self.caches: dict[int, list] = {}
        self.rngs: dict[int, np.random.Generator] = {}

    def extend(self, sid: int, tokens: list[int]) -> None:
        self.seqs.setdefault(sid, []).extend(tokens)

    def drop(self, sid: int) -> None:
        for d in (self.seqs, self.fed, self.caches, self.rngs):
            d.pop(sid, None)

    def _logits(self, tokens: list[int], cache: list) -> mx.array:
        if len(tokens) == 1 and self.runner is not None and compiled.eligible(cache):
            out = self.runner.decode(mx.array([tokens]), cache)[0]
        else:
            out = self.model(mx.array([tokens]), cache=cache)[0, -1]
        return out[: self.vocab] if self.vocab is not None else out

    def propose(self, sid: int, n: int, params: SamplingParams) -> tuple[list[int], np.ndarray]:
        """n draft tokens after the sequence's last token, and their distributions (n, V)
        (empty when greedy). The draft cache then holds the sequence plus n-1 drafts."""
        seq, cache = self.seqs[sid], self.caches.setdefault(sid, self._make_cache())
        fed = self.fed.get(sid, 0)
        assert fed < len(seq), "the sequence's last token is always new to the draft"
        for start in range(fed, len(seq) - 1, 512):  # catch up a long prompt in chunks
            chunk = seq[start : min(start + 512, len(seq) - 1)]
            mx.eval(self.model(mx.array([chunk]), cache=cache))
        logits = self._logits(seq[-1:], cache)
        self.fed[sid] = len(seq)
        drafts, qs = [], []
        for i in range(n):
            d, q = draw(logits, params, self.rngs, sid)
            qs += [] if q is None else [q]
            drafts.append(d)
            if i < n - 1:
                logits = self._logits([d], cache)
        return drafts, np.stack(qs) if qs else np.zeros((0, 0))

    def propose_rows(
        self, sids: list[int], n: int, params: list[SamplingParams]
    ) -> list[tuple[list[int], np.ndarray]]:
        """`propose` for several sequences at once: one batched draft forward per draft
        position. Each row's cache is first brought to all but its last `lag` tokens (the same
        lag for every row: a cache ahead is trimmed and the token fed again), the row caches
        are merged into one left-padded batch, and split back afterwards."""
        if n == 0:  # a row's last token: nothing to draft, nothing fed
            return [([], np.zeros((0, 0))) for _ in sids]
        if len(sids) <= 1:
            return [self.propose(sid, n, p) for sid, p in zip(sids, params, strict=True)]
        seqs = [self.seqs[sid] for sid in sids]
        # After a verify step a row's draft lags 1 token (a rejection) or 2 (all accepted).
        lag = min(2, max(len(self.seqs[sid]) - self.fed.get(sid, 0) for sid in sids))
        caches = []
        for sid, seq in zip(sids, seqs, strict=True):
            cache = self.caches.setdefault(sid, self._make_cache())
            fed, want = self.fed.get(sid, 0), len(seq) - lag
            for start in range(fed, want, 512):  # catch up a long prompt in chunks
                chunk = seq[start : min(start + 512, want)]
                mx.eval(self.model(mx.array([chunk]), cache=cache))
            trim(cache, fed - want)
            self.fed[sid] = len(seq)
            caches.append(cache)
        batch = [type(layer[0]).merge(list(layer)) for layer in zip(*caches, strict=True)]
        logits = self._batch_logits([seq[-lag:] for seq in seqs], batch)
        drafts: list[list[int]] = [[] for _ in sids]
        qs: list[list[np.ndarray]] = [[] for _ in sids]
        for step in range(n):
            for i, (sid, p) in enumerate(zip(sids, params, strict=True)):
                d, q = draw(logits[i], p, self.rngs, sid)
                drafts[i].append(d)
                qs[i] += [] if q is None else [q]
            if step < n - 1:
                logits = self._batch_logits([[d[-1]] for d in drafts], batch)
        for i, sid in enumerate(sids):
            self.caches[sid] = [c.extract(i) for c in batch]
        empty = np.zeros((0, 0))
        return [(d, np.stack(q) if q else empty) for d, q in zip(drafts, qs, strict=True)]

    def _batch_logits(self, tokens: list[list[int]], cache: list) -> mx.array:
        if len(tokens[0]) == 1 and self.runner is not None and compiled.eligible(cache):
            out = self.runner.decode(mx.array(tokens), cache)  # (B, V)
        else:
            out = self.model(mx.array(tokens), cache=cache)[:, -1]
        return out[:, : self.vocab] if self.vocab is not None else out

    def settle(self, sid: int, n: int, accepted: int) -> None:
        """Drop the rejected drafts from the draft cache (it holds n-1 of them)."""
        if n == 0:
            return
        kept = min(accepted, n - 1)
        trim(self.caches[sid], n - 1 - kept)
        self.fed[sid] += kept


def _draft_runner(model, compile: bool | None):
    """A runner of the whole draft model on this (the leader's) process, for its compiled
    one-token steps; None where the family does not compile or compile is off (--compile as
    for the model)."""
    from thunderpool.engine.runner import Runner

    if not (compiled.wanted(compile) and compiled.supports(model)):
        return None
    runner = Runner(model, mx.distributed.init(), None)
    return runner if runner.compiled is not None else None


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
            acct.begin(B)
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
        rng = ex.drafter.rngs.setdefault(sids[i], _rng(params))
        outs.append(accept_sampled(d, p, q, rng))
    return [o.tolist() if isinstance(o, mx.array) else o for o in outs]


def follow(executor: Executor, k: int) -> None:
    """A follower's verify burst: the same exchanges and forwards as the leader's."""
    ex = executor
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


def drafter_for(job) -> Drafter | None:
    """The leader's draft for a RankJob that names one (--draft-model DIR, or mtp)."""
    if job.draft_model is None:
        return None
    if job.draft_model == "mtp":  # the model's own multi-token-prediction layer
        from thunderpool.engine.mtp import load_mtp_drafter

        return load_mtp_drafter(Path(job.model_dir), job.spec_k)
    return load_drafter(Path(job.draft_model), Path(job.model_dir), job.spec_k, job.compile)


def load_drafter(
    draft_dir: Path, target_dir: Path, k: int = DEFAULT_K, compile: bool | None = None
) -> Drafter:
    """The draft model, whole on this rank, after checking that it speaks the target's
    tokenizer: the same token-to-id map where both ship a tokenizer, else the same vocab size."""
    from mlx_lm.utils import load_model

    from thunderpool.engine.loader import read_config

    draft_cfg, target_cfg = read_config(draft_dir), read_config(target_dir)
    vocab = _vocab_size(target_cfg)
    has = [(d / "tokenizer.json").is_file() for d in (draft_dir, target_dir)]
    if all(has):
        mine, theirs = _token_ids(draft_dir), _token_ids(target_dir)
        if mine != theirs:
            differ = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
            raise ThunderpoolError(
                f"--draft-model {draft_dir} has another tokenizer than the model {target_dir} "
                f"(e.g. {differ}); pick a draft of the same model family and tokenizer"
            )
    elif any(has) or _vocab_size(draft_cfg) != vocab:
        raise ThunderpoolError(
            f"--draft-model {draft_dir} (vocab {_vocab_size(draft_cfg)}) cannot be checked "
            f"against the tokenizer of {target_dir} (vocab {vocab}); a draft must share the "
            "model's tokenizer files, or (without any) its vocabulary size"
        )
    model, _ = load_model(draft_dir)
    return Drafter(model, k, vocab, compile=compile)


def _vocab_size(config: dict) -> int:
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0))


def _token_ids(model_dir: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab()
