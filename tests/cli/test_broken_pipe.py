"""Output cut short by its reader (`thunderpool ... | head -1`): the command stops quietly, with
exit 0 or SIGPIPE's status (141), no traceback, and no rank process left running."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import alive, workers_under

SIGPIPE_STATUS = 128 + signal.SIGPIPE
TOKEN = "pipe-test-token-123"


def thunderpool(*args: str) -> list[str]:
    return [sys.executable, "-m", "thunderpool", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet(stderr: str) -> None:
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
    assert "Exception ignored" not in stderr, stderr


def cut_after_first_output(argv: list[str], tmp: Path) -> tuple[int, str, set[int]]:
    """Run with stdout to a pipe; close our end once the first bytes arrive. Returns the exit
    status, stderr, and the rank processes that were running at that moment."""
    err = tmp / "stderr.txt"
    with err.open("w") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
    try:
        first = os.read(proc.stdout.fileno(), 1)
        assert first, err.read_text()
        ranks = workers_under(proc.pid, deep=True)
        proc.stdout.close()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return code, err.read_text(), ranks


def cut_before_output(argv: list[str], env: dict | None = None) -> tuple[int, str]:
    """Run with stdout to a pipe whose reader is gone before the command writes anything."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            argv, stdout=write, stderr=subprocess.PIPE, text=True, timeout=300, env=env
        )
    finally:
        os.close(write)
    return done.returncode, done.stderr


def cut_after_first_line(argv: list[str], env: dict | None = None) -> tuple[int, str]:
    """`| head -1`: read one line, then close; the command may have written everything."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    line = proc.stdout.readline()
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=300)
    assert line, stderr
    return proc.returncode, stderr.decode()


def test_generate_cut_after_its_first_output_stops_every_rank(tiny_chat, tmp_path):
    argv = thunderpool(
        *("generate", "--model", str(tiny_chat), "--nodes", "2", "--backend", "ring"),
        *("--raw", "--prompt", "Once upon a time", "--max-tokens", "1500"),
    )
    code, stderr, ranks = cut_after_first_output(argv, tmp_path)
    # Greedy decoding of this model runs the full 1500 tokens: writes were cut, not finished.
    assert code == SIGPIPE_STATUS, stderr
    quiet(stderr)
    assert len(ranks) == 2, stderr
    deadline = time.monotonic() + 10  # init reaps ranks re-parented to it
    while any(alive(p) for p in ranks):
        assert time.monotonic() < deadline, f"ranks still running: {ranks}"
        time.sleep(0.1)


SIMULATE = ("simulate", "--cluster", "2x m3-ultra-512@tb5-rdma", "--model", "glm-5:mxfp8")


def test_simulate_tables_cut_short():
    """The plan's tables: `--list` and `--validate` print theirs on the same rich console,
    and cli.main() ends any command whose reader is gone, so one of them stands for all."""
    argv = SIMULATE
    code, stderr = cut_before_output(thunderpool(*argv))
    assert code == SIGPIPE_STATUS, stderr
    quiet(stderr)
    code, stderr = cut_after_first_line(thunderpool(*argv))
    assert code in (0, SIGPIPE_STATUS), stderr
    quiet(stderr)


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    """One `thunderpool node` on loopback: enough for `status` and `plan` to print tables."""
    home = tmp_path_factory.mktemp("agent")
    port = free_port()
    env = {**os.environ, "THUNDERPOOL_HOME": str(home)}
    proc = subprocess.Popen(
        thunderpool(
            *("node", "--host", "127.0.0.1", "--port", str(port), "--no-mdns", "--no-measure"),
            *("--token", TOKEN),
        ),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "the agent exited"
            assert time.monotonic() < deadline, "the agent did not start"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.3)
        yield f"127.0.0.1:{port}", env
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("command", ["status", "plan"])
def test_cluster_tables_cut_short(agent, command):
    join, env = agent
    argv = thunderpool(command, "--join", join, "--token", TOKEN)
    code, stderr = cut_before_output(argv, env)
    assert code == SIGPIPE_STATUS, stderr
    quiet(stderr)
    code, stderr = cut_after_first_line(argv, env)
    assert code in (0, SIGPIPE_STATUS), stderr
    quiet(stderr)
