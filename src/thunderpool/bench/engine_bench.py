"""Engine benchmarks: our engine against mlx-lm on one rank, and TP/PP instances on several.

Every run greedy-decodes the same synthetic prompt (fixed seed) for exactly `max_tokens`
tokens. TTFT is the time to the first token; decode tok/s is (n - 1) / (last - first token).
Numbers are medians with min/max over the repeats; the tests check tokens, never timings.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from thunderpool.engine.engine import Leader
from thunderpool.engine.job import BenchTask, RankJob
from thunderpool.engine.sampling import SamplingParams
from thunderpool.errors import ThunderpoolError

PROMPT_SEED = 0
WARMUP_TOKENS = 4
PROBE_REPEATS = 50


@dataclass(frozen=True, slots=True)
class Run:
    """One timed generation."""

    tokens: list[int]
    prompt_tokens: int
    ttft_s: float
    decode_s: float

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s else 0.0

    @property
    def decode_tps(self) -> float:
        steps = len(self.tokens) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s else 0.0


def synthetic_prompt(n: int, vocab_size: int, seed: int = PROMPT_SEED) -> list[int]:
    """The same `n` random token ids for every engine and every run."""
    return np.random.default_rng(seed).integers(0, vocab_size, size=n).tolist()


def timed(steps: Iterator[int], prompt_tokens: int) -> Run:
    """Drain a token generator, timing the first and the last token from before its first step."""
    start = time.perf_counter()
    tokens: list[int] = []
    first = last = start
    for token in steps:
        last = time.perf_counter()
        if not tokens:
            first = last
        tokens.append(token)
    return Run(tokens, prompt_tokens, first - start, last - first)


def spread(values: Iterable[float]) -> dict[str, float]:
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[Run]) -> dict:
    return {
        "ttft_ms": spread(r.ttft_s * 1e3 for r in runs),
        "prefill_tps": spread(r.prefill_tps for r in runs),
        "decode_tps": spread(r.decode_tps for r in runs),
        "generated_tokens": len(runs[0].tokens),
    }


def model_dims(model) -> tuple[int, int]:
    """(vocab size, hidden size) of an mlx-lm model, from its args or its embedding."""
    args = getattr(model, "args", None)
    vocab, hidden = getattr(args, "vocab_size", None), getattr(args, "hidden_size", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and (vocab is None or hidden is None):
        # A quantized embedding packs its columns, so only trust the row count there.
        vocab = vocab or embed.weight.shape[0]
        hidden = hidden or embed.weight.shape[1]
    if vocab is None or hidden is None:
        raise ThunderpoolError(f"cannot read the vocab/hidden size of {type(model).__name__}")
    return int(vocab), int(hidden)


def _ours(leader: Leader, prompt: list[int], max_tokens: int) -> Iterator[int]:
    for step in leader.generate_ids(prompt, SamplingParams(max_tokens=max_tokens)):
        yield step.token


# --- on the leader rank of an instance (called by engine/worker.py) -------------------------


def bench_leader(leader: Leader, task: BenchTask, group: mx.distributed.Group, emit) -> None:
    """Time `task.repeats` generations, probe the all_sum latency, emit one "bench" event."""
    model, size = leader.runner.model, group.size()
    vocab, hidden = model_dims(model)
    prompt = synthetic_prompt(task.prompt_tokens, vocab)
    timed(_ours(leader, prompt, min(WARMUP_TOKENS, task.max_tokens)), len(prompt))
    runs = [timed(_ours(leader, prompt, task.max_tokens), len(prompt)) for _ in range(task.repeats)]
    result = {
        "world_size": size,
        "parallel": "single" if size == 1 else ("pp" if leader.runner.stage is not None else "tp"),
        "prompt_tokens": task.prompt_tokens,
        "max_tokens": task.max_tokens,
        "repeats": task.repeats,
        **summarize(runs),
        "tokens": runs[0].tokens,
        "identical_runs": all(r.tokens == runs[0].tokens for r in runs),
        **collective_cost(leader, size, hidden, runs),
    }
    if task.concurrency:
        from thunderpool.bench.batching import bench_concurrency

        result["batching"] = bench_concurrency(
            leader, task.concurrency, task.prompt_tokens, task.max_tokens, vocab
        )
    emit("bench", **result)


def collective_cost(leader: Leader, size: int, hidden: int, runs: list[Run]) -> dict:
    """Collectives per decoded token and their estimated share of a decode step.

    TP all_sums twice per layer (attention and MLP outputs); PP sends once per stage boundary,
    the return to rank 0 included. Multi-rank decode adds one control all_sum per step.
    """
    if size == 1:
        model_ops, control_ops, latency = 0, 0, 0.0
    else:
        latency = leader.probe((1, 1, hidden), PROBE_REPEATS)
        model_ops = size if leader.runner.stage is not None else 2 * len(leader.runner.model.layers)
        control_ops = 1
    step_s = 1.0 / statistics.median(r.decode_tps for r in runs)
    est_s = (model_ops + control_ops) * latency
    return {
        "all_sum_latency_ms": latency * 1e3,
        "collectives_per_token": model_ops,
        "control_collectives_per_token": control_ops,
        "est_collective_ms_per_token": est_s * 1e3,
        "decode_step_ms": step_s * 1e3,
        "collective_share": est_s / step_s,
    }


# --- one rank, in process: our engine against mlx-lm ----------------------------------------


def bench_single(model_dir: Path, prompt_tokens: int, max_tokens: int, repeats: int) -> dict:
    """Our engine and mlx-lm's generate_step on the same model and prompt, alternated (ABAB)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    from thunderpool.engine.control import Control
    from thunderpool.engine.loader import Layout, load_shard

    group = mx.distributed.init()
    runner, _, _ = load_shard(Path(model_dir), group, Layout())
    leader = Leader(runner, Control(group))
    # mlx_lm.load minus the tokenizer, which tiny test checkpoints do not have.
    ref, _ = load_model(Path(model_dir))
    prompt = synthetic_prompt(prompt_tokens, model_dims(runner.model)[0])

    def theirs(n: int) -> Iterator[int]:
        steps = generate_step(mx.array(prompt), ref, max_tokens=n, sampler=_greedy)
        for token, _ in steps:
            yield int(token)

    engines: dict[str, Callable[[int], Iterator[int]]] = {
        "thunderpool": lambda n: _ours(leader, prompt, n),
        "mlx_lm": theirs,
    }
    for run in engines.values():
        timed(run(min(WARMUP_TOKENS, max_tokens)), prompt_tokens)
    runs: dict[str, list[Run]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, run in engines.items():
            runs[name].append(timed(run(max_tokens), prompt_tokens))
    ours, mlx_lm = summarize(runs["thunderpool"]), summarize(runs["mlx_lm"])
    reference = runs["mlx_lm"][0].tokens
    return {
        "model": str(model_dir),
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "thunderpool": ours,
        "mlx_lm": mlx_lm,
        "decode_ratio": _ratio(ours["decode_tps"], mlx_lm["decode_tps"]),
        "prefill_ratio": _ratio(ours["prefill_tps"], mlx_lm["prefill_tps"]),
        "identical_tokens": all(r.tokens == reference for rs in runs.values() for r in rs),
        "tokens": reference,
    }


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _ratio(a: dict, b: dict) -> float:
    return a["median"] / b["median"] if b["median"] else 0.0


# --- several ranks: a real instance of rank processes ---------------------------------------


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
) -> dict:
    """Run a BenchTask on `nodes` local ranks; the leader's results plus per-rank memory.

    `pin` pins each rank to one core (the launcher's default when there are enough cores).
    """
    from thunderpool.cluster.launch import LocalInstance

    task = BenchTask(
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        repeats=repeats,
        concurrency=concurrency,
    )
    job = RankJob(model_dir=str(model_dir), world_size=nodes, parallel=parallel, task=task)
    bench: dict | None = None
    ranks: dict[int, dict] = {r: {"rank": r} for r in range(nodes)}
    with LocalInstance(job, timeout=timeout, pin=pin) as instance:
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
    return {**bench, "ranks": [ranks[r] for r in range(nodes)]}


# --- the `thunderpool bench` command ---------------------------------------------------------


def run_bench(
    model_dir: Path,
    nodes: int = 2,
    prompt_tokens: int = 128,
    max_tokens: int = 64,
    repeats: int = 3,
    modes: tuple[str, ...] = ("tp", "pp"),
    json_out: Path | None = None,
    console=None,
    concurrency: tuple[int, ...] = (),
) -> dict:
    """One rank against mlx-lm, then each parallel mode at `nodes` ranks; prints a table."""
    from rich.console import Console

    console = console or Console()
    with console.status("one rank: thunderpool vs mlx-lm"):
        single = bench_single(model_dir, prompt_tokens, max_tokens, repeats)
    parallel: dict[str, dict] = {}
    for mode in modes:
        with console.status(f"{mode.upper()}{nodes}: {nodes} ranks"):
            try:
                parallel[mode] = bench_parallel(
                    model_dir, nodes, mode, prompt_tokens, max_tokens, repeats
                )
            except ThunderpoolError as e:
                # One layout that cannot run (e.g. more ranks than layers) should not hide the rest.
                parallel[mode] = {"error": str(e)}
    results = {"model": str(model_dir), "nodes": nodes, "single": single, "parallel": parallel}
    console.print(render_table(results))
    if concurrency:
        results["batching"] = bench_batching(
            model_dir, nodes, modes, prompt_tokens, max_tokens, concurrency, console
        )
    console.print(
        f"engine/mlx-lm decode ratio: {single['decode_ratio']:.2f} (goal >= 0.95), "
        f"prefill ratio: {single['prefill_ratio']:.2f}, "
        f"identical tokens: {'yes' if single['identical_tokens'] else 'NO'}"
    )
    if json_out is not None:
        Path(json_out).write_text(json.dumps(results, indent=2))
    return results


def render_table(results: dict):
    """Medians with the min-max spread dimmed underneath, so that it fits 80 columns."""
    from rich import box
    from rich.table import Table

    single, nodes = results["single"], results["nodes"]
    table = Table(
        title=f"{Path(results['model']).name}: {single['prompt_tokens']}-token prompt, "
        f"{single['max_tokens']} new tokens, median (min-max) of {single['repeats']}",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("engine", min_width=11)
    # coll/tok: model collectives + control all_sums per token; coll ms/tok: estimated cost.
    for col in (
        "TTFT\nms",
        "prefill\ntok/s",
        "decode\ntok/s",
        "decode vs\n1 rank",
        "coll/\ntoken",
        "coll\nms/tok",
    ):
        table.add_column(col, justify="right", no_wrap=True)
    base = single["thunderpool"]["decode_tps"]["median"]
    rows = [("mlx-lm\n1 rank", single["mlx_lm"]), ("thunderpool\n1 rank", single["thunderpool"])]
    rows += [(f"{m.upper()}{nodes}\n{nodes} ranks", r) for m, r in results["parallel"].items()]
    for name, r in rows:
        if "error" in r:
            table.add_row(name, f"[red]{r['error']}[/red]", *[""] * 5)
            continue
        coll, est = "-", "-"
        if r.get("collectives_per_token"):
            coll = f"{r['collectives_per_token']}+{r['control_collectives_per_token']}"
            ms, share = r["est_collective_ms_per_token"], r["collective_share"]
            est = f"{ms:.2f}\n[dim]({share:.0%})[/dim]"
        ratio = r["decode_tps"]["median"] / base if base else 0.0
        table.add_row(
            name,
            _cell(r["ttft_ms"]),
            _cell(r["prefill_tps"]),
            _cell(r["decode_tps"]),
            f"{ratio:.2f}",
            coll,
            est,
        )
    return table


def _cell(s: dict) -> str:
    return f"{_num(s['median'])}\n[dim]{_num(s['min'])}-{_num(s['max'])}[/dim]"


def _num(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


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
    console.print(table)
    return out
