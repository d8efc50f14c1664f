"""The flags several subcommands share (layout, speculation, replication, backend) and their
value parsers, each with an error naming the bad value."""

from __future__ import annotations

import argparse

from thunderpool.errors import LaunchError, ThunderpoolError
from thunderpool.launch import mpi


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        msg = f"'{text}' is not a comma-separated list of integers"
        raise argparse.ArgumentTypeError(msg) from None


def parse_floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        msg = f"'{text}' is not a comma-separated list of numbers"
        raise argparse.ArgumentTypeError(msg) from None


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(","))
    if not modes or any(m not in ("tp", "pp", "ep", "hybrid") for m in modes):
        raise argparse.ArgumentTypeError(
            f"'{text}' must be a comma-separated subset of tp,pp,ep,hybrid"
        )
    return modes


def parse_positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' must be a whole number >= 1")
    return value


def add_layout(p: argparse.ArgumentParser, many_models: bool = False) -> None:
    p.add_argument(
        "--model",
        action="append" if many_models else "store",
        help="MLX/HF model dir, .gguf file or Hugging Face repo id "
        "(default: the embedded SmolLM2-135M-Instruct)"
        + ("; repeat it to serve several models, each on its own ranks" if many_models else ""),
    )
    p.add_argument(
        "--nodes",
        type=parse_positive,
        help="number of ranks (default 2 locally; with --cluster, the planner's)",
    )
    p.add_argument(
        "--parallel",
        choices=("tp", "pp", "ep", "hybrid"),
        help="tensor parallel (faster), pipeline parallel (fits bigger models), for MoE "
        "models expert parallel (whole experts per rank, attention as TP), or hybrid (TP "
        "inside each of --groups, PP between them); "
        "default tp locally, the planner's choice with --cluster",
    )
    add_groups(p)
    p.add_argument(
        "--cluster",
        action="store_true",
        help="run on the cluster's nodes (see `thunderpool node`) as planned",
    )
    from thunderpool.cli.connect import add_cluster_args

    add_cluster_args(p)
    p.add_argument("--layer-split", type=parse_ints, help="PP: per-rank layer weights, e.g. 20,10")
    p.add_argument("--tp-weights", type=parse_floats, help="TP: per-rank head shares, e.g. 2,1")
    p.add_argument(
        "--expert-split",
        type=parse_ints,
        help="EP: routed experts per rank, e.g. 96,160 (default: in proportion to --tp-weights)",
    )
    add_replication(p)
    add_backend(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds of silence from the ranks before all are stopped (default 600)",
    )
    add_allow_untested(p)
    add_compile(p)


def add_replication(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--replicate-experts",
        type=parse_positive,
        metavar="N",
        help="EP: copy each MoE layer's N most routed experts onto the least loaded other "
        "rank (tokens split between the copies); needs routing counts (`route-counts`)",
    )
    p.add_argument(
        "--routing",
        metavar="FILE",
        help="routing counts for --replicate-experts and `plan` (default: "
        "thunderpool-routing.json next to the model)",
    )


def check_replication(args: argparse.Namespace) -> None:
    """--replicate-experts copies experts from one EP rank to another: one rank has none to
    copy to, so the flag would silently do nothing there."""
    copies, nodes = getattr(args, "replicate_experts", None), getattr(args, "nodes", None)
    if not copies or (nodes is None and getattr(args, "cluster", False)):
        return  # with --cluster and no --nodes, the planner's EP ranks take the copies
    most = max(nodes) if isinstance(nodes, tuple) else nodes or 2  # bench: a list
    if most < 2:
        raise ThunderpoolError(
            f"--replicate-experts {copies} copies experts between expert-parallel ranks, and "
            f"--nodes {most} runs one rank: nothing to copy to; use --nodes 2 or more, or "
            "drop --replicate-experts"
        )


def add_groups(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--groups",
        type=parse_ints,
        help="hybrid: ranks per pipeline stage, each stage a TP group in its own MLX world, "
        "e.g. 2,2 (uneven: 2,1; layers per stage with --layer-split, heads per rank with "
        "--tp-weights over all ranks in order)",
    )


def check_hybrid(args: argparse.Namespace) -> None:
    """--parallel hybrid and --groups go together; --nodes defaults to their sum."""
    groups, parallel = getattr(args, "groups", None), getattr(args, "parallel", None)
    if hasattr(args, "modes"):  # bench: hybrid is one of --modes
        parallel = "hybrid" if "hybrid" in args.modes else None
    if groups and parallel != "hybrid":
        raise ThunderpoolError(
            "--groups sizes the stages of --parallel hybrid (bench: --modes hybrid); add it"
        )
    if parallel != "hybrid":
        return
    if getattr(args, "cluster", False):
        if groups:
            raise ThunderpoolError(
                "--groups names local groups; with --cluster the planner forms them from "
                "the RDMA-joined nodes: drop --groups"
            )
        return
    if not groups:
        raise ThunderpoolError("--parallel hybrid needs --groups, e.g. --groups 2,2")
    from thunderpool.parallel.handoff import check_groups

    if hasattr(args, "modes"):
        check_groups(groups)
        args.nodes = tuple(sorted({*args.nodes, sum(groups)}))  # hybrid runs at sum(groups)
    else:
        check_groups(groups, getattr(args, "nodes", None))
        args.nodes = sum(groups)
    if getattr(args, "draft_model", None):
        raise ThunderpoolError(
            "speculative decoding does not run on --parallel hybrid yet; drop --draft-model "
            "or use --parallel tp or pp"
        )
    if getattr(args, "backend", None) == "mpi":
        raise ThunderpoolError(
            "--parallel hybrid runs each group as its own MLX ring world; use --backend ring"
        )


def add_compile(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode with the compiled, fused step where it is proven equal (llama, qwen2, "
        "qwen3, qwen3_moe; one rank, TP and PP), its products split over a CPU rank's cores "
        "(default: on for CPU ranks, off for GPU ranks (Metal, CUDA), where it has not yet "
        "been run against eager, and off for serve, where its memory grows under load "
        "(README): --compile turns it on there; --no-compile: op by op everywhere; "
        "docs/benchmarks.md section 8)",
    )


def add_allow_untested(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-untested",
        action="store_true",
        help="run a sharded layout not yet verified against the unsharded model for this "
        "model family, without the day-0 proof on a tiny model of its architecture (a loud "
        "warning; the output may be wrong)",
    )


def add_speculation(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-model",
        help="speculative decoding: a small model of the same tokenizer that drafts tokens on "
        "the leader (or, on TP, sharded over the ranks) for the model to verify (dir, .gguf or "
        "hub id; batches of up to 4 rows), or "
        "`mtp`: the model's own multi-token-prediction layer (DeepSeek V3, GLM-4.5)",
    )
    p.add_argument(
        "--spec-k", type=parse_positive, default=4, help="draft tokens per verify step (default 4)"
    )


def add_backend(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=("auto", "ring", "mpi"),
        default="auto",
        help="collectives between local ranks: MPI shared memory under Open MPI's mpirun "
        "(faster on one host) or MLX ring over loopback; auto (default) takes mpi when "
        "Open MPI is installed, else ring (serve: ring where its ranks fill every core, as "
        "waiting MPI ranks spin and starve the API's streaming; --cluster picks per link)",
    )


def add_kv_bits(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=(8, 4),
        help="store the KV cache quantized to 8 or 4 bits (mlx-lm's QuantizedKVCache, alike "
        "on every rank, in batches and in the prefix cache): about 0.53x / 0.28x the memory of "
        "a 16-bit cache per context token; refused for sliding-window, recurrent and latent "
        "caches (default: unquantized)",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        choices=(32, 64, 128),
        default=64,
        help="--kv-bits: values per scale and bias, along a head (default 64, as mlx-lm)",
    )


def resolve_backend(args, world_size: int, serving: bool = False) -> str:
    """The collective backend for local ranks: "auto" takes MPI's shared memory when Open MPI
    is installed (it wins on one host, docs/benchmarks.md), else MLX ring; but `serving`
    (a gateway streams beside the ranks) takes ring when the ranks fill every core: waiting
    MPI ranks spin and starved the gateway (SSE stalls of seconds, docs/benchmarks.md), ring
    ranks block. An explicit mpi is refused with --cluster (the planner picks jaccl or ring
    per link) or without Open MPI."""
    requested = getattr(args, "backend", "auto")
    if getattr(args, "cluster", False):
        if requested == "mpi":
            raise LaunchError(
                "--backend mpi is for ranks on this host; with --cluster the coordinator uses "
                "jaccl over RDMA or ring over TCP; drop --backend"
            )
        return "ring"
    if requested == "mpi":
        mpi.find_mpi()  # module lookups: tests fake them there
        return "mpi" if world_size > 1 else "ring"
    if requested == "auto" and world_size > 1 and mpi.mpi_available():
        return "ring" if serving and world_size >= mpi.cores_here() else "mpi"
    return "ring"
