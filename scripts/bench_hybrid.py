#!/usr/bin/env python3
"""Hybrid TP×PP against flat TP and flat PP on the namespace testbed (root; run under
flock /tmp/testbed.lock), with `tc` rate limits between two islands and none inside.

Hosts 1+2 and 3+4 are the islands: each host's egress to the other island's addresses goes
through a token bucket of --rate (an htb class, u32 filter); its traffic inside the
island is unshaped. Four agents join; the coordinator measures the links, and the planner
predicts every plan. Then TP4, PP4 (hosts 1-4) and hybrid 2×2 ((1,2) then (3,4)) each
decode a synthetic prompt, alternated round by round; the table gives each layout's median
decode tok/s (and min-max) over the rounds beside the planner's prediction for that plan.

    flock /tmp/testbed.lock env PYTHONPATH=$PWD/src python3 scripts/bench_hybrid.py --rate 20mbit
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "cluster"))
from testbed import AGENT_PORT, Testbed, available, node_cmd, wait_until  # noqa: E402

from thunderpool.cluster.control.client import AgentError  # noqa: E402
from thunderpool.cluster.control.coordinator import Coordinator, node_specs  # noqa: E402
from thunderpool.cluster.control.instance import ClusterInstance  # noqa: E402
from thunderpool.engine.job import BenchTask, RankJob  # noqa: E402
from thunderpool.models.source import resolve_model  # noqa: E402
from thunderpool.parallel.layout import Layout  # noqa: E402
from thunderpool.planner.placement import place  # noqa: E402
from thunderpool.planner.spec import model_spec  # noqa: E402

TOKEN = "hybrid-bench-token"
ISLANDS = ((1, 2), (3, 4))


def own_host(i: int) -> list[str]:
    """Each agent a machine of its own for the planner (the namespaces share one kernel), so it
    prices the 4-rank plans this script runs, as 4 real machines would run them."""
    return ["--host-id", f"bench-host-{i}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="20mbit", help="rate limit between the islands")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--plan-only", action="store_true", help="print the planner's plans, stop")
    args = p.parse_args()
    if (why := available()) is not None:
        raise SystemExit(f"the testbed is not available: {why}")
    model = resolve_model(None, progress=False)
    home = Path(tempfile.mkdtemp(prefix="hybrid-bench-"))
    with Testbed(4) as bed:
        # Before the agents join: their first probes are kept when later ones are no faster.
        bed.limit_between(list(ISLANDS), args.rate)
        first = f"{bed.host(1).ip}:{AGENT_PORT}"
        coord = Coordinator([first], TOKEN)

        def count() -> int:
            try:
                return len(coord.discover().nodes)
            except AgentError:
                return 0

        bed.popen(
            1, node_cmd(bed, 1, home, "--token", TOKEN, *own_host(1)), stderr=subprocess.DEVNULL
        )
        assert wait_until(lambda: count() == 1, timeout=60)
        for i in (2, 3, 4):
            cmd = node_cmd(bed, i, home, "--token", TOKEN, "--join", first, *own_host(i))
            bed.popen(i, cmd, stderr=subprocess.DEVNULL)
        assert wait_until(lambda: count() == 4, timeout=60)
        state = coord.probe(coord.discover())
        ids = {state.contacts[n].split(":")[0]: n for n in state.nodes}
        order = [ids[bed.host(i).ip] for i in (1, 2, 3, 4)]
        for a, b in ((1, 2), (1, 3), (3, 4)):
            link = state.link(ids[bed.host(a).ip], ids[bed.host(b).ip])
            print(
                f"link {a}-{b}: {link.bandwidth_Bps / 1e6:.1f} MB/s, rtt {link.rtt_s * 1e3:.2f} ms"
            )
        nodes, links = node_specs(state)
        context = args.prompt_tokens + args.max_tokens
        plans = place(model_spec(model), nodes, links, context_tokens=context)
        wanted = {
            "tp4": ("tp", [tuple(order)]),
            "pp4": ("pp", [(n,) for n in order]),
            "hybrid2x2": ("hybrid", [tuple(order[:2]), tuple(order[2:])]),
        }
        layouts, predicted = {}, {}
        for name, (kind, stages) in wanted.items():
            match = [
                pl
                for pl in plans
                if pl.kind == kind
                and [tuple(s.nodes) for s in pl.stages] == stages
                or (kind == "tp" and pl.kind == kind and set(pl.nodes) == set(order))
            ]
            if match:
                layouts[name], predicted[name] = match[0].layout(), match[0].prediction
            else:
                layouts[name] = {"tp": Layout("tp"), "pp": Layout("pp")}.get(
                    kind, Layout("hybrid", groups=(2, 2))
                )
                predicted[name] = None
        if args.plan_only:
            for pl in plans:
                stages = " > ".join(
                    "+".join(str(order.index(n) + 1) for n in st.nodes) for st in pl.stages
                )
                print(f"{pl.kind:7s} {stages:12s} {pl.prediction.decode_tps:8.2f} tok/s predicted")
            return 0
        measured: dict[str, list[float]] = {name: [] for name in wanted}
        task = BenchTask(prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, repeats=1)
        for r in range(args.rounds):
            for name in wanted if r % 2 == 0 else list(wanted)[::-1]:
                job = RankJob(model_dir="", world_size=4, task=task, layout=layouts[name])
                bench = None
                with ClusterInstance(coord, state, order, job, timeout=600) as inst:
                    for ev in inst.events():
                        if ev.event["kind"] == "bench":
                            bench = ev.event
                tps = bench["decode_tps"]
                tps = tps["median"] if isinstance(tps, dict) else tps
                measured[name].append(tps)
                print(f"round {r + 1} {name}: {tps:.2f} tok/s", flush=True)
    print(f"\n| layout | decode tok/s median (min-max), {args.rounds} rounds | predicted tok/s |")
    print("|---|---|---|")
    for name, runs in measured.items():
        pred = predicted[name]
        text = f"{pred.decode_tps:.1f}" if pred is not None else "(no such plan)"
        print(
            f"| {name} | {statistics.median(runs):.2f} ({min(runs):.2f}-{max(runs):.2f}) | {text} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
