"""Ranks never outlive whoever started them, on every OS (macOS has no PR_SET_PDEATHSIG).

The launcher holds the write end of a pipe and each rank holds the read end, named by
THUNDERPOOL_LIFELINE_FD. Nothing is ever written: a thread in the rank blocks on a read that
returns end-of-file once no write end is left open, that is when the launcher closes the
instance or dies in any way (the kernel closes a SIGKILLed process's files), and the rank then
kills itself. mpirun closes the files its ranks would inherit, so ranks under it open a FIFO
the launcher holds open instead (`fifo`, `open_fifo`): the same end-of-file rule, one more
process away. On Linux, PR_SET_PDEATHSIG stays as a second line (PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from pathlib import Path

LIFELINE_ENV = "THUNDERPOOL_LIFELINE_FD"
# Linux also kills a rank the moment its parent dies; the lifeline alone suffices elsewhere.
PDEATHSIG = sys.platform == "linux"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child before exec (Linux): SIGKILL when the parent dies. No-op elsewhere."""
    if PDEATHSIG:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Lifeline:
    """The launcher's end of one instance's lifeline: `pass_fds` and `env` for each rank it
    starts itself, `fifo()` for ranks a process in between starts; `close()` ends them all."""

    def __init__(self) -> None:
        read, write = os.pipe()  # not inherited except where passed
        self._read: int | None = read
        self._write: int | None = write
        self._fifo_write: int | None = None

    @property
    def pass_fds(self) -> tuple[int, ...]:
        assert self._read is not None, "a closed lifeline"
        return (self._read,)

    def env(self) -> dict[str, str]:
        return {LIFELINE_ENV: str(self.pass_fds[0])}

    def fifo(self, path: Path) -> Path:
        """A FIFO at `path` that stays open for writing while this lifeline lives."""
        os.mkfifo(path, 0o600)
        # A FIFO opens for writing only once it has a reader: be that reader for a moment.
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            self._fifo_write = os.open(path, os.O_WRONLY)
        finally:
            os.close(reader)
        return path

    def close(self) -> None:
        for fd in (self._write, self._fifo_write, self._read):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._write = self._fifo_write = self._read = None


def open_fifo(path: str) -> int | None:
    """In a rank under mpirun: the read end of the launcher's FIFO, inheritable across exec,
    or None when the launcher has gone already (its FIFO removed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a blocking open waits for a writer
    except OSError:
        return None
    os.set_blocking(fd, True)
    os.set_inheritable(fd, True)
    return fd


def hold(fd: int | None) -> None:
    """In a rank: kill this process the moment its launcher's lifeline breaks (fd None: the
    rank was started by hand, so nothing to watch)."""
    if fd is None:
        return
    try:
        os.set_inheritable(fd, False)  # the rank's own children do not keep it alive
    except OSError:  # not open: THUNDERPOOL_LIFELINE_FD came from elsewhere than a launcher
        print(f"warning: {LIFELINE_ENV}={fd} is not an open file; unset it", file=sys.stderr)
        return
    threading.Thread(target=_watch, args=(fd,), name="lifeline", daemon=True).start()


def _watch(fd: int) -> None:
    with contextlib.suppress(OSError):
        while os.read(fd, 64):
            pass  # nothing is written; end-of-file is the message
    # SIGKILL, not an exit: no atexit work, no MPI_Finalize waiting on peers.
    os.kill(os.getpid(), signal.SIGKILL)
