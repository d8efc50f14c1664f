"""Start a rank with posix_spawn: no fork of the agent, which on macOS has threads and has
loaded Metal (Python's docs warn that fork, and so `preexec_fn`, is unsafe in such a process).

The child gets /dev/null for stdin, a pipe each for stdout and stderr, its own session (so the
agent kills its group), and the lifeline's read end at the same fd number (launch/lifeline.py):
the rank dies once the agent closes the instance or dies. What `subprocess.Popen` offers that
RankManager uses (pid, stdout, stderr, poll, wait) is here too.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time


class Spawned:
    """A process started by `spawn`: the part of subprocess.Popen the agent uses."""

    def __init__(self, pid: int, args: list[str], stdout: int, stderr: int):
        self.pid, self.args, self.returncode = pid, args, None
        self.stdout = os.fdopen(stdout, "r", encoding="utf-8", errors="replace")
        self.stderr = os.fdopen(stderr, "r", encoding="utf-8", errors="replace")
        self._lock = threading.Lock()  # one waitpid at a time: pollers share the process

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return code


def spawn(argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> Spawned:
    """Start argv with posix_spawn in a session of its own, `pass_fds` open in it at the same
    numbers. Called from one thread only (RankManager's spawner): the passed fds are
    inheritable for the instant of the call, and other launchers close what they do not pass."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_DUP2, out_w, 1),
        (os.POSIX_SPAWN_DUP2, err_w, 2),
    ]
    try:
        for fd in pass_fds:
            os.set_inheritable(fd, True)
        pid = os.posix_spawn(argv[0], argv, env, file_actions=actions, setsid=True)
    except BaseException:
        for fd in (out_r, err_r):
            os.close(fd)
        raise
    finally:
        for fd in pass_fds:
            os.set_inheritable(fd, False)
        os.close(out_w)
        os.close(err_w)
    return Spawned(pid, argv, out_r, err_r)
