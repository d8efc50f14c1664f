"""Verified families: mlx-lm's aliases, the refusal's exact words, plans marked and filtered."""

from __future__ import annotations

import json
from types import SimpleNamespace

import mlx_lm.utils
import pytest
from rich.console import Console

import thunderpool.cli.cluster as cluster_cli
from thunderpool.cli import main
from thunderpool.errors import ShardingError, ThunderpoolError, UnverifiedLayoutError
from thunderpool.models import families
from thunderpool.models.families import (
    HYBRID_LAYOUTS,
    LAYOUTS,
    MOE_LAYOUTS,
    VERIFIED,
    check_layout,
    describe,
    family_of,
    guard,
    unverified,
)
from thunderpool.planner.hardware import LinkSpec, NodeSpec
from thunderpool.planner.placement import place
from thunderpool.planner.spec import model_spec_from_config

GiB = 2**30
GEMMA3 = {"model_type": "gemma3_text"}
# The table as these tests assume it, whatever the matrix has verified since.
PINNED = {"llama": ("tp", "pp"), "qwen3": ("tp", "pp"), "qwen3_moe": ("tp", "pp")}
REAL_VERIFIED, REAL_PROVEN = families.VERIFIED, families.proven  # before `pinned` patches them


@pytest.fixture(autouse=True)
def pinned(monkeypatch):
    monkeypatch.setattr(families, "VERIFIED", dict(PINNED))
    monkeypatch.setattr(families, "proven", lambda: {})  # nothing found by the matrix
    return families.VERIFIED


def test_table_is_mlx_lm_families_and_known_layouts():
    for name, layouts in VERIFIED.items():  # the real table, not the pinned one
        assert family_of({"model_type": name}).supported, name
        assert set(layouts) <= set(LAYOUTS + MOE_LAYOUTS + HYBRID_LAYOUTS), name


@pytest.mark.parametrize("alias", sorted(mlx_lm.utils.MODEL_REMAPPING))
def test_family_is_the_module_mlx_lm_builds(alias):
    config = {"model_type": alias}
    family = family_of(config)
    assert family.model_type == alias
    if not family.supported:
        pytest.skip(f"mlx-lm has no module for {alias}")
    model_cls, _ = mlx_lm.utils._get_classes(config)
    assert model_cls.__module__ == f"mlx_lm.models.{family.name}"


def test_aliases_and_architecture_remapping():
    assert family_of({"model_type": "mistral"}).name == "llama"
    assert family_of({"model_type": "mistral"}).label == "mistral (mlx-lm llama)"
    assert family_of({"model_type": "kimi_k2"}).name == "deepseek_v3"
    for (model_type, arch), name in mlx_lm.utils.MODEL_ARCHITECTURE_REMAPPING.items():
        assert family_of({"model_type": model_type, "architectures": [arch]}).name == name
    unknown = family_of({"model_type": "warp_drive"})
    assert (unknown.name, unknown.supported) == ("warp_drive", False)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_verified_layouts_pass(family, layout):
    for world in (2, 3):
        assert check_layout({"model_type": family}, world, layout) is None


def test_one_rank_of_any_family_passes():
    for model_type in ("gemma3_text", "deepseek_v3", "qwen2"):
        for layout in ("tp", "pp"):
            assert check_layout({"model_type": model_type}, 1, layout) is None


def test_refusal_names_family_layout_and_what_works(pinned):
    with pytest.raises(UnverifiedLayoutError) as e:
        check_layout(GEMMA3, 2, "pp")
    assert str(e.value) == (
        "gemma3_text with pp on 2 ranks is not verified against the unsharded model "
        "(verified for gemma3_text: none, single rank only); use --nodes 1, or "
        "--allow-untested to run it anyway"
    )
    assert isinstance(e.value, ShardingError) and isinstance(e.value, ThunderpoolError)
    pinned["gemma3_text"] = ("tp",)
    with pytest.raises(UnverifiedLayoutError) as e:
        check_layout(GEMMA3, 2, "pp")
    assert str(e.value) == (
        "gemma3_text with pp on 2 ranks is not verified against the unsharded model "
        "(verified for gemma3_text: tp); use --parallel tp, or --allow-untested to run it anyway"
    )
    assert check_layout(GEMMA3, 3, "tp") is None
    with pytest.raises(UnverifiedLayoutError, match="use --modes tp, or --allow-untested"):
        check_layout(GEMMA3, 2, "pp", flag="--modes")


def test_no_refusal_offers_a_layout_that_is_refused(monkeypatch):
    """Every refused cell of the table: the advice names only layouts verified for that family
    (a recorded reason's own "use --parallel tp" is cut where TP is refused too)."""
    import re

    monkeypatch.setattr(families, "VERIFIED", REAL_VERIFIED)
    monkeypatch.setattr(families, "proven", REAL_PROVEN)
    table = json.loads(families.PROVEN_JSON.read_text())["families"]
    for family, row in table.items():
        for layout, found in row.items():
            if found == "ok" or layout == "one":
                continue
            with pytest.raises(UnverifiedLayoutError) as e:
                check_layout({"model_type": family}, 2, layout)
            offered = set(re.findall(r"use --parallel (\w+)", str(e.value)))
            ok = {lay for lay, v in row.items() if v == "ok"}
            assert offered <= ok, (family, layout, str(e.value))
            assert offered or "use --nodes 1" in str(e.value), str(e.value)


def test_alias_is_named_as_the_user_wrote_it():
    with pytest.raises(
        UnverifiedLayoutError, match=r"^kimi_k2 \(mlx-lm deepseek_v3\) with tp on 4"
    ):
        check_layout({"model_type": "kimi_k2"}, 4, "tp")


def test_family_mlx_lm_lacks_is_left_to_the_loader():
    # The loader's "not supported by mlx-lm" message is the useful one there.
    assert check_layout({"model_type": "warp_drive"}, 2, "tp") is None


def test_allow_untested_returns_the_reason_and_warns_on_one_line(capsys):
    reason = check_layout(GEMMA3, 2, "tp", allow_untested=True)
    assert reason == unverified(family_of(GEMMA3), 2, "tp")
    console = Console(stderr=True, width=40)  # soft wrap: one line even on a narrow terminal
    guard(GEMMA3, 2, "tp", True, console)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"WARNING (--allow-untested): {reason}; its output may be wrong"]
    guard({"model_type": "llama"}, 2, "tp", False, console)
    assert capsys.readouterr().err == ""


def test_describe_lines(pinned):
    assert describe(family_of({"model_type": "llama"})) == "verified layouts for llama: tp, pp"
    assert describe(family_of({"model_type": "deepseek_v3"})) == (
        "verified layouts for deepseek_v3: none (single rank only); tp and pp need --allow-untested"
    )
    pinned["gemma3_text"] = ("tp",)
    assert describe(family_of(GEMMA3)) == (
        "verified layouts for gemma3_text: tp; pp needs --allow-untested"
    )
    assert "mlx-lm has no warp_drive model" in describe(family_of({"model_type": "warp_drive"}))


# --- the planner: every plan carries whether its layout is verified, and why not --------

LLAMA_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def mac(name, avail_gib=48, host=""):
    return NodeSpec(name, 64 * GiB, avail_gib * GiB, 400e9, 30e12, 2 * GiB, host=host)


def plans_for(model_type: str, avail_gib: float = 48):
    spec = model_spec_from_config({**LLAMA_8B, "model_type": model_type})
    nodes = [mac("n1", avail_gib), mac("n2", avail_gib)]
    return place(spec, nodes, [LinkSpec("n1", "n2", 50e-6, 5e9, "rdma")])


def test_plans_are_marked_by_family():
    llama = plans_for("llama")
    assert {p.kind for p in llama} == {"single", "tp", "pp"}
    assert all(p.verified and p.unverified == "" for p in llama)
    qwen2 = plans_for("qwen2")
    assert [p.kind for p in qwen2] == [p.kind for p in llama]  # marked, never dropped or moved
    for p in qwen2:
        assert p.verified == (p.kind == "single")
        if p.kind != "single":
            assert p.unverified == (
                f"qwen2 with {p.kind} on 2 ranks is not verified against the unsharded model "
                "(verified for qwen2: none, single rank only)"
            )
    assert all(p.verified for p in plans_for("mistral"))  # mlx-lm builds mistral as llama


def test_the_matrix_proves_equal_shares_only(monkeypatch):
    # verified.json's cells ran 2 ranks in equal shares: unequal ones (the planner's weights
    # for unlike nodes, --tp-weights, --expert-split) are not proven by them.
    monkeypatch.setattr(families, "proven", lambda: {"olmo2": {"tp": "ok", "pp": "ok"}})
    monkeypatch.setattr(families, "VERIFIED", {**PINNED, "olmo2": ("tp", "pp")})
    olmo2 = family_of({"model_type": "olmo2"})
    assert unverified(olmo2, 2, "tp") is None
    assert "proven in equal shares only" in unverified(olmo2, 2, "tp", equal=False)
    assert unverified(family_of({"model_type": "llama"}), 2, "tp", equal=False) is None
    spec = model_spec_from_config({**LLAMA_8B, "model_type": "olmo2"})
    fast = NodeSpec("n2", 64 * GiB, 48 * GiB, 800e9, 30e12, 2 * GiB)
    plans = place(spec, [mac("n1"), fast], [LinkSpec("n1", "n2", 50e-6, 5e9, "rdma")])
    tp = next(p for p in plans if p.kind == "tp")
    assert len(set(tp.tp_weights)) == 2 and "equal shares only" in tp.unverified


# --- `--cluster`: only verified plans launch, unless --allow-untested ---------------------


class FakeCoordinator:
    token = "t"

    def __init__(self, names):
        node = {
            n: SimpleNamespace(
                name=f"host-{n}",
                memory_budget="",
                memory_available_bytes=30e9,
                memory_total_bytes=32e9,
            )
            for n in names
        }
        self.state = SimpleNamespace(nodes=node, unprobed_pairs=lambda: [])

    def discover(self):
        return self.state

    def alive(self, state):
        return state, []

    def probe(self, state):
        return state


def cluster_launch(monkeypatch, plans, **flags):
    """The plan ClusterPlanner launches for these plans and flags, and what it printed."""
    monkeypatch.setattr(cluster_cli, "coordinator", lambda args: FakeCoordinator(["n1", "n2"]))
    monkeypatch.setattr(cluster_cli, "ranked_plans", lambda args, state: plans)
    launched = []
    monkeypatch.setattr(
        cluster_cli,
        "ClusterInstance",
        lambda coord, state, order, job, timeout, **_: launched.append((order, job)) or job,
    )
    args = SimpleNamespace(**{"parallel": None, "nodes": None, "allow_untested": False, **flags})
    console = Console(record=True, width=300)
    make_job = lambda world, layout: {"world": world, "parallel": layout.parallel}  # noqa: E731
    job = cluster_cli.ClusterPlanner(args, make_job, None, console)(True)
    return job, console.export_text()


def test_cluster_launches_the_best_verified_plan(monkeypatch):
    plans = plans_for("qwen2")
    assert plans[0].kind != "single"  # a faster, unverified plan is ranked first
    job, printed = cluster_launch(monkeypatch, plans)
    assert job["world"] == 1 and "WARNING" not in printed


def test_cluster_refuses_an_unverified_layout_asked_for(monkeypatch):
    with pytest.raises(UnverifiedLayoutError) as e:
        cluster_launch(monkeypatch, plans_for("qwen2"), parallel="pp", nodes=2)
    assert str(e.value).startswith("qwen2 with pp on 2 ranks is not verified")
    assert str(e.value).endswith("; use --nodes 1, or --allow-untested to run it anyway")
    # Nothing fits one node: no fix but the flag.
    with pytest.raises(UnverifiedLayoutError, match=r"single rank only\); pass --allow-untested"):
        cluster_launch(monkeypatch, plans_for("qwen2", avail_gib=12))


def test_cluster_runs_unverified_with_the_flag_and_warns(monkeypatch):
    plans = plans_for("qwen2")
    job, printed = cluster_launch(monkeypatch, plans, parallel="pp", allow_untested=True)
    assert job["parallel"] == "pp" and job["world"] == 2
    assert "WARNING (--allow-untested): qwen2 with pp on 2 ranks is not verified" in printed


def test_plan_command_shows_verified_layouts_and_marks(monkeypatch, tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (model / "model.safetensors").write_bytes(b"")  # resolve_model looks for a weight file
    monkeypatch.setattr(cluster_cli, "coordinator", lambda args: FakeCoordinator(["n1", "n2"]))
    monkeypatch.setattr(cluster_cli, "measured_state", lambda coord: coord.state)
    plans = plans_for("qwen2")
    monkeypatch.setattr(cluster_cli, "ranked_plans", lambda args, state: plans)
    assert main(["plan", "--model", str(model)]) == 0
    out = capsys.readouterr().out
    assert (
        "verified layouts for qwen2: none (single rank only); tp and pp need --allow-untested"
        in out.splitlines()
    )
    assert "untested" in out
    assert "winner: single over" in out  # what --cluster would launch
    # LLAMA_8B's KV: K and V of 8 heads x 128 in bf16 over 32 layers, priced as the plans are.
    assert "KV cache per context token: 128.0 KiB over all ranks (16-bit;" in out
    assert main(["plan", "--model", str(model), "--allow-untested"]) == 0
    assert f"winner: {plans[0].kind} over" in capsys.readouterr().out


# --- `simulate`: the line, the marks and the JSON fields -------------------------------


def test_simulate_shows_and_writes_verification(tmp_path, capsys):
    out = tmp_path / "plans.json"
    cluster = ["--cluster", "2x m3-ultra-512@tb5-rdma"]
    assert main(["simulate", *cluster, "--model", "deepseek-v3:q4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert (
        "verified layouts for deepseek_v3: none (single rank only); tp and pp need --allow-untested"
    ) in text.splitlines()
    assert "untested" in text
    written = json.loads(out.read_text())
    assert (written["family"], written["verified_layouts"]) == ("deepseek_v3", [])
    for p in written["plans"]:
        assert p["verified"] == (p["kind"] == "single")
        assert (p["unverified"] is None) == p["verified"]
    assert main(["simulate", *cluster, "--model", "llama-3.3-70b:q4", "--json", str(out)]) == 0
    assert "verified layouts for llama: tp, pp" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["verified_layouts"] == ["tp", "pp"]
    assert {p["kind"] for p in written["plans"] if p["verified"]} >= {"tp", "pp"}
