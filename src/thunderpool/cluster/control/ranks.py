"""The rank processes an agent runs for the coordinator: start, collect events, stop, reap.

Ranks run in their own sessions and die with the agent on every OS: each instance has its own
lifeline (launch/lifeline.py), closed when it stops or the agent dies; Linux's
PR_SET_PDEATHSIG too. On macOS they start by posix_spawn, not fork (cluster/control/spawn.py).
Their `TPEV` events are buffered per instance so the coordinator can fetch them in order.
An instance ends only once no process of its ranks' groups is left: one left holding an RDMA
device makes the next jaccl start on this Mac fail with EBUSY.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from thunderpool.cluster.control.messages import RankSpec
from thunderpool.cluster.control.spawn import Spawned, spawn
from thunderpool.config import LINK_TOKEN_ENV
from thunderpool.engine.job import EVENT_PREFIX, RankJob
from thunderpool.launch.blas import fast_blas_env
from thunderpool.launch.lifeline import Lifeline
from thunderpool.launch.local import child_setup, one_core_env, own_core

# A coordinator polls every instance several times a second; silence this long means it is
# gone or cut off, and ranks left running would hang in collectives forever.
LEASE_S = 5.0
log = logging.getLogger("thunderpool.agent")


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen | Spawned
    stderr: deque = field(default_factory=lambda: deque(maxlen=20))


@dataclass
class _Instance:
    ranks: dict[int, _Rank] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    tmp: tempfile.TemporaryDirectory = field(
        default_factory=lambda: tempfile.TemporaryDirectory(prefix="thunderpool-agent-")
    )
    polled: float = field(default_factory=time.monotonic)
    lifeline: Lifeline = field(default_factory=Lifeline)


class RankManager:
    def __init__(self, resolve_model=None, link_token: str | None = None, lease: float = LEASE_S):
        self.instances: dict[str, _Instance] = {}
        self.lock = threading.Lock()
        # Notified when a rank sends an event or closes its output (it exited).
        self.changed = threading.Condition(self.lock)
        self.resolve_model = resolve_model
        # A serving leader checks this on its engine link; it never travels in a message.
        self.link_token = link_token
        self.lease = lease
        self._closed = threading.Event()
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, and the agent's
        # request threads come and go: ranks are forked by one thread that lives as long as we do.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="spawner")
        threading.Thread(target=self._watch_leases, name="leases", daemon=True).start()

    def _watch_leases(self) -> None:
        while not self._closed.wait(0.5):
            now = time.monotonic()
            for iid, inst in list(self.instances.items()):
                if now - inst.polled > self.lease:
                    log.warning(
                        "instance %s: no poll from its coordinator for %.0f s; stopping its ranks",
                        iid,
                        self.lease,
                    )
                    self.stop(iid)

    def start(self, spec: RankSpec) -> None:
        job = RankJob.model_validate_json(spec.job)
        if self.resolve_model is not None:
            # The model is named as the user named it; each node resolves it to its own copy.
            model_dir = self.resolve_model(job.model_dir or None)
            job = job.model_copy(update={"model_dir": str(model_dir)})
            # The leader runs the draft: its own copy (mtp: the model's own layer, no copy).
            # A follower holding a copy at the same path shards it with the others (TP,
            # engine/draft_load.py); it downloads none, and without one votes for the
            # leader's whole draft.
            named = job.draft_model not in (None, "", "mtp")
            if named and (spec.rank == 0 or Path(job.draft_model).expanduser().exists()):
                draft = self.resolve_model(job.draft_model)
                job = job.model_copy(update={"draft_model": str(draft)})
        with self.lock:
            if (inst := self.instances.get(spec.instance_id)) is None:
                inst = self.instances[spec.instance_id] = _Instance()  # its own pipe and dir
            inst.polled = time.monotonic()
        tmp = Path(inst.tmp.name)
        cpu = own_core(spec.cpu)
        job_file = tmp / f"job-{spec.rank}.json"
        job_file.write_text(job.model_dump_json())
        env = {
            **os.environ,
            **fast_blas_env(),
            **spec.env,
            # A hybrid rank's rank in its stage's world, which its spec's env names.
            "MLX_RANK": spec.env.get("MLX_RANK", str(spec.rank)),
            **one_core_env(cpu),
            **({LINK_TOKEN_ENV: self.link_token} if self.link_token else {}),
            **inst.lifeline.env(),
        }
        for var, content in spec.files.items():
            path = tmp / f"{var.lower()}-{spec.rank}.json"
            path.write_text(content)
            env[var] = str(path)
        argv = [sys.executable, "-m", "thunderpool.rank", str(job_file)]
        fds = inst.lifeline.pass_fds
        proc = self._spawner.submit(_spawn, argv, env, cpu, fds).result()
        rank = _Rank(spec.rank, proc)
        inst.ranks[spec.rank] = rank
        inst.polled = time.monotonic()  # the lease runs from the coordinator's last word
        threading.Thread(target=self._pump_out, args=(inst, rank), daemon=True).start()
        threading.Thread(target=self._pump_err, args=(rank,), daemon=True).start()

    def _pump_out(self, inst: _Instance, rank: _Rank) -> None:
        for line in rank.proc.stdout:
            if line.startswith(EVENT_PREFIX):
                with contextlib.suppress(json.JSONDecodeError):
                    event = json.loads(line[len(EVENT_PREFIX) :])
                    with self.lock:
                        inst.events.append({"rank": rank.rank, "event": event})
                        self.changed.notify_all()
        with self.lock:
            self.changed.notify_all()

    def _pump_err(self, rank: _Rank) -> None:
        for line in rank.proc.stderr:
            if line.strip():
                rank.stderr.append(line.rstrip("\n"))

    def poll(self, instance_id: str, after: int, wait: float = 0.0) -> dict:
        """Events after index `after`, and each rank's exit code (None while running).

        With `wait`, hold the answer up to that many seconds until something happens, so the
        coordinator need not spin (its polling competes with the ranks for CPU).
        """
        inst = self.instances.get(instance_id)
        if inst is None:
            return {"events": [], "exits": {}, "errors": {}, "known": False}
        inst.polled = time.monotonic()
        deadline = time.monotonic() + min(wait, 5.0)
        with self.lock:
            # Sleep until an event or an exit (not a 10 ms spin: pinned ranks share our cores).
            while (
                len(inst.events) <= after
                and all(r.proc.poll() is None for r in inst.ranks.values())
                and (left := deadline - time.monotonic()) > 0
            ):
                self.changed.wait(min(left, 0.1))
            events = inst.events[after:]
        exits = {r.rank: r.proc.poll() for r in inst.ranks.values()}
        errors = {
            r.rank: _last_error(r.stderr)
            for r in inst.ranks.values()
            if exits[r.rank] not in (None, 0)
        }
        return {"events": events, "exits": exits, "errors": errors, "known": True}

    def stop(self, instance_id: str, grace: float = 2.0) -> list[int]:
        """End an instance: SIGTERM, then SIGKILL, to each rank's whole process group (a child
        a rank started holds its RDMA devices too, crashed rank or not), and wait until no
        process of those groups is left. Returns the pids still alive after that: none, unless
        the kernel cannot kill them (then they may hold RDMA devices: `thunderpool doctor`)."""
        inst = self.instances.pop(instance_id, None)
        if inst is None:
            return []
        procs = [r.proc for r in inst.ranks.values()]  # each leads its own session and group
        _signal_groups(procs, signal.SIGTERM)
        if left := _wait_groups(procs, grace):
            _signal_groups(left, signal.SIGKILL)
            left = _wait_groups(left, KILL_WAIT_S)
        alive = [pid for p in left for pid in group_members(p.pid)]
        if alive:
            log.error(
                "instance %s: processes %s of its ranks outlived SIGKILL; they may hold RDMA "
                "devices (`thunderpool doctor` names them)",
                instance_id,
                alive,
            )
        inst.lifeline.close()
        inst.tmp.cleanup()
        return alive

    def stop_all(self) -> None:
        self._closed.set()
        for iid in list(self.instances):
            self.stop(iid)


# macOS: posix_spawn, never a fork of this threaded, Metal-loaded agent (cluster/control/spawn.py);
# the lifeline alone ties ranks to us there. Linux forks to set PDEATHSIG and pin a core first.
POSIX_SPAWN = sys.platform == "darwin"


def _spawn(
    argv: list[str], env: dict[str, str], cpu: int | None, fds: tuple[int, ...]
) -> subprocess.Popen | Spawned:
    if POSIX_SPAWN:
        return spawn(argv, env, fds)
    return subprocess.Popen(
        argv,
        env=env,
        pass_fds=fds,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: child_setup(cpu),
    )


KILL_WAIT_S = 5.0  # after SIGKILL, how long a group may take to be gone


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (a zombie has freed everything it held).
    Linux reads /proc; elsewhere (launchd reaps orphans at once) the group's existence."""
    if sys.platform != "linux":
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def _signal_groups(procs: list, sig: int) -> None:
    # A reaped rank whose group is empty is skipped: its pid may belong to another process now.
    for p in procs:
        if p.poll() is not None and not group_members(p.pid):
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)


def _wait_groups(procs: list, timeout: float) -> list:
    """Reap each rank and wait for its group to empty; the ranks whose group did not in time."""
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            p.poll()  # reaps the rank itself, so only its group's other processes count
        left = [p for p in procs if p.poll() is None or group_members(p.pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def _last_error(lines: deque) -> str:
    errors = [ln for ln in lines if ln.startswith("error:")]
    last = (errors or list(lines) or ["(no output)"])[-1]
    return last.removeprefix("error: ")
