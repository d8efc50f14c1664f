"""`thunderpool simulate`: the planner's plans on a described cluster, as tables or JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from thunderpool.errors import ThunderpoolError
from thunderpool.models.families import Family, describe, family_of
from thunderpool.planner.placement import Plan, explain
from thunderpool.planner.presets import GB, Cluster, parse_cluster, presets
from thunderpool.planner.simulate import Check, bundled, distinct, load_model, simulate, validate


def add_simulate_parser(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="predict decode/prefill tok/s of the planner's plans on a described cluster "
        "(presets or a file) for any model config, even one too large to download",
    )
    p.add_argument(
        "--cluster",
        help="preset expression like '4x m3-ultra-512@tb5-rdma' or "
        "'m3-ultra-256+m5-max-128@tb5-rdma', or a .toml/.json cluster file",
    )
    p.add_argument(
        "--model",
        help="config.json, model dir, or a bundled config name, optionally with a "
        "quantization suffix: glm-5:mxfp8, qwen3-235b-a22b:q8, llama-3.3-70b:q4",
    )
    p.add_argument("--context", type=int, default=4096, help="tokens of context per request")
    p.add_argument("--concurrency", type=int, default=1, help="requests served at once")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        help="prompt length for TTFT and prefill tok/s, and the cache decode reads "
        "(default: min(512, context))",
    )
    p.add_argument("--top", type=int, default=8, help="plans to show")
    p.add_argument("--json", type=Path, help="also write the plans as JSON here")
    p.add_argument("--list", action="store_true", help="list node/link presets and bundled models")
    p.add_argument(
        "--spec-accept",
        type=float,
        help="also predict speculative decoding at this draft acceptance rate (0..1): each "
        "shown plan with the draft, against the best one-node plan without one",
    )
    p.add_argument(
        "--spec-k", type=int, default=0, help="draft tokens per verify step (default: best)"
    )
    p.add_argument(
        "--draft",
        default="qwen3-0.6b:q8",
        help="the draft model for --spec-accept, as --model (default qwen3-0.6b:q8), or mtp: "
        "the model's own multi-token-prediction layer (DeepSeek V3, GLM)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="price the compiled decode step (what `serve` runs by default) instead of eager; "
        "off here because its speed on Metal is not measured",
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="predict every published result the simulator is calibrated against",
    )


def simulate_main(args: argparse.Namespace) -> int:
    console = Console()
    if args.list:
        _print_presets(console)
        return 0
    if args.validate:
        _print_checks(console, validate())
        return 0
    if not args.cluster or not args.model:
        raise ThunderpoolError(
            "simulate needs --cluster and --model, e.g. --cluster '2x m3-ultra-512@tb5-rdma' "
            "--model glm-5:mxfp8 (see --list for presets and bundled models)"
        )
    cluster = parse_cluster(args.cluster)
    spec = load_model(args.model)
    plans = simulate(
        spec,
        cluster,
        args.context,
        args.concurrency,
        args.prompt_tokens,
        compiled=bool(args.compile),
    )
    prompt = args.prompt_tokens or min(512, args.context)
    console.print(
        f"{args.model}: {spec.params / 1e9:.0f}B parameters ({spec.active_params / 1e9:.1f}B "
        f"active), {spec.total_bytes / GB:.0f} GB of weights; on {cluster.describe()}; "
        f"context {args.context} x {args.concurrency}, prompt {prompt}"
    )
    console.print(plan_table(distinct(plans, cluster)[: args.top]))
    console.print(budget_line(cluster), soft_wrap=True)
    from thunderpool.planner import ep

    shown = distinct(plans, cluster)[: args.top]
    ep_rows = ep.ep_rows(spec, shown, cluster, prompt, args.concurrency)
    if ep_rows:
        console.print(ep.ep_table(ep_rows, GB))
    family = family_of({"model_type": spec.model_type})
    console.print(describe(family), soft_wrap=True)
    console.print(explain(plans))
    if args.spec_accept is not None:
        from thunderpool.planner.speculative import spec_table

        shown = distinct(plans, cluster)[: args.top]
        if args.draft == "mtp":  # the model's own MTP layer (planner/speculative.py)
            from thunderpool.planner.speculative import mtp_draft

            draft = mtp_draft(spec)
        else:
            draft = load_model(args.draft)
        console.print(
            spec_table(
                spec,
                shown,
                plans,
                cluster,
                draft,
                args.spec_accept,
                args.spec_k,
                prompt,
                shard=args.draft != "mtp",  # an MTP draft runs on the leader (engine/mtp.py)
            )
        )
    if args.json:
        out = plans_json(args, cluster, plans, family)
        if ep_rows:
            out["ep"] = ep.ep_json(ep_rows)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


def budget_line(cluster: Cluster) -> str:
    """The memory each kind of node's plan may use: its RAM less os_reserve_gb (on a Mac, with
    the GPU wired limit raised to that, presets.toml; unraised, Metal wires ~3/4 of RAM)."""
    seen: dict[str, str] = {}
    for n in cluster.nodes:
        name = n.preset or n.name
        usable = n.memory_gb - n.os_reserve_gb
        seen[name] = f"{name}: {usable:.0f} GB ({n.memory_gb:.0f} GB less {n.os_reserve_gb:.0f} GB"
        if n.family.startswith("m"):  # a Mac: Metal wires that much only when told
            seen[name] += f"; sudo sysctl iogpu.wired_limit_mb={int(usable * GB / 2**20)}"
        seen[name] += ")"
    return "memory budget per node: " + "; ".join(seen.values())


def plan_table(plans: list[Plan], names: dict[str, str] | None = None) -> Table:
    """Plans, fastest decode first: stages joined by ">", a TP stage's nodes by ","; `names`
    shows a live cluster's node ids by host name; "untested" marks an unverified layout."""
    names = names or {}
    table = Table(
        "#",
        "kind",
        "nodes",
        "decode tok/s",
        "prefill tok/s",
        "TTFT",
        "free memory per node",
        title="plans, fastest decode first",
    )
    for i, p in enumerate(plans, 1):
        free = ", ".join(f"{names.get(n, n)} {p.memory_free[n] / GB:.1f} GB" for n in p.nodes)
        split = f" ({'+'.join(map(str, p.layer_split))})" if p.layer_split else ""
        split = f" ({'+'.join(map(str, p.experts))} experts)" if p.experts else split
        ttft = p.prediction.ttft_s
        table.add_row(
            str(i),
            p.kind
            + split
            + (" compiled" if p.compiled else "")
            + ("" if p.verified else " untested"),
            " > ".join(", ".join(names.get(n, n) for n in s.nodes) for s in p.stages),
            f"{p.prediction.decode_tps:.1f}",
            f"{p.prediction.prefill_tps:.0f}",
            f"{ttft * 1e3:.0f} ms" if ttft < 1 else f"{ttft:.2f} s",
            free,
        )
    return table


def plans_json(
    args: argparse.Namespace, cluster: Cluster, plans: list[Plan], family: Family
) -> dict:
    return {
        "model": args.model,
        "family": family.name,
        "verified_layouts": list(family.verified),
        "context": args.context,
        "concurrency": args.concurrency,
        "cluster": cluster.to_dict(),
        "plans": [
            {
                "kind": p.kind,
                "stages": [list(s.nodes) for s in p.stages],
                "layer_split": p.layer_split,
                "decode_tps": p.prediction.decode_tps,
                "prefill_tps": p.prediction.prefill_tps,
                "ttft_s": p.prediction.ttft_s,
                "memory_free_gb": {n: p.memory_free[n] / GB for n in p.nodes},
                "reason": p.reason,
                "verified": p.verified,
                "unverified": p.unverified or None,
                "compiled": p.compiled,
            }
            for p in plans
        ],
    }


def _print_presets(console: Console) -> None:
    nodes = Table("node preset", "chip", "memory", "bandwidth", "FP32", title="node presets")
    for name, n in presets()["node"].items():
        nodes.add_row(
            name, n["chip"], f"{n['memory_gb']} GB", f"{n['mem_bw_gbs']} GB/s", f"{n['tflops']} TF"
        )
    links = Table("link preset", "kind", "latency", "bandwidth", title="link presets")
    for name, x in presets()["link"].items():
        links.add_row(name, x["kind"], f"{x['latency_us']} us", f"{x['bandwidth_gbs']} GB/s")
    console.print(nodes)
    console.print(links)
    console.print("bundled models: " + ", ".join(bundled()))


def _print_checks(console: Console, checks: list[Check]) -> None:
    table = Table(
        "published result",
        "decode: published",
        "predicted",
        "error",
        "prefill: published",
        "predicted",
        "error",
        "use",
        title="predicted against published",
    )
    for c in checks:
        dec = (
            (f"{c.published_decode:.1f}", f"{c.predicted_decode:.1f}", f"{c.decode_error:+.0%}")
            if c.decode_error is not None
            else ("", "", "")
        )
        pre = (
            (f"{c.published_prefill:.0f}", f"{c.predicted_prefill:.0f}", f"{c.prefill_error:+.0%}")
            if c.prefill_error is not None
            else ("", "", "")
        )
        table.add_row(
            c.what,
            *dec,
            *pre,
            "fit" if c.fitted else "check",
        )
    console.print(table)
