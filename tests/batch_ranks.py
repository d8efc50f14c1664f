"""Serve's continuous batching driven in token time, in process on one rank or on real ranks.

A scenario is JSON: requests (token prompts, sampling) that arrive when a given request has
emitted n tokens, cancellations at a request's n-th token, an optional eos override, and
`pipeline` (None: each rank's default, batch.overlaps), and `draft` (a draft model dir: the
leader speculates `spec_k` tokens per row, speculate.py), and `kv_bits` (every rank's KV
cache quantized, kv_quant.py). Arrivals
and cancellations happen inside the emit callback, so inside a decode burst when one runs.
`run_ranks` starts the rank processes (MLX ring on loopback, with a timeout) of any layout
(`parallel`, `layer_split`); rank 0 drives the Engine and the others follow:
`python batch_ranks.py SPEC.json OUT.json`.
"""

from __future__ import annotations

import thunderpool

if __name__ == "__main__":  # this rank program, not a test importing it
    thunderpool.hide_torch()

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from thunderpool.bench.breakdown import counting_collectives
from thunderpool.engine import executor
from thunderpool.engine.control import Control, control_for
from thunderpool.engine.engine import Engine, follow
from thunderpool.engine.loader import Layout, load_shard, read_config
from thunderpool.engine.plan import STOP_PLAN, StepPlan
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.sequence import TextRequests
from thunderpool.engine.speculate import draft_ranks
from thunderpool.launch.local import child_setup, free_ports, one_core_env


def plan_name(plan: StepPlan) -> str:
    """ "step+" starts a decode burst, "pre" is a prefill chunk alone, "step" drops rows only."""
    if plan.op != "step":
        return plan.op
    return "step+" if plan.decode else ("pre" if plan.prefill else "step")


MAX_TOKENS = 6
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS}


def tokens(n: int, seed: int) -> list[int]:
    """n token ids of the tiny models' vocabulary (256), the same for the same seed."""
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def prefix_turns(alone) -> list[dict]:
    """Four requests on one 40-token head for the prefix cache: two batched, the first's
    second turn (its prompt, `alone(prompt)`'s answer and more), one joining mid-burst."""
    shared = tokens(40, 1)
    first = shared + tokens(8, 2)
    turn2 = first + alone(first) + tokens(5, 3)
    return [
        {"prompt": first, "params": GREEDY},
        {"prompt": shared + tokens(11, 4), "params": GREEDY},  # batched with request 0
        {"prompt": turn2, "params": GREEDY, "after": [0, MAX_TOKENS]},  # turn 2
        {"prompt": shared + tokens(3, 5), "params": GREEDY, "after": [1, 2]},  # joins mid-burst
    ]


def run_scenario(runner, control: Control, tokenizer, spec: dict, drafter=None) -> dict:
    """Runs the scenario on the leader; returns each request's outcome and the event log:
    plans (plan_name) and "x" for each decode step's exchange, interleaved with ["submit" |
    "cancel" | "finish", request]."""
    engine = Engine(
        runner,
        control,
        prefill_chunk=spec.get("prefill_chunk", 16),
        max_batch=spec.get("max_batch", 8),
        eos=set(spec.get("eos") or ()),
        pipeline=spec.get("pipeline"),
        prefix_cache_tokens=spec.get("prefix_cache_tokens", 0),
        drafter=drafter,
    )
    sched = TextRequests(engine, tokenizer)
    reqs, cancels = spec["requests"], [tuple(c) for c in spec.get("cancel", [])]
    events: list = []
    send, burst_step = control.send, control.burst_step

    def logged_send(data: bytes) -> None:
        # A plan is JSON; a sharded draft's verify header (speculate._header) is not.
        events.append(plan_name(StepPlan.decode_bytes(data)) if data[:1] == b"{" else "v")
        send(data)

    def logged_burst_step(*args, **kwargs):
        events.append("x")
        return burst_step(*args, **kwargs)

    control.send, control.burst_step = logged_send, logged_burst_step
    out = [{"tokens": [], "text": "", "reason": None, "completion": 0} for _ in reqs]
    ids: dict[int, int] = {}
    cancelled: set[int] = set()
    per_token: list = []  # (collectives by op, Control.collectives) at each emitted token
    counts: dict = {}

    def submit(i: int) -> None:
        events.append(["submit", i])
        params = SamplingParams(**{**reqs[i]["params"], "stop": tuple(reqs[i].get("stop", ()))})
        ids[i] = sched.submit(reqs[i]["prompt"], params, lambda d, i=i: on_delta(i, d))

    def on_delta(i: int, d) -> None:
        o = out[i]
        o["tokens"] += list(d.tokens)
        o["text"] += d.text
        per_token.append((dict(counts), control.collectives))
        if d.finish_reason:
            o["reason"], o["completion"] = d.finish_reason, d.completion_tokens
            o["cached"] = d.cached_tokens
            events.append(["finish", i])
        n = len(o["tokens"])
        for j, r in enumerate(reqs):
            if r.get("after") == [i, n] and j not in ids:
                submit(j)
        if (i, n) in cancels and i not in cancelled:
            cancelled.add(i)
            events.append(["cancel", i])
            sched.cancel(ids[i])

    def done() -> bool:
        ended = (o["reason"] is not None or i in cancelled for i, o in enumerate(out))
        return len(ids) == len(reqs) and all(ended)

    with counting_collectives() if spec.get("count") else contextlib.nullcontext() as c:
        counts = c if c is not None else counts
        for i, r in enumerate(reqs):
            if r.get("after") is None:
                submit(i)
        for _ in range(10_000):
            if done():
                break
            engine.step()
        assert done(), f"the scenario did not finish: {out}"
        while engine.step():  # the last finished and cancelled rows leave the batch
            pass
    control.send, control.burst_step = send, burst_step
    state = engine.executor.state
    left = [state.rows, state.batch is None, len(state.pending)]
    result = {"out": out, "events": events, "per_token": per_token, "left": left}
    if (stats := getattr(engine.executor, "spec_stats", None)) is not None:
        result["spec"] = [stats.steps, stats.proposed, stats.accepted, stats.emitted]
        result["draft_ranks"] = draft_ranks(drafter)
    return result


def run_batch(spec: dict, group, stage: int = 0) -> dict | None:
    """Loads the spec's model on this rank of `group` (hybrid: of stage `stage`'s world); the
    leader runs the scenario and returns its result, the others follow it and return None."""
    groups = tuple(spec["groups"]) if spec.get("groups") else None
    model = Path(spec["model"])
    split = tuple(spec["layer_split"]) if spec.get("layer_split") else None
    experts = tuple(spec["expert_split"]) if spec.get("expert_split") else None
    # Counting wraps mx.distributed's Python calls, which a compiled step makes only while
    # it traces: counted runs decode eagerly (the graph holds the same collectives).
    layout = Layout(
        spec.get("parallel", "tp"),
        tp_weights=tuple(spec["tp_weights"]) if spec.get("tp_weights") else None,
        layer_split=split,
        expert_split=experts,
        compile=not spec.get("count"),
        groups=groups,
        stage=stage,
        handoff=tuple(spec.get("handoff", ())),
        kv_bits=spec.get("kv_bits"),
    )
    runner, config, _ = load_shard(model, group, layout)
    control = control_for(runner)
    drafter = None
    if spec.get("draft"):  # as a rank builds it: sharded on every TP rank, else the leader's
        from thunderpool.engine.draft_load import drafter_for

        if "draft_shards" in spec:  # each rank's THUNDERPOOL_DRAFT_SHARDS (0: no files)
            os.environ["THUNDERPOOL_DRAFT_SHARDS"] = spec["draft_shards"][group.rank()]

        job = SimpleNamespace(
            draft_model=spec["draft"],
            model_dir=str(model),
            spec_k=spec.get("spec_k", 4),
            compile=None,
        )
        drafter = drafter_for(job, runner, control, layout)
    if not runner.is_leader:
        if spec.get("pipeline") is not None:
            executor.overlaps = lambda runner: spec["pipeline"]  # the follower's choice too
        follow(runner, control, drafter)
        return None
    tokenizer = None
    if spec.get("tokenizer"):
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(model, eos_token_ids=read_config(model).get("eos_token_id"))
    if drafter is not None:
        drafter.max_rows = spec.get("max_rows", drafter.max_rows)
    try:
        return run_scenario(runner, control, tokenizer, spec, drafter)
    finally:
        control.send(STOP_PLAN.encode())


def main(spec_path: str, out_path: str, stage: str = "0") -> None:
    spec = json.loads(Path(spec_path).read_text())
    groups = tuple(spec["groups"]) if spec.get("groups") else None
    if groups is None or groups[int(stage)] > 1:
        group = mx.distributed.init(backend="ring", strict=True)
    else:
        group = mx.distributed.init()
    result = run_batch(spec, group, int(stage))
    if result is not None:
        Path(out_path).write_text(json.dumps(result))


def run_ranks(
    spec: dict, tmp: Path, timeout: float = 240.0, nodes: int = 2, script: str = __file__, env=None
) -> dict:
    """Runs `spec` on `nodes` ring ranks on loopback; returns rank 0's `run_scenario` result
    (or what `script`, another `SCRIPT SPEC.json OUT.json` rank program, wrote). With
    spec["groups"] (hybrid), each stage is its own ring world, joined by hand-offs."""
    groups = spec.get("groups") or [nodes]
    nodes = sum(groups)
    spec_file, out_file = tmp / "spec.json", tmp / "out.json"
    ports = free_ports(2 * nodes)
    if spec.get("groups"):
        spec = {**spec, "handoff": [f"127.0.0.1:{p}" for p in ports[nodes:]]}
    spec_file.write_text(json.dumps(spec))
    where = []  # (stage, rank in its world, hostfile) of each global rank
    for stage, size in enumerate(groups):
        hosts = tmp / f"hosts-{stage}.json"
        first = sum(groups[:stage])
        hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports[first : first + size]]))
        where += [(stage, r, hosts if size > 1 else None) for r in range(size)]
    procs, logs = [], [tmp / f"rank{r}.log" for r in range(nodes)]
    # A core each where there are enough, as mpirun and pinned cluster ranks run: `pipeline`
    # None then takes the pinned CPU rank's default (batch.overlaps: one step after another).
    cores = sorted(os.sched_getaffinity(0))
    try:
        for rank, (stage, mine, hosts) in enumerate(where):
            cpu = cores[rank] if 1 < nodes <= len(cores) else None
            env_r = {**os.environ, **(env or {}), "MLX_RANK": str(mine)}
            if hosts is not None:  # a world of one rank forms no ring
                env_r["MLX_HOSTFILE"] = str(hosts)
            # A hybrid rank is told its stage; other rank programs take the spec and out only.
            args = [str(stage)] if spec.get("groups") else []
            with logs[rank].open("w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, script, str(spec_file), str(out_file), *args],
                        env={**env_r, **one_core_env(cpu)},
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=lambda cpu=cpu: child_setup(cpu),
                    )
                )
        codes = [p.wait(timeout=timeout) for p in procs]
        assert codes == [0] * nodes, "\n".join(f.read_text()[-3000:] for f in logs)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return json.loads(out_file.read_text())


def run_mpi_ranks(spec: dict, tmp: Path, timeout: float, nodes: int, script: str, env=None):
    """`script` on `nodes` ranks under mpirun (MLX's mpi backend, unpinned, oversubscribed:
    Open MPI then yields the core while it waits, where ring ranks spin); returns what rank 0
    wrote. The rank program must init the "mpi" backend (spec["backend"] says so)."""
    from thunderpool.launch.mpi import find_mpi, mpi_command

    mpirun, lib = find_mpi()
    spec_file, out_file = tmp / "spec.json", tmp / "out.json"
    spec_file.write_text(json.dumps({**spec, "backend": "mpi"}))
    extra = {**(env or {}), "MLX_MPI_LIBNAME": lib, "OMPI_MCA_mpi_yield_when_idle": "1"}
    root = os.geteuid() == 0
    argv = [sys.executable, script, str(spec_file), str(out_file)]
    cmd = mpi_command(mpirun, nodes, False, sorted(extra), argv, root)
    log = tmp / "mpirun.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **extra},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: child_setup(None),
        )
    try:
        code = proc.wait(timeout=timeout)
        assert code == 0, log.read_text()[-6000:]
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return json.loads(out_file.read_text())


if __name__ == "__main__":
    main(*sys.argv[1:4])
