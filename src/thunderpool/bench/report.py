"""What `thunderpool bench` prints and draws: the speed table, the decode-step breakdown, the
energy status, and two PNG plots (tok/s against ranks; a decode step's time split)."""

from __future__ import annotations

from pathlib import Path

SEGMENTS = (("compute_ms", "compute"), ("collective_ms", "collectives"), ("wait_ms", "waiting"))


def layouts(results: dict) -> list[tuple[str, dict]]:
    """(row name, result) for every measured layout, in table order."""
    single = results["single"]
    rows = [("mlx-lm 1 rank", single["mlx_lm"]), ("thunderpool 1 rank", single["thunderpool"])]
    if "pinned" in results:
        rows.append(("1 rank pinned", results["pinned"]))
    for key, r in results["parallel"].items():
        rows.append((f"{key.upper()} {r.get('world_size', '')} ranks", r))
    return rows


def render_table(results: dict):
    """Medians with the min-max spread dimmed underneath, so that it fits 80 columns."""
    from rich import box
    from rich.table import Table

    single = results["single"]
    table = Table(
        title=f"{Path(results['model']).name}: {single['prompt_tokens']}-token prompt, "
        f"{single['max_tokens']} new tokens, median (min-max) of {single['repeats']}",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("engine", min_width=11)
    # coll/token: the model's collectives + control ones the leader issues per decode step.
    columns = ("TTFT\nms", "prefill\ntok/s", "decode\ntok/s", "decode vs\nbaseline", "coll/\ntoken")
    for col in columns:
        table.add_column(col, justify="right", no_wrap=True)
    base = (results.get("pinned") or single["thunderpool"])["decode_tps"]["median"]
    for name, r in layouts(results):
        name = name.replace(" ", "\n", 1)
        if "error" in r:
            table.add_row(name, f"[red]{r['error']}[/red]", *[""] * 4)
            continue
        coll = "-"
        if r.get("collectives_per_token"):
            coll = f"{r['collectives_per_token']}+{r['control_collectives_per_token']}"
        ratio = r["decode_tps"]["median"] / base if base else 0.0
        table.add_row(
            name,
            _cell(r["ttft_ms"]),
            _cell(r["prefill_tps"]),
            _cell(r["decode_tps"]),
            f"{ratio:.2f}",
            coll,
        )
    return table


def breakdown_table(results: dict):
    """One decode step per layout: compute, estimated collectives, waiting, and the measured
    collective time against the latency bound."""
    from rich import box
    from rich.table import Table

    table = Table(
        title="a decode step, ms (compute alone per rank; collectives = count x all_sum latency)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("layout")
    for col in ("step", "compute", "coll.", "wait", "step -\ncompute", "bound", "ratio"):
        table.add_column(col, justify="right", no_wrap=True)
    for name, r in layouts(results)[1:]:
        b = r.get("breakdown")
        if not b:
            continue
        ratio = b["collective_ratio"]
        table.add_row(
            name,
            f"{b['step_ms']:.1f}",
            f"{b['compute_ms']:.1f}",
            f"{b['collective_ms']:.2f}",
            f"{b['wait_ms']:.2f}",
            f"{b['measured_collective_ms']:.2f}",
            f"{b['latency_bound_ms']:.2f}",
            "-" if ratio is None else f"{ratio:.2f}",
        )
    return table


def print_report(results: dict, console) -> None:
    single = results["single"]
    console.print(render_table(results))
    console.print(breakdown_table(results))
    console.print(
        f"engine/mlx-lm decode ratio: {single['decode_ratio']:.2f} (goal >= 0.95), "
        f"prefill ratio: {single['prefill_ratio']:.2f}, "
        f"identical tokens: {'yes' if single['identical_tokens'] else 'NO'}"
    )
    speedups = results["scaling"]["decode_speedup"]
    if speedups:
        parts = ", ".join(f"{k.upper()} {v:.2f}x" for k, v in speedups.items())
        console.print(f"decode speedup vs {results['scaling']['baseline']}: {parts}")
    energy = results["energy"]
    if energy["available"]:
        console.print(
            f"energy ({energy['source']}, {energy['scope']}): "
            f"{energy['decode_joules_per_token']:.3f} J per decoded token, "
            f"{energy['prefill_joules_per_token']:.4f} J per prompt token"
        )
    else:
        console.print(f"energy: not measured: {energy['reason']}")
    for f in results.get("files", []):
        console.print(f"[dim]wrote {f}[/]")


def _cell(s: dict) -> str:
    return f"{_num(s['median'])}\n[dim]{_num(s['min'])}-{_num(s['max'])}[/dim]"


def _num(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def write_plots(results: dict, scaling_png: Path, breakdown_png: Path) -> None:
    """scaling_png: decode and prefill tok/s against ranks per mode (error bars: min-max);
    breakdown_png: each layout's decode step stacked as compute, collectives, waiting."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    model = Path(results["model"]).name
    scaling = results["scaling"]
    fig = Figure(figsize=(10, 4), layout="constrained")
    for ax, metric, label in zip(
        fig.subplots(1, 2),
        ("decode_tps", "prefill_tps"),
        ("decode tok/s", "prefill tok/s"),
        strict=True,
    ):
        for mode, points in scaling[metric].items():
            x = [p[0] for p in points]
            y = [p[1] for p in points]
            err = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=mode.upper())
        ax.set_xlabel("ranks (nodes)")
        ax.set_ylabel(label)
        ax.set_xticks(sorted({p[0] for pts in scaling[metric].values() for p in pts} or {1}))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if scaling[metric]:
            ax.legend()
    fig.suptitle(f"{model}: median of the repeats; 1 rank = {scaling['baseline']}")
    fig.savefig(scaling_png, dpi=120)

    rows = [(n, r["breakdown"]) for n, r in layouts(results)[1:] if r.get("breakdown")]
    fig = Figure(figsize=(max(6, 1.6 * len(rows) + 2), 4.5), layout="constrained")
    ax = fig.subplots()
    names = [n.replace(" ", "\n", 1) for n, _ in rows]
    bottom = [0.0] * len(rows)
    for key, label in SEGMENTS:
        values = [b[key] for _, b in rows]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [a + v for a, v in zip(bottom, values, strict=True)]
    # The parts are measured apart, so they need not add up to the measured step exactly.
    ax.scatter(names, [b["step_ms"] for _, b in rows], marker="_", s=900, c="k", label="step")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{model}: where a decode step goes")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(breakdown_png, dpi=120)
