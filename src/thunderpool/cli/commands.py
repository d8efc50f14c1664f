"""What each CLI subcommand does, kept apart from argument parsing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from thunderpool.cli.jobs import local_layout, rank_job, replica_fields
from thunderpool.errors import ThunderpoolError
from thunderpool.parallel.layout import Layout
from thunderpool.progress import LoadBar


def _mib(n: int | float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _instance(args: argparse.Namespace, make_job, timeout: float | None):
    """Local ranks on this host, or the planned ranks across the cluster (--cluster)."""
    from thunderpool.cli.flags import resolve_backend
    from thunderpool.cli.proof import admit
    from thunderpool.launch.mpi import local_instance
    from thunderpool.models.source import resolve_model

    nodes = args.nodes or 2
    groups = getattr(args, "groups", None)
    # Hybrid: one MLX ring world per group (mpirun starts one world), joined by hand-offs.
    backend = "ring" if groups else resolve_backend(args, nodes)
    if args.cluster:
        from thunderpool.cli.cluster import cluster_instance

        return cluster_instance(args, make_job, timeout), args.model or "SmolLM2-135M-Instruct"
    model_dir = resolve_model(args.model)
    layout, config = local_layout(args, model_dir, nodes)
    admit(config, nodes, layout, args.allow_untested, backend, Console(stderr=True))
    if getattr(args, "draft_model", None) == "mtp":
        from thunderpool.engine.mtp import check_mtp_files

        check_mtp_files(model_dir, config)
    job = make_job(nodes, layout, str(model_dir), backend)
    return local_instance(job, timeout=timeout), model_dir.name


def generate(args: argparse.Namespace) -> int:
    from thunderpool.engine.job import GenerateTask
    from thunderpool.engine.sampling import SamplingParams

    err = Console(stderr=True)
    try:
        sampling = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
        )
    except ValueError as e:
        raise ThunderpoolError(_first_error(e)) from None
    task = GenerateTask(prompt=args.prompt, chat=not args.raw, sampling=sampling)

    def make_job(world: int, layout: Layout, model_dir: str | None = None, backend: str = "ring"):
        return rank_job(args, task, world, layout, model_dir or args.model or "", backend)

    instance, name = _instance(args, make_job, args.timeout)
    world = instance.job.world_size
    mode = instance.job.layout.parallel.upper() if world > 1 else "single rank"
    from thunderpool.launch.mpi import LOCAL_BACKENDS

    where = "the cluster" if args.cluster else LOCAL_BACKENDS[instance.job.backend]
    err.print(f"[dim]{name}: {world} rank(s), {mode}, {where}[/]")
    loaded, peaks, done = {}, {}, None
    bar = LoadBar(world, f"loading {name} on {world} rank(s)", err)
    with instance, bar:
        for ev in instance.events():
            e = ev.event
            if e["kind"] in ("progress", "loaded"):
                bar.update(e, ev.rank)
            match e["kind"]:
                case "loaded":
                    loaded[ev.rank] = e
                case "text":
                    sys.stdout.write(e["text"])
                    sys.stdout.flush()
                case "done":
                    done = e
                case "rank_done":
                    peaks[ev.rank] = e
    sys.stdout.write("\n")
    if done:
        _print_summary(err, done, loaded, peaks)
    return 0


def serve(args: argparse.Namespace) -> int:
    from thunderpool.cli.serve import serve_main

    return serve_main(args, Console(stderr=True))


def _experts(loaded: dict) -> str:
    """An EP rank's experts, first-last like the layers."""
    if "experts" not in loaded:
        return ""
    a, b = loaded["experts"]
    return f" experts {a}-{b - 1}"


def _print_summary(console: Console, done: dict, loaded: dict, peaks: dict) -> None:
    console.print(
        f"TTFT {done['ttft_s'] * 1000:.0f} ms | prefill {done['prefill_tps']:.1f} tok/s "
        f"({done['prompt_tokens']} tokens) | decode {done['decode_tps']:.1f} tok/s "
        f"({done['generated_tokens']} tokens) | finish: {done['finish_reason']}"
    )
    if done.get("kv_bytes_per_token"):
        console.print(
            f"KV cache: {done['kv_bytes_per_token'] / 1024:.1f} KiB per context token over all "
            "ranks" + (f" ({done['kv_bits']}-bit)" if done.get("kv_bits") else "")
        )
    if "spec_steps" in done:
        console.print(
            f"speculative: {done['spec_steps']} verify steps, acceptance "
            f"{done['spec_acceptance']:.2f}, {done['spec_tokens_per_step']:.2f} tokens/step"
        )
    table = Table(
        "rank",
        "layers",
        "sharding",
        "params",
        "RSS after load",
        "peak RSS",
        "peak MLX",
        title="memory per rank",
    )
    for rank in sorted(loaded):
        ld, pk = loaded[rank], peaks.get(rank, {})
        a, b = ld["layers"]
        table.add_row(
            str(rank),
            f"{a}-{b - 1}",
            ld["method"] + _experts(ld),
            _mib(ld["param_bytes"]),
            _mib(ld["peak_rss_bytes"]),
            _mib(pk.get("peak_rss_bytes", 0)),
            _mib(pk.get("peak_mlx_bytes", 0)),
        )
    console.print(table)


def _first_error(e: ValueError) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"--{'-'.join(str(x) for x in first['loc']).replace('_', '-')}: {first['msg']}"
    # SamplingParams names the field first: "top_p=1.5 must be in (0, 1]".
    name = str(e).split("=", 1)[0]
    return f"--{name.replace('_', '-')}: {e}" if name.isidentifier() else str(e)


def _same_blas_as_ranks() -> None:
    """bench runs one rank in this process: restart it with the BLAS the ranks preload, so
    every row of the table is measured with the same library."""
    import os

    from thunderpool.launch.blas import fast_blas_env

    env = fast_blas_env()
    library = env.get("LD_PRELOAD", "").split(" ")[0]
    if library and library not in os.environ.get("LD_PRELOAD", "").split(" "):
        os.execve(
            sys.executable,
            [sys.executable, "-m", "thunderpool", *sys.argv[1:]],
            {**os.environ, **env},
        )


def import_gguf(args: argparse.Namespace) -> int:
    from thunderpool.models.gguf import import_gguf as run_import

    out = args.out or args.file.with_name(args.file.stem + f"-{args.dtype}")
    path = run_import(Path(args.file), Path(out), dtype=args.dtype)
    print(path)
    return 0


def bench(args: argparse.Namespace) -> int:
    from thunderpool.cli.flags import resolve_backend

    _same_blas_as_ranks()
    # The prefix cache's two-turn chat has its own default first turn.
    args.prompt_tokens = args.prompt_tokens or (1500 if args.prefix_cache_turns else 128)
    backend = resolve_backend(args, max(args.nodes))
    console = Console()
    if args.synthetic:
        from thunderpool.bench.synthetic import synthetic_model

        if args.model:
            raise ThunderpoolError("--synthetic and --model both name a model; pass one of them")
        # A path: on a cluster every node must see it (one machine, or a shared disk).
        args.model = str(synthetic_model(args.synthetic, console=console))
    if getattr(args, "constrained", False):
        import json

        from thunderpool.bench.structured import constrained_cost
        from thunderpool.models.source import resolve_model

        result = constrained_cost(resolve_model(args.model), args.max_tokens, args.repeats)
        print(json.dumps(result, indent=2))
        return 0
    if args.cluster:
        import json

        rows = _bench_accuracy(args)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0
    from thunderpool.bench.run import run_bench
    from thunderpool.models.source import resolve_model

    model_dir = resolve_model(args.model)
    if args.prefix_cache_turns:
        return _bench_prefix_cache(model_dir, args, console)
    if any(n < 1 for n in args.nodes):
        raise ThunderpoolError(f"--nodes {args.nodes} must all be >= 1")
    _guard_bench(model_dir, args, console)
    if getattr(args, "draft_model", None) or getattr(args, "draft_layers", None):
        return _spec_bench(model_dir, args, console, backend)
    results = run_bench(
        model_dir,
        nodes=args.nodes,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        modes=args.modes,
        json_out=args.json,
        out_dir=args.out,
        console=console,
        concurrency=args.concurrency or (),
        pin=args.pin,
        backend=backend,
        timeout=args.timeout,
        tp_weights=args.tp_weights,
        compile=args.compile,
        expert_replicas=replica_fields(args, model_dir, max(args.nodes)).get("expert_replicas"),
        groups=getattr(args, "groups", None),
    )
    # The report shows every layout; a layout that failed (a rank's error) fails the run.
    failed = [f"{k.upper()}: {r['error']}" for k, r in results["parallel"].items() if "error" in r]
    if failed:
        raise ThunderpoolError("; ".join(failed))
    return 0


def _bench_accuracy(args: argparse.Namespace) -> list[dict]:
    from thunderpool.bench.accuracy import planner_accuracy
    from thunderpool.cli.cluster import coordinator, measured_state, ranked_plans
    from thunderpool.engine.job import BenchTask

    coord = coordinator(args)
    state = measured_state(coord)
    args.context = args.prompt_tokens + args.max_tokens
    task = BenchTask(
        prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, repeats=args.repeats
    )
    plans = ranked_plans(args, state)
    allow = getattr(args, "allow_untested", False)
    return planner_accuracy(coord, state, plans, args.model or "", task, allow)


def _bench_prefix_cache(model_dir: Path, args: argparse.Namespace, console: Console) -> int:
    import json

    from thunderpool.bench.prefix_cache import bench_prefix_cache, print_prefix_report

    with console.status("prefix cache: two-turn chat and agent replay on one rank"):
        result = bench_prefix_cache(
            model_dir, args.prompt_tokens, args.repeats, args.prefix_cache_turns
        )
    print_prefix_report(result, console)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _guard_bench(model_dir: Path, args: argparse.Namespace, console: Console) -> None:
    """Every sharded run bench would start must be verified for the family (or allowed)."""
    from thunderpool.engine.loader import read_config
    from thunderpool.models.families import guard

    config = read_config(model_dir)
    for n in sorted(set(args.nodes)):
        for mode in args.modes:
            guard(config, n, mode, args.allow_untested, console, flag="--modes")


def _spec_bench(model_dir: Path, args: argparse.Namespace, console: Console, backend: str) -> int:
    """bench --draft-model/--draft-layers: plain vs speculative decode, one rank and each
    --modes x --nodes layout (bench/speculative.py)."""
    import json

    from thunderpool.bench.speculative import run_spec_bench
    from thunderpool.bench.synthetic import write_truncated
    from thunderpool.engine.job import BenchTask
    from thunderpool.models.source import resolve_model

    if args.draft_layers:
        draft = model_dir.with_name(f"{model_dir.name}-draft{args.draft_layers}")
        if not (draft / "config.json").is_file():
            write_truncated(model_dir, args.draft_layers, draft)
    elif args.draft_model == "mtp":  # the model's own MTP layer: RankJob.draft_model "mtp"
        from thunderpool.engine.loader import read_config
        from thunderpool.engine.mtp import check_mtp_files

        check_mtp_files(model_dir, read_config(model_dir))
        draft = Path("mtp")
    else:
        draft = resolve_model(args.draft_model)
    layouts = [(1, "tp")] + [(n, m) for n in args.nodes for m in args.modes if n > 1]
    task = BenchTask(
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        concurrency=tuple(args.concurrency or ()),
    )
    results = run_spec_bench(
        model_dir, draft, layouts, task, args.spec_k, console, args.pin, backend, args.timeout
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
