"""What each CLI subcommand does, kept apart from argument parsing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from thunderpool.errors import ThunderpoolError


def _mib(n: int | float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def generate(args: argparse.Namespace) -> int:
    from thunderpool.cluster.launch import LocalInstance
    from thunderpool.engine.job import GenerateTask, RankJob, Sampling
    from thunderpool.engine.loader import Layout, preflight
    from thunderpool.models.source import resolve_model

    err = Console(stderr=True)
    try:
        sampling = Sampling(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
        )
    except ValueError as e:
        raise ThunderpoolError(_first_error(e)) from None
    model_dir = resolve_model(args.model)
    preflight(model_dir, args.nodes, Layout(args.parallel, args.tp_weights, args.layer_split))
    job = RankJob(
        model_dir=str(model_dir),
        world_size=args.nodes,
        parallel=args.parallel,
        tp_weights=args.tp_weights,
        layer_split=args.layer_split,
        prefill_chunk=args.prefill_chunk,
        task=GenerateTask(prompt=args.prompt, chat=not args.raw, sampling=sampling),
    )
    mode = args.parallel.upper() if args.nodes > 1 else "single rank"
    err.print(f"[dim]{model_dir.name}: {args.nodes} rank(s), {mode}, MLX ring on loopback[/]")
    loaded, peaks, done = {}, {}, None
    with LocalInstance(job, timeout=args.timeout) as instance:
        for ev in instance.events():
            e = ev.event
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
    import ipaddress

    from thunderpool.cluster.launch import LocalInstance
    from thunderpool.engine.job import RankJob, ServeTask
    from thunderpool.engine.loader import Layout, preflight
    from thunderpool.models.source import resolve_model

    err = Console(stderr=True)
    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        raise ThunderpoolError(
            f"--host {args.host} is not an IP address; use e.g. 0.0.0.0"
        ) from None
    if not loopback and not args.api_key and not args.insecure:
        raise ThunderpoolError(
            f"--host {args.host} exposes the API beyond this machine; pass --api-key KEY "
            "(or --insecure to serve without one)"
        )
    model_dir = resolve_model(args.model)
    preflight(model_dir, args.nodes, Layout(args.parallel, args.tp_weights, args.layer_split))
    task = ServeTask(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        model_name=model_dir.name,
        max_batch=args.max_batch,
        max_context=args.max_context,
    )
    job = RankJob(
        model_dir=str(model_dir),
        world_size=args.nodes,
        parallel=args.parallel,
        tp_weights=args.tp_weights,
        layer_split=args.layer_split,
        prefill_chunk=args.prefill_chunk,
        task=task,
    )
    mode = args.parallel.upper() if args.nodes > 1 else "single rank"
    with LocalInstance(job, timeout=None) as instance:
        for ev in instance.events():
            e = ev.event
            match e["kind"]:
                case "listening":
                    err.print(
                        f"API and dashboard at {e['url']} (loading {model_dir.name} on "
                        f"{args.nodes} rank(s), {mode})"
                    )
                case "loaded":
                    err.print(
                        f"[dim]rank {ev.rank}: layers {e['layers'][0]}-{e['layers'][1] - 1}, "
                        f"{_mib(e['param_bytes'])} of weights in {e['seconds']:.1f} s[/]"
                    )
                case "ready":
                    err.print("ready: POST /v1/chat/completions; Ctrl-C stops every rank")
    return 0


def _print_summary(console: Console, done: dict, loaded: dict, peaks: dict) -> None:
    console.print(
        f"TTFT {done['ttft_s'] * 1000:.0f} ms | prefill {done['prefill_tps']:.1f} tok/s "
        f"({done['prompt_tokens']} tokens) | decode {done['decode_tps']:.1f} tok/s "
        f"({done['generated_tokens']} tokens) | finish: {done['finish_reason']}"
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
            ld["method"],
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
    return str(e)


def import_gguf(args: argparse.Namespace) -> int:
    from thunderpool.models.gguf import import_gguf as run_import

    out = args.out or args.file.with_name(args.file.stem + f"-{args.dtype}")
    path = run_import(Path(args.file), Path(out), dtype=args.dtype)
    print(path)
    return 0


def bench(args: argparse.Namespace) -> int:
    from thunderpool.bench.engine_bench import run_bench
    from thunderpool.models.source import resolve_model

    model_dir = resolve_model(args.model)
    run_bench(
        model_dir,
        nodes=args.nodes,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        json_out=args.json,
        console=Console(),
        concurrency=args.concurrency or (),
    )
    return 0
