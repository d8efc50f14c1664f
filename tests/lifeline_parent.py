"""A parent of rank processes with Linux's PR_SET_PDEATHSIG turned off, for test_lifeline:
only the portable lifeline can then end its ranks when the test SIGKILLs it.

`python lifeline_parent.py cli ARGS...`: thunderpool's CLI (e.g. `generate`).
`python lifeline_parent.py launcher ring|mpi MODEL`: a local launcher running two TP ranks of a
    serving job; prints "ready" once they are loaded and idle, then waits.
`python lifeline_parent.py agent MODEL`: an agent's RankManager running the same two ranks.
Idle serving ranks write nothing, so no broken pipe ends them: only the lifeline can.
"""

from __future__ import annotations

import json
import sys
import time

import thunderpool

thunderpool.hide_torch()

from thunderpool.launch import lifeline  # noqa: E402

lifeline.PDEATHSIG = False

from thunderpool.config import LINK_TOKEN_ENV  # noqa: E402
from thunderpool.engine.job import RankJob, ServeTask  # noqa: E402
from thunderpool.launch.local import free_ports  # noqa: E402


def serving_job(model: str, backend: str) -> RankJob:
    task = ServeTask(model_name="tiny")
    return RankJob(model_dir=model, world_size=2, parallel="tp", backend=backend, task=task)


def launcher(backend: str, model: str) -> None:
    from thunderpool.launch.mpi import local_instance

    env = {LINK_TOKEN_ENV: "t"}
    with local_instance(serving_job(model, backend), timeout=None, env=env) as inst:
        for ev in inst.events():
            if ev.event["kind"] == "ready":
                print("ready", flush=True)


def agent(model: str) -> None:
    from thunderpool.cluster.control.messages import RankSpec
    from thunderpool.cluster.control.ranks import RankManager

    manager = RankManager(link_token="t", lease=3600)
    job = serving_job(model, "ring").model_dump_json()
    hosts = json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)])
    for rank in (0, 1):
        files = {"MLX_HOSTFILE": hosts}
        manager.start(RankSpec(instance_id="i", rank=rank, world_size=2, job=job, files=files))
    seen = 0
    while True:
        polled = manager.poll("i", seen, wait=1.0)
        seen += len(polled["events"])
        if any(e["event"]["kind"] == "ready" for e in polled["events"]):
            print("ready", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    match sys.argv[1]:
        case "cli":
            from thunderpool.cli import main

            sys.exit(main(sys.argv[2:]))
        case "launcher":
            launcher(sys.argv[2], sys.argv[3])
        case "agent":
            agent(sys.argv[2])
