"""The one place a command's arguments (and a plan's layout) become a RankJob."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from thunderpool.engine.job import RankJob, ServeTask, Task
from thunderpool.errors import ThunderpoolError
from thunderpool.parallel.layout import Layout


def rank_job(
    args: argparse.Namespace,
    task: Task,
    world: int,
    layout: Layout,
    model_dir: str,
    backend: str = "ring",
) -> RankJob:
    """A job of `world` ranks running `task` in `layout` (a plan's, or the flags'), with what
    every command shares: prefill chunk, compiled steps, KV-cache format and speculation."""
    compile_ = args.compile
    if compile_ is None and isinstance(task, ServeTask):
        # serve decodes eagerly unless asked: under its churn the compiled step's memory
        # grows (~0.8-1 MiB/s per rank in the soak, cause not found; README).
        compile_ = False
    layout = replace(layout, compile=compile_, **kv_fields(args))
    return RankJob(
        model_dir=model_dir,
        world_size=world,
        backend=backend,
        task=task,
        layout=layout,
        prefill_chunk=args.prefill_chunk,
        **draft_fields(args),
    )


def local_layout(args: argparse.Namespace, model_dir: Path, nodes: int) -> tuple[Layout, dict]:
    """The flags' layout of `nodes` ranks on this host, checked against the model before any
    rank starts: (the layout, the model's config)."""
    from thunderpool.engine.loader import preflight

    layout = Layout(
        args.parallel or "tp",
        args.tp_weights,
        args.layer_split,
        getattr(args, "expert_split", None),
        groups=tuple(args.groups) if getattr(args, "groups", None) else None,
        **replica_fields(args, model_dir, nodes),
        **kv_fields(args),
    )
    return layout, preflight(model_dir, nodes, layout)


def replica_fields(args: argparse.Namespace, model_dir: Path, nodes: int) -> dict:
    """{"expert_replicas": ...} for --replicate-experts on `nodes` EP ranks, else {}."""
    copies = getattr(args, "replicate_experts", None)
    if not copies or nodes < 2:
        return {}
    from thunderpool.planner.replicas import expert_replicas

    split = getattr(args, "expert_split", None)
    replicas = expert_replicas(
        model_dir, nodes, copies, args.routing, args.tp_weights, list(split) if split else None
    )
    return {"expert_replicas": replicas}


def kv_fields(args: argparse.Namespace) -> dict:
    """Layout fields of --kv-bits/--kv-group-size (every rank quantizes its KV cache alike)."""
    bits = getattr(args, "kv_bits", None)
    if bits is None:
        return {}
    return {"kv_bits": bits, "kv_group_size": args.kv_group_size}


def draft_fields(args: argparse.Namespace) -> dict:
    """RankJob fields of --draft-model/--spec-k (speculative decoding). Resolved here for local
    ranks; with --cluster it travels as named, and the leader's node resolves it to its own
    copy (the coordinator checks first that it has one: fabric.check_draft)."""
    if not getattr(args, "draft_model", None):
        return {}
    if args.draft_model == "mtp":  # the model's own multi-token-prediction layer (engine/mtp.py)
        return {"draft_model": "mtp", "spec_k": args.spec_k}
    if getattr(args, "cluster", False):
        return {"draft_model": args.draft_model, "spec_k": args.spec_k}
    from thunderpool.models.source import resolve_model

    return {"draft_model": str(resolve_model(args.draft_model)), "spec_k": args.spec_k}


def prefix_cache_bytes(args) -> float:
    gb = getattr(args, "prefix_cache_gb", 0.0) or 0.0
    if gb < 0:
        raise ThunderpoolError(f"--prefix-cache-gb {gb} is negative; use 0 to turn it off")
    return gb * 2**30
