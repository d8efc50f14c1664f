"""The `thunderpool bench` command: one rank against mlx-lm, then TP and PP instances.

Fair scaling (`pin=True`): every rank, the 1-rank baseline included, runs pinned to its own
core with single-threaded BLAS, so TPn/PPn against 1 rank compares n cores with one. Without
it the in-process 1-rank row uses every core while the ranks of an instance get one each.
"""

from __future__ import annotations

import json
from pathlib import Path

from thunderpool.bench.engine_bench import bench_single
from thunderpool.engine.job import BenchTask, RankJob
from thunderpool.errors import ThunderpoolError
from thunderpool.parallel.layout import Layout


def bench_parallel(
    model_dir: Path,
    nodes: int,
    parallel: str,
    prompt_tokens: int,
    max_tokens: int,
    repeats: int,
    timeout: float = 600.0,
    pin: bool | None = None,
    concurrency: tuple[int, ...] = (),
    backend: str = "ring",
    tp_weights: tuple[float, ...] | None = None,
    compile: bool | None = None,
    expert_replicas: tuple[tuple[int, int, int], ...] | None = None,
    groups: tuple[int, ...] | None = None,
) -> dict:
    """Run a BenchTask on `nodes` local ranks; the leader's results plus per-rank memory.
    Hybrid (`groups`): one ring world per group, `nodes` ranks in all.

    `pin` pins each rank to one core (the launcher's default when there are enough cores);
    backend "mpi" starts the ranks under mpirun (launch/mpi.py) instead of MLX ring.
    """
    task = BenchTask(
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        repeats=repeats,
        concurrency=concurrency,
    )
    job = RankJob(
        model_dir=str(model_dir),
        world_size=nodes,
        task=task,
        backend="mpi" if backend == "mpi" and nodes > 1 and not groups else "ring",
        layout=Layout(
            parallel,
            tp_weights if parallel in ("tp", "ep") and nodes > 1 else None,
            compile=compile,
            expert_replicas=expert_replicas if parallel == "ep" and nodes > 1 else None,
            groups=groups if parallel == "hybrid" else None,
        ),
    )
    from thunderpool.launch.mpi import local_instance

    bench: dict | None = None
    ranks: dict[int, dict] = {r: {"rank": r} for r in range(nodes)}
    with local_instance(job, timeout=timeout, pin=pin) as instance:
        for ev in instance.events():
            fields = {k: v for k, v in ev.event.items() if k != "kind"}
            match ev.event.get("kind"):
                case "bench":
                    bench = fields
                case "loaded":
                    ranks[ev.rank].update(
                        param_bytes=fields["param_bytes"],
                        load_s=fields["seconds"],
                        layers=fields["layers"],
                    )
                case "rank_done":
                    ranks[ev.rank].update(
                        peak_rss_bytes=fields["peak_rss_bytes"],
                        peak_mlx_bytes=fields.get("peak_mlx_bytes"),
                    )
    if bench is None:
        raise ThunderpoolError(f"the {parallel} instance of {nodes} ranks sent no bench result")
    pinned = instance.pin
    if nodes > 1 and parallel == "ep":
        bench["parallel"] = "ep"  # the rank sees TP's runner; keep EP's points apart from TP's
    return {**bench, "pinned": pinned, "backend": job.backend, "ranks": [ranks[r] for r in ranks]}


def run_bench(
    model_dir: Path,
    nodes: int | tuple[int, ...] = 2,
    prompt_tokens: int = 128,
    max_tokens: int = 64,
    repeats: int = 3,
    modes: tuple[str, ...] = ("tp", "pp"),
    json_out: Path | None = None,
    console=None,
    concurrency: tuple[int, ...] = (),
    out_dir: Path | None = None,
    pin: bool = False,
    backend: str = "ring",
    timeout: float = 600.0,
    tp_weights: tuple[float, ...] | None = None,
    compile: bool | None = None,
    expert_replicas: tuple[tuple[int, int, int], ...] | None = None,
    groups: tuple[int, ...] | None = None,
) -> dict:
    """One rank against mlx-lm, then each mode at each node count (hybrid: at the ranks of
    `groups` only); prints tables, writes JSON and plots (to `json_out` and/or `out_dir`)."""
    from rich.console import Console

    from thunderpool.bench.report import print_report

    console = console or Console()
    counts = (nodes,) if isinstance(nodes, int) else tuple(nodes)
    with console.status("one rank: thunderpool vs mlx-lm"):
        single = bench_single(model_dir, prompt_tokens, max_tokens, repeats, compile)
    results: dict = {
        "model": str(model_dir),
        "nodes": list(counts),
        "pin": pin,
        "backend": backend,
        "single": single,
    }
    args = (prompt_tokens, max_tokens, repeats, timeout)
    if pin:
        with console.status("1 rank pinned to one core"):
            results["pinned"] = bench_parallel(model_dir, 1, "tp", *args, pin=True, compile=compile)
    parallel: dict[str, dict] = {}
    for n in counts:
        for mode in modes:
            if mode == "hybrid" and n != sum(groups or ()):
                continue
            with console.status(f"{mode.upper()}{n}: {n} ranks ({backend})"):
                try:
                    parallel[f"{mode}{n}"] = bench_parallel(
                        model_dir,
                        n,
                        mode,
                        *args,
                        pin=True if pin else None,
                        backend=backend,
                        tp_weights=tp_weights,
                        compile=compile,
                        expert_replicas=expert_replicas if n == max(counts) else None,
                        groups=groups,
                    )
                except ThunderpoolError as e:
                    # One layout that cannot run (e.g. more ranks than layers) should not hide
                    # the rest.
                    parallel[f"{mode}{n}"] = {"error": str(e), "parallel": mode, "world_size": n}
    results["parallel"] = parallel
    results["scaling"] = scaling(results)
    results["energy"] = single["thunderpool"]["energy"]
    if concurrency:
        results["batching"] = bench_batching(
            model_dir, counts[-1], modes, prompt_tokens, max_tokens, concurrency, console
        )
    _write(results, out_dir, json_out)
    print_report(results, console)
    return results


def _write(results: dict, out_dir: Path | None, json_out: Path | None) -> None:
    """The JSON and its two plots, into `out_dir` and/or beside `json_out`."""
    from thunderpool.bench.report import write_plots

    files: list[tuple[Path, Path, Path]] = []  # (JSON, scaling plot, breakdown plot)
    if out_dir is not None:
        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        files.append((d / "bench.json", d / "scaling.png", d / "breakdown.png"))
    if json_out is not None:
        j = Path(json_out)
        plots = (j.with_name(f"{j.stem}-scaling.png"), j.with_name(f"{j.stem}-breakdown.png"))
        files.append((j, *plots))
    results["files"] = [str(f) for group in files for f in group]
    for data, scaling_png, breakdown_png in files:
        write_plots(results, scaling_png, breakdown_png)
        data.write_text(json.dumps(results, indent=2))


def scaling(results: dict) -> dict:
    """Decode and prefill tok/s against the number of ranks, per mode, from one baseline."""
    base = results.get("pinned") or results["single"]["thunderpool"]
    label = "1 rank pinned to one core" if "pinned" in results else "1 rank, all cores"
    out: dict = {"baseline": label}
    for metric in ("decode_tps", "prefill_tps"):
        base_v = base[metric]["median"]
        series: dict[str, list] = {}
        speedup: dict[str, float] = {}
        for key, r in results["parallel"].items():
            if "error" in r:
                continue
            v = r[metric]["median"]
            first = [1, base_v, base[metric]["min"], base[metric]["max"]]
            series.setdefault(r["parallel"], [first])
            series[r["parallel"]].append([r["world_size"], v, r[metric]["min"], r[metric]["max"]])
            speedup[key] = v / base_v if base_v else 0.0
        out[metric] = series  # [ranks, median, min, max] per point
        out[metric.replace("_tps", "_speedup")] = speedup
    return out


def bench_batching(
    model_dir: Path,
    nodes: int,
    modes: tuple[str, ...],
    prompt_tokens: int,
    max_tokens: int,
    concurrency: tuple[int, ...],
    console,
) -> dict:
    """Continuous batching: aggregate decode tok/s at each concurrency, per layout."""
    from rich.table import Table

    layouts = [("single", 1)] + [(m, nodes) for m in modes]
    out: dict[str, list] = {}
    for mode, n in layouts:
        with console.status(f"batching: {mode} at {concurrency}"):
            res = bench_parallel(
                model_dir,
                n,
                "tp" if mode == "single" else mode,
                prompt_tokens,
                max_tokens,
                1,
                concurrency=concurrency,
            )
        out[mode] = res.get("batching", [])
    table = Table(
        "layout",
        *[f"{c} streams" for c in concurrency],
        title="continuous batching: decode tok/s, all streams together (aggregate)",
    )
    for mode, rows in out.items():
        table.add_row(
            mode.upper() if mode != "single" else "1 rank",
            *[f"{r['decode_tps']:.1f} ({r['aggregate_tps']:.1f})" for r in rows],
        )
        if rows and "mlx_lm_decode_tps" in rows[0]:
            table.add_row(
                "mlx-lm BatchGenerator",
                *[f"{r['mlx_lm_decode_tps']:.1f} ({r['mlx_lm_aggregate_tps']:.1f})" for r in rows],
            )
            table.add_row(
                "1 rank / mlx-lm",
                *[
                    f"{r['decode_tps'] / r['mlx_lm_decode_tps']:.2f}x"
                    + ("" if r["same_tokens_as_mlx_lm"] else " (tokens differ)")
                    for r in rows
                ],
            )
    console.print(table)
    return out
