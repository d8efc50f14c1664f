"""Nothing Linux-only on a Mac path (issue 25 item 9), proven with recorded macOS outputs and
a monkeypatched platform: no libc.so.6 or prctl, brew hints, performance cores, and a Metal
rank's matmuls named Metal, not Accelerate."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from recorded.replay import Replay

from thunderpool import cores
from thunderpool.engine import rowsplit
from thunderpool.engine.blas import in_use
from thunderpool.engine.job import GenerateTask, RankJob
from thunderpool.errors import LaunchError
from thunderpool.launch import lifeline, mpi
from thunderpool.launch.local import LocalInstance


def test_a_metal_rank_multiplies_on_metal_not_accelerate():
    assert in_use(platform="darwin", gpu=True) == {"blas": "Metal", "blas_path": None}
    assert in_use(platform="darwin", gpu=False) == {"blas": "Accelerate", "blas_path": None}
    assert in_use(platform="linux", gpu=True) == {"blas": "CUDA", "blas_path": None}
    maps = "7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4"
    assert in_use(maps, platform="linux", gpu=False)["blas"] == "BLIS"


def test_open_mpi_hint_names_brew_on_macos(monkeypatch):
    assert mpi.install_mpi("darwin") == "brew install open-mpi"
    assert mpi.install_mpi("linux") == "sudo apt install openmpi-bin"
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    mpi.find_mpi.cache_clear()
    try:
        with pytest.raises(
            LaunchError, match=r"\(`brew install open-mpi`\); or use --backend ring"
        ):
            mpi.find_mpi()
    finally:
        mpi.find_mpi.cache_clear()


def test_the_mpi_rank_boot_is_portable(monkeypatch, tmp_path):
    """No libc.so.6 and no prctl unless on Linux: the boot holds the lifeline FIFO instead."""
    assert "libc.so.6" not in mpi._RANK_BOOT and "prctl" not in mpi._RANK_BOOT
    monkeypatch.setattr(lifeline, "PDEATHSIG", False)  # as on macOS
    argv = mpi.rank_argv(tmp_path / "job.json", tmp_path, tmp_path / "lifeline")
    assert argv[-4:] == [str(tmp_path / "job.json"), str(tmp_path), str(tmp_path / "lifeline"), "0"]

    def no_ctypes(*args, **kwargs):
        raise AssertionError("ctypes used off Linux")

    monkeypatch.setattr(lifeline.ctypes, "CDLL", no_ctypes)
    lifeline.die_with_parent()  # nothing to do


def test_a_mac_sizes_work_by_its_performance_cores(monkeypatch):
    assert cores.work_cores("darwin", Replay("macos26_metal")) == 12
    # An Intel Mac has no performance levels: every core counts.
    assert cores.work_cores("darwin", Replay("macos15")) == os.cpu_count()
    assert cores.parse_count("12\n") == 12 and cores.parse_count("0") is None
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(cores, "_performance_cores_here", lambda: 12)
    assert rowsplit.own_cores() == 12  # a CPU rank's decode products split 12 ways, not 16


def test_ranks_are_not_pinned_where_the_os_cannot_pin(monkeypatch):
    """macOS has no sched_setaffinity, and its mpirun refuses --bind-to core."""
    job = RankJob(model_dir="m", world_size=2, task=GenerateTask(prompt="x"))
    assert LocalInstance(job, pin=None).pin == (len(os.sched_getaffinity(0)) >= 2)
    monkeypatch.delattr(os, "sched_setaffinity")
    assert LocalInstance(job, pin=None).pin is False
    assert mpi.mpi_command("mpirun", 2, False, [], ["w"], root=False)[3:5] == ["--bind-to", "none"]


def test_homebrews_libmpi_is_found_beside_its_mpirun(tmp_path):
    """Homebrew on Apple Silicon: /opt/homebrew/{bin/mpirun, lib/libmpi.dylib}, a lib dir
    ctypes.util.find_library does not search."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "bin" / "mpirun").write_text("")
    assert mpi.libmpi_beside(str(tmp_path / "bin" / "mpirun")) is None
    (tmp_path / "lib" / "libmpi.dylib").write_text("")
    assert mpi.libmpi_beside(str(tmp_path / "bin" / "mpirun")) == str(
        tmp_path / "lib" / "libmpi.dylib"
    )
