"""Ops one decode step dispatches, eager or compiled: the nodes of its graph, counted.

Method: prefill a short prompt, run two decode steps (the compiled one traces on its first),
build a third lazily and write its graph (the logits and every layer's new cache) with
`mx.export_to_dot`; each rectangle is one primitive the step evaluates. Views (reshapes,
transposes, broadcasts, slices) are counted apart from kernels, which compute; a compiled
step's fused elementwise chains show as one `Compiled...` kernel each.
"""

from __future__ import annotations

import io
import re
from collections import Counter

import mlx.core as mx

from thunderpool.engine.runner import Runner

VIEWS = frozenset(
    {"Broadcast", "Transpose", "Flatten", "Unflatten", "Reshape", "ExpandDims", "Squeeze", "Slice"}
)
_NODE = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


def decode_step_ops(runner: Runner, compiled: bool, prompt: tuple[int, ...] = (1, 2, 3, 4)):
    """{"total", "views", "kernels", "fused", "by_op"} of one steady decode step of one row."""
    saved = runner.compiled
    runner.compiled = saved if compiled else None
    try:
        cache = runner.make_cache()
        mx.eval(runner.forward(mx.array([list(prompt)]), cache))
        for _ in range(2):
            mx.eval(runner.decode(mx.array([[prompt[-1]]]), cache))
        out = runner.decode(mx.array([[prompt[-1]]]), cache)
        dot = io.StringIO()
        mx.export_to_dot(dot, out, *[c.keys for c in cache], *[c.values for c in cache])
        mx.eval(out)
    finally:
        runner.compiled = saved
    by_op = Counter(label.split()[0] for label in _NODE.findall(dot.getvalue()))
    total = sum(by_op.values())
    views = sum(n for op, n in by_op.items() if op in VIEWS)
    fused = sum(n for op, n in by_op.items() if op.startswith("Compiled"))
    return {
        "total": total,
        "views": views,
        "kernels": total - views,
        "fused": fused,
        "by_op": dict(by_op.most_common()),
    }
