"""An unverified family + sharded layout: refused in seconds before any rank starts, with one
`error:` line naming the family, the layout and what works; --allow-untested runs it loudly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import TINY, TOKENIZER_FILES
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

import thunderpool.launch.mpi as mpi
from thunderpool.cli import commands, main
from thunderpool.models import families

# Gemma 3 (text): verified for no sharded layout yet; 4 layers cut sliding/full at 2.
GEMMA3 = {
    **{k: v for k, v in TINY["llama"].items() if k not in ("architectures", "rope_theta")},
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": 8,
    "sliding_window_pattern": 2,
    "vocab_size": 49152,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# The table as these tests assume it, whatever the matrix has verified since: the mechanism is
# under test here (tests/unit/test_families.py checks the real table).
PINNED = {"llama": ("tp", "pp")}
# What the all-families matrix found for it, as these tests assume it (a family it never saw
# would get the day-0 proof instead: tests/engine/test_day0.py).
FOUND = {"gemma3_text": {"one": "ok", "pp": "greedy tokens differ", "tp": "greedy tokens differ"}}
CLI = (
    "import sys; import thunderpool.models.families as f; f.VERIFIED = "
    f"{PINNED!r}; f.proven = lambda: {FOUND!r}; from thunderpool.cli import main; "
    "sys.exit(main(sys.argv[1:]))"
)
REFUSAL = (
    "error: gemma3_text with pp on 2 ranks is not verified against the unsharded model: greedy "
    "tokens differ (verified for gemma3_text: none, single rank only); use --nodes 1, or "
    "--allow-untested to run it anyway"
)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    """A tiny random gemma3_text checkpoint with the embedded model's tokenizer."""
    from thunderpool.models.source import resolve_model

    path = tmp_path_factory.mktemp("gemma3") / "gemma3"
    model_cls, args_cls = _get_classes(GEMMA3)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(GEMMA3))
    path.mkdir(parents=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(GEMMA3, indent=2))
    source = resolve_model(None, progress=False)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, path / name)
    return path


def generate(model: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", CLI, "generate", "--model", str(model), "--raw"]
    cmd += ["--prompt", "Hello there", "--max-tokens", "4", "--backend", "ring", *args]
    # The timeout only guards against a hang; a refusal takes seconds.
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_generate_refuses_pp_on_an_unverified_family(gemma3):
    proc = generate(gemma3, "--nodes", "2", "--parallel", "pp")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [REFUSAL]
    assert proc.stdout == ""


@pytest.fixture(autouse=True)
def pinned(monkeypatch):
    monkeypatch.setattr(families, "VERIFIED", PINNED)
    monkeypatch.setattr(families, "proven", lambda: FOUND)


def test_refusal_starts_no_rank(gemma3, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(mpi, "local_instance", lambda job, **kw: started.append(job))
    argv = ["--model", str(gemma3), "--nodes", "2", "--parallel", "tp", "--prompt", "hi", "--raw"]
    assert main(["generate", *argv]) == 2
    assert started == []
    err = capsys.readouterr().err
    assert err.startswith("error: gemma3_text with tp on 2 ranks is not verified") and (
        err.count("\n") == 1
    )


def test_serve_and_bench_refuse_before_starting_anything(gemma3, monkeypatch, capsys):
    monkeypatch.setattr(commands, "_same_blas_as_ranks", lambda: None)
    started = []
    monkeypatch.setattr(mpi, "local_instance", lambda job, **kw: started.append(job))
    assert main(["serve", "--model", str(gemma3), "--nodes", "3", "--parallel", "pp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: gemma3_text with pp on 3 ranks is not verified")
    assert main(["bench", "--model", str(gemma3), "--nodes", "2", "--modes", "tp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: gemma3_text with tp on 2 ranks is not verified")
    assert "use --nodes 1, or --allow-untested" in err
    assert started == []


def test_one_rank_of_any_family_runs(gemma3):
    proc = generate(gemma3, "--nodes", "1")
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" not in proc.stderr and "1 rank(s), single rank" in proc.stderr


def test_allow_untested_warns_and_runs(gemma3):
    proc = generate(gemma3, "--nodes", "2", "--parallel", "pp", "--allow-untested")
    assert proc.returncode == 0, proc.stderr
    warning = [ln for ln in proc.stderr.splitlines() if ln.startswith("WARNING")]
    assert warning == [
        "WARNING (--allow-untested): gemma3_text with pp on 2 ranks is not verified against "
        "the unsharded model: greedy tokens differ (verified for gemma3_text: none, single "
        "rank only); its output may be wrong"
    ]
    assert "2 rank(s), PP" in proc.stderr and "finish:" in proc.stderr
