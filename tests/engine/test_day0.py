"""Day 0: a family added to the installed mlx-lm after this release is proven, then served.

The new family is a copy of mlx-lm's llama module under a model type no table of ours lists,
put where mlx-lm finds models (mlx_lm/models/<model_type>.py). `serve` must prove each
layout on a tiny model of the checkpoint's architecture (cli/proof.py), then answer as one
rank does; the verdict is kept, so a second start does not prove again.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import mlx_lm
import pytest
from conftest import make_tiny_chat
from serving import serving

from thunderpool.models import families

NEW = "tp_day0_family"  # no release of ours knows it
PROMPT = "The day-0 proof says"


@pytest.fixture(scope="module")
def new_family(tmp_path_factory):
    import mlx_lm.models.llama as llama

    dest = Path(llama.__file__).with_name(f"{NEW}.py")
    shutil.copy(llama.__file__, dest)
    importlib.invalidate_caches()
    families._ships.cache_clear()
    try:
        home = tmp_path_factory.mktemp("home")
        model = make_tiny_chat(tmp_path_factory.mktemp("new") / "model", model_type=NEW)
        yield model, home
    finally:
        dest.unlink(missing_ok=True)
        sys.modules.pop(f"mlx_lm.models.{NEW}", None)
        families._ships.cache_clear()


def _complete(url: str) -> str:
    body = {"model": "model", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def one_rank(new_family) -> str:
    """One rank's answer, generated once for both layouts (greedy: the same every time)."""
    return _one_rank(*new_family)


def _one_rank(model: Path, home: Path) -> str:
    cmd = [sys.executable, "-m", "thunderpool", "generate", "--model", str(model),
           "--nodes", "1", "--raw", "--max-tokens", "8", "--prompt", PROMPT]
    env = {**__import__("os").environ, "THUNDERPOOL_HOME": str(home)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_family_is_new():
    assert NEW not in families.proven() and NEW not in families.MATRIX


@pytest.mark.timeout(900)
@pytest.mark.parametrize("parallel", ["tp", "pp"])
def test_new_family_is_proven_then_served_like_one_rank(
    parallel, new_family, one_rank, monkeypatch
):
    model, home = new_family
    monkeypatch.setenv("THUNDERPOOL_HOME", str(home))
    want = one_rank
    args = ("--model", str(model), "--nodes", "2", "--parallel", parallel, "--backend", "ring")
    with serving(*args) as served:
        got = _complete(served.url)
        log = served.log.read_text()
    assert "day-0 proof:" in log and f"on {parallel} over 2 ranks" in log
    assert want.startswith(got) or got == want.strip(), (got, want)
    verdicts = json.loads((home / "proofs.json").read_text())
    key = f"{NEW}|{parallel}|2|mlx-lm {mlx_lm.__version__}"
    assert verdicts[key] == "ok"


def test_a_kept_verdict_is_not_proven_again(new_family, monkeypatch):
    from thunderpool.cli import proof

    model, home = new_family
    monkeypatch.setenv("THUNDERPOOL_HOME", str(home))
    config = json.loads((model / "config.json").read_text())
    (home / "proofs.json").write_text(json.dumps({
        f"{NEW}|pp|3|mlx-lm {mlx_lm.__version__}": "greedy tokens differ from one rank's",
        f"{NEW}|tp|3|mlx-lm {mlx_lm.__version__}": "ok",
    }))
    monkeypatch.setattr(proof, "prove", lambda *a: pytest.fail("proved again"))
    proof.admit(config, 3, "tp", False)
    with pytest.raises(families.UnverifiedLayoutError, match="day-0 proof .* differ"):
        proof.admit(config, 3, "pp", False)


def test_unequal_shares_are_proven_first(monkeypatch, tmp_path):
    # verified.json proved ernie4_5_moe's TP and EP in equal shares: unequal ones go through
    # the day-0 proof with the same shares (the expert split scaled to the tiny model's).
    from thunderpool.cli import proof
    from thunderpool.models import tiny
    from thunderpool.parallel.layout import Layout

    monkeypatch.setenv("THUNDERPOOL_HOME", str(tmp_path))
    config = {**tiny.family_config("ernie4_5_moe"), "moe_num_experts": 256}
    assert families.proven()["ernie4_5_moe"]["ep"] == "ok"
    asked = []
    monkeypatch.setattr(proof, "prove", lambda c, w, layout, b: asked.append(layout) or "ok")
    proof.admit(config, 2, Layout("ep"), False)
    proof.admit(config, 2, Layout("tp", (1.0, 1.0)), False)
    assert asked == []  # equal shares: proven by the matrix
    proof.admit(config, 2, Layout("ep", expert_split=(96, 160)), False)
    proof.admit(config, 2, Layout("tp", (2.0, 1.0)), False)
    assert asked == [Layout("ep", expert_split=(3, 5)), Layout("tp", (2.0, 1.0))]
    with pytest.raises(families.UnverifiedLayoutError, match="hot-expert copies are proven"):
        proof.admit(config, 2, Layout("ep", expert_replicas=((0, 1, 1),)), False)


@pytest.mark.timeout(300)
def test_the_proof_runs_unequal_shares():
    from thunderpool.cli import proof
    from thunderpool.models import tiny
    from thunderpool.parallel.layout import Layout

    split = Layout("ep", expert_split=(3, 5))
    assert proof.prove(tiny.family_config("ernie4_5_moe"), 2, split) == "ok"
    # olmo2's q_norm spans every head: an all_sum of each rank's share, whatever the shares.
    assert proof.prove(tiny.family_config("olmo2"), 2, Layout("tp", (2.0, 1.0))) == "ok"
    # MiMo-V2's layers differ in head counts: each gets its own share in equal shares only.
    found = proof.prove(tiny.family_config("mimo_v2_flash"), 2, Layout("tp", (2.0, 1.0)))
    assert "only in equal shares that divide every layer's (query, KV) head counts" in found
