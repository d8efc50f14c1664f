"""Local ranks under Open MPI's mpirun with MLX's `mpi` backend: the same tokens and logits as
one rank, rank-tagged events, and no process left behind on success, failure or kill."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import run_trace, tiny_prompts

from thunderpool.cli.flags import resolve_backend
from thunderpool.engine.job import RankJob, TraceTask
from thunderpool.errors import LaunchError
from thunderpool.launch import mpi
from thunderpool.launch.mpi import MpiInstance, mpi_command, session_pids, tail_lines

needs_mpi = pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (openmpi-bin)")


def test_tail_reads_whole_lines_until_done(tmp_path):
    path, lines, finished = tmp_path / "out.0", [], threading.Event()
    reader = threading.Thread(target=tail_lines, args=(path, finished.is_set, lines.append))
    reader.start()
    time.sleep(0.1)  # the file does not exist yet: the tail waits for it
    with path.open("w") as f:
        f.write("TPEV {}\npart")
        f.flush()
        time.sleep(0.1)
        f.write("ial\nlast")
    finished.set()
    reader.join(timeout=5)
    assert lines == ["TPEV {}", "partial", "last", None]


def test_tail_of_a_rank_that_never_started_ends():
    lines = []
    tail_lines(Path("/nonexistent/out.1"), lambda: True, lines.append)
    assert lines == [None]


def test_command_pins_one_core_per_rank():
    cmd = mpi_command("/usr/bin/mpirun", 2, True, ["A", "B"], ["python", "w.py"], root=True)
    assert cmd == [
        "/usr/bin/mpirun", "-np", "2", "--bind-to", "core", "--map-by", "core",
        "--allow-run-as-root", "-x", "A", "-x", "B", "python", "w.py",
    ]  # fmt: skip
    loose = mpi_command("mpirun", 3, False, [], ["w"], root=False)
    assert loose == ["mpirun", "-np", "3", "--bind-to", "none", "--oversubscribe", "w"]


@pytest.fixture
def no_open_mpi(monkeypatch):
    def missing():
        raise LaunchError("--backend mpi needs Open MPI's mpirun")

    monkeypatch.setattr(mpi, "find_mpi", missing)


def args(backend: str, cluster: bool = False) -> SimpleNamespace:
    return SimpleNamespace(backend=backend, cluster=cluster)


def test_auto_backend_takes_mpi_for_local_ranks_when_open_mpi_is_there(monkeypatch):
    monkeypatch.setattr(mpi, "find_mpi", lambda: ("/usr/bin/mpirun", "libmpi.so.40"))
    assert resolve_backend(args("auto"), 2) == "mpi"
    assert resolve_backend(args("auto"), 1) == "ring"  # one rank: nothing to reduce
    assert resolve_backend(args("ring"), 2) == "ring"
    assert resolve_backend(args("auto", cluster=True), 2) == "ring"  # the planner decides


def test_auto_backend_falls_back_to_ring_without_open_mpi(no_open_mpi):
    assert resolve_backend(args("auto"), 3) == "ring"
    with pytest.raises(LaunchError, match="needs Open MPI"):
        resolve_backend(args("mpi"), 2)
    with pytest.raises(LaunchError, match="--backend mpi is for ranks on this host"):
        resolve_backend(args("mpi", cluster=True), 2)


def trace_job(model_dir, out, nodes=2, parallel="tp") -> RankJob:
    task = TraceTask(prompts=tuple(map(tuple, tiny_prompts())), max_tokens=12, out=str(out))
    return RankJob(
        model_dir=str(model_dir), world_size=nodes, parallel=parallel, backend="mpi", task=task
    )


@pytest.fixture(scope="module")
def one_rank(tiny_models, tmp_path_factory) -> dict:
    """The reference both layouts compare with: one rank (the tiny prompts, 12 tokens)."""
    out = tmp_path_factory.mktemp("one") / "one.npz"
    return run_trace(tiny_models["qwen3"], out, nodes=1, max_tokens=12)


@needs_mpi
@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["tp", "pp"])
def test_mpi_ranks_match_one_rank(tiny_models, tmp_path, parallel, one_rank):
    with MpiInstance(trace_job(tiny_models["qwen3"], tmp_path / "mpi.npz", 2, parallel)) as inst:
        events = list(inst.events())
        sid = inst.proc.pid
    assert sorted(e.rank for e in events if e.event["kind"] == "loaded") == [0, 1]
    got = np.load(tmp_path / "mpi.npz")
    np.testing.assert_array_equal(got["tokens"], one_rank["tokens"])
    np.testing.assert_allclose(got["logits"], one_rank["logits"], rtol=1e-4, atol=1e-4)
    assert session_pids(sid) == []


@needs_mpi
def test_a_failing_rank_names_itself_and_nothing_is_left(tmp_path):
    job = trace_job(tmp_path / "missing-model", tmp_path / "x.npz")
    inst = MpiInstance(job, timeout=60)
    with pytest.raises(LaunchError) as err, inst:
        list(inst.events())
    # Both ranks fail alike; the one mpirun saw exit first is named.
    assert re.match(r"rank [01] failed: .*config.json", str(err.value)), err.value
    assert session_pids(inst.proc.pid) == []


@needs_mpi
def test_kill_ends_every_rank(tiny_models, tmp_path):
    inst = MpiInstance(trace_job(tiny_models["llama"], tmp_path / "k.npz"), timeout=60)
    inst.start()
    deadline = time.monotonic() + 30
    while len(session_pids(inst.proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(session_pids(inst.proc.pid)) >= 3  # mpirun and both ranks
    inst.kill()
    assert session_pids(inst.proc.pid) == []


@needs_mpi
def test_ranks_die_with_a_killed_mpirun(tiny_models, tmp_path):
    """SIGKILL gives mpirun no chance to stop its ranks: they must not spin on alone."""
    inst = MpiInstance(trace_job(tiny_models["llama"], tmp_path / "k.npz"), timeout=60)
    inst.start()
    started = [Path(inst.tmp.name) / f"out.{rank}" for rank in (0, 1)]
    deadline = time.monotonic() + 30
    while not all(f.exists() for f in started) and time.monotonic() < deadline:
        time.sleep(0.1)  # each rank creates its file once it is set to die with mpirun
    ranks = [p for p in session_pids(inst.proc.pid) if p != inst.proc.pid]
    assert len(ranks) == 2
    os.kill(inst.proc.pid, signal.SIGKILL)
    inst.proc.wait()
    deadline = time.monotonic() + 10
    while session_pids(inst.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_pids(inst.proc.pid) == []
    inst.kill()


def test_serve_takes_ring_where_its_ranks_fill_every_core(monkeypatch):
    """Waiting MPI ranks spin; beside the gateway on a machine they fill, they starved its
    streaming (tests/api/test_stream_gaps.py). generate and bench keep MPI."""
    monkeypatch.setattr(mpi, "find_mpi", lambda: ("/usr/bin/mpirun", "libmpi.so.40"))
    monkeypatch.setattr(mpi, "cores_here", lambda: 2)
    assert resolve_backend(args("auto"), 2, serving=True) == "ring"
    assert resolve_backend(args("auto"), 2) == "mpi"
    assert resolve_backend(args("mpi"), 2, serving=True) == "mpi"  # asked for by name
    monkeypatch.setattr(mpi, "cores_here", lambda: 8)
    assert resolve_backend(args("auto"), 2, serving=True) == "mpi"  # cores left for the API
