"""Energy: the RAPL reader against a fake /sys/class/powercap tree, powermetrics parsing, and
an exact reason wherever power cannot be read."""

from __future__ import annotations

from pathlib import Path

import pytest

from thunderpool.bench import energy
from thunderpool.bench.energy import (
    RaplMeter,
    energy_delta_uj,
    energy_summary,
    open_meter,
    parse_powermetrics_mw,
    rapl_domains,
    window_joules,
)
from thunderpool.bench.engine_bench import Run

MAX = 262_143_328_850  # a real package's max_energy_range_uj


def domain(root: Path, name: str, label: str, uj: int, max_uj: int = MAX) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "name").write_text(label + "\n")
    (d / "energy_uj").write_text(f"{uj}\n")
    (d / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return d


@pytest.fixture
def powercap(tmp_path) -> Path:
    root = tmp_path / "powercap"
    domain(root, "intel-rapl:0", "package-0", 1_000_000)
    domain(root, "intel-rapl:0:0", "core", 400_000)  # part of package 0: never added again
    domain(root, "intel-rapl:1", "package-1", MAX - 500_000)
    (root / "intel-rapl").mkdir()  # the control type directory, not a domain
    return root


def test_delta_wraps_at_the_max_range():
    assert energy_delta_uj(100, 350, MAX) == 250
    assert energy_delta_uj(MAX - 500_000, 1_500_000, MAX) == 2_000_000
    assert energy_delta_uj(7, 7, MAX) == 0


def test_only_package_domains_are_read(powercap):
    domains = rapl_domains(powercap)
    assert [d.name for d in domains] == ["package-0", "package-1"]
    assert [d.max_range_uj for d in domains] == [MAX, MAX]


def test_meter_adds_packages_across_a_wraparound(powercap):
    meter, reason = open_meter(powercap, platform="linux")
    assert reason is None and isinstance(meter, RaplMeter) and meter.source == "rapl"
    before = meter.snapshot()
    assert before == [1_000_000, MAX - 500_000]
    (powercap / "intel-rapl:0" / "energy_uj").write_text("3500000\n")  # +2.5 J
    (powercap / "intel-rapl:0:0" / "energy_uj").write_text("999999999\n")  # ignored
    (powercap / "intel-rapl:1" / "energy_uj").write_text("1500000\n")  # wrapped: +2 J
    assert meter.joules_since(before) == pytest.approx(4.5, abs=1e-9)


def test_no_powercap_says_why(tmp_path):
    meter, reason = open_meter(tmp_path / "missing", platform="linux")
    assert meter is None
    assert f"no {tmp_path / 'missing'}" in reason and "RAPL" in reason


def test_powercap_without_packages_says_why(tmp_path):
    (tmp_path / "dtpm").mkdir()
    meter, reason = open_meter(tmp_path, platform="linux")
    assert meter is None and "has no RAPL package domain" in reason


def test_root_only_counter_says_how_to_enable(powercap, monkeypatch):
    real = Path.read_text

    def read_text(self, *a, **k):
        if self.name == "energy_uj":
            raise PermissionError(13, "Permission denied")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", read_text)
    meter, reason = open_meter(powercap, platform="linux")
    assert meter is None
    assert "readable by root only" in reason and "chmod a+r" in reason


def test_macos_without_powermetrics_or_root_says_so(monkeypatch):
    monkeypatch.setattr(energy.shutil, "which", lambda name: None)
    assert open_meter(platform="darwin") == (
        None,
        "powermetrics is not installed (it ships with macOS)",
    )
    monkeypatch.setattr(energy.shutil, "which", lambda name: "/usr/bin/powermetrics")
    monkeypatch.setattr(energy.os, "geteuid", lambda: 501)
    meter, reason = open_meter(platform="darwin")
    assert meter is None and "needs root" in reason and "sudo thunderpool bench" in reason
    assert open_meter(platform="win32") == (None, "no power counters known on win32")


def test_powermetrics_lines_and_windows():
    assert parse_powermetrics_mw("Combined Power (CPU + GPU + ANE): 5123 mW") == 5123.0
    assert parse_powermetrics_mw("Package Power: 12.5 mW") == 12.5
    assert parse_powermetrics_mw("CPU Power: 900 mW") is None
    samples = [(0.95, 99.0), (1.05, 10.0), (1.15, 20.0), (1.25, 30.0), (1.35, 99.0)]
    # Each sample covers the 0.1 s before it: three overlap [1.0, 1.2], mean 20 W.
    assert window_joules(samples, 1.0, 1.2, 0.1) == pytest.approx(20.0 * 0.2)
    assert window_joules([(2.0, 8.0)], 2.5, 2.55, 0.1) == pytest.approx(8.0 * 0.05)
    assert window_joules([], 0.0, 1.0, 0.1) == 0.0


def test_summary_per_token():
    runs = [
        Run([1, 2, 3, 4, 5], 10, 0.5, 2.0, prefill_j=3.0, decode_j=8.0),
        Run([1, 2, 3, 4, 5], 10, 0.5, 2.0, prefill_j=1.0, decode_j=4.0),
    ]

    class Meter:
        source = "rapl"

    assert energy_summary(Meter(), None, runs) == {
        "available": True,
        "source": "rapl",
        "scope": "whole host",
        "prefill_joules_per_token": 4.0 / 20,
        "decode_joules_per_token": 12.0 / 8,
        "decode_watts": 12.0 / 4.0,
    }
    assert energy_summary(None, "why", runs) == {"available": False, "reason": "why"}
