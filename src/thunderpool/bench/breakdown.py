"""Where a decode step's time goes: compute, collectives and waiting.

Method, per layout, measured on the real instance after its timed runs:

1. step: the median decode step of the timed runs (1 / median decode tok/s).
2. count: the collectives the leader issues in one steady decode step, counted by wrapping
   `mx.distributed`'s functions while that step's graph is built; `Control.collectives` tells
   the control ones (the token exchange) from the model's.
3. compute: every rank at once decodes the same prompt on its own shard with the collectives
   replaced by local stand-ins (all_sum -> identity, send -> its input, recv -> zeros): the
   same kernels and shapes, no communication. The per-rank medians come back in one real
   all_sum. TP takes the slowest rank (each all_sum waits for it); PP adds the stages (one
   sequence visits them in turn).
4. latency: the median time of one all_sum of a hidden-size row and of one control-size
   message, each alone with an eval around it (a little more than inside a graph).

   TP's split output head adds one all_gather of this rank's logits, timed the same way.

collective = the model's all_sums (or sends and recvs) x hidden latency + gathers x gather
latency + control count x control latency; wait = step - compute - collective, clamped at 0
(imbalance, Python between steps, sync the estimate misses). `collective_ratio` = (step -
compute) / (the model's all_sums x hidden latency): what the collectives really add (the
logits' gather included) against the latency bound, `layers x 2 x latency` for TP.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Iterator

import mlx.core as mx

from thunderpool.engine.batch import overlaps
from thunderpool.engine.runner import Runner
from thunderpool.engine.sampling import SamplingParams

COLLECTIVES = ("all_sum", "all_gather", "all_max", "all_min", "sum_scatter", "send", "recv")


@contextlib.contextmanager
def _replaced(fns: dict) -> Iterator[None]:
    """mx.distributed's functions named in `fns` replaced inside the block, restored after."""
    originals = {name: getattr(mx.distributed, name) for name in fns}
    try:
        for name, fn in fns.items():
            setattr(mx.distributed, name, fn)
        yield
    finally:
        for name, fn in originals.items():
            setattr(mx.distributed, name, fn)


@contextlib.contextmanager
def counting_collectives() -> Iterator[Counter]:
    """Counts every mx.distributed collective built inside the block, by name."""
    counts: Counter = Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    with _replaced({n: counted(n, getattr(mx.distributed, n)) for n in COLLECTIVES}):
        yield counts


@contextlib.contextmanager
def solo_collectives() -> Iterator[None]:
    """Inside the block collectives are local no-ops of the right shape (compute-only runs)."""
    stand_ins = {
        "all_sum": lambda x, *a, **k: x,
        "send": lambda x, *a, **k: x,
        "recv": lambda shape, dtype, *a, **k: mx.zeros(shape, dtype),
        # Every rank's share of the split output head stands in for the others' (same shape).
        "all_gather": lambda x, *a, group=None, **k: mx.concatenate([x] * _size(group)),
    }
    with _replaced(stand_ins):
        yield


def _size(group) -> int:
    return group.size() if group is not None else 1


def count_decode_step(leader, prompt: list[int]) -> dict:
    """The collectives the leader issues for one steady decode step (greedy).

    The engine builds step k+1 just before (pipelined) or just after yielding token k, so the
    calls between the second and the third token are exactly one step's graph. Closing the
    generator then, well before its last token, also exercises the early-stop path.
    """
    steps = leader.generate_ids(prompt, SamplingParams(max_tokens=8))
    next(steps)
    next(steps)
    control_before = leader.control.collectives
    with counting_collectives() as counts:
        next(steps)
    control = leader.control.collectives - control_before
    steps.close()
    total = sum(counts.values())
    return {
        "by_op": dict(sorted(counts.items())),
        "model": total - control,
        "control": control,
        "total": total,
    }


def solo_decode_ms(runner: Runner, prompt: list[int], steps: int) -> float:
    """Median ms per decode step of this rank's shard alone, pipelined where the engine is."""
    pipeline = overlaps(runner)
    with solo_collectives():
        cache = runner.make_cache()
        out = runner.forward(mx.array([prompt]), cache)
        token = _next_token(runner, out, prompt[-1])
        mx.eval(token, *_arrays(out))
        times, pending, last = [], None, time.perf_counter()
        for _ in range(steps):
            out = runner.forward(token[:, None], cache)
            token = _next_token(runner, out, prompt[-1])
            current = [token, *_arrays(out)]
            # Stepped one at a time where the engine is (batch.overlaps).
            (mx.async_eval if pipeline else mx.eval)(current)
            if pending is not None:
                mx.eval(pending)
                now = time.perf_counter()
                times.append(now - last)
                last = now
            pending = current
        mx.eval(pending)
        times.append(time.perf_counter() - last)
    return statistics.median(times) * 1e3


def _arrays(out: mx.array | None) -> list[mx.array]:
    return [] if out is None else [out]


def _next_token(runner: Runner, out: mx.array | None, fallback: int) -> mx.array:
    """The leader samples greedily like a real step; followers feed a fixed token."""
    if runner.is_leader and out is not None:
        return mx.argmax(out, axis=-1)
    return mx.array([fallback])


def solo_compute(
    runner: Runner, group: mx.distributed.Group, prompt: list[int], steps: int
) -> list[float]:
    """Every rank runs `solo_decode_ms` at once; returns each rank's median ms (all ranks)."""
    mine = solo_decode_ms(runner, prompt, steps)
    slots = [0.0] * group.size()
    slots[group.rank()] = mine
    if group.size() == 1:
        return slots
    summed = mx.distributed.all_sum(mx.array(slots), group=group, stream=mx.cpu)
    return summed.tolist()


def decode_breakdown(
    step_ms: float,
    parallel: str,
    compute_ms_by_rank: list[float],
    counts: dict,
    hidden_latency_ms: float,
    control_latency_ms: float,
    gather_latency_ms: float = 0.0,
) -> dict:
    """Split one decode step (see the module docstring); pure, so unit-testable."""
    if parallel == "single" or not compute_ms_by_rank:
        compute = step_ms
    elif parallel == "pp":
        compute = sum(compute_ms_by_rank)
    else:
        compute = max(compute_ms_by_rank)
    gathers = counts["by_op"].get("all_gather", 0)
    hidden_ones = counts["model"] - gathers  # TP: the layers' all_sums; PP: send and recv
    collective = (
        hidden_ones * hidden_latency_ms
        + gathers * gather_latency_ms
        + counts["control"] * control_latency_ms
    )
    added = max(step_ms - compute, 0.0)
    bound = hidden_ones * hidden_latency_ms
    return {
        "step_ms": step_ms,
        "compute_ms": compute,
        "compute_ms_by_rank": compute_ms_by_rank,
        "collective_ms": collective,
        "wait_ms": max(step_ms - compute - collective, 0.0),
        "measured_collective_ms": added,
        "latency_bound_ms": bound,
        # The goal (<= 1.2) is TP's; a PP step's excess is its stages waiting for each other.
        "collective_ratio": added / bound if bound and parallel == "tp" else None,
        "collectives_per_step": counts,
        "hidden_all_sum_ms": hidden_latency_ms,
        "control_all_sum_ms": control_latency_ms,
        "logits_all_gather_ms": gather_latency_ms,
    }
