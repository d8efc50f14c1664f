"""`thunderpool simulate`: the planner on a described cluster instead of a live one.

A cluster comes from presets (presets.py); a model from a config.json, a model directory or a
bundled config (configs/*.json, for models too large to download), optionally with a
quantization suffix (`glm-5:mxfp8`, `qwen3-235b-a22b:q8`). `validate()` replays the published
results listed in presets.toml against the same model.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.table import Table

from thunderpool.errors import ThunderpoolError
from thunderpool.models.families import Family, describe, family_of
from thunderpool.planner.placement import Plan, explain, place
from thunderpool.planner.presets import GB, Cluster, parse_cluster, presets
from thunderpool.planner.spec import ModelSpec, model_spec, model_spec_from_config

QUANT = re.compile(
    r"^(?:q([2-8])(?:g(32|64|128))?|mxfp4|nvfp4|mxfp8|mixed_([2-4])_([46])|bf16|fp16|fp32)$"
)
# The microscaling formats' (bits, group): mlx_lm.convert --q-mode's defaults.
_MX = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
_RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")
_DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}


def bundled() -> list[str]:
    """Names of the configs shipped for models too large to download."""
    folder = resources.files("thunderpool.planner").joinpath("configs")
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )


def load_model(text: str) -> ModelSpec:
    """A ModelSpec from `NAME[:QUANT]`: a config.json, a model dir or a bundled config name."""
    name, _, quant = text.partition(":")
    path = Path(name).expanduser()
    if path.is_dir():
        if any(path.glob("*.safetensors")) and not quant:
            return model_spec(path)
        path = path / "config.json"
    if path.is_file():
        config = _read_json(path)
    elif name in bundled():
        folder = resources.files("thunderpool.planner").joinpath("configs")
        config = json.loads(folder.joinpath(f"{name}.json").read_text())
    else:
        raise ThunderpoolError(
            f"no model {name!r}: not a config.json, a model directory or a bundled config; "
            f"use a path or one of {', '.join(bundled())} (optionally with :q4, :q8, :mxfp8...)"
        )
    config, dtype = quantized(config, quant)
    return model_spec_from_config(config, dtype_bytes=dtype)


def quantized(config: dict, quant: str) -> tuple[dict, float]:
    """The config as stored with `quant` (MLX quantization), and its float width in bytes."""
    dtype = _DTYPE_BYTES.get(config.get("torch_dtype", "bfloat16"), 2.0)
    if not quant:
        return config, dtype
    m = QUANT.match(quant.lower())
    if not m:
        raise ThunderpoolError(
            f"unknown quantization {quant!r}; use q2..q8 (affine, group 64), q4g32 (q2..q8 at "
            f"group 32, 64 or 128), mxfp4, nvfp4, mxfp8, {', '.join(_RECIPES)} (mlx-lm's "
            "mixed recipes), bf16, fp16 or fp32"
        )
    plain = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    plain.pop("expert_dtype", None)
    quant = quant.lower()
    if quant in ("bf16", "fp16", "fp32"):
        return plain, 4.0 if quant == "fp32" else 2.0
    if quant in _MX:
        q = {"bits": _MX[quant][0], "group_size": _MX[quant][1], "mode": quant}
    elif quant.startswith("mixed"):
        if quant not in _RECIPES:
            raise ThunderpoolError(f"unknown mixed recipe {quant!r}; use {', '.join(_RECIPES)}")
        low, high = int(m.group(3)), int(m.group(4))
        q = {"bits": low, "group_size": 64, "recipe": [low, high]}
    else:
        q = {"bits": int(m.group(1)), "group_size": int(m.group(2) or 64)}
    return {**plain, "quantization": q}, 2.0


def simulate(
    spec: ModelSpec,
    cluster: Cluster,
    context: int = 4096,
    concurrency: int = 1,
    prompt_tokens: int | None = None,
    compiled: bool = False,
) -> list[Plan]:
    """Every plan that fits the described cluster, fastest predicted decode first; decode
    steps eager, or (`compiled`) compiled where our engine compiles them (its default)."""
    nodes, links = cluster.specs()
    return place(
        spec,
        nodes,
        links,
        context_tokens=context,
        concurrency=concurrency,
        prompt_tokens=prompt_tokens,
        compiled=compiled,
    )


@dataclass(frozen=True, slots=True)
class Check:
    """A published result against our prediction for the same layout."""

    what: str
    published_decode: float | None
    predicted_decode: float | None
    published_prefill: float | None
    predicted_prefill: float | None
    fitted: bool
    source: str

    @property
    def decode_error(self) -> float | None:
        if self.published_decode is None or self.predicted_decode is None:
            return None
        return self.predicted_decode / self.published_decode - 1

    @property
    def prefill_error(self) -> float | None:
        if self.published_prefill is None or self.predicted_prefill is None:
            return None
        return self.predicted_prefill / self.published_prefill - 1


def validate() -> list[Check]:
    """Predict every published result of presets.toml with the layout it was measured on,
    decoding eagerly as the tools that published them (mlx-lm, exo) do."""
    rows = []
    for p in presets()["published"]:
        cluster = parse_cluster(p["cluster"])
        spec = load_model(p["model"])
        prompt = p["prompt"]
        plans = simulate(spec, cluster, context=prompt + 256, prompt_tokens=prompt)
        kind = p.get("layout", "single" if len(cluster.nodes) == 1 else "tp")
        same = [x for x in plans if x.kind == kind and len(x.nodes) == len(cluster.nodes)]
        if not same:
            raise ThunderpoolError(f"{p['what']}: no {kind} plan over all nodes fits")
        pred = same[0].prediction
        rows.append(
            Check(
                what=p["what"],
                published_decode=p.get("decode"),
                predicted_decode=pred.decode_tps if "decode" in p else None,
                published_prefill=p.get("prefill"),
                predicted_prefill=pred.prefill_tps if "prefill" in p else None,
                fitted=p.get("fitted", False),
                source=p["source"],
            )
        )
    return rows


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


def distinct(plans: list[Plan], cluster: Cluster) -> list[Plan]:
    """Plans that differ other than by swapping nodes of the same preset (shown once)."""
    preset = {n.name: n.preset or n.name for n in cluster.nodes}
    seen, out = set(), []
    for p in plans:
        key = (p.kind, p.layer_split, tuple(tuple(preset[n] for n in s.nodes) for s in p.stages))
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


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


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ThunderpoolError(f"{path} is not valid JSON ({e}); pass an HF config.json") from None
