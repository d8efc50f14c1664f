"""Leftovers after a crash (issue 37, item 5), by construction: `doctor` reads who holds each
RDMA device from recorded `ioreg`/`ps` captures (tests/mac/mac_rdma_use.py) and names the
process and the fix; the agent ends an instance only once no process of its ranks is left,
proven with fake ranks whose child holds a device the way a jaccl rank holds its queue pairs
(an exclusive lock a second holder gets EBUSY for); a jaccl EBUSY names `thunderpool doctor`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from doctor_scenes import FULL_LIMIT, doctor, macs
from macs import SCENES, Scene, mesh

from thunderpool.cluster.control import ranks
from thunderpool.cluster.control.instance import ClusterInstance
from thunderpool.cluster.control.messages import RankSpec
from thunderpool.cluster.node.doctor_held import check_rdma_held
from thunderpool.engine.job import RankJob, TraceTask
from thunderpool.errors import LaunchError

RANK0 = "/var/folders/x1/q8z0000gn/T/thunderpool-agent-3kx9_p2a/job-0.json"
PY = "/Users/studio/.venv/bin/python3"


def test_a_mac_nothing_holds_passes(tmp_path):
    dirs, nodes = macs(Scene(2, mesh(2), wired_limit_mb=FULL_LIMIT), tmp_path)
    check = doctor(dirs, nodes, 0)[0]["RDMA in use"]
    names = ", ".join(f"rdma_en{p}" for p in range(2, 8))
    assert (check.status, check.detail) == ("PASS", f"no process holds {names}")


def test_a_leftover_rank_is_named_and_fix_kills_it(tmp_path):
    """Mac 0 after a crash: a rank whose agent died (launchd adopted it) holds rdma_en2."""
    dirs, nodes = macs(SCENES["pair_leftovers"], tmp_path)
    checks, ran, code, _ = doctor(dirs, nodes, 0, "--fix")
    check = checks["RDMA in use"]
    assert check.status == "FAIL"
    assert check.detail == (
        f"rdma_en2 is held by pid 5123 (Python: {PY} -m thunderpool.rank {RANK0}), "
        "a thunderpool rank whose agent is gone"
    )
    assert check.fix == "kill the leftover rank(s): kill -9 5123"
    assert ("kill", "-9", "5123") in ran


def test_another_program_and_stale_queue_pairs_are_named(tmp_path):
    """Mac 1: a program of the user's holds rdma_en2 (named, not killed); rdma_en3 keeps queue
    pairs no process holds (only a restart frees them)."""
    dirs, nodes = macs(SCENES["pair_leftovers"], tmp_path)
    checks, ran, _, _ = doctor(dirs, nodes, 1, "--fix")
    check = checks["RDMA in use"]
    assert check.status == "FAIL"
    assert check.detail == (
        f"rdma_en2 is held by pid 2290 (Python: {PY} train_tp.py); "
        "rdma_en3 has 2 queue pair(s) that no process holds"
    )
    assert check.fix == (
        "if no model should be running on this Mac now, quit pid 2290 (kill 2290): a new "
        "jaccl launch here fails with EBUSY while its queue pairs are held; restart this Mac: "
        "only a restart frees queue pairs no process holds"
    )
    assert not [cmd for cmd in ran if cmd[0] == "kill"]


def test_a_rank_of_a_running_instance_only_warns(tmp_path):
    """A rank its agent still runs (its parent is the agent) is in use, not left over."""
    from mac_rdma_use import AGENT_PID, Holder, ioreg_rdma, ps, rank_command

    scene = Scene(2, mesh(2), holders=(Holder(0, 1, 6001, AGENT_PID, rank_command(0)),))
    check = check_rdma_held((0, ioreg_rdma(scene, 0)), (0, ps(scene, 0)))
    assert (check.status, check.commands) == ("WARN", ())
    assert check.detail.startswith("rdma_en2 is held by pid 6001 (Python: ")


def test_unreadable_registry_is_skipped_with_the_command_to_run():
    check = check_rdma_held((127, ""), (0, ""))
    assert (check.status, check.detail) == (
        "SKIP",
        "cannot read `ioreg -a -l -r -c AppleThunderboltIPPort`",
    )


# ---- the agent: an instance ends with none of its processes left --------------------------

# A fake rank: takes the "device" (an exclusive lock, as a jaccl rank's queue pairs), starts a
# child that shares it and ignores SIGTERM, then crashes or runs. A second holder fails the way
# jaccl does on a held device.
FAKE_RANK = """
import fcntl, os, signal, sys, time
device, pidfile, mode = sys.argv[1:4]
fd = os.open(device, os.O_RDWR | os.O_CREAT)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    sys.exit("ValueError: [jaccl] Changing queue pair to RTR failed with errno 16")
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(pidfile + ".tmp", "w").write(str(os.getpid()))
    os.rename(pidfile + ".tmp", pidfile)
    time.sleep(600)
    os._exit(0)
while not os.path.exists(pidfile):
    time.sleep(0.01)
if mode == "crash":
    os._exit(1)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_for(pred, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (got := pred()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc to see the fake ranks' children")
@pytest.mark.parametrize("posix_spawn", [True, False], ids=["posix_spawn", "fork"])
def test_a_restart_after_a_crash_works_once_the_instance_ended(posix_spawn, tmp_path, monkeypatch):
    device, real_spawn = tmp_path / "rdma_en2", ranks._spawn

    def spawn(argv, env, cpu, fds):
        job = json.loads(Path(argv[-1]).read_text())
        fake = [sys.executable, "-c", FAKE_RANK, str(device), *job["model_dir"].split("|")]
        return real_spawn(fake, env, cpu, fds)

    monkeypatch.setattr(ranks, "_spawn", spawn)
    monkeypatch.setattr(ranks, "POSIX_SPAWN", posix_spawn)
    manager = ranks.RankManager(lease=3600)

    def start(iid: str, mode: str) -> Path:
        pidfile = tmp_path / f"{iid}.pid"
        task = TraceTask(prompts=((1,),), max_tokens=1, out="-")
        job = RankJob(model_dir=f"{pidfile}|{mode}", world_size=1, task=task).model_dump_json()
        manager.start(RankSpec(instance_id=iid, rank=0, world_size=1, job=job))
        return pidfile

    try:
        crashed = start("a", "crash")
        assert wait_for(lambda: manager.poll("a", 0)["exits"] == {0: 1})
        child = int(crashed.read_text())
        assert alive(child)  # the crashed rank's child still holds the device
        start("b", "run")  # so a restart now fails as jaccl does on a held device
        assert wait_for(lambda: manager.poll("b", 0)["exits"] == {0: 1})
        assert manager.poll("b", 0)["errors"] == {
            0: "ValueError: [jaccl] Changing queue pair to RTR failed with errno 16"
        }
        assert manager.stop("b") == []
        # Ending the crashed instance kills its rank's whole group, child included.
        assert manager.stop("a") == []
        assert not alive(child)
        running = start("c", "run")
        assert wait_for(running.exists)
        assert manager.poll("c", 0)["exits"] == {0: None}  # the restart holds the device
        child = int(running.read_text())
        assert manager.stop("c") == []  # both ignore SIGTERM: SIGKILL, then none is left
        assert not alive(child)
    finally:
        manager.stop_all()


# ---- the launch error ------------------------------------------------------------------------


def test_a_jaccl_ebusy_failure_points_to_doctor_on_that_mac(monkeypatch):
    monkeypatch.setattr("thunderpool.cluster.control.instance.CAUSE_GRACE_S", 0.0)
    inst = ClusterInstance.__new__(ClusterInstance)
    inst.order, inst.nodes = ["n0", "n1"], ["n0", "n1"]
    monkeypatch.setattr(inst, "_name", {"n0": "studio-0", "n1": "studio-1"}.get)
    cause = "ValueError: [jaccl] Changing queue pair to RTR failed with errno 16"
    err = inst._lost([(1, 1, "n1", cause)], {"n0": 0, "n1": 0})
    assert isinstance(err, LaunchError)
    assert str(err) == (
        f"rank 1 on studio-1 exited with code 1: {cause} (EBUSY: an RDMA device on studio-1 "
        "is still held, most often by a process left from an earlier run; run `thunderpool "
        "doctor` on studio-1: it names the process holding it and the fix); stopped all 2 ranks"
    )
    # Any other jaccl errno is passed on as it is.
    other = cause.replace("errno 16", "errno 22")
    assert str(inst._lost([(0, 1, "n0", other)], {})) == (
        f"rank 0 on studio-0 exited with code 1: {other}; stopped all 2 ranks"
    )
