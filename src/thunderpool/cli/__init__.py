"""Command line: `thunderpool generate | import-gguf | bench`.

User errors print one line (`error: ...`) and exit 2; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from thunderpool import __version__
from thunderpool.cli.flags import (
    add_allow_untested,
    add_backend,
    add_compile,
    add_groups,
    add_kv_bits,
    add_layout,
    add_replication,
    add_speculation,
    check_hybrid,
    check_replication,
    parse_floats,
    parse_ints,
    parse_modes,
    parse_positive,
)
from thunderpool.cli.serve_flags import add_models_flags
from thunderpool.errors import ThunderpoolError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="thunderpool",
        description="Pool several machines into one inference machine (MLX tensor + pipeline "
        "parallel).",
    )
    parser.add_argument("--version", action="version", version=f"thunderpool {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="start local ranks, load the model sharded, stream "
        "an answer, print TTFT, tok/s and peak memory per rank",
    )
    add_layout(gen)
    add_speculation(gen)
    add_kv_bits(gen)
    gen.add_argument("--prompt", required=True, help="the user message")
    gen.add_argument("--max-tokens", type=parse_positive, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, help="sampling seed, for reproducible samples")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument(
        "--prefill-chunk",
        type=parse_positive,
        default=512,
        help="prompt tokens per prefill step (default 512)",
    )

    srv = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API and a dashboard backed "
        "by N local ranks (continuous batching)",
    )
    add_layout(srv, many_models=True)
    add_models_flags(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` on /v1 and /metrics (default "
        "$THUNDERPOOL_API_KEY)",
    )
    srv.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback --host without --api-key"
    )
    srv.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let browser pages from ORIGIN call the API, e.g. http://localhost:3000 "
        "(repeatable; '*' allows any; default: none)",
    )
    srv.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name to answer besides this machine's own names and IP addresses, e.g. "
        "the name of a reverse proxy in front (repeatable; '*.example.com' for a domain). "
        "Other names are refused (DNS rebinding)",
    )
    srv.add_argument(
        "--max-batch", type=parse_positive, default=8, help="requests decoded together (default 8)"
    )
    srv.add_argument(
        "--max-concurrent-per-key",
        type=parse_positive,
        default=64,
        metavar="N",
        help="generation requests one client (its API key, or its address) may have running; "
        "more get 429 with Retry-After (default 64)",
    )
    srv.add_argument(
        "--max-context",
        type=parse_positive,
        help="prompt + completion tokens per request (default: the model's limit)",
    )
    srv.add_argument("--prefill-chunk", type=parse_positive, default=512)
    srv.add_argument(
        "--log-prompts",
        action="store_true",
        help="add each prompt's text to its access-log line (off: prompts stay private)",
    )
    add_speculation(srv)
    add_kv_bits(srv)
    srv.add_argument(
        "--prefix-cache-gb",
        type=float,
        default=1.0,
        help="KV of recent prompts kept for reuse by the next turn, in GiB over all ranks "
        "(default 1; 0 turns the prefix cache off)",
    )

    from thunderpool.cli.chat import add_chat_parser
    from thunderpool.cli.cluster import add_plan_parser
    from thunderpool.cli.connect import add_cluster_args
    from thunderpool.cli.node import add_node_parser
    from thunderpool.cli.simulate import add_simulate_parser

    add_chat_parser(sub)
    add_node_parser(sub)
    status = sub.add_parser(
        "status",
        help="the cluster's nodes (memory, speed) and every "
        "link's measured latency, bandwidth and kind",
    )
    add_cluster_args(status)
    add_plan_parser(sub)
    from thunderpool.cli.cache import add_cache_parser

    add_cache_parser(sub)
    add_simulate_parser(sub)
    try:
        from thunderpool.cli.doctor import add_doctor_parser

        add_doctor_parser(sub)
    except ImportError:
        pass

    rc = sub.add_parser(
        "route-counts",
        help="count how often each MoE layer routes to each expert on calibration prompts "
        "(JSON for --replicate-experts and plan --routing)",
    )
    rc.add_argument("--model", help="a MoE model (dir, .gguf or repo id)")
    rc.add_argument("--prompts", metavar="FILE", help="one prompt per line (default: built in)")
    rc.add_argument("--out", help="JSON to write (default: thunderpool-routing.json in the model)")

    imp = sub.add_parser(
        "import-gguf",
        help="turn a GGUF file (llama, mistral/mixtral, qwen2, qwen3, qwen3moe, gemma3, phi3, "
        "deepseek2) into an MLX model dir",
    )
    imp.add_argument("file", type=Path)
    imp.add_argument("--out", type=Path, help="output dir (default: next to the file)")
    imp.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16", "q4", "q8"),
        default="float32",
        help="weight dtype (float32 is fastest on Linux CPUs); q4/q8 store MLX affine 4/8-bit "
        "whatever the file's quantization (Q4_0/Q4_1/Q8_0 repacked exactly)",
    )

    bench = sub.add_parser(
        "bench",
        help="TTFT, prefill and decode tok/s: our engine vs mlx-lm on one "
        "rank, then TP and PP on --nodes ranks, with each decode step split into compute, "
        "collectives and waiting; JSON and PNG plots; with a draft, plain vs speculative "
        "decode and each mode's step account",
    )
    bench.add_argument("--model", help="model (default: the embedded SmolLM2-135M-Instruct)")
    bench.add_argument(
        "--synthetic",
        metavar="SHAPE",
        help="instead of --model, a random-weight float32 llama of this shape, written to the "
        "cache once: 1b (TinyLlama-1.1B's shape, 4.4 GB) or moe (a Qwen3-MoE of 16 experts, "
        "4 routed, 0.96 GB)",
    )
    bench.add_argument(
        "--nodes",
        type=parse_ints,
        default=(2,),
        help="ranks per parallel run; a list scales, e.g. 2,3 (default 2)",
    )
    bench.add_argument(
        "--modes",
        type=parse_modes,
        default=("tp", "pp"),
        help="parallel modes (default tp,pp; hybrid runs at the ranks of --groups)",
    )
    add_replication(bench)
    add_groups(bench)
    add_speculation(bench)
    bench.add_argument(
        "--draft-layers",
        type=parse_positive,
        help="instead of --draft-model, a draft cut from the model's first N layers "
        "(written to the cache once; for --synthetic models)",
    )
    bench.add_argument("--prompt-tokens", type=parse_positive, help="(default 128)")
    bench.add_argument("--max-tokens", type=parse_positive, default=64)
    bench.add_argument("--repeats", type=parse_positive, default=3)
    bench.add_argument(
        "--pin",
        action="store_true",
        help="fair scaling: every rank and a 1-rank baseline each pinned to one core",
    )
    add_backend(bench)
    bench.add_argument(
        "--tp-weights", type=parse_floats, help="TP: per-rank head and channel shares, e.g. 1,2"
    )
    bench.add_argument("--json", type=Path, help="write all results as JSON here (plots beside)")
    bench.add_argument(
        "--out", type=Path, help="write bench.json, scaling.png and breakdown.png into this dir"
    )
    bench.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds of silence from the ranks before all are stopped (default 600)",
    )
    bench.add_argument(
        "--concurrency",
        type=parse_ints,
        help="also measure continuous batching at these stream counts, e.g. 1,4,8 (one rank: "
        "beside mlx-lm's BatchGenerator on the same prompts)",
    )
    bench.add_argument(
        "--constrained",
        action="store_true",
        help="instead, measure decode tok/s with a JSON-schema grammar against without, "
        "on one rank",
    )
    bench.add_argument(
        "--prefix-cache-turns",
        type=parse_positive,
        metavar="N",
        help="instead, measure the prefix cache on one rank: a two-turn chat's turn-2 TTFT "
        "against turn 1 (turn 1: --prompt-tokens, default 1500 here) and an N-turn agent "
        "replay's prefilled tokens, with and without the cache",
    )
    bench.add_argument(
        "--cluster",
        action="store_true",
        help="instead, run the planner's best plans on the cluster and compare "
        "predicted with measured decode tok/s",
    )
    from thunderpool.cli.connect import add_cluster_args as _cluster_args

    _cluster_args(bench)
    add_allow_untested(bench)
    add_compile(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; output cut short by its reader (`| head -1`) ends it quietly."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # a reader gone by now shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        if not _stdout_unread():
            raise
        return _quiet_exit()
    except SystemExit as e:
        # rich turns a closed stdout into SystemExit(1), after pointing stdout at /dev/null.
        if isinstance(e.__context__, BrokenPipeError) and _stdout_is_devnull():
            return _quiet_exit()
        raise


def _stdout_unread() -> bool:
    """Whether stdout is a pipe nobody reads any more (not some socket's broken pipe)."""
    import select

    if not hasattr(select, "poll"):
        return True
    poll = select.poll()
    poll.register(sys.stdout.fileno(), select.POLLOUT)
    return any(ev & select.POLLERR for _, ev in poll.poll(0))


def _stdout_is_devnull() -> bool:
    import os

    return os.path.samestat(os.fstat(sys.stdout.fileno()), os.stat(os.devnull))


def _quiet_exit() -> int:
    """The ranks were stopped while the error unwound; exit as a process killed by SIGPIPE
    would, with nothing more written and no traceback."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail too
    return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so that every rank this process started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        ep_flags = getattr(args, "parallel", None) == "ep" or "ep" in getattr(args, "modes", ())
        if getattr(args, "replicate_experts", None) and not ep_flags:
            raise ThunderpoolError(
                "--replicate-experts copies experts for --parallel ep (bench: --modes ep) only; "
                "add it or drop --replicate-experts"
            )
        check_replication(args)
        if getattr(args, "expert_split", None) and getattr(args, "parallel", None) != "ep":
            raise ThunderpoolError(
                "--expert-split places experts for --parallel ep only; add --parallel ep or "
                "drop --expert-split"
            )
        check_hybrid(args)
        match args.command:
            case "generate":
                from thunderpool.cli.commands import generate

                return generate(args)
            case "serve":
                from thunderpool.cli.commands import serve

                return serve(args)
            case "node":
                from thunderpool.cli.node import node_main

                return node_main(args)
            case "status":
                from thunderpool.cli.cluster import status_main

                return status_main(args)
            case "cache":
                from thunderpool.cli.cache import cache_main

                return cache_main(args)
            case "plan":
                from thunderpool.cli.cluster import plan_main

                return plan_main(args)
            case "simulate":
                from thunderpool.cli.simulate import simulate_main

                return simulate_main(args)
            case "doctor":
                from thunderpool.cli.doctor import doctor_main

                return doctor_main(args)
            case "chat":
                from thunderpool.cli.chat import chat_main

                return chat_main(args)
            case "route-counts":
                from thunderpool.cli.routing import route_counts_main

                return route_counts_main(args)
            case "import-gguf":
                from thunderpool.cli.commands import import_gguf

                return import_gguf(args)
            case "bench":
                from thunderpool.cli.commands import bench

                return bench(args)
    except ThunderpoolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; all ranks stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
