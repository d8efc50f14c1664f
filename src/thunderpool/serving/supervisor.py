"""Keeps a serving instance running: launch, watch, and on a loss replan and launch again.

The first instance failing to start is the user's error (bad model, no fit) and ends `serve`.
Once one has served, a lost rank or node makes the gateway answer 503 while the supervisor
plans on the nodes that are left and starts a new instance; if nothing fits it keeps trying
as nodes come back. A replan the user asks for waits for running requests to finish first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from rich.console import Console

from thunderpool.engine.link import FrameError
from thunderpool.errors import LaunchError, ThunderpoolError
from thunderpool.serving.gateway import Gateway
from thunderpool.serving.view import ClusterView

RETRY_S = 2.0  # between attempts to plan when the model fits nowhere
MAX_START_FAILURES = 3  # instances in a row that die before serving: give up
DRAIN_S = 120.0  # how long a requested replan waits for running requests
LINK_SETTLE_S = 3.0  # after a lost engine link: how long a launcher may take to name a failed rank


class Instance(Protocol):
    leader_host: str

    def __enter__(self): ...
    def __exit__(self, *exc): ...
    def events(self): ...
    def interrupt(self) -> None: ...


class Supervisor:
    def __init__(
        self,
        gateway: Gateway,
        plan: Callable[[bool], Instance],
        console: Console,
        on_event: Callable[[object], None] = lambda ev: None,
        view: ClusterView | None = None,
        name: str = "",
    ):
        self.gateway, self.plan, self.console, self.on_event = gateway, plan, console, on_event
        self.who = f"{name} " if name else ""  # which model's instance, when serve has several
        self.view = view  # /v1/cluster's nodes, links and placement, from the ranks' reports
        self.instance: Instance | None = None
        self.generation = 0  # instances started so far (the dashboard and tests read it)
        self._replan = threading.Event()
        self._stopping = False
        self._serving = False  # the running instance has reached ready
        self._last_error = ""
        gateway.on_link_lost = self._link_lost

    def request_replan(self) -> bool:
        """Move to a new plan (e.g. a node rejoined) once running requests have finished; an
        instance still loading finishes loading first, so a replan never counts as a failed
        start. True when a replan was pending already (this is the same one)."""
        pending = self._replan.is_set()
        self._replan.set()
        if self.instance is not None and self._serving:
            self.instance.interrupt()
        return pending

    def run(self) -> None:
        first, failures = True, 0
        while not self._stopping:
            self._replan.clear()  # the plan made now is the new plan a request asked for
            try:
                instance = self.plan(first)
            except ThunderpoolError as e:
                if first:
                    raise
                self.gateway.loading(0.0, f"waiting for nodes: {e}", "recovering")
                time.sleep(RETRY_S)
                continue
            served = self._run_one(instance, first)
            first = False
            failures = 0 if served else failures + 1
            if failures >= MAX_START_FAILURES:
                self.gateway.lost("the instance failed to start 3 times in a row", "failed")
                raise LaunchError(f"{self.gateway.detail}; last error: {self._last_error}")

    def _run_one(self, instance: Instance, first: bool) -> bool:
        """Run one instance until it ends; True when it reached ready."""
        self.instance, served = instance, False
        if self._stopping:  # stopped while it was planned (an unload): never start it
            self.instance = None
            return False
        self.generation += 1
        phase = "loading" if first else "recovering"
        self.gateway.loading(0.0, "loading model shards", phase)
        world = getattr(getattr(instance, "job", None), "world_size", 1)
        done: dict[int, float] = {}
        if self.view is not None:
            self.gateway.set_cluster(**self.view.begin(instance))
        try:
            with instance:
                for ev in self._events(instance):
                    e = ev.event
                    self.on_event(ev)
                    if self.view is not None and (shown := self.view.observe(ev.rank, e)):
                        self.gateway.set_cluster(**shown)
                    match e["kind"]:
                        case "progress":
                            done[ev.rank] = e["fraction"]
                        case "loaded":
                            done[ev.rank] = 1.0
                        case "ready":
                            self.gateway.attach(instance.leader_host, e["link_port"])
                            served = self._serving = True
                            about = describe(instance, self.generation)
                            self.gateway.set_cluster(instance=about)
                            self.console.print(
                                f"{self.who}ready: {about['parallel']} on "
                                f"{', '.join(about['nodes'])} (instance {about['generation']})"
                            )
                    if e["kind"] in ("progress", "loaded") and not served:
                        fraction = sum(done.values()) / world
                        self.gateway.loading(fraction, "loading model shards", phase)
                    if self._replan.is_set() and served:
                        break
                if self._replan.is_set():
                    self._drain()
        except (LaunchError, OSError, FrameError) as e:
            self._last_error = str(e)
            if first and not served:
                self.gateway.lost(str(e), "failed")
                raise
            self.console.print(f"[red]{self.who}instance lost[/]: {e}; replanning")
        finally:
            self.instance, self._serving = None, False
        self.gateway.lost(self._last_error or "replanning", "recovering")
        self._replan.clear()
        return served

    def _events(self, instance: Instance):
        try:
            yield from instance.events()
        except (LaunchError, OSError, FrameError) as e:
            # Tell the clients before the ranks are stopped: stopping waits on a lost node.
            self.gateway.lost(str(e))
            raise

    def _drain(self) -> None:
        """A requested replan: 503 for new requests, let running ones finish (bounded)."""
        self.gateway.draining("replanning")
        deadline = time.monotonic() + DRAIN_S
        while self.gateway.active_count() and time.monotonic() < deadline:
            time.sleep(0.1)
        self._last_error = "replanning on request"

    def _link_lost(self, reason: str) -> None:
        self._last_error = reason
        instance = self.instance
        # A failed rank often ends the leader's link before its launcher sees the exit (mpirun
        # takes ~1 s to stop the rest): give the launcher that long to report the rank's own
        # error (it ends the instance itself), then end what is left.
        deadline = time.monotonic() + LINK_SETTLE_S
        while instance is not None and self.instance is instance and time.monotonic() < deadline:
            time.sleep(0.05)
        if instance is not None and self.instance is instance:
            instance.interrupt()

    def stop(self) -> None:
        self._stopping = True
        if self.instance is not None:
            self.instance.interrupt()


def describe(instance: Instance, generation: int) -> dict:
    """What /v1/cluster says about the running instance."""
    job = getattr(instance, "job", None)
    world = job.world_size if job else 1
    state = getattr(instance, "state", None)
    order = getattr(instance, "order", None)
    if state is not None and order is not None:
        nodes = [state.nodes[n].name for n in order]
        hosts = [state.contacts[n].rsplit(":", 1)[0] for n in order]
    else:
        nodes, hosts = [f"rank{r}" for r in range(world)], ["127.0.0.1"] * world
    parallel = (job.layout.parallel if world > 1 else "single") if job else "single"
    return {"generation": generation, "parallel": parallel, "nodes": nodes, "hosts": hosts}
