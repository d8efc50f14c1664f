"""Row splits of the compiled step's products (engine/rowsplit.py): the parts cover every
row once, and BLIS runs one thread during compiled decode steps and few-row forwards (their
products split over the streams, engine/kmajor.py), the process's setting in prefill
(checked in a child with BLIS preloaded, where this machine has it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from families import make_family

from thunderpool.engine import rowsplit
from thunderpool.launch.blas import CANDIDATES

BLIS = next((p for p in CANDIDATES if "blis" in p and Path(p).is_file()), None)


@pytest.mark.parametrize(("rows", "parts"), [(960, 2), (576, 3), (49152, 8), (20, 4), (1, 2)])
def test_parts_cover_every_row_once(rows, parts):
    cuts = rowsplit.bounds(rows, parts)
    assert cuts[0][0] == 0 and cuts[-1][1] == rows and len(cuts) <= parts
    assert all(a < b for a, b in cuts) and all(
        b == c for (_, b), (c, _) in zip(cuts, cuts[1:], strict=False)
    )
    assert all(a % rowsplit.ALIGN == 0 for a, _ in cuts)
    if rows >= parts * rowsplit.ALIGN:
        sizes = [b - a for a, b in cuts]
        assert len(cuts) == parts and max(sizes) - min(sizes) <= 2 * rowsplit.ALIGN


def test_a_bad_ways_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("THUNDERPOOL_DECODE_WAYS", "two")
    with pytest.raises(Exception, match="THUNDERPOOL_DECODE_WAYS='two'"):
        rowsplit.ways()
    monkeypatch.setenv("THUNDERPOOL_DECODE_WAYS", str(rowsplit.MAX_WAYS + 1))
    with pytest.raises(Exception, match=f"at most {rowsplit.MAX_WAYS}"):
        rowsplit.ways()
    monkeypatch.setenv("THUNDERPOOL_DECODE_WAYS", "3")
    assert rowsplit.ways() == 3


_CHILD = """
import ctypes, sys, mlx.core as mx
from thunderpool.engine.loader import Layout, load_shard
blis = ctypes.CDLL(sys.argv[2])
from pathlib import Path
runner, _, _ = load_shard(Path(sys.argv[1]), mx.distributed.init(), Layout(compile=True))
cache = runner.make_cache()
seen = []
out = runner.forward(mx.array([list(range(3, 43))]), cache); mx.eval(out)
seen.append(blis.bli_thread_get_num_threads())
out = runner.decode(mx.argmax(out, -1)[:, None], cache); mx.eval(out)
seen.append(blis.bli_thread_get_num_threads())
out = runner.forward(mx.array([list(range(5, 45))]), runner.make_cache()); mx.eval(out)
seen.append(blis.bli_thread_get_num_threads())
out = runner.verify(mx.array([[5, 8, 9]]), runner.make_cache()); mx.eval(out)
seen.append(blis.bli_thread_get_num_threads())
print(runner.compiled.steps, *seen)
"""


@pytest.mark.skipif(BLIS is None, reason="BLIS (libblis4-pthread) is not installed")
def test_compiled_decode_runs_blis_on_one_thread_and_prefill_on_all(tmp_path):
    model = make_family("llama", tmp_path / "llama")
    env = {**os.environ, "LD_PRELOAD": BLIS, "BLIS_NUM_THREADS": "3"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), BLIS],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # prefill (40 tokens), decode, prefill, a 3-token verify (split over the streams)
    assert done.stdout.split() == ["1", "3", "1", "3", "1"]
