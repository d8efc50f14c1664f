"""Cluster descriptions for `thunderpool simulate`: presets, expressions and files.

A cluster is nodes (datasheet peaks) and links; `Cluster.specs()` turns them into the
planner's NodeSpec/LinkSpec with the calibration constants of presets.toml. Expressions:
`4x m3-ultra-512@tb5-rdma`, `m3-ultra-256+m5-max-128@tb5-rdma`; files: TOML or JSON with
`[[node]]` and `[[link]]` tables (or `links = "10gbe"` for a full mesh of one kind).
"""

from __future__ import annotations

import itertools
import json
import re
import tomllib
from dataclasses import asdict, dataclass, fields
from functools import cache
from importlib import resources
from pathlib import Path

from thunderpool.errors import ThunderpoolError
from thunderpool.planner.hardware import LINK_KINDS, LinkSpec, NodeSpec

GB = 1e9
GiB = 2**30
TERM = re.compile(r"^\s*(?:(\d+)\s*x\s*)?([a-z0-9][a-z0-9.-]*)\s*$")


@cache
def presets() -> dict:
    """presets.toml, parsed once."""
    text = resources.files("thunderpool.planner").joinpath("presets.toml").read_text()
    return tomllib.loads(text)


@dataclass(frozen=True, slots=True)
class Node:
    """A machine by its datasheet: memory (GB), peak bandwidth (GB/s), peak FP32 TFLOP/s."""

    name: str
    memory_gb: float
    mem_bw_gbs: float
    tflops: float
    family: str = "m4"  # which calibrated op latency applies (presets.toml)
    os_reserve_gb: float = 8.0
    preset: str = ""


@dataclass(frozen=True, slots=True)
class Link:
    """A link between nodes a and b: one-way latency (us), bandwidth (GB/s)."""

    a: str
    b: str
    kind: str
    latency_us: float
    bandwidth_gbs: float
    transport: str = "tcp"  # which calibrated collective overhead applies
    preset: str = ""


@dataclass(frozen=True, slots=True)
class Cluster:
    nodes: tuple[Node, ...]
    links: tuple[Link, ...]

    def specs(self) -> tuple[list[NodeSpec], list[LinkSpec]]:
        """The planner's view: sustained numbers after the calibration constants."""
        cal = presets()["calibration"]
        nodes = [
            NodeSpec(
                name=n.name,
                memory_bytes=int(n.memory_gb * GB),
                available_bytes=int(n.memory_gb * GB),
                mem_bw_Bps=n.mem_bw_gbs * GB * cal["bandwidth_efficiency"],
                flops=n.tflops * 1e12 * cal["flops_efficiency"],
                os_reserve_bytes=int(n.os_reserve_gb * GB),
                op_latency_s=_lookup(cal["op_latency_us"], n.family, "family", n.name) * 1e-6,
                row_op_latency_s=_lookup(cal["row_op_latency_us"], n.family, "family", n.name)
                * 1e-6,
                row_read_fraction=_lookup(cal["row_read_fraction"], n.family, "family", n.name),
            )
            for n in self.nodes
        ]
        links = [
            LinkSpec(
                a=x.a,
                b=x.b,
                latency_s=x.latency_us * 1e-6,
                bandwidth_Bps=x.bandwidth_gbs * GB,
                kind=x.kind,
                overhead_s=_lookup(cal["collective_overhead_us"], x.transport, "transport", x.a)
                * 1e-6,
            )
            for x in self.links
        ]
        return nodes, links

    def to_dict(self) -> dict:
        return {"node": [asdict(n) for n in self.nodes], "link": [asdict(x) for x in self.links]}

    def describe(self) -> str:
        kinds = sorted({x.preset or x.kind for x in self.links})
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.preset or n.name] = counts.get(n.preset or n.name, 0) + 1
        who = " + ".join(f"{c}x {p}" if c > 1 else p for p, c in counts.items())
        return who + (f" over {', '.join(kinds)}" if kinds else "")


def live_family(chip: str) -> str:
    """The calibrated family of a measured node, by its chip: an Apple Ultra, another Apple
    chip (the M4 fit), else MLX's CPU backend."""
    chip = chip.lower()
    return "cpu" if "apple" not in chip else "m3-ultra" if "ultra" in chip else "m4"


def live_op_latency_s(chip: str) -> float:
    """The calibrated per-matmul cost for a measured node, by its chip family."""
    return presets()["calibration"]["op_latency_us"][live_family(chip)] * 1e-6


def live_row_op_latency_s(chip: str) -> float:
    """The calibrated per-matmul cost of each extra row of a batched step, by chip family
    (agents do not measure it)."""
    return presets()["calibration"]["row_op_latency_us"][live_family(chip)] * 1e-6


def live_row_read_fraction(chip: str) -> float:
    """The calibrated share of the weights' read each extra row of a batched step pays again,
    by chip family (agents do not measure it)."""
    return float(presets()["calibration"]["row_read_fraction"][live_family(chip)])


def live_collective_overhead_s(kind: str) -> float:
    """The calibrated fixed cost of one collective over a measured link: jaccl's over RDMA,
    else MLX ring's over TCP (loopback included)."""
    transport = "rdma" if kind == "rdma" else "tcp"
    return presets()["calibration"]["collective_overhead_us"][transport] * 1e-6


def parse_cluster(text: str) -> Cluster:
    """A cluster from a preset expression or from the path of a TOML/JSON cluster file."""
    path = Path(text)
    if path.suffix in (".toml", ".json") or path.is_file():
        return load_cluster(path)
    body, _, link = text.partition("@")
    nodes: list[Node] = []
    for term in body.split("+"):
        m = TERM.match(term.lower())
        if not m:
            raise ThunderpoolError(
                f"cannot read {term.strip()!r} in --cluster {text!r}; write terms like "
                "'2x m3-ultra-512' joined by '+', then '@' and a link preset"
            )
        count, name = int(m.group(1) or 1), m.group(2)
        if count < 1:
            raise ThunderpoolError(f"{term.strip()!r} asks for {count} nodes; use 1 or more")
        for _ in range(count):
            nodes.append(node_preset(name, f"{name}-{len(nodes) + 1}"))
    if len(nodes) > 1 and not link:
        raise ThunderpoolError(
            f"--cluster {text!r} has {len(nodes)} nodes but no link; append @ and one of "
            f"{', '.join(presets()['link'])}, e.g. {text}@tb5-rdma"
        )
    links = mesh([n.name for n in nodes], link.strip().lower()) if link else ()
    return Cluster(tuple(nodes), links)


def node_preset(preset: str, name: str) -> Node:
    table = presets()["node"]
    if preset not in table:
        raise ThunderpoolError(
            f"unknown node preset {preset!r}; use one of {', '.join(table)} "
            "or describe the node in a cluster file (see docs/simulator.md)"
        )
    p = table[preset]
    keys = ("memory_gb", "mem_bw_gbs", "tflops", "family", "os_reserve_gb")
    return Node(name=name, preset=preset, **{k: p[k] for k in keys if k in p})


def mesh(names: list[str], preset: str) -> tuple[Link, ...]:
    """One link of kind `preset` between every pair of nodes."""
    table = presets()["link"]
    if preset not in table:
        raise ThunderpoolError(
            f"unknown link preset {preset!r}; use one of {', '.join(table)} "
            "or describe the links in a cluster file (see docs/simulator.md)"
        )
    p = table[preset]
    return tuple(
        Link(a, b, p["kind"], p["latency_us"], p["bandwidth_gbs"], p["transport"], preset)
        for a, b in itertools.combinations(names, 2)
    )


def load_cluster(path: Path) -> Cluster:
    """A cluster file: `[[node]]` tables (a `preset` and/or explicit fields, `count` to repeat)
    and `[[link]]` tables (a `preset` and/or fields), or `links = "<preset>"` for a mesh."""
    if not path.is_file():
        raise ThunderpoolError(
            f"cluster file {path} does not exist; pass a preset expression "
            "like '2x m3-ultra-512@tb5-rdma' or an existing .toml/.json file"
        )
    try:
        data = (
            json.loads(path.read_text())
            if path.suffix == ".json"
            else tomllib.loads(path.read_text())
        )
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ThunderpoolError(f"cluster file {path} is not valid {path.suffix[1:]}: {e}") from None
    nodes: list[Node] = []
    for entry in data.get("node", []):
        entry = dict(entry)
        count = int(entry.pop("count", 1))
        for _ in range(count):
            nodes.append(_node_from(dict(entry), len(nodes) + 1, path))
    if not nodes:
        raise ThunderpoolError(f"cluster file {path} has no [[node]] tables; add one per machine")
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise ThunderpoolError(f"cluster file {path} repeats node names {names}; make them unique")
    links = list(mesh(names, data["links"])) if isinstance(data.get("links"), str) else []
    for entry in data.get("link", []):
        links.append(_link_from(dict(entry), set(names), path))
    return Cluster(tuple(nodes), tuple(links))


def save_cluster(cluster: Cluster, path: Path) -> None:
    """Write a cluster file (JSON for .json, else TOML) that load_cluster reads back equal."""
    data = cluster.to_dict()
    if path.suffix == ".json":
        path.write_text(json.dumps(data, indent=1) + "\n")
        return
    out = []
    for table, rows in data.items():
        for row in rows:
            out.append(f"[[{table}]]")
            out += [f"{k} = {json.dumps(v)}" for k, v in row.items()]
            out.append("")
    path.write_text("\n".join(out))


def _node_from(entry: dict, index: int, path: Path) -> Node:
    preset = entry.pop("preset", "")
    name = entry.pop("name", f"{preset or 'node'}-{index}")
    base = asdict(node_preset(preset, name)) if preset else {"name": name}
    unknown = set(entry) - {f.name for f in fields(Node)}
    if unknown:
        raise ThunderpoolError(
            f"node {name!r} in {path} has unknown fields {sorted(unknown)}; use "
            f"{', '.join(f.name for f in fields(Node) if f.name != 'name')}"
        )
    base.update(entry)
    missing = [k for k in ("memory_gb", "mem_bw_gbs", "tflops") if k not in base]
    if missing:
        raise ThunderpoolError(
            f"node {name!r} in {path} lacks {', '.join(missing)}; give them or a `preset`"
        )
    return Node(**base)


def _link_from(entry: dict, names: set[str], path: Path) -> Link:
    preset = entry.get("preset", "")
    base = {}
    if preset:
        base = {k: v for k, v in asdict(mesh(["x", "y"], preset)[0]).items() if k not in ("a", "b")}
    base.update(entry)
    for end in ("a", "b"):
        if base.get(end) not in names:
            raise ThunderpoolError(
                f"a link in {path} joins {base.get(end)!r}, which is not a node; "
                f"use one of {', '.join(sorted(names))}"
            )
    if base.get("kind") not in LINK_KINDS:
        raise ThunderpoolError(
            f"link {base['a']}-{base['b']} in {path} has kind {base.get('kind')!r}; "
            f"use one of {', '.join(LINK_KINDS)} or a `preset`"
        )
    try:
        return Link(**base)
    except TypeError as e:
        raise ThunderpoolError(f"link {base['a']}-{base['b']} in {path}: {e}") from None


def _lookup(table: dict, key: str, what: str, who: str) -> float:
    if key not in table:
        raise ThunderpoolError(
            f"{who}: unknown {what} {key!r}; use one of {', '.join(table)} (presets.toml)"
        )
    return float(table[key])
