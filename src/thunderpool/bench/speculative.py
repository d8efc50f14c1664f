"""`bench --draft-model`: decode tok/s with and without speculative decoding, alternated in the
same instance (plain, speculative, plain, ...), on one rank and each --modes x --nodes layout,
with the draft's acceptance rate and tokens per verify step. Greedy, so both must give the
same tokens (checked and reported). With --concurrency, the same alternation for C requests at
once: per-row speculation against plain batched decoding ("k=0 under load")."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from thunderpool.bench.accounts import accounted, print_accounts, solo_forward
from thunderpool.bench.engine_bench import (
    PROMPT_SEED,
    WARMUP_TOKENS,
    model_dims,
    run_ours,
    synthetic_prompt,
)
from thunderpool.engine.engine import Engine
from thunderpool.engine.job import BenchTask, RankJob
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.speculate import SpecStats
from thunderpool.parallel.layout import Layout


def bench_spec_leader(engine: Engine, task: BenchTask, emit) -> None:
    """On the leader: `task.repeats` plain and speculative generations, alternated."""
    ex = engine.executor
    drafter, size = ex.drafter, engine.control.size
    parallel = "single" if size == 1 else ("pp" if engine.runner.stage is not None else "tp")
    if task.concurrency:  # its level 1 is the lone request
        batching = [bench_spec_batch(engine, task, c) for c in task.concurrency]
        emit("bench", world_size=size, parallel=parallel, spec_k=drafter.k, batching=batching)
        return
    prompt = synthetic_prompt(task.prompt_tokens, model_dims(engine.runner.model)[0])
    runs: dict[str, list] = {"plain": [], "spec": []}
    for warm in (True, False):
        for _ in range(1 if warm else task.repeats):
            for mode in ("plain", "spec"):
                engine.use_drafter(drafter if mode == "spec" else None)
                ex.spec_stats = SpecStats()
                run = run_ours(engine, prompt, WARMUP_TOKENS if warm else task.max_tokens)
                if not warm:
                    runs[mode].append((run, ex.spec_stats))
    tps = {m: [r.decode_tps for r, _ in rs] for m, rs in runs.items()}
    accounts = []
    for mode in ("plain", "spec"):
        engine.use_drafter(drafter if mode == "spec" else None)
        ex.spec_stats = SpecStats()
        acct = accounted(engine, lambda: run_ours(engine, prompt, task.max_tokens))
        timed_ms = 1e3 / statistics.median(tps[mode]) if statistics.median(tps[mode]) else 0.0
        solo = solo_forward(engine, prompt, 1, round(acct.get("width", 1)))
        accounts.append(
            {
                "mode": mode,
                "rows": 1,
                "account": acct,
                "timed_ms_per_token": timed_ms,
                "solo_ms": solo,
            }
        )
    engine.use_drafter(drafter)
    stats = [s for _, s in runs["spec"]]
    plain, spec = statistics.median(tps["plain"]), statistics.median(tps["spec"])
    emit(
        "bench",
        world_size=size,
        parallel=parallel,
        spec_k=drafter.k,
        accounts=accounts,
        plain_decode_tps=tps["plain"],
        spec_decode_tps=tps["spec"],
        speedup=spec / plain if plain else 0.0,
        acceptance=sum(s.accepted for s in stats) / max(1, sum(s.proposed for s in stats)),
        tokens_per_step=sum(s.emitted for s in stats) / max(1, sum(s.steps for s in stats)),
        identical_tokens=len({tuple(r.tokens) for rs in runs.values() for r, _ in rs}) == 1,
    )


def run_batch(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts submitted at once, greedy, to their end: each row's tokens, total tok/s
    (every token over the wall time, prefills included) and decode tok/s (the tokens after
    every row has its first one, over that span)."""
    out: list[list[int]] = [[] for _ in prompts]
    times: list[list[float]] = [[] for _ in prompts]

    def on_event(ev, i: int) -> None:
        out[i].append(ev.token)
        times[i].append(time.perf_counter())

    params, start = SamplingParams(max_tokens=max_tokens), time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, params, lambda ev, i=i: on_event(ev, i))
    while engine.step():
        pass
    end = max(t[-1] for t in times)
    decoding = max(t[0] for t in times)  # from here every row decodes
    steady = sum(1 for ts in times for t in ts if t > decoding)
    return {
        "tokens": out,
        "total_tps": sum(map(len, out)) / (end - start),
        "decode_tps": steady / (end - decoding) if end > decoding else 0.0,
    }


def bench_spec_batch(engine: Engine, task: BenchTask, rows: int) -> dict:
    """`rows` requests at once (distinct prompts), plain batched decoding and per-row
    speculation alternated, after one warm-up of each."""
    ex, drafter = engine.executor, engine.executor.drafter
    vocab = model_dims(engine.runner.model)[0]
    prompts = [synthetic_prompt(task.prompt_tokens, vocab, PROMPT_SEED + i) for i in range(rows)]
    engine.scheduler.max_batch, limit = rows, drafter.max_rows
    drafter.max_rows = rows
    runs: dict[str, list] = {"plain": [], "spec": []}
    for warm in (True, False):
        for _ in range(1 if warm else task.repeats):
            for mode in ("plain", "spec"):
                engine.use_drafter(drafter if mode == "spec" else None)
                ex.spec_stats = SpecStats()
                run = run_batch(engine, prompts, WARMUP_TOKENS if warm else task.max_tokens)
                if not warm:
                    runs[mode].append((run, ex.spec_stats))
    result: dict = {"rows": rows, "accounts": []}
    for mode, rs in runs.items():
        for key in ("total_tps", "decode_tps"):
            result[f"{mode}_{key}"] = [r[key] for r, _ in rs]
        engine.use_drafter(drafter if mode == "spec" else None)
        ex.spec_stats = SpecStats()
        acct = accounted(engine, lambda: run_batch(engine, prompts, task.max_tokens))
        # Per row's token: a step delivers a token to each row.
        tps = statistics.median(result[f"{mode}_decode_tps"])
        timed = 1e3 / tps if tps else 0.0
        solo = solo_forward(engine, prompts[0], rows, round(acct.get("width", 1)))
        result["accounts"].append(
            {
                "mode": mode,
                "rows": rows,
                "account": acct,
                "timed_ms_per_token": timed,
                "solo_ms": solo,
            }
        )
    engine.use_drafter(drafter)
    drafter.max_rows = limit
    stats = [s for _, s in runs["spec"]]
    result["acceptance"] = sum(s.accepted for s in stats) / max(1, sum(s.proposed for s in stats))
    result["tokens_per_step"] = sum(s.emitted for s in stats) / max(1, sum(s.steps for s in stats))
    tokens = {str(r["tokens"]) for rs in runs.values() for r, _ in rs}
    result["identical_tokens"] = len(tokens) == 1
    return result


def run_spec_bench(
    model_dir: Path,
    draft_dir: Path,
    layouts: list[tuple[int, str]],
    task: BenchTask,
    spec_k: int,
    console,
    pin: bool = False,
    backend: str = "ring",
    timeout: float = 600.0,
) -> list[dict]:
    """One instance per (ranks, mode) layout; prints a table, returns each leader's result."""
    from rich.table import Table

    from thunderpool.launch.mpi import local_instance

    results = []
    for nodes, parallel in layouts:
        job = RankJob(
            model_dir=str(model_dir),
            world_size=nodes,
            layout=Layout(parallel),
            task=task,
            draft_model=str(draft_dir),
            spec_k=spec_k,
            backend="mpi" if backend == "mpi" and nodes > 1 else "ring",
        )
        with console.status(f"{nodes} rank(s) {parallel}: plain vs speculative"):
            with local_instance(job, timeout=timeout, pin=pin) as instance:
                for ev in instance.events():
                    if ev.event.get("kind") == "bench":
                        results.append({k: v for k, v in ev.event.items() if k != "kind"})
    table = Table(title=f"{model_dir.name} drafted by {draft_dir.name}, k={spec_k}, greedy")
    for col in ("layout", "plain tok/s", "spec tok/s", "speedup", "accept", "tok/step", "same"):
        table.add_column(col, justify="right")
    for r in (r for r in results if "speedup" in r):
        table.add_row(
            f"{r['parallel']} {r['world_size']}",
            f"{statistics.median(r['plain_decode_tps']):.2f}",
            f"{statistics.median(r['spec_decode_tps']):.2f}",
            f"{r['speedup']:.2f}x",
            f"{r['acceptance']:.2f}",
            f"{r['tokens_per_step']:.2f}",
            "yes" if r["identical_tokens"] else "NO",
        )
    if any("speedup" in r for r in results):
        console.print(table)
    if any(r.get("batching") for r in results):
        print_batching(results, spec_k, console)
    batched = [
        {**r, "accounts": [a for b in r.get("batching", []) for a in b.get("accounts", [])]}
        for r in results
    ]
    print_accounts([r for r in results if r.get("accounts")] + batched, console)
    return results


def print_batching(results: list[dict], spec_k: int, console) -> None:
    from rich.table import Table

    table = Table(title=f"continuous batching: plain vs per-row speculation, k={spec_k}")
    cols = ("layout", "rows", "plain total", "spec total", "plain decode", "spec decode")
    for col in (*cols, "accept", "tok/step", "same"):
        table.add_column(col, justify="right")
    med = statistics.median
    for r in results:
        for b in r.get("batching", []):
            table.add_row(
                f"{r['parallel']} {r['world_size']}",
                str(b["rows"]),
                *(f"{med(b[k]):.2f}" for k in ("plain_total_tps", "spec_total_tps")),
                *(f"{med(b[k]):.2f}" for k in ("plain_decode_tps", "spec_decode_tps")),
                f"{b['acceptance']:.2f}",
                f"{b['tokens_per_step']:.2f}",
                "yes" if b["identical_tokens"] else "NO",
            )
    console.print(table)
