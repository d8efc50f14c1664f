"""The models `serve` knows, by name: each keeps one gateway for the server's life and, while it
is loaded, its own supervisor, ranks and engine link, so one instance's loss or replan never
touches another's. A request for an unloaded model loads it (the request waits); an idle model
unloads once its keep_alive has passed; past --max-loaded the least recently used idle one is
unloaded first, never one with requests in flight.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from rich.console import Console

from thunderpool.api.errors import RETRY_AFTER_S, APIError
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.service import Delta, EngineClient, ModelEntry
from thunderpool.serving.gateway import Gateway
from thunderpool.serving.supervisor import Instance, Supervisor

log = logging.getLogger("thunderpool.models")
GRACE_S = 0.5  # acquired this recently: its request is about to submit, so the model is busy
TICK_S = 0.25  # how often idle models are looked at
WAIT_S = 0.05  # a request waiting for its model to load looks this often
STOP_S = 60.0  # how long stopping waits for an instance's ranks to be killed
UNLOADED = "not loaded; a request for it loads it"


@dataclass
class Known:
    """One model as serve resolved it at start: its gateway and how to start an instance."""

    name: str
    gateway: Gateway
    plan: Callable[[bool], Instance]
    on_event: Callable[[object], None] = lambda ev: None
    view: object | None = None  # a ClusterView: /v1/cluster's nodes and placement
    weight_bytes: int = 0  # the planner's estimate of its weights (planner/spec.py)


@dataclass(eq=False)
class _Slot:
    known: Known
    keep_alive: float
    supervisor: Supervisor | None = None
    thread: threading.Thread | None = None
    on_demand: bool = False  # loaded for a request, which waits for it
    startup: bool = False
    in_flight: int = 0
    touched: float = 0.0  # last acquire or finished generation (monotonic)
    unloading: bool = False
    error: BaseException | None = None


class Models:
    """Implements engine.service.ModelRegistry; `serve()` runs in serve's main thread."""

    def __init__(
        self,
        known: list[Known],
        console: Console,
        keep_alive: float = math.inf,
        max_loaded: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int | None = None,
    ):
        self.console, self.max_loaded, self.clock = console, max_loaded, clock
        self.max_bytes = max_bytes  # weights of the loaded models together, at most
        self.keep_alive = keep_alive  # for a request that names none (as Ollama's default)
        self._slots = {k.name: _Slot(k, keep_alive) for k in known}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        for s in self._slots.values():
            s.known.gateway.loading(0.0, UNLOADED, "unloaded")

    # ModelRegistry
    def names(self) -> list[str]:
        return list(self._slots)

    def client(self, name: str) -> EngineClient:
        return self._slots[name].known.gateway

    async def acquire(self, name: str, keep_alive: float | None = None) -> EngineClient:
        slot = self._slots[name]
        # Each request sets the model's keep_alive, its own or the server's (as Ollama does).
        slot.touched = self.clock()
        slot.keep_alive = self.keep_alive if keep_alive is None else keep_alive
        if slot.supervisor is None or slot.unloading:  # an unload in progress finishes first
            await asyncio.to_thread(self._load, slot, True)
        gateway = slot.known.gateway
        while slot.on_demand and slot.supervisor is not None and gateway.state == "loading":
            slot.touched = self.clock()  # a request waiting for the load keeps it loaded
            await asyncio.sleep(WAIT_S)
        return _Tracked(gateway, slot, self.clock)  # type: ignore[return-value]

    def keep(self, name: str, keep_alive: float) -> None:
        slot = self._slots[name]
        # Seen by the next tick in serve's thread: unloading waits on ranks, never on the loop.
        slot.keep_alive, slot.touched = keep_alive, self.clock() - GRACE_S

    def entries(self) -> list[ModelEntry]:
        return [self._entry(s) for s in self._slots.values()]

    def _entry(self, s: _Slot) -> ModelEntry:
        g = s.known.gateway
        cluster = g.info.cluster if s.supervisor is not None else {}  # no stale placement
        nodes = cluster.get("nodes") or []
        used = [n.get("memory_used_bytes") or n.get("param_bytes") or 0 for n in nodes]
        expires = None
        if s.supervisor is not None and math.isfinite(s.keep_alive):
            expires = time.time() + max(0.0, s.touched + s.keep_alive - self.clock())
        state = g.state if s.supervisor is not None else "failed" if s.error else "unloaded"
        return ModelEntry(
            g.info.model,
            state,
            g.progress,
            g.detail,
            in_flight=s.in_flight,
            expires_at=expires,
            memory_bytes=sum(used) if s.supervisor is not None and any(used) else None,
            cluster=cluster,
        )

    # serve's side
    def serve(self, startup: list[str]) -> None:
        """Start `startup`'s instances, then unload idle models until stopped; a model that
        fails to start at first (a bad model, no fit) ends serve, as does any failure of the
        only model (serve ran one model before, and ended then)."""
        for name in startup:
            self._slots[name].startup = True
            self._load(self._slots[name], False)
        while not self._stop.wait(TICK_S):
            for s in self._slots.values():
                if s.error is not None and (len(self._slots) == 1 or s.startup):
                    raise s.error
                if s.known.gateway.state == "ready":
                    s.startup = False  # it served: a later failure is that model's alone
            self._reap()

    def load(self, name: str) -> None:
        """Start loading `name` (an admin's request); evicts like a request's load does."""
        self._load(self._slots[name], True)

    def unload(self, name: str) -> bool:
        """Unload `name` now; False when it was not loaded. A 409 while it has requests."""
        slot = self._slots[name]
        with self._lock:
            if slot.supervisor is None:
                return False
            if busy := self._busy(slot, grace=False):
                raise APIError(
                    409,
                    f"'{name}' has {busy} request(s) in flight; retry when they finish, or "
                    "unload it with keep_alive 0 (it unloads once idle)",
                    param="model",
                )
            self._unload(slot)
        return True

    def request_replan(self, name: str) -> tuple[int, bool]:
        """The admin's replan of one model's instance: (its instance number, pending)."""
        sup = self._slots[name].supervisor
        if sup is None:
            raise APIError(409, f"'{name}' is not loaded; nothing to replan", param="model")
        return sup.generation, sup.request_replan()

    def replanner(self, name: str | None = None) -> _Replanner:
        """What /v1/admin/replan drives: `name`'s (default: the first model's) supervisor."""
        return _Replanner(self, name or self.names()[0])

    def stop(self) -> None:
        self._stop.set()
        threads = []
        with self._lock:
            for s in self._slots.values():
                if s.supervisor is not None:
                    s.unloading = True
                    s.supervisor.stop()
                    threads.append(s.thread)
        for t in threads:
            if t is not None:
                t.join(STOP_S)

    # inside
    def _busy(self, slot: _Slot, grace: bool = True) -> int:
        """Requests in flight (or, with `grace`, just acquired) on `slot`; 0 when idle."""
        recent = grace and self.clock() - slot.touched < GRACE_S
        return max(slot.in_flight, slot.known.gateway.active_count(), int(recent))

    def _reap(self) -> None:
        now = self.clock()
        with self._lock:
            for s in self._slots.values():
                if s.supervisor is None or s.unloading or self._busy(s):
                    continue
                if now - s.touched >= s.keep_alive:
                    log.info("unloading %s: idle past its keep_alive", s.known.name)
                    self._unload(s)

    def _load(self, slot: _Slot, on_demand: bool) -> None:
        with self._lock:
            if slot.supervisor is not None or self._stop.is_set():
                return
            self._make_room(slot)
            k = slot.known
            label = k.name if len(self._slots) > 1 else ""
            sup = Supervisor(k.gateway, k.plan, self.console, k.on_event, k.view, label)  # type: ignore[arg-type]
            slot.supervisor, slot.on_demand, slot.error = sup, on_demand, None
            k.gateway.loading(0.0, "loading model shards", "loading")
            slot.thread = threading.Thread(
                target=self._run, args=(slot, sup), name=f"model-{k.name}", daemon=True
            )
            slot.thread.start()
        self.console.print(f"loading {k.name}")

    def _full(self, loaded: list[_Slot], new: _Slot) -> str:
        """Why `new` does not fit beside `loaded` ("" when it does)."""
        if self.max_loaded is not None and len(loaded) >= self.max_loaded:
            return f"{len(loaded)} model(s) loaded (--max-loaded {self.max_loaded})"
        used = sum(s.known.weight_bytes for s in loaded)
        if self.max_bytes is not None and used + new.known.weight_bytes > self.max_bytes:
            return (
                f"its {gib(new.known.weight_bytes)} of weights and the loaded models' "
                f"{gib(used)} exceed --max-memory-gb {self.max_bytes / 2**30:g}"
            )
        return ""

    def _make_room(self, slot: _Slot) -> None:
        """Unload the least recently used idle models until `slot` fits --max-loaded and
        --max-memory-gb."""
        loaded = [s for s in self._slots.values() if s.supervisor is not None]
        while loaded and (why := self._full(loaded, slot)):  # serve checked each fits alone
            idle = [s for s in loaded if not self._busy(s)]
            if not idle:
                busy = ", ".join(f"'{s.known.name}' ({self._busy(s)} in flight)" for s in loaded)
                raise APIError(
                    503,
                    f"cannot load '{slot.known.name}': {why}, and each loaded model has "
                    f"requests in flight: {busy}; retry when one is idle, or unload one "
                    "(POST /v1/admin/unload)",
                    type="server_error",
                    code="model_not_ready",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            lru = min(idle, key=lambda s: s.touched)
            self.console.print(f"unloading {lru.known.name} to make room for {slot.known.name}")
            self._unload(lru)
            loaded.remove(lru)

    def _unload(self, slot: _Slot) -> None:
        """Stop the slot's instance and wait until its ranks are gone (their memory free)."""
        sup, thread = slot.supervisor, slot.thread
        if sup is None:
            return
        slot.unloading = True
        sup.stop()
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_S)

    def _run(self, slot: _Slot, sup: Supervisor) -> None:
        try:
            sup.run()
        except BaseException as e:  # noqa: BLE001 - reported by serve() or the next request
            if not slot.unloading:
                slot.error = e
                log.warning("%s stopped: %s", slot.known.name, e)
        finally:
            # No lock here: the thread that unloads this slot holds it while it joins us.
            if slot.unloading or slot.error is None:
                slot.known.gateway.loading(0.0, UNLOADED, "unloaded")
            slot.unloading, slot.on_demand = False, False
            if slot.supervisor is sup:
                slot.supervisor = None


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


class _Tracked:
    """A model's gateway that counts its running generations, so an idle model is known."""

    def __init__(self, gateway: Gateway, slot: _Slot, clock: Callable[[], float]):
        self._gateway, self._slot, self._clock = gateway, slot, clock

    def __getattr__(self, name: str):
        return getattr(self._gateway, name)

    async def generate(
        self, prompt: list[int], params: SamplingParams, *, replayable: bool = False
    ) -> AsyncIterator[Delta]:
        self._slot.in_flight += 1
        try:
            async for d in self._gateway.generate(prompt, params, replayable=replayable):
                yield d
        finally:
            self._slot.in_flight -= 1
            self._slot.touched = self._clock()


@dataclass(frozen=True)
class _Replanner:
    models: Models
    name: str

    @property
    def generation(self) -> int:
        sup = self.models._slots[self.name].supervisor
        return sup.generation if sup is not None else 0

    def request_replan(self) -> bool:
        return self.models.request_replan(self.name)[1]
