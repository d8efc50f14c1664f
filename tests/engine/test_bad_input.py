"""Bad input: one clear `error:` line, a non-zero exit within seconds, no rank left running."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from thunderpool.engine.job import RankJob, TraceTask
from thunderpool.errors import LaunchError
from thunderpool.launch.local import LocalInstance


def cli(*args: str) -> subprocess.CompletedProcess:
    # The timeout only guards against a hang; a correct run takes a few seconds.
    return subprocess.run(
        [sys.executable, "-m", "thunderpool", *args], capture_output=True, text=True, timeout=120
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def model_copy(tiny_models, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], dst)
    return dst


def test_missing_model_path(tmp_path):
    missing = tmp_path / "nope"
    proc = cli("generate", "--model", str(missing), "--prompt", "hi")
    assert_one_line_error(proc, str(missing), "does not exist")


def test_truncated_safetensors(model_copy):
    f = model_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    proc = cli("generate", "--model", str(model_copy), "--prompt", "hi")
    assert_one_line_error(proc, "model.safetensors is truncated", "re-download")


def test_corrupt_safetensors(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\xff" * 64)
    proc = cli("generate", "--model", str(model_copy), "--prompt", "hi")
    assert_one_line_error(proc, "not a valid safetensors file")


def test_unsupported_architecture(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**cfg, "model_type": "warp_drive"}))
    proc = cli("generate", "--model", str(model_copy), "--prompt", "hi")
    assert_one_line_error(proc, "model_type 'warp_drive'", "not supported")


def test_more_pp_nodes_than_layers(model_copy):
    proc = cli(
        "generate", "--model", str(model_copy), "--prompt", "hi", "--nodes", "5", "--parallel", "pp"
    )
    assert_one_line_error(proc, "--nodes 5 is more than the 4 layers", "--parallel tp")


def test_bad_sampling_value(model_copy):
    proc = cli("generate", "--model", str(model_copy), "--prompt", "hi", "--top-p", "1.5")
    assert_one_line_error(proc, "top-p")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_rank_crash_mid_run_stops_every_rank(tiny_models, tmp_path):
    # A long greedy run; rank 1 is killed once both ranks have loaded.
    task = TraceTask(
        prompts=((1, 2, 3),), max_tokens=100_000, out=str(tmp_path / "t.npz"), keep_logits=False
    )
    job = RankJob(model_dir=str(tiny_models["llama"]), world_size=2, task=task)
    instance = LocalInstance(job, timeout=60)
    with instance, pytest.raises(LaunchError) as err:
        loaded = 0
        for ev in instance.events():
            loaded += ev.event["kind"] == "loaded"
            if loaded == 2:
                time.sleep(0.5)
                os.kill(instance.procs[1].pid, signal.SIGKILL)
                loaded = -1
    assert "rank 1 was killed by signal 9" in str(err.value)
    assert "stopped all 2 ranks" in str(err.value)
    assert all(p.poll() is not None for p in instance.procs)
    assert all(gone(p.pid) for p in instance.procs)
