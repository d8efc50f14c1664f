"""Start the rank processes of one instance on this host, watch them, and kill all on failure.

Ranks talk MLX `ring` over loopback (a JSON hostfile of 127.0.0.1:port per rank). Each rank
runs in its own session so that a kill reaches its children, and dies with the launcher on
every OS (its lifeline, launch/lifeline.py; PR_SET_PDEATHSIG too on Linux). Any rank exiting
non-zero, or silence past the timeout, stops them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from thunderpool.engine.job import EVENT_PREFIX, RankJob
from thunderpool.errors import LaunchError
from thunderpool.launch.blas import fast_blas_env
from thunderpool.launch.lifeline import Lifeline, die_with_parent


@dataclass(frozen=True, slots=True)
class RankEvent:
    rank: int
    event: dict


# Ports below every OS's ephemeral range (Linux 32768+, macOS 49152+): a port picked here cannot
# be handed to an outgoing connection between our check and the rank's bind.
PORT_RANGE = (20000, 32760)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free TCP ports below the ephemeral range, held open together while picked.
    Bound without SO_REUSEADDR, so a port a previous instance left in TIME_WAIT is skipped."""
    socks: list[socket.socket] = []
    rng = random.Random()
    try:
        for _ in range(200 * n):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, rng.randrange(*PORT_RANGE)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:
            raise LaunchError(f"found only {len(socks)} of {n} free ports in {PORT_RANGE}")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def watch(
    lines: queue.Queue,
    *,
    open_streams: int,
    running: Callable[[], bool],
    check: Callable[[], None],
    on_stderr: Callable[[int | None, str], None],
    kill: Callable[[], None],
    timeout: float | None,
    ranks: int,
    interrupted: threading.Event | None = None,
) -> Iterator[RankEvent]:
    """The launchers' watch loop over (rank, "out" | "err", line, or None at a stream's end).

    Yields rank events while a stream is open or `running()`; `check()` raises on a failed
    exit; `timeout` seconds without a line kill every rank (None: a serving instance may
    rightly be silent for hours, so only exits end it). An `interrupted` event returns early.
    """
    limit = timeout if timeout is not None else float("inf")
    deadline = time.monotonic() + limit
    while open_streams or running():
        if interrupted is not None and interrupted.is_set():
            return
        check()
        if time.monotonic() > deadline:
            kill()
            raise LaunchError(
                f"no progress from the ranks for {timeout:.0f}s; stopped all {ranks} ranks "
                "(raise --timeout for very large models)"
            )
        try:
            rank, name, line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        if line is None:
            open_streams -= 1
            continue
        deadline = time.monotonic() + limit
        if name == "err":
            on_stderr(rank, line)
        elif line.startswith(EVENT_PREFIX):
            yield RankEvent(rank, json.loads(line[len(EVENT_PREFIX) :]))
    check()


def drain(lines: queue.Queue, on_stderr: Callable[[int | None, str], None]) -> None:
    """Hand every stderr line already queued to `on_stderr` (a failed rank's last words)."""
    with contextlib.suppress(queue.Empty):
        while True:
            rank, name, line = lines.get_nowait()
            if name == "err" and line is not None:
                on_stderr(rank, line)


def child_setup(cpu: int | None) -> None:
    """Runs in the child before exec: die with the launcher (Linux; the lifeline does it
    everywhere), optionally pin to one core."""
    die_with_parent()
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def one_core_env(cpu: int | None) -> dict[str, str]:
    """A rank pinned to one core must not start BLAS threads for cores it cannot use."""
    if cpu is None:
        return {}
    return {"OPENBLAS_NUM_THREADS": "1", "BLIS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def own_core(index: int | None) -> int | None:
    """The core for the coordinator's `index`-th rank on this machine: the index-th core this
    agent may use (a container's cpuset need not start at core 0)."""
    if index is None:
        return None
    cores = _cpus()
    return cores[index % len(cores)]


class Launcher:
    """What the launchers of this host's ranks share (LocalInstance, mpi.MpiInstance): a
    context manager that starts the ranks and kills them all on exit; `events()` streams their
    output and `interrupt()` makes it return. Subclasses define start, events and kill."""

    leader_host = "127.0.0.1"

    def __init__(
        self, job: RankJob, timeout: float | None, pin: bool | None, env, tails: int, prefix: str
    ):
        self.job, self.timeout = job, timeout
        n = job.world_size
        # One rank keeps every core; several get one core each (they busy-poll in collectives),
        # where the OS lets us pin (not macOS: mpirun there refuses --bind-to core).
        pinnable = hasattr(os, "sched_setaffinity")
        self.pin = (pinnable and 1 < n <= len(_cpus())) if pin is None else pin
        self.env = dict(env or {})
        self.procs: list[subprocess.Popen] = []
        self.stderr_tail: list[deque[str]] = [deque(maxlen=20) for _ in range(tails)]
        self.lines: queue.Queue = queue.Queue()
        self.tmp = tempfile.TemporaryDirectory(prefix=prefix)
        self.lifeline = Lifeline()  # closed by kill(), or by the kernel when we die
        self._interrupted = threading.Event()

    def interrupt(self) -> None:
        """Make `events()` return at its next check (the caller then kills or replaces us)."""
        self._interrupted.set()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


class LocalInstance(Launcher):
    """N ranks of one job on this host, talking MLX ring over loopback."""

    def __init__(
        self,
        job: RankJob,
        *,
        timeout: float | None = 600.0,
        pin: bool | None = None,
        env: dict[str, str] | None = None,
    ):
        super().__init__(job, timeout, pin, env, job.world_size, "thunderpool-")
        self.cpus = _cpus()

    def start(self) -> None:
        tmp = Path(self.tmp.name)
        env = {**os.environ, **fast_blas_env(), **self.env}
        for rank, (job, world_env) in enumerate(self._worlds(tmp)):
            job_file = tmp / f"job-{job.layout.stage}.json"
            if not job_file.exists():
                job_file.write_text(job.model_dump_json())
            cpu = self.cpus[rank % len(self.cpus)] if self.pin else None
            proc = subprocess.Popen(
                [sys.executable, "-m", "thunderpool.rank", str(job_file)],
                env={**env, **world_env, **one_core_env(cpu), **self.lifeline.env()},
                pass_fds=self.lifeline.pass_fds,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
                preexec_fn=lambda cpu=cpu: child_setup(cpu),
            )
            self.procs.append(proc)
            for stream, name in ((proc.stdout, "out"), (proc.stderr, "err")):
                threading.Thread(target=self._pump, args=(rank, name, stream), daemon=True).start()

    def _worlds(self, tmp: Path) -> Iterator[tuple[RankJob, dict[str, str]]]:
        """Each rank's job and MLX environment, in global rank order: one ring world of all
        ranks, or (hybrid) one per stage with its own hostfile, joined by hand-off ports."""
        job = self.job
        groups = job.layout.groups or (job.world_size,)
        ports = free_ports(job.world_size + (job.world_size if job.layout.groups else 0))
        handoff = tuple(f"127.0.0.1:{p}" for p in ports[job.world_size :])
        for stage, size in enumerate(groups):
            env: dict[str, str] = {}
            first = sum(groups[:stage])
            if size > 1:
                hostfile = tmp / f"hosts-{stage}.json"
                ring = [[f"127.0.0.1:{p}"] for p in ports[first : first + size]]
                hostfile.write_text(json.dumps(ring))
                env["MLX_HOSTFILE"] = str(hostfile)
            staged = job.at_stage(stage, handoff) if job.layout.groups else job
            for rank in range(size):
                yield staged, {**env, "MLX_RANK": str(rank)}

    def _pump(self, rank: int, name: str, stream) -> None:
        for line in stream:
            self.lines.put((rank, name, line.rstrip("\n")))
        self.lines.put((rank, name, None))

    def events(self) -> Iterator[RankEvent]:
        """Yields each rank's events until all ranks exit 0; raises LaunchError otherwise."""
        yield from watch(
            self.lines,
            open_streams=2 * len(self.procs),
            running=lambda: any(p.poll() is None for p in self.procs),
            check=self._check_exits,
            on_stderr=self._on_stderr,
            kill=self.kill,
            timeout=self.timeout,
            ranks=len(self.procs),
            interrupted=self._interrupted,
        )

    def _on_stderr(self, rank: int, line: str) -> None:
        self.stderr_tail[rank].append(line)
        if self.env.get("THUNDERPOOL_ECHO_STDERR"):
            print(f"[rank {rank}] {line}", file=sys.stderr)

    def _check_exits(self) -> None:
        failed = [(r, p.poll()) for r, p in enumerate(self.procs) if p.poll() not in (None, 0)]
        if not failed:
            return
        time.sleep(0.2)  # let the stderr pumps catch the ranks' last words
        drain(self.lines, lambda rank, line: self.stderr_tail[rank].append(line))
        self.kill()
        # A rank killed by a signal is the cause; its peers then fail on the broken link.
        rank, code = min(failed, key=lambda rc: (rc[1] >= 0, rc[0]))
        raise LaunchError(self._describe_failure(rank, code))

    def _describe_failure(self, rank: int, code: int) -> str:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        tail = [ln for ln in self.stderr_tail[rank] if ln.strip()]
        errors = [ln for ln in tail if ln.startswith("error:")]
        last = (errors or tail or ["(no output)"])[-1]
        cause = last.removeprefix("error: ")
        return f"rank {rank} {how}: {cause}; stopped all {len(self.procs)} ranks"

    def kill(self, grace: float = 2.0) -> None:
        """SIGTERM every rank's process group, then SIGKILL what is left; reap all."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        end = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.lifeline.close()
        self.tmp.cleanup()
