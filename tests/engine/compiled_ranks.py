"""Compiled against eager decode of the same batch scenario, alike on every rank.

Each rank runs the scenario twice (eager on the model loaded with compile off, so with
unfused projections; then compiled and fused) on the runners directly, so TP's all_sums
line up without the engine's protocol: a row prefills and decodes alone, a second row of
another length joins (a left-padded batch), then the first leaves. Inputs are fixed
tokens (teacher forcing), so every step compares the same logits. Multi-rank:
`python compiled_ranks.py SPEC.json OUT.json` under MLX_RANK/MLX_HOSTFILE (ring).
"""

from __future__ import annotations

import thunderpool

if __name__ == "__main__":  # this rank program, not a test importing it
    thunderpool.hide_torch()

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from thunderpool.engine.batch import BatchState
from thunderpool.engine.loader import Layout, load_shard
from thunderpool.engine.runner import Runner

PROMPTS = ([3, 17, 42, 9, 100, 7, 250], [5, 8, 13, 21, 34, 55, 89, 144, 233, 1, 2, 3, 4])
# (sequence ids joining before the steps, ids dropping before them, decode steps)
PHASES = (((0,), (), 3), ((1,), (), 4), ((), (0,), 3))
# Verify windows (speculation): (ids joining, ids dropping, window width, trims after it);
# uneven trims leave rows at different lengths (a rolled, left-padded batch), and a decode
# step follows each window.
WINDOWS = (((0,), (), 5, [3]), ((), (), 3, [1]), ((1,), (), 4, [1, 3]), ((), (), 5, [0, 2]),
           ((), (0,), 2, [0]))  # fmt: skip


def scenario(runner: Runner, compiled: bool) -> dict:
    """Last-position logits (B, V) of every decode step on the leader (fp32 lists)."""
    saved = runner.compiled
    runner.compiled = saved if compiled else None
    state, logits, feed = BatchState(runner), [], 0
    before = saved.steps if saved is not None else 0
    try:
        for join, drop, steps in PHASES:
            state.drop(set(drop))
            for sid in join:
                out = state.prefill(sid, PROMPTS[sid])
                mx.eval(out)
                state.join(sid)
            for _ in range(steps):
                feed += 1
                tokens = mx.array([(feed * 31 + sid * 7) % 200 for sid in state.rows])
                out = state.decode(tokens)
                mx.eval(out)
                if runner.is_leader:
                    logits.append(np.array(out.astype(mx.float32)).tolist())
    finally:
        runner.compiled = saved
    used = (saved.steps - before) if saved is not None else 0
    return {"logits": logits, "compiled_steps": used}


def windows(runner: Runner, compiled: bool) -> dict:
    """Every position's logits (B, L, V) of each verify window, and the last-position logits
    of the decode step after it, on the leader."""
    saved = runner.compiled
    runner.compiled = saved if compiled else None
    state, logits, feed = BatchState(runner), [], 0
    before = saved.verifies if saved is not None else 0
    try:
        for join, drop, width, trims in WINDOWS:
            state.drop(set(drop))
            for sid in join:
                mx.eval(state.prefill(sid, PROMPTS[sid]))
                state.join(sid)
            feed += 1
            tokens = [[(feed * 37 + sid * 11 + i * 5) % 200 for i in range(width)]
                      for sid in state.rows]  # fmt: skip
            outs = [state.verify(mx.array(tokens))]
            mx.eval(outs[0])
            state.trim_rows(trims)
            outs.append(state.decode(mx.array([t[0] for t in tokens])))
            mx.eval(outs[1])
            if runner.is_leader:
                logits += [np.array(o.astype(mx.float32)).tolist() for o in outs]
    finally:
        runner.compiled = saved
    used = (saved.verifies - before) if saved is not None else 0
    return {"logits": logits, "compiled_verifies": used}


def compare(runner: Runner, reference: Runner) -> dict:
    """The compiled (and fused) decode and verify windows of `runner` against the eager ones
    of `reference`, the same model loaded with compile off: its projections unfused."""
    result = {
        "eager": scenario(reference, False),
        "compiled": scenario(runner, True),
        "compiles_windows": runner.compiled is not None and runner.compiled.windows,
    }
    # Rotating (sliding-window) caches cannot trim per row: such models never speculate.
    if all(type(c).__name__ == "KVCache" for c in reference.make_cache()):
        result["windows"] = {"eager": windows(reference, False), "compiled": windows(runner, True)}
    return result


def fused(runner: Runner) -> bool:
    """Whether the compiled step runs the fused forward (engine/fused.py)."""
    return runner.compiled is not None and runner.compiled.fused is not None


def split(runner: Runner) -> dict:
    """How many row parts the first fused layer's products run in (0: unsplit); "o_reduced":
    whether its o projection is TP's row-parallel one (an all_sum after the product)."""
    if not fused(runner):
        return {}
    layer = runner.compiled.fused.layers[0]
    o = layer.o.local if hasattr(layer.o, "local") else layer.o
    qkv = layer.qkv.members[0] if hasattr(layer.qkv, "members") else layer.qkv  # input-major: q
    return {"qkv": len(qkv.parts), "o": len(o.parts), "o_reduced": hasattr(layer.o, "group")}


def main(spec_path: str, out_path: str) -> None:
    """Every (layout, model) of the spec, in one launch of the ranks: {"tp/llama": ...}."""
    spec = json.loads(Path(spec_path).read_text())
    group = mx.distributed.init(backend="ring", strict=True)
    results = {}
    for parallel, models in spec["layouts"].items():
        for name, model in models.items():
            runner, _, _ = load_shard(Path(model), group, Layout(parallel, compile=True))
            reference, _, _ = load_shard(Path(model), group, Layout(parallel, compile=False))
            results[f"{parallel}/{name}"] = {
                **compare(runner, reference),
                "fused": fused(runner),
                "split": split(runner),
            }
    if group.rank() == 0:
        Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:3])
