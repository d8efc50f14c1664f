"""Continuous batching of a family's tiny checkpoint on a sharded layout, on real ranks.

Runs tests/engine/batch_ranks.py's scenario driver (staggered arrivals, rows joining and
leaving the decoding batch) with any layout: `python batch_family.py SPEC.json OUT.json`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))

from batch_ranks import run_scenario  # noqa: E402

from thunderpool.cluster.launch import free_ports  # noqa: E402
from thunderpool.engine import engine  # noqa: E402
from thunderpool.engine.control import Control  # noqa: E402
from thunderpool.engine.loader import Layout, load_shard  # noqa: E402
from thunderpool.engine.plan import STOP_PLAN  # noqa: E402


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    group = mx.distributed.init(backend="ring", strict=True)
    split = tuple(spec["layer_split"]) if spec.get("layer_split") else None
    experts = tuple(spec["expert_split"]) if spec.get("expert_split") else None
    layout = Layout(spec["parallel"], layer_split=split, expert_split=experts)
    runner, _, _ = load_shard(Path(spec["model"]), group, layout)
    control = Control(group)
    if group.rank() != 0:
        engine.follow(runner, control)
        return
    try:
        result = run_scenario(runner, control, None, spec)
    finally:
        control.send(STOP_PLAN.encode())
    Path(out_path).write_text(json.dumps(result))


def run_batch(spec: dict, nodes: int, tmp: Path, timeout: float = 240.0) -> dict:
    """Runs `spec` on `nodes` ring ranks on loopback; returns rank 0's scenario result."""
    spec_file, out_file, hosts = tmp / "spec.json", tmp / "out.json", tmp / "hosts.json"
    spec_file.write_text(json.dumps(spec))
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(nodes)]))
    procs, logs = [], [tmp / f"rank{r}.log" for r in range(nodes)]
    try:
        for rank in range(nodes):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hosts)}
            with logs[rank].open("w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, str(spec_file), str(out_file)],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
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


if __name__ == "__main__":
    main(*sys.argv[1:3])
