"""Co-located ranks under Open MPI's `mpirun` and MLX's `mpi` backend (one host only).

On one host MPI's shared-memory transport all-reduces a hidden-size row in ~15 us where MLX
`ring` over loopback takes ~60 us (docs/benchmarks.md), which is most of TP's collective time.
Same interface as LocalInstance: start / events / kill, a context manager, a silence timeout.
Each rank writes its stdout and stderr to its own files, which we tail: mpirun's own output
forwarding (--tag-output) merges lines of different ranks. MLX dlopens `libmpi.so`, which
Debian only ships as libmpi.so.40, so MLX_MPI_LIBNAME names the real file. mpirun puts each
rank in its own process group of its session, so kill() ends the whole session.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from thunderpool.engine.job import RankJob
from thunderpool.errors import LaunchError
from thunderpool.launch import lifeline
from thunderpool.launch.blas import fast_blas_env
from thunderpool.launch.local import (
    Launcher,
    LocalInstance,
    RankEvent,
    child_setup,
    drain,
    one_core_env,
    watch,
)

# Run by mpirun for each rank: hold the launcher's lifeline (a FIFO: mpirun passes no other
# files on), on Linux also die with mpirun (it would leave ranks spinning in a collective if it
# were SIGKILLed), write output to files named by the rank, then become the worker.
_RANK_BOOT = """
import os, sys
from thunderpool.launch import lifeline
job, out, fifo, pdeathsig = sys.argv[1:5]
rank = os.environ["OMPI_COMM_WORLD_RANK"]
mpirun = os.getppid()
if pdeathsig == "1":
    lifeline.die_with_parent()  # kept across exec
if os.getppid() != mpirun or (fd := lifeline.open_fifo(fifo)) is None:
    sys.exit(1)  # mpirun or the launcher died before the lines above
os.environ[lifeline.LIFELINE_ENV] = str(fd)
for fd, name in ((1, "out"), (2, "err")):
    os.dup2(os.open(f"{out}/{name}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
os.execv(sys.executable, [sys.executable, "-m", "thunderpool.rank", job])
"""
_POLL_S = 0.02


def mpi_command(
    mpirun: str, n: int, pin: bool, env_names: list[str], argv: list[str], root: bool
) -> list[str]:
    """The mpirun command line: n local ranks, one core each if pinned."""
    cmd = [mpirun, "-np", str(n), "--bind-to", "core" if pin else "none"]
    if pin:
        cmd += ["--map-by", "core"]
    else:
        cmd += ["--oversubscribe"]
    if root:
        cmd.append("--allow-run-as-root")
    for name in env_names:
        cmd += ["-x", name]
    return cmd + argv


# How each backend joins local ranks, as the runs' first line says it.
LOCAL_BACKENDS = {"ring": "MLX ring on loopback", "mpi": "MPI shared memory under mpirun"}


# Why `serve` takes ring on a machine its ranks fill (the first line of its output says it).
SERVE_RING_REASON = (
    "every core runs a rank, and MPI ranks spin while they wait, starving the API's "
    "streaming of CPU; ring's ranks block instead (--backend mpi overrides)"
)


def cores_here() -> int:
    """Every core this process may run on (the gateway may use any of them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def mpi_available() -> bool:
    try:
        find_mpi()
    except LaunchError:
        return False
    return True


def local_instance(job: RankJob, **kwargs) -> LocalInstance | MpiInstance:
    """The launcher for `job`'s ranks on this host: under mpirun for backend "mpi" (MPI's
    shared-memory collectives: lower latency between co-located ranks), else MLX ring."""
    if job.backend == "mpi" and job.world_size > 1:
        return MpiInstance(job, **kwargs)
    if job.backend == "mpi":
        job = job.model_copy(update={"backend": "ring"})  # one rank: nothing to reduce
    return LocalInstance(job, **kwargs)


def install_mpi(platform: str | None = None) -> str:
    """The command that installs Open MPI on `platform` (sys.platform's names; None: here)."""
    if (platform or sys.platform) == "darwin":
        return "brew install open-mpi"
    return "sudo apt install openmpi-bin"


def libmpi_beside(mpirun: str) -> str | None:
    """libmpi in the lib dir next to mpirun's bin dir: where Homebrew on Apple Silicon puts it
    (/opt/homebrew/lib), which find_library does not search."""
    prefix = Path(os.path.realpath(mpirun)).parent.parent
    for name in ("libmpi.dylib", "libmpi.so.40", "libmpi.so"):
        if (prefix / "lib" / name).exists():
            return str(prefix / "lib" / name)
    return None


@functools.cache
def find_mpi() -> tuple[str, str]:
    """(mpirun path, libmpi file name), or a LaunchError saying what to install."""
    import shutil

    mpirun = shutil.which("mpirun")
    lib = ctypes.util.find_library("mpi") or (mpirun and libmpi_beside(mpirun))
    if mpirun is None or lib is None:
        raise LaunchError(
            f"--backend mpi needs Open MPI's mpirun and libmpi (`{install_mpi()}`); "
            "or use --backend ring"
        )
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    if "Open MPI" not in out.stdout + out.stderr:
        raise LaunchError(
            f"{mpirun} is not Open MPI ({(out.stdout or out.stderr).strip()[:60]!r}); "
            "--backend mpi is tested with Open MPI only; use --backend ring"
        )
    return mpirun, lib


def rank_argv(job_file: Path, out_dir: Path, fifo: Path) -> list[str]:
    """What mpirun runs for every rank: the worker with its output in out_dir/{out,err}.RANK,
    alive while the lifeline FIFO `fifo` is open for writing."""
    flag = "1" if lifeline.PDEATHSIG else "0"
    return [sys.executable, "-c", _RANK_BOOT, str(job_file), str(out_dir), str(fifo), flag]


def tail_lines(path: Path, done, put) -> None:
    """put() each complete line written to `path` (created later, maybe never) until done()
    is true and the file is read to its end; then put(None)."""
    while not path.exists():
        if done():
            put(None)
            return
        time.sleep(_POLL_S)
    with path.open() as f:
        partial = ""
        while True:
            chunk = f.readline()
            if chunk:
                partial += chunk
                if partial.endswith("\n"):
                    put(partial.rstrip("\n"))
                    partial = ""
                continue
            if done():
                # One last read: the writer may have finished between readline and done().
                rest = partial + f.read()
                for line in rest.splitlines():
                    put(line)
                put(None)
                return
            time.sleep(_POLL_S)


# Open MPI 4's words for the rank that ended a job: killed by a signal, or the first to exit
# non-zero ("Process name: [[jobid,vpid],RANK]" then "Exit code: N" on the next lines).
_SIGNALED = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
_PROCESS = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]")
_EXIT_CODE = re.compile(r"Exit code:\s*(-?\d+)")


def mpirun_verdict(lines) -> tuple[int, str, int] | None:
    """(rank, "signal" | "code", number) from mpirun's own report of the rank that ended the
    job, or None when it named none."""
    text = "\n".join(lines)
    if m := _SIGNALED.search(text):
        return int(m[1]), "signal", int(m[2])
    if (m := _PROCESS.search(text)) and (c := _EXIT_CODE.search(text, m.end())):
        return int(m[1]), "code", int(c[1])
    return None


def session_pids(sid: int) -> list[int]:
    """Every live (not zombie) process of session `sid` (Linux /proc): mpirun and its ranks."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # Fields after the ")" closing the command name: state ppid pgrp session ...
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(stat.parent.name))
    return pids


class MpiInstance(Launcher):
    """N ranks of one job on this host under mpirun; `events()` streams their output."""

    def __init__(
        self,
        job: RankJob,
        *,
        timeout: float | None = 600.0,
        pin: bool | None = None,
        env: dict[str, str] | None = None,
    ):
        if job.backend != "mpi":
            raise LaunchError(f"MpiInstance runs backend 'mpi' jobs, not {job.backend!r}")
        # One stderr tail per rank, and one for mpirun itself.
        super().__init__(job, timeout, pin, env, job.world_size + 1, "thunderpool-mpi-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        mpirun, lib = find_mpi()
        tmp = Path(self.tmp.name)
        job_file = tmp / "job.json"
        job_file.write_text(self.job.model_dump_json())
        extra = {
            **fast_blas_env(),
            "MLX_MPI_LIBNAME": lib,
            **one_core_env(0 if self.pin else None),
            **self.env,
        }
        argv = rank_argv(job_file, tmp, self.lifeline.fifo(tmp / "lifeline"))
        root = hasattr(os, "geteuid") and os.geteuid() == 0
        cmd = mpi_command(mpirun, self.job.world_size, self.pin, sorted(extra), argv, root)
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **extra},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=lambda: child_setup(None),  # die with us (Linux's PR_SET_PDEATHSIG)
        )
        self.procs = [self.proc]
        for stream in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._pump, args=(stream,), daemon=True).start()
        done = lambda: self.proc.poll() is not None  # noqa: E731
        for rank in range(self.job.world_size):
            for name in ("out", "err"):
                put = lambda line, r=rank, n=name: self.lines.put((r, n, line))  # noqa: E731
                args = (tmp / f"{name}.{rank}", done, put)
                threading.Thread(target=tail_lines, args=args, daemon=True).start()

    def _pump(self, stream) -> None:
        """mpirun's own output (its errors), filed under rank None."""
        for line in stream:
            self.lines.put((None, "err", line.rstrip("\n")))
        self.lines.put((None, "err", None))

    def events(self) -> Iterator[RankEvent]:
        """Yields each rank's events until mpirun exits 0; raises LaunchError otherwise."""
        assert self.proc is not None, "start() first"
        yield from watch(
            self.lines,
            open_streams=2 + 2 * self.job.world_size,
            running=lambda: self.proc.poll() is None,
            check=self._check_exit,
            on_stderr=lambda rank, line: self._tail(rank).append(line),
            kill=self.kill,
            timeout=self.timeout,
            ranks=self.job.world_size,
            interrupted=self._interrupted,
        )

    def _tail(self, rank: int | None) -> deque[str]:
        return self.stderr_tail[self.job.world_size if rank is None else rank]

    def _check_exit(self) -> None:
        code = self.proc.poll()
        if code in (None, 0):
            return
        time.sleep(0.3)  # let the tails catch the ranks' last words
        drain(self.lines, lambda rank, line: self._tail(rank).append(line))
        self.kill()
        raise LaunchError(self._describe_failure(code))

    def _describe_failure(self, code: int) -> str:
        """The failed rank's own words: a rank mpirun saw killed by a signal is the cause (its
        peers then fail on the broken link), else a rank's `error:` line, else the traceback's
        last line of the rank mpirun names as the first to exit non-zero."""
        n = self.job.world_size
        said = mpirun_verdict(self.stderr_tail[n])
        if said is not None and said[1] == "signal":
            return f"rank {said[0]} was killed by signal {said[2]}; stopped all {n} ranks"
        first = said[0] if said is not None and said[0] < n else None
        order = [first] if first is not None else []
        order += [r for r in range(n) if r != first]
        for rank in order:
            errors = [ln for ln in self.stderr_tail[rank] if ln.startswith("error:")]
            if errors:
                cause = errors[-1].removeprefix("error: ")
                return f"rank {rank} failed: {cause}; stopped all {n} ranks"
        for rank in order:
            tail = [ln for ln in self.stderr_tail[rank] if ln.strip()]
            if tail:
                how = f"exited with code {said[2]}" if rank == first else "failed"
                return f"rank {rank} {how}: {tail[-1]}; stopped all {n} ranks"
        tail = [ln for ln in self.stderr_tail[n] if ln.strip(" -")]
        if tail:
            return f"mpirun exited with code {code}: {tail[-1]}; stopped all {n} ranks"
        return f"mpirun exited with code {code} (no output); stopped all {n} ranks"

    def kill(self, grace: float = 2.0) -> None:
        """SIGTERM mpirun's whole session (mpirun and every rank), then SIGKILL; reap all."""
        if self.proc is not None:
            sid = self.proc.pid
            for sig in (signal.SIGTERM, signal.SIGKILL):
                pids = session_pids(sid) if sys.platform == "linux" else [sid]
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, sig)
                end = time.monotonic() + grace
                while time.monotonic() < end and self._alive(sid):
                    time.sleep(0.05)
                if not self._alive(sid):
                    break
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
        self.lifeline.close()  # what mpirun left (macOS: no session walk) ends now
        self.tmp.cleanup()

    def _alive(self, sid: int) -> bool:
        self.proc.poll()  # reap mpirun itself so that it stops counting as alive
        if sys.platform != "linux":
            return self.proc.poll() is None
        return bool(session_pids(sid))
