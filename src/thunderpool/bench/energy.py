"""Joules per token where the platform exposes power: Linux RAPL or macOS `powermetrics`.

RAPL: each package domain under /sys/class/powercap (`intel-rapl:N`, also on AMD) counts
microjoules in `energy_uj`, which wraps to 0 past `max_energy_range_uj`. Its subdomains
(`intel-rapl:N:M`: core, uncore, dram) are parts of the package, so only packages are added.
macOS: `powermetrics` (root only) prints the combined CPU + GPU + ANE power each interval; a
window's energy is the mean power of the samples in it times its length.
Both measure the whole host (every rank on it), not one process. Where neither is available,
`open_meter` says why and bench reports that instead of a number.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

POWERCAP = Path("/sys/class/powercap")
POWERMETRICS_MS = 100  # sampling interval
_PACKAGE = re.compile(r"^intel-rapl:\d+$")
_POWER = re.compile(r"^(?:Combined Power \(CPU \+ GPU \+ ANE\)|Package Power):\s*([\d.]+)\s*mW")


class EnergyUnavailable(Exception):
    """This host exposes no power reading; the message says why and what would enable it."""


@dataclass(frozen=True, slots=True)
class RaplDomain:
    name: str
    energy: Path  # .../energy_uj
    max_range_uj: int

    def read_uj(self) -> int:
        return int(self.energy.read_text())


def energy_delta_uj(before: int, after: int, max_range_uj: int) -> int:
    """Microjoules between two readings of one counter that wraps past `max_range_uj`."""
    return after - before if after >= before else after + max_range_uj - before


def rapl_domains(root: Path = POWERCAP) -> list[RaplDomain]:
    """The readable package domains under `root`; raises EnergyUnavailable saying why not."""
    if not root.is_dir():
        raise EnergyUnavailable(
            f"no {root}: this kernel exposes no RAPL counters (usual in VMs and containers; "
            "on bare metal load the intel_rapl_msr or amd_energy driver)"
        )
    domains = []
    for d in sorted(root.iterdir()):
        if not _PACKAGE.match(d.name):
            continue
        energy = d / "energy_uj"
        try:
            max_range = int((d / "max_energy_range_uj").read_text())
            int(energy.read_text())
        except PermissionError:
            raise EnergyUnavailable(
                f"{energy} is readable by root only (Linux >= 5.10); run bench as root or "
                f"`sudo chmod a+r {root}/intel-rapl:*/energy_uj`"
            ) from None
        except (OSError, ValueError) as e:
            raise EnergyUnavailable(f"cannot read {energy}: {e}") from None
        label = (d / "name").read_text().strip() if (d / "name").is_file() else d.name
        domains.append(RaplDomain(label, energy, max_range))
    if not domains:
        raise EnergyUnavailable(f"{root} has no RAPL package domain (intel-rapl:N)")
    return domains


class RaplMeter:
    source = "rapl"

    def __init__(self, domains: list[RaplDomain]):
        self.domains = domains

    def snapshot(self) -> list[int]:
        return [d.read_uj() for d in self.domains]

    def joules_since(self, before: list[int]) -> float:
        after = self.snapshot()
        deltas = (
            energy_delta_uj(b, a, d.max_range_uj)
            for d, b, a in zip(self.domains, before, after, strict=True)
        )
        return sum(deltas) / 1e6

    def close(self) -> None:
        pass


def parse_powermetrics_mw(line: str) -> float | None:
    """Milliwatts of the whole SoC (Apple silicon) or package (Intel Macs) in one line."""
    m = _POWER.match(line.strip())
    return float(m.group(1)) if m else None


class PowermetricsMeter:
    """Runs `powermetrics` for the whole benchmark; windows average the samples they hold."""

    source = "powermetrics"

    def __init__(self, command: list[str]):
        self.samples: list[tuple[float, float]] = []  # (monotonic time, watts)
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            mw = parse_powermetrics_mw(line)
            if mw is not None:
                self.samples.append((time.monotonic(), mw / 1e3))

    def snapshot(self) -> float:
        return time.monotonic()

    def joules_since(self, start: float) -> float:
        end = time.monotonic()
        return window_joules(self.samples, start, end, POWERMETRICS_MS / 1e3)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def window_joules(
    samples: list[tuple[float, float]], start: float, end: float, interval: float
) -> float:
    """Mean power of the samples that overlap [start, end] times its length.

    A sample at time t covers (t - interval, t]; with none overlapping (no sample yet), the
    last one before the window stands in.
    """
    inside = [w for t, w in samples if start < t < end + interval]
    if not inside:
        before = [w for t, w in samples if t <= start]
        if not before:
            return 0.0
        inside = before[-1:]
    return sum(inside) / len(inside) * (end - start)


def open_meter(root: Path = POWERCAP, platform: str = sys.platform):
    """(meter, None) where power can be read here, else (None, why not)."""
    try:
        if platform.startswith("linux"):
            return RaplMeter(rapl_domains(root)), None
        if platform == "darwin":
            return _powermetrics(), None
        raise EnergyUnavailable(f"no power counters known on {platform}")
    except EnergyUnavailable as e:
        return None, str(e)


def _powermetrics() -> PowermetricsMeter:
    tool = shutil.which("powermetrics")
    if tool is None:
        raise EnergyUnavailable("powermetrics is not installed (it ships with macOS)")
    if os.geteuid() != 0:
        raise EnergyUnavailable("powermetrics needs root; run `sudo thunderpool bench`")
    command = [tool, "--samplers", "cpu_power,gpu_power", "-i", str(POWERMETRICS_MS)]
    return PowermetricsMeter(command)


def energy_summary(meter, reason: str | None, runs: list) -> dict:
    """Joules per token over the timed runs: prefill per prompt token, decode per step."""
    if meter is None:
        return {"available": False, "reason": reason}
    prefill = sum(r.prefill_j for r in runs)
    decode = sum(r.decode_j for r in runs)
    steps = sum(len(r.tokens) - 1 for r in runs)
    seconds = sum(r.decode_s for r in runs)
    return {
        "available": True,
        "source": meter.source,
        "scope": "whole host",
        "prefill_joules_per_token": prefill / sum(r.prompt_tokens for r in runs),
        "decode_joules_per_token": decode / steps if steps else 0.0,
        "decode_watts": decode / seconds if seconds else 0.0,
    }
