"""schemathesis against a real `serve --nodes 2` on the embedded model: every phase
(examples, coverage, fuzzing, stateful), every default check, and schema-valid requests held
to fuzz_checks.py's rule (taken, but for the 400s each 400 answer names in words). Bounded in
examples and time; the server must answer, and generate, at the end.

Turned off, with the reason: positive_data_acceptance in its plain form only (fuzz_checks.py
runs it, less the documented semantic refusals); nothing else.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serving import serving

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
MODEL = "SmolLM2-135M-Instruct-f32"


PHASES = (("examples,coverage,fuzzing", 40), ("stateful", 15))  # (phases, seconds): each gets
# its own run, so that the stateful phase is reached within the budget


@pytest.mark.timeout(sum(t for _, t in PHASES) + 400)
def test_schemathesis_finds_nothing_on_a_live_server(tmp_path):
    # A short context bounds each generation: the fuzzer picks max_tokens up to it.
    with serving("--nodes", "2", "--max-context", "96", "--max-batch", "4") as served:
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_checks",
               "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
        runs = [_fuzz(served.url, phases, seconds, tmp_path, env) for phases, seconds in PHASES]
        assert served.proc.poll() is None, served.log.read_text()[-3000:]
        assert httpx.get(f"{served.url}/health", timeout=30).status_code == 200
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
    for run in runs:
        assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    stateful = runs[-1].stdout
    assert "Scenarios:" in stateful and "No tests were run" not in stateful, stateful[-3000:]


def _fuzz(url: str, phases: str, seconds: int, tmp_path: Path, env: dict):
    cmd = [
        str(Path(sys.executable).with_name("schemathesis")), "run", f"{url}/openapi.json",
        "--phases", phases, "--exclude-checks", "positive_data_acceptance",
        "--max-examples", "3", "--max-time", str(seconds),
        "--request-timeout", "60", "--generation-deterministic", "--no-shrink",
        "--continue-on-failure", "--suppress-health-check", "all", "--no-color",
        "--report", "junit", "--report-dir", str(tmp_path / phases.replace(",", "-")),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 240, env=env)
