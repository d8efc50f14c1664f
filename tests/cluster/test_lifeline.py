"""Ranks never outlive their parent, on every OS (issue 25 item 8): the portable lifeline
(launch/lifeline.py) proven with Linux's PR_SET_PDEATHSIG turned off, so that it works alone
as it must on macOS. The parent (tests/lifeline_parent.py) is `generate`, `serve`, a local
launcher of idle serving ranks (ring, and mpirun where the ranks are its grandchildren), or an
agent's RankManager; the test SIGKILLs it and every rank (and mpirun) must be gone within 5 s.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from procs import alive, workers_under
from serving import free_port

from thunderpool.launch.lifeline import LIFELINE_ENV, Lifeline, hold, open_fifo

PARENT = Path(__file__).parent.parent / "lifeline_parent.py"
NO_MPI = pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (openmpi-bin)")
GONE_S = 5.0

# A stand-in rank: holds the lifeline named in its environment (as thunderpool.rank does).
HOLDER = """
import time
from thunderpool.launch.lifeline import hold
from thunderpool.config import lifeline_fd
hold(lifeline_fd())
print("holding", flush=True)
time.sleep(60)
"""


def wait_until(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not (ok := pred()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(ok)


def test_closing_the_lifeline_kills_the_rank_at_once():
    line = Lifeline()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        env={**os.environ, **line.env()},
        pass_fds=line.pass_fds,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "holding\n"
        assert proc.poll() is None
        line.close()
        assert proc.wait(timeout=GONE_S) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_fifo_lifeline_reaches_a_process_that_inherits_nothing(tmp_path):
    """mpirun passes no files to its ranks: they open the launcher's FIFO by its path."""
    line = Lifeline()
    fifo = line.fifo(tmp_path / "lifeline")
    boot = f"import os; from thunderpool.launch.lifeline import open_fifo; fd = open_fifo({str(fifo)!r}); os.environ[{LIFELINE_ENV!r}] = str(fd); os.execv({sys.executable!r}, [{sys.executable!r}, '-c', {HOLDER!r}])"  # noqa: E501
    proc = subprocess.Popen([sys.executable, "-c", boot], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "holding\n"
        line.close()
        assert proc.wait(timeout=GONE_S) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_fifo_whose_launcher_is_gone_is_no_lifeline(tmp_path):
    line = Lifeline()
    fifo = line.fifo(tmp_path / "lifeline")
    line.close()
    fd = open_fifo(str(fifo))
    assert fd is not None and os.read(fd, 1) == b""  # end-of-file at once: the rank dies
    os.close(fd)
    fifo.unlink()
    assert open_fifo(str(fifo)) is None


def sigkill_and_watch(parent: subprocess.Popen, expect: int) -> float:
    """SIGKILL `parent` once `expect` ranks run under it; seconds until all (and mpirun) end."""
    assert wait_until(lambda: len(workers_under(parent.pid, deep=True)) == expect, 60)
    ranks = workers_under(parent.pid, deep=True)
    children = {int(p) for p in _children(parent.pid)}  # mpirun, where there is one
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    start = time.monotonic()
    everyone = ranks | children
    gone = wait_until(lambda: not any(alive(p) for p in everyone), 30)
    took = time.monotonic() - start
    assert gone, f"still running 30 s after their parent died: {[p for p in everyone if alive(p)]}"
    return took


def _children(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []


def start_parent(log: Path, *args: str, ready: bool) -> subprocess.Popen:
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(PARENT), *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    if ready:
        assert proc.stdout.readline() == "ready\n", log.read_text()
    return proc


CASES = [
    ("launcher", "ring"),
    pytest.param("launcher", "mpi", marks=NO_MPI),
    ("agent", None),
]


@pytest.mark.parametrize(("kind", "backend"), CASES)
def test_idle_serving_ranks_die_with_their_sigkilled_parent(tiny_chat, tmp_path, kind, backend):
    args = [kind, *([backend] if backend else []), str(tiny_chat)]
    parent = start_parent(tmp_path / "parent.log", *args, ready=True)
    took = sigkill_and_watch(parent, expect=2)
    print(f"{kind} {backend or ''}: every rank gone {took:.2f} s after the SIGKILL")
    assert took <= GONE_S


@pytest.mark.parametrize("backend", ["ring", pytest.param("mpi", marks=NO_MPI)])
def test_generating_ranks_die_with_a_sigkilled_generate(tiny_chat, tmp_path, backend):
    cli = ["cli", "generate", "--model", str(tiny_chat), "--nodes", "2", "--backend", backend]
    log = tmp_path / "generate.log"
    parent = start_parent(
        log, *cli, "--prompt", "Hello", "--max-tokens", "100000", "--temperature", "0", ready=False
    )
    assert parent.stdout.read(1), log.read_text()  # the ranks decode: text streams
    took = sigkill_and_watch(parent, expect=2)
    print(f"generate {backend}: every rank gone {took:.2f} s after the SIGKILL")
    assert took <= GONE_S


@pytest.mark.parametrize("backend", ["ring", pytest.param("mpi", marks=NO_MPI)])
def test_serving_ranks_die_with_a_sigkilled_serve(tiny_chat, tmp_path, backend):
    port = free_port()
    log = tmp_path / "serve.log"
    cli = ["cli", "serve", "--model", str(tiny_chat), "--nodes", "2", "--backend", backend]
    parent = start_parent(log, *cli, "--port", str(port), ready=False)

    def ready() -> bool:
        assert parent.poll() is None, log.read_text()
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(ready, 120), log.read_text()
    took = sigkill_and_watch(parent, expect=2)
    print(f"serve {backend}: every rank gone {took:.2f} s after the SIGKILL")
    assert took <= GONE_S


def test_a_stray_lifeline_variable_does_not_kill_a_rank(capsys):
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)  # a number that names no open file now
    hold(fd)
    assert f"THUNDERPOOL_LIFELINE_FD={fd} is not an open file" in capsys.readouterr().err
