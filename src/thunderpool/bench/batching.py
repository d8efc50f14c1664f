"""Aggregate decode throughput under continuous batching: C concurrent streams at once, and
on one rank mlx-lm's own batched generation (`BatchGenerator`) on the same checkpoint and
prompts, loaded by mlx-lm as its users run it (not our rank's model, whose projections are
input-major on a CPU: engine/kmajor.py)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from thunderpool.engine.engine import Engine
from thunderpool.engine.sampling import SamplingParams


def bench_concurrency(
    engine: Engine,
    levels: tuple[int, ...],
    prompt_tokens: int,
    max_tokens: int,
    vocab: int,
    model_dir: Path,
) -> list[dict]:
    """For each level C, C greedy requests submitted together.

    aggregate_tps counts every token over the whole wall time (prefills included);
    decode_tps counts the tokens emitted once all C streams are decoding together. On one
    rank the same prompts then run through mlx-lm's BatchGenerator (mlx_lm_* keys)."""
    rng = np.random.default_rng(0)
    results, theirs_model = [], None
    if engine.control.size == 1:
        from mlx_lm.utils import load_model

        theirs_model, _ = load_model(model_dir)
    for c in levels:
        prompts = [rng.integers(0, vocab, prompt_tokens).tolist() for _ in range(c)]
        ours = _ours(engine, prompts, max_tokens)
        result = {"concurrency": c, **ours.rates()}
        if theirs_model is not None:
            theirs = _mlx_lm(theirs_model, prompts, max_tokens)
            result.update({f"mlx_lm_{k}": v for k, v in theirs.rates().items()})
            result["same_tokens_as_mlx_lm"] = ours.tokens == theirs.tokens
        results.append(result)
    return results


class _Emits:
    """Each stream's tokens and the time each arrived."""

    def __init__(self, streams: int):
        self.tokens: list[list[int]] = [[] for _ in range(streams)]
        self.times: list[tuple[int, float]] = []
        self.start = time.perf_counter()

    def add(self, stream: int, token: int) -> None:
        self.tokens[stream].append(token)
        self.times.append((stream, time.perf_counter()))

    def rates(self) -> dict:
        end = self.times[-1][1]
        streams = len(self.tokens)
        all_decoding = max(min(t for j, t in self.times if j == i) for i in range(streams))
        steady = [t for _, t in self.times if t > all_decoding]
        return {
            "wall_s": end - self.start,
            "aggregate_tps": len(self.times) / (end - self.start),
            "decode_tps": len(steady) / (end - all_decoding) if steady else 0.0,
        }


def _ours(engine: Engine, prompts: list[list[int]], max_tokens: int) -> _Emits:
    engine.scheduler.max_batch = len(prompts)
    emits, params = _Emits(len(prompts)), SamplingParams(max_tokens=max_tokens)
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, params, lambda ev, i=i: emits.add(i, ev.token))
    while engine.step():
        pass
    return emits


def _mlx_lm(model, prompts: list[list[int]], max_tokens: int) -> _Emits:
    """mlx-lm's continuous batching (greedy, no stop tokens: every stream runs max_tokens)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=len(prompts))
    emits = _Emits(len(prompts))
    try:
        uids = gen.insert(prompts, [max_tokens] * len(prompts))
        stream = {uid: i for i, uid in enumerate(uids)}
        while responses := gen.next_generated():
            for r in responses:
                if r.finish_reason != "stop":
                    emits.add(stream[r.uid], int(r.token))
    finally:
        gen.close()
    return emits
