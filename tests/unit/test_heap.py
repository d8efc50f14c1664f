"""The rank's fixed mmap threshold (engine/heap.py): glibc takes it, and a threshold the user
set in the environment is left alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from thunderpool.engine import heap

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")


def _run(env: dict) -> str:
    code = "from thunderpool.engine.heap import fix_mmap_threshold as f; print(f())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=60, check=True).stdout.strip()  # fmt: skip


def test_glibc_takes_the_threshold(monkeypatch):
    import os

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    assert _run(env) == "True"
    assert _run({**env, "MALLOC_MMAP_THRESHOLD_": "65536"}) == "False"
    assert heap.THRESHOLD == 128 * 1024
