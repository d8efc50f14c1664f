"""`thunderpool generate` end to end on the embedded model: chat template, streamed text, stats."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.reference

QUESTION = "What is the capital of France?"


def generate(*args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "thunderpool",
        "generate",
        "--prompt",
        QUESTION,
        "--max-tokens",
        "24",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def single():
    proc = generate("--nodes", "1")
    assert proc.returncode == 0, proc.stderr
    return proc


def test_single_rank_answers_paris_and_reports_stats(single):
    assert "Paris" in single.stdout
    assert "TTFT" in single.stderr and "decode" in single.stderr
    assert "memory per rank" in single.stderr


WHERE = {"ring": "MLX ring on loopback", "mpi": "MPI shared memory under mpirun"}


# "auto" is `generate --nodes 2` with no other flag: TP, on MPI where Open MPI is installed.
# Each layout and each backend once, through the CLI. The other cells' tokens are proven
# without it: TP2 on ring equals transformers in tests/reference/test_smollm2.py (tp2), PP2
# on MPI equals one rank in tests/parallel/test_mpi.py::test_mpi_ranks_match_one_rank (pp).
CELLS = [("pp", "ring"), ("tp", "auto")]


@pytest.mark.parametrize(("parallel", "backend"), CELLS)
def test_two_ranks_stream_the_same_text(parallel, backend, single):
    if backend == "auto":
        proc = generate("--nodes", "2")
        backend = "ring" if shutil.which("mpirun") is None else "mpi"
    else:
        proc = generate("--nodes", "2", "--parallel", parallel, "--backend", backend)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == single.stdout
    assert WHERE[backend] in proc.stderr
    # Both ranks report their memory.
    rows = [ln for ln in proc.stderr.splitlines() if ln.startswith("│ 0") or ln.startswith("│ 1")]
    assert len(rows) == 2


def test_mpi_backend_with_cluster_is_refused():
    proc = generate("--cluster", "--backend", "mpi")
    assert proc.returncode != 0
    assert "--backend mpi is for ranks on this host" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_stop_string_cuts_the_answer(single):
    proc = generate("--nodes", "1", "--stop", "Paris")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" not in proc.stdout
    assert single.stdout.startswith(proc.stdout.rstrip("\n"))
    assert "finish: stop" in proc.stderr
