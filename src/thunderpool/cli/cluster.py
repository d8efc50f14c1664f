"""`thunderpool status` and `plan`, and the cluster side of `generate`/`serve --cluster`."""

from __future__ import annotations

import argparse
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from thunderpool.cli.connect import add_cluster_args, coordinator, measured_state
from thunderpool.cli.jobs import prefix_cache_bytes
from thunderpool.cluster.control.coordinator import node_specs
from thunderpool.cluster.control.instance import ClusterInstance
from thunderpool.cluster.control.state import ClusterState
from thunderpool.errors import ThunderpoolError

GB = 1e9


def status_main(args: argparse.Namespace) -> int:
    coord = coordinator(args)
    state = measured_state(coord)
    console = Console()
    nodes = Table(
        "node",
        "id",
        "agent",
        "chip",
        "memory (avail/total)",
        "mem bw",
        "fp32",
        "backends",
        "versions",
        title=f"{len(state.nodes)} node(s)",
    )
    for n in state.nodes.values():
        nodes.add_row(
            n.name,
            n.node_id,
            state.contacts.get(n.node_id, ""),
            n.chip,
            f"{n.memory_available_bytes / GB:.1f}/{n.memory_total_bytes / GB:.1f} GB",
            f"{n.mem_bw_Bps / GB:.1f} GB/s",
            f"{n.flops / GB:.0f} GFLOP/s",
            ",".join(n.backends) + (" +RDMA" if n.rdma else ""),
            f"tp {n.version} / mlx {n.mlx_version}",
        )
    links = Table("between", "addresses", "RTT", "bandwidth", "kind", title="links")
    for link in sorted(state.links.values(), key=lambda x: (x.a, x.b)):
        a, b = state.nodes[link.a].name, state.nodes[link.b].name
        links.add_row(
            f"{a} - {b}",
            f"{link.a_address} - {link.b_address}",
            f"{link.rtt_s * 1e3:.3f} ms",
            f"{link.bandwidth_Bps / GB:.2f} GB/s",
            link.link,
        )
    console.print(nodes)
    console.print(links)
    from thunderpool.cli.cache import shards_table

    console.print(shards_table(coord, state))
    return 0


def add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="rank the ways to place a model on the cluster, with "
        "predicted speed and the memory left on every node",
    )
    p.add_argument("--model", help="model dir, .gguf or repo id (default: embedded SmolLM2)")
    p.add_argument("--context", type=int, default=4096, help="tokens of context per request")
    p.add_argument("--concurrency", type=int, default=1, help="requests served at once")
    p.add_argument("--top", type=int, default=8, help="plans to show")
    p.add_argument(
        "--routing",
        metavar="FILE",
        help="MoE: measured routing counts (`thunderpool route-counts`) for EP plans' imbalance",
    )
    add_cluster_args(p)
    from thunderpool.cli.flags import add_allow_untested, add_compile

    add_allow_untested(p)
    add_compile(p)  # priced as `serve --compile` would run
    p.add_argument(
        "--draft-model",
        help="reserve a speculative draft on the leader (what `serve --draft-model` loads): "
        "a model dir, .gguf or hub id, or `mtp` (the model's own MTP layer)",
    )
    from thunderpool.cli.flags import add_kv_bits

    add_kv_bits(p)  # the KV cache priced as `serve --kv-bits` stores it


def ranked_plans(args: argparse.Namespace, state: ClusterState):
    from thunderpool.cluster.control.remote_model import model_here_or_remote
    from thunderpool.planner.placement import place
    from thunderpool.planner.spec import kv_element_bytes, model_spec

    # The coordinator needs only the config and headers: from a member if it lacks the model.
    spec = model_spec(model_here_or_remote(args.model, lambda: coordinator(args)))
    nodes, links = node_specs(state)
    concurrency = getattr(args, "concurrency", 1)  # bench's --concurrency is a list of levels
    routing = _routing(args)
    draft = _draft_spec(args, spec)
    return place(
        spec,
        nodes,
        links,
        context_tokens=getattr(args, "context", 4096),
        kv_dtype_bytes=kv_element_bytes(2.0, getattr(args, "kv_bits", None), _group(args)),
        concurrency=concurrency if isinstance(concurrency, int) else 1,
        prefix_cache_bytes=prefix_cache_bytes(args),
        routing={i: routing.popularity(i) for i in routing.layers} if routing else None,
        # Priced as CPU ranks run it (unset: on for CPU ranks, engine/compiled.py: wanted).
        compiled=getattr(args, "compile", True) is not False,
        draft=draft,
    )


def _group(args: argparse.Namespace) -> int:
    return getattr(args, "kv_group_size", None) or 64


def kv_line(args: argparse.Namespace, plans) -> str:
    """The KV cache's bytes per context token as the plans reserve them."""
    bits = getattr(args, "kv_bits", None)
    how = f"{bits}-bit, group {_group(args)}" if bits else "16-bit; --kv-bits 8 or 4 shrinks it"
    per_token = plans[0].kv_token_bytes / 1024 if plans else 0.0
    return f"KV cache per context token: {per_token:.1f} KiB over all ranks ({how})"


def _draft_spec(args: argparse.Namespace, spec):
    """The speculative draft the leader will hold (--draft-model), for its memory."""
    from thunderpool.cluster.control.remote_model import model_here_or_remote
    from thunderpool.planner.spec import model_spec

    name = getattr(args, "draft_model", None)
    if not name:
        return None
    if name == "mtp":  # the model's own MTP layer, loaded on the leader (engine/mtp.py)
        from thunderpool.planner.speculative import mtp_draft

        return mtp_draft(spec)
    return model_spec(model_here_or_remote(name, lambda: coordinator(args)))


def _routing(args: argparse.Namespace):
    """The RoutingCounts --routing names, or None."""
    from thunderpool.parallel.routing import RoutingCounts

    path = getattr(args, "routing", None)
    return RoutingCounts.read(path) if path else None


def plan_main(args: argparse.Namespace) -> int:
    from thunderpool.cli.simulate import plan_table
    from thunderpool.planner.placement import explain

    state = measured_state(coordinator(args))
    plans = ranked_plans(args, state)
    names = {k: n.name for k, n in state.nodes.items()}
    table = plan_table(plans[: args.top], names)
    console = Console()
    console.print(table)
    console.print(budget_line(state), soft_wrap=True)
    console.print(kv_line(args, plans), soft_wrap=True)
    console.print(verified_line(args.model, lambda: coordinator(args)), soft_wrap=True)
    # The winner is what `--cluster` would launch: verified plans only, unless allowed.
    runnable = [p for p in plans if p.verified or args.allow_untested]
    if runnable:
        console.print(_named(explain(runnable), state))
    else:
        console.print("no verified plan fits; --allow-untested would run the first one")
    return 0


def budget_line(state: ClusterState, gb: float = 1e9) -> str:
    """The memory each node's plan may use, and why: a Mac's Metal wired limit less a reserve
    (cluster/node/metal.py), elsewhere the memory its agent reports available."""
    parts = []
    for n in state.nodes.values():
        why = n.memory_budget or (
            f"{n.memory_available_bytes / gb:.1f} GB available of {n.memory_total_bytes / gb:.1f}"
            " GB"
        )
        parts.append(f"{n.name}: {why}")
    return "memory budget per node: " + "; ".join(parts)


def verified_line(model: str | None, coord=None) -> str:
    """`verified layouts for llama: tp, pp` for the model `--model` names; `coord` builds the
    coordinator that asks a member for its config when this machine has no copy."""
    import json

    from thunderpool.cluster.control.remote_model import model_here_or_remote
    from thunderpool.models.families import describe, family_of
    from thunderpool.models.source import resolve_model

    where = model_here_or_remote(model, coord) if coord else resolve_model(model)
    config = json.loads((where / "config.json").read_text())
    return describe(family_of(config))


def cluster_instance(args: argparse.Namespace, make_job, timeout: float | None):
    """Plan on the measured cluster (honouring --parallel/--nodes when given), then launch."""
    return ClusterPlanner(args, make_job, timeout, Console(stderr=True))(True)


class ClusterPlanner:
    """Plans an instance on the nodes that answer now; `serve` calls it again after a loss.

    The first plan honours --parallel/--nodes. A replan keeps the same kind on whatever number
    of nodes is left, else takes the best plan that fits; PlacementError when nothing does.
    """

    def __init__(self, args: argparse.Namespace, make_job, timeout: float | None, console):
        from thunderpool.cli.cache import FetchBars

        self.args, self.make_job, self.timeout, self.console = args, make_job, timeout, console
        self.coord = coordinator(args)
        # Each round of weight-fetch progress goes to these (terminal bars; serve adds /health).
        self.fetch_listeners = [FetchBars(console)]

    def __call__(self, first: bool) -> ClusterInstance:
        state, dead = self.coord.alive(self.coord.discover())
        if dead:
            self.console.print(f"[dim]not answering, left out: {', '.join(dead)}[/]")
        state = self.coord.probe(state)
        if missing := state.unprobed_pairs():
            pairs = ", ".join(f"{state.nodes[a].name}-{state.nodes[b].name}" for a, b in missing)
            self.console.print(f"[yellow]could not measure the links {pairs}[/]")
        plans = ranked_plans(self.args, state)
        allow = getattr(self.args, "allow_untested", False)
        runnable = [p for p in plans if p.verified or allow]
        # A replan keeps what the user asked for when it can, else relaxes node count, then kind.
        tiers = [(True, True)] if first else [(True, True), (True, False), (False, False)]
        wanted = next(
            (
                w
                for kind, count in tiers
                if (w := [p for p in runnable if self._fits(p, kind, count)])
            ),
            [],
        )
        if not wanted and (blocked := [p for p in plans if self._fits(p, True, True)]):
            raise _refusal(blocked[0], runnable)
        if not wanted:
            kinds = ", ".join(sorted({f"{p.kind} on {len(p.nodes)}" for p in plans}))
            raise ThunderpoolError(
                f"no plan with --parallel {self.args.parallel} --nodes {self.args.nodes} "
                f"fits this cluster; possible: {kinds}"
            )
        plan = wanted[0]
        if not plan.verified:
            from thunderpool.models.families import warn_untested

            warn_untested(plan.unverified, self.console)
        layout = plan.layout()
        if layout.parallel == "ep" and getattr(self.args, "expert_split", None):
            layout = replace(layout, expert_split=_expert_split(self.args.expert_split, plan))
        if layout.parallel == "ep" and getattr(self.args, "replicate_experts", None):
            layout = replace(layout, expert_replicas=_replicas(self.args, layout.expert_split))
        job = self.make_job(len(plan.nodes), layout)
        names = [state.nodes[n].name for n in plan.nodes]
        reason = _named(plan.reason, state)
        self.console.print(f"[dim]plan: {plan.kind} over {' > '.join(names)}: {reason}[/]")
        return ClusterInstance(
            self.coord, state, list(plan.nodes), job, timeout=self.timeout, on_fetch=self._fetched
        )

    def _fetched(self, fetches) -> None:
        for listener in self.fetch_listeners:
            listener(fetches)

    def _fits(self, p, kind: bool, count: bool) -> bool:
        args = self.args
        kind_ok = (
            args.parallel is None
            or p.kind == args.parallel
            or (p.kind == "single" and args.nodes == 1)
        )
        count_ok = args.nodes is None or len(p.nodes) == args.nodes
        return (kind_ok or not kind) and (count_ok or not count)

    def members(self) -> list[dict]:
        """Every node the cluster knows of, and whether its agent answers now."""
        known = self.coord.discover()
        alive, dead = self.coord.alive(known)
        return [
            {"id": k, "name": n.name, "contact": known.contacts.get(k, ""), "alive": k not in dead}
            for k, n in sorted(known.nodes.items(), key=lambda kv: kv[1].name)
        ]


def _replicas(args: argparse.Namespace, split) -> tuple[tuple[int, int, int], ...]:
    """--replicate-experts on the planned EP ranks, from --routing's measured counts."""
    from thunderpool.planner.replicas import plan_replicas

    routing = _routing(args)
    if routing is None or routing.experts != sum(split):
        raise ThunderpoolError(
            "--replicate-experts with --cluster needs --routing FILE: this model's routing "
            f"counts over its {sum(split)} experts (`thunderpool route-counts`)"
        )
    popularity = {i: routing.popularity(i) for i in routing.layers}
    return plan_replicas(popularity, list(split), args.replicate_experts)


def _expert_split(counts, plan) -> tuple[int, ...]:
    """--expert-split for the planned EP ranks: one count per rank, as many experts in all."""
    if len(counts) != len(plan.nodes) or sum(counts) != sum(plan.experts):
        raise ThunderpoolError(
            f"--expert-split {','.join(map(str, counts))} does not fit the plan's "
            f"{len(plan.nodes)} ranks and {sum(plan.experts)} experts; drop it, or add "
            f"--nodes {len(counts)}"
        )
    return tuple(counts)


def _refusal(plan, runnable) -> ThunderpoolError:
    """The best plan the user asked for is unverified: say so, and what would run."""
    from thunderpool.errors import UnverifiedLayoutError

    kinds = [p.kind for p in runnable if p.kind in ("tp", "pp")]
    fix = f"use --parallel {kinds[0]}" if kinds else "use --nodes 1" if runnable else ""
    fix = f"{fix}, or" if fix else "pass"
    return UnverifiedLayoutError(f"{plan.unverified}; {fix} --allow-untested to run it anyway")


def _named(text: str, state: ClusterState) -> str:
    """Node ids (what the planner works with) replaced by host names for people."""
    for node_id, node in state.nodes.items():
        text = text.replace(node_id, node.name)
    return text
