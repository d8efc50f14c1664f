"""Engine benchmarks: our engine against mlx-lm on one rank, and the leader of an instance.

Every run greedy-decodes the same synthetic prompt (fixed seed) for exactly `max_tokens`
tokens. TTFT is the time to the first token; decode tok/s is (n - 1) / (last - first token).
Numbers are medians with min/max over the repeats; the tests check tokens, never timings.
Energy (energy.py) is read at the same three instants, where the host exposes it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from thunderpool.bench.breakdown import count_decode_step, decode_breakdown
from thunderpool.bench.energy import energy_summary, open_meter
from thunderpool.engine.engine import Engine
from thunderpool.engine.job import BenchTask
from thunderpool.engine.sampling import SamplingParams
from thunderpool.errors import ThunderpoolError
from thunderpool.parallel.vocab import split_head_of

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
    prefill_j: float = 0.0  # host energy up to the first token (0 without a meter)
    decode_j: float = 0.0  # host energy from the first to the last token

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


def timed(steps: Iterator[int], prompt_tokens: int, meter=None) -> Run:
    """Drain a token generator, timing the first and the last token from before its first step."""
    snap = meter.snapshot() if meter else None
    prefill_j = 0.0
    start = time.perf_counter()
    tokens: list[int] = []
    first = last = start
    for token in steps:
        last = time.perf_counter()
        if not tokens:
            first = last
            if meter:
                prefill_j = meter.joules_since(snap)
                snap = meter.snapshot()
        tokens.append(token)
    decode_j = meter.joules_since(snap) if meter else 0.0
    return Run(tokens, prompt_tokens, first - start, last - first, prefill_j, decode_j)


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


def run_ours(engine: Engine, prompt: list[int], max_tokens: int, meter=None) -> Run:
    """One greedy generation on the engine, timed like `timed` at each token's delivery."""
    snap = meter.snapshot() if meter else None
    tokens: list[int] = []
    first, prefill_j = [], 0.0
    last = start = time.perf_counter()

    def on_event(ev) -> None:
        nonlocal last, snap, prefill_j
        last = time.perf_counter()
        if not tokens:
            first.append(last)
            if meter:
                prefill_j, snap = meter.joules_since(snap), meter.snapshot()
        tokens.append(ev.token)

    engine.generate(prompt, SamplingParams(max_tokens=max_tokens), on_event)
    decode_j = meter.joules_since(snap) if meter else 0.0
    t1 = first[0] if first else start
    return Run(tokens, len(prompt), t1 - start, last - t1, prefill_j, decode_j)


# --- on the leader rank of an instance (called by thunderpool/rank.py) -------------------------


def bench_leader(
    engine: Engine, task: BenchTask, group: mx.distributed.Group, emit, model_dir: Path
) -> None:
    """Time `task.repeats` generations, split a decode step, emit one "bench" event (without a
    draft: bench/speculative.py's bench_spec_leader times speculation)."""
    # Hybrid: the ranks of every stage's world (HybridControl.size), not stage 0's alone.
    model, size = engine.runner.model, engine.control.size
    vocab, hidden = model_dims(model)
    prompt = synthetic_prompt(task.prompt_tokens, vocab)
    run_ours(engine, prompt, min(WARMUP_TOKENS, task.max_tokens))
    # Counted first: the timed runs then prove that every rank is still in step (same
    # tokens on every run).
    counts = count_decode_step(engine, prompt)
    meter, reason = open_meter()
    try:
        runs = [run_ours(engine, prompt, task.max_tokens, meter) for _ in range(task.repeats)]
    finally:
        if meter is not None:
            meter.close()
    parallel = "single" if size == 1 else ("pp" if engine.runner.stage is not None else "tp")
    if getattr(engine.runner.stage, "link", None) is not None:
        parallel = "hybrid"
    result = {
        "world_size": size,
        "parallel": parallel,
        "prompt_tokens": task.prompt_tokens,
        "max_tokens": task.max_tokens,
        "repeats": task.repeats,
        **summarize(runs),
        "tokens": runs[0].tokens,
        "identical_runs": all(r.tokens == runs[0].tokens for r in runs),
        "energy": energy_summary(meter, reason, runs),
        **step_breakdown(engine, parallel, prompt, task.max_tokens - 1, hidden, runs, counts),
    }
    if task.concurrency:
        from thunderpool.bench.batching import bench_concurrency

        result["batching"] = bench_concurrency(
            engine, task.concurrency, task.prompt_tokens, task.max_tokens, vocab, model_dir
        )
    emit("bench", **result)


def step_breakdown(
    engine: Engine,
    parallel: str,
    prompt: list[int],
    steps: int,
    hidden: int,
    runs: list[Run],
    counts: dict,
) -> dict:
    """Counted collectives per decode step, per-rank compute alone, all_sum latencies, and
    the split of a step into compute, collectives and waiting (breakdown.py)."""
    step_ms = 1e3 / statistics.median(r.decode_tps for r in runs)
    by_rank, hidden_ms, control_ms, gather_ms = [], 0.0, 0.0, 0.0
    # Hybrid stages hand off over TCP, which "solo" cannot stand in for: no split measured.
    if engine.control.size > 1 and parallel != "hybrid":
        by_rank = engine.measure("solo", prompt, steps)
        hidden_ms = engine.measure("probe", (1, 1, hidden), PROBE_REPEATS, "all_sum") * 1e3
        control = (engine.control.min_elements,)
        control_ms = engine.measure("probe", control, PROBE_REPEATS, "all_sum") * 1e3
        if counts["by_op"].get("all_gather"):
            rows = split_head_of(engine.runner.model).width
            gather_ms = engine.measure("probe", (rows, 1), PROBE_REPEATS, "all_gather") * 1e3
    split = decode_breakdown(step_ms, parallel, by_rank, counts, hidden_ms, control_ms, gather_ms)
    return {
        "breakdown": split,
        # The table's columns (and the planner-accuracy bench) read these.
        "all_sum_latency_ms": hidden_ms,
        "collectives_per_token": counts["model"],
        "control_collectives_per_token": counts["control"],
        "est_collective_ms_per_token": split["collective_ms"],
        "decode_step_ms": step_ms,
        "collective_share": split["collective_ms"] / step_ms,
    }


# --- one rank, in process: our engine against mlx-lm ----------------------------------------


def bench_single(
    model_dir: Path, prompt_tokens: int, max_tokens: int, repeats: int, compile: bool | None = None
) -> dict:
    """Our engine and mlx-lm's generate_step on the same model and prompt, alternated (ABAB)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    from thunderpool.engine.control import Control
    from thunderpool.engine.loader import Layout, load_shard

    group = mx.distributed.init()
    runner, _, _ = load_shard(Path(model_dir), group, Layout(compile=compile))
    engine = Engine(runner, Control(group), max_context=1 << 62)
    # mlx_lm.load minus the tokenizer, which tiny test checkpoints do not have.
    ref, _ = load_model(Path(model_dir))
    prompt = synthetic_prompt(prompt_tokens, model_dims(runner.model)[0])

    def theirs(n: int) -> Iterator[int]:
        steps = generate_step(mx.array(prompt), ref, max_tokens=n, sampler=_greedy)
        for token, _ in steps:
            yield int(token)

    engines: dict[str, Callable[..., Run]] = {
        "thunderpool": lambda n, meter=None: run_ours(engine, prompt, n, meter),
        "mlx_lm": lambda n, meter=None: timed(theirs(n), prompt_tokens, meter),
    }
    for run in engines.values():
        run(min(WARMUP_TOKENS, max_tokens))
    runs: dict[str, list[Run]] = {name: [] for name in engines}
    meter, reason = open_meter()
    try:
        for _ in range(repeats):
            for name, run in engines.items():
                runs[name].append(run(max_tokens, meter))
    finally:
        if meter is not None:
            meter.close()
    ours, mlx_lm = summarize(runs["thunderpool"]), summarize(runs["mlx_lm"])
    for name, summary in (("thunderpool", ours), ("mlx_lm", mlx_lm)):
        summary["energy"] = energy_summary(meter, reason, runs[name])
    step_ms = 1e3 / ours["decode_tps"]["median"] if ours["decode_tps"]["median"] else 0.0
    counts = {"model": 0, "control": 0, "total": 0, "by_op": {}}
    ours["breakdown"] = decode_breakdown(step_ms, "single", [], counts, 0.0, 0.0)
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
