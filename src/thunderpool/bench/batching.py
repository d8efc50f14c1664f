"""Aggregate decode throughput under continuous batching: C concurrent streams at once."""

from __future__ import annotations

import time

import numpy as np

from thunderpool.engine.engine import Engine
from thunderpool.engine.sampling import SamplingParams


def bench_concurrency(
    engine: Engine, levels: tuple[int, ...], prompt_tokens: int, max_tokens: int, vocab: int
) -> list[dict]:
    """For each level C, C greedy requests submitted together.

    aggregate_tps counts every token over the whole wall time (prefills included);
    decode_tps counts the tokens emitted once all C streams are decoding together.
    """
    rng = np.random.default_rng(0)
    results = []
    for c in levels:
        engine.scheduler.max_batch = c
        emits: list[tuple[int, float]] = []
        params = SamplingParams(max_tokens=max_tokens)
        start = time.perf_counter()
        for i in range(c):
            prompt = rng.integers(0, vocab, prompt_tokens).tolist()
            engine.submit(
                prompt, params, lambda d, i=i, e=emits: e.append((i, time.perf_counter()))
            )
        while engine.step():
            pass
        end = emits[-1][1]
        all_decoding = max(min(t for j, t in emits if j == i) for i in range(c))
        steady = [t for _, t in emits if t > all_decoding]
        results.append(
            {
                "concurrency": c,
                "wall_s": end - start,
                "aggregate_tps": len(emits) / (end - start),
                "decode_tps": len(steady) / (end - all_decoding) if steady else 0.0,
            }
        )
    return results
