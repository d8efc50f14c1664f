"""Metal memory (issue 25 item 7), replayed from a recorded Mac (recorded/macos26_metal*):
a Mac node's planner budget is what Metal will wire less a reserve, `plan` and `simulate` say
which budget they used, a rank on Metal raises MLX's wired limit and reads its memory from MLX.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import mlx.core as mx
from recorded.replay import RECORDED, Replay

from thunderpool.cli.cluster import budget_line
from thunderpool.cli.simulate import budget_line as simulate_budget_line
from thunderpool.cluster.node import metal
from thunderpool.cluster.node.capabilities import node_info
from thunderpool.engine import loader, serve
from thunderpool.planner.presets import parse_cluster

GiB, MiB = 2**30, 2**20
RECOMMENDED = 103079215104  # the recorded max_recommended_working_set_size: 96 GiB
TOTAL = 137438953472  # 128 GiB
VM_AVAILABLE = (5000000 + 1500000 + 50000) * 16384  # free + inactive + speculative pages


def recorded_metal(scene: str) -> dict:
    return json.loads((RECORDED / scene / "metal_device_info.json").read_text())


def mac(scene: str):
    return node_info(
        7070,
        "m4",
        measure=False,
        run=Replay(scene),
        system="Darwin",
        metal_info=lambda: recorded_metal(scene),
    )


def test_a_mac_plans_with_what_metal_wires_by_default_less_the_reserve():
    info = mac("macos26_metal")
    assert RECOMMENDED == 96 * GiB and VM_AVAILABLE > RECOMMENDED  # Metal's limit binds
    assert info.memory_total_bytes == TOTAL
    assert info.gpu_wired_limit_bytes == RECOMMENDED
    # What Metal wires, within RAM less the one reserve (doctor's and --fix's too).
    assert metal.OS_RESERVE_BYTES == 8 * 10**9 and RECOMMENDED < TOTAL - metal.OS_RESERVE_BYTES
    assert info.memory_available_bytes == RECOMMENDED
    assert info.memory_budget == (
        "103.1 GB: Metal wires 103.1 GB (recommended working set), at most RAM less 8.0 GB "
        "for macOS"
    )
    assert info.cpu_count == 12  # performance cores: hw.perflevel0.physicalcpu


def test_a_raised_wired_limit_raises_the_budget_up_to_what_is_free():
    info = mac("macos26_metal_raised")
    assert info.gpu_wired_limit_bytes == 122880 * MiB
    # 120 GiB would be the budget (RAM less 8 GB is more), but only VM_AVAILABLE is free now.
    assert info.memory_available_bytes == VM_AVAILABLE == 107315200000
    assert "(iogpu.wired_limit_mb)" in info.memory_budget


def test_budget_rules():
    info = {"max_recommended_working_set_size": RECOMMENDED}
    assert metal.budget(TOTAL, None, "0") is None  # no Metal: RAM applies
    for text in ("0\n", "", None, "garbage"):  # unset or unreadable: Metal's recommendation
        b = metal.budget(TOTAL, info, text)
        assert (b.bytes, b.wired_limit_bytes) == (RECOMMENDED, RECOMMENDED)
    low = metal.budget(TOTAL, info, str(64 * 1024))  # a limit below the recommendation
    assert low.wired_limit_bytes == RECOMMENDED and low.source == "recommended working set"
    high = metal.budget(TOTAL, info, str(200 * 1024))  # above the RAM: the RAM bounds it
    assert (high.wired_limit_bytes, high.bytes) == (200 * GiB, TOTAL - 8 * 10**9)
    tiny = metal.budget(GiB, {"max_recommended_working_set_size": GiB // 2}, "0")
    assert tiny.bytes == 0


def test_a_linux_node_has_no_metal_budget():
    info = node_info(7070, "l", measure=False, run=Replay("linux"), root=RECORDED / "linux")
    assert (info.gpu_wired_limit_bytes, info.memory_budget) == (0, "")


def test_plan_says_which_budget_each_node_has():
    m = mac("macos26_metal")
    linux = SimpleNamespace(
        name="box", memory_budget="", memory_available_bytes=20e9, memory_total_bytes=24e9
    )
    state = SimpleNamespace(nodes={"a": m, "b": linux})
    assert budget_line(state) == (
        f"memory budget per node: {m.name}: 103.1 GB: Metal wires 103.1 GB (recommended working "
        "set), at most RAM less 8.0 GB for macOS; box: 20.0 GB available of 24.0 GB"
    )


def test_simulate_says_which_budget_each_node_has():
    cluster = parse_cluster("2x m4-max-128@tb5-rdma")
    assert simulate_budget_line(cluster) == (
        "memory budget per node: m4-max-128: 120 GB (128 GB less 8 GB; "
        "sudo sysctl iogpu.wired_limit_mb=114440)"
    )
    assert simulate_budget_line(parse_cluster("2x linux-ddr5-128@10gbe")) == (
        "memory budget per node: linux-ddr5-128: 120 GB (128 GB less 8 GB)"
    )


def test_a_metal_rank_wires_the_recommended_working_set(monkeypatch):
    calls = []
    monkeypatch.setattr(mx, "set_wired_limit", calls.append)
    assert metal.raise_wired_limit() is None and calls == []  # no Metal here: nothing
    info = recorded_metal("macos26_metal")
    assert metal.raise_wired_limit(info) == RECOMMENDED
    assert calls == [RECOMMENDED]


def test_a_metal_rank_reports_mlx_memory_not_proc(monkeypatch):
    assert not loader.on_metal()
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx, "get_peak_memory", lambda: 7 * GiB)
    monkeypatch.setattr(mx, "get_active_memory", lambda: 5 * GiB)
    assert loader.on_metal()
    assert loader.peak_rss_bytes() == 7 * GiB
    assert serve.current_rss_bytes() == 5 * GiB
