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
from collections import Counter
from collections.abc import Iterator

import mlx.core as mx

from thunderpool.engine.measure import replaced as _replaced
from thunderpool.engine.measure import solo_collectives, solo_compute, solo_decode_ms
from thunderpool.engine.sampling import SamplingParams

__all__ = ["counting_collectives", "solo_collectives", "solo_compute", "solo_decode_ms"]

COLLECTIVES = ("all_sum", "all_gather", "all_max", "all_min", "sum_scatter", "send", "recv")


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


def count_decode_step(engine, prompt: list[int]) -> dict:
    """The collectives the leader issues for one steady decode step (greedy).

    The engine builds step k+1 just before (pipelined) or just after delivering token k, so
    the calls between the second and the third token are exactly one step's graph.
    """
    marks: list[tuple[dict, int]] = []
    # A compiled step calls mx.distributed only while tracing; its graph holds the same
    # collectives, so they are counted on the eager step.
    compiled, engine.runner.compiled = engine.runner.compiled, None
    try:
        with counting_collectives() as counts:

            def on_event(ev) -> None:
                marks.append((dict(counts), engine.control.collectives))

            engine.generate(prompt, SamplingParams(max_tokens=8), on_event)
    finally:
        engine.runner.compiled = compiled
    (before, c_before), (after, c_after) = marks[1], marks[2]
    by_op = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    total = sum(by_op.values())
    control = c_after - c_before
    return {
        "by_op": dict(sorted(by_op.items())),
        "model": total - control,
        "control": control,
        "total": total,
    }


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
