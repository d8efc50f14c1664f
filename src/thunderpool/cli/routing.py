"""`thunderpool route-counts`: measure a MoE model's expert routing for --replicate-experts."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from thunderpool.parallel.routing import ROUTING_FILE, calibration_prompts, measure


def route_counts_main(args: argparse.Namespace) -> int:
    """`thunderpool route-counts`: measure and write the JSON (next to the model by default)."""
    from thunderpool.engine.loader import build_lazy
    from thunderpool.models.source import resolve_model

    model_dir = resolve_model(args.model)
    texts = None
    if args.prompts:
        texts = [t for t in Path(args.prompts).read_text().splitlines() if t.strip()]
    model, config = build_lazy(model_dir)
    counts = measure(model, config, calibration_prompts(model_dir, texts))
    out = Path(args.out) if args.out else model_dir / ROUTING_FILE
    out.write_text(counts.model_dump_json(indent=1))
    hot = {i: int(np.argmax(c)) for i, c in counts.layers.items()}
    share = max(max(c) / max(1, sum(c)) for c in counts.layers.values())
    print(
        f"{counts.tokens} tokens, {len(counts.layers)} MoE layers; hottest expert per layer "
        f"{hot}; the hottest takes {share:.0%} of its layer's routes (uniform: "
        f"{1 / counts.experts:.0%}); wrote {out}"
    )
    return 0
