"""What one collective costs inside a decode step between ranks that share this machine.

A probe times a lone all_sum; inside a step the collective sits between memory-bound matmuls.
With MLX ring each one passes from the compute thread to a pool thread and on to a spinning
socket thread, and ranks that share a machine (each pinned to a core, sharing one memory bus)
also wait there for the later of two near-equal halves. Two ring ranks over loopback, pinned
to the first two cores, run the same chain of MLP-like segments with and without an all_sum
after each; the difference per segment is the price the planner puts on a collective between
co-located nodes (cluster/coordinator.node_specs).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# One segment: a hidden row through an up and a down projection, ~3.5 MB of fp32 weights
# (SmolLM2's half-layer segments in TP2 read about as much).
HIDDEN, FFN, SEGMENTS, STEPS = 576, 768, 30, 12


def _chain(x, up, down, reduce: bool) -> float:
    """Seconds of one step of SEGMENTS segments on this rank (every rank runs the same)."""
    import mlx.core as mx

    h = x
    for _ in range(SEGMENTS):
        h = (h @ up.T) @ down.T
        h = (mx.distributed.all_sum(h) if reduce else h) * 0.5
    start = time.perf_counter()
    mx.eval(h)
    return time.perf_counter() - start


def rank_main() -> None:
    """A rank of the measurement (MLX_RANK and MLX_HOSTFILE set); rank 0 prints the result."""
    import mlx.core as mx

    group = mx.distributed.init(backend="ring", strict=True)
    scale = 1.0 / FFN**0.5
    x = mx.random.normal((1, HIDDEN))
    up = mx.random.normal((FFN, HIDDEN)) * scale
    down = mx.random.normal((HIDDEN, FFN)) * scale
    mx.eval(x, up, down, mx.distributed.all_sum(mx.zeros(1)))
    alone, reduced = [], []
    for _ in range(STEPS):  # interleaved, so both see the same neighbours
        alone.append(_chain(x, up, down, False))
        reduced.append(_chain(x, up, down, True))
    extra = statistics.median(reduced[2:]) - statistics.median(alone[2:])
    if group.rank() == 0:
        print(json.dumps({"collective_s": max(extra, 0.0) / SEGMENTS}), flush=True)


def measure_colocated_collective(timeout: float = 60.0) -> float:
    """Seconds one all_sum adds inside a step between two pinned ring ranks on this machine;
    0 where there are fewer than two cores to pin to, or the measurement fails."""
    from thunderpool.cluster.capabilities import rank_env
    from thunderpool.cluster.launch import child_setup, free_ports, one_core_env

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return 0.0
    with tempfile.TemporaryDirectory(prefix="thunderpool-colocated-") as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
        ranks = [
            subprocess.Popen(
                [sys.executable, "-m", "thunderpool.cluster.colocated"],
                env=rank_env(MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile), **one_core_env(core)),
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                preexec_fn=lambda core=core: child_setup(core),
            )
            for r, core in enumerate(cores[:2])
        ]
        try:
            out, _ = ranks[0].communicate(timeout=timeout)
            ranks[1].wait(timeout=10)
            return float(json.loads(out)["collective_s"]) if ranks[0].returncode == 0 else 0.0
        except (subprocess.TimeoutExpired, ValueError, KeyError, TypeError):
            return 0.0
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                    p.wait()


if __name__ == "__main__":
    rank_main()
