"""The API's engine in the serve process: requests go to the leader rank over the engine link.

The gateway outlives every instance. When an instance is lost, requests that already streamed
tokens end with an error delta; requests that had not started wait, and are submitted again
to the next instance once it is ready. While there is none, the API answers 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from thunderpool.engine import link
from thunderpool.engine.sampling import SamplingParams
from thunderpool.engine.service import Delta, EngineInfo, EngineStatus

CONNECT_TIMEOUT_S = 10.0
log = logging.getLogger("thunderpool.gateway")


@dataclass(eq=False)
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    deliver: Callable[[Delta], None]
    replayable: bool = False  # the client sees only the finished answer: hold deltas back
    started: bool = False  # a delta reached the client: it cannot be run again
    held: list[Delta] = field(default_factory=list)


class Gateway:
    """Implements engine.service.EngineClient over whichever instance is current."""

    def __init__(self, info: EngineInfo, tokenizer: Any, token: str):
        self.info, self.tokenizer, self.token = info, tokenizer, token
        self.state, self.progress, self.detail = "loading", 0.0, "loading model shards"
        self.fetch: tuple[dict, ...] = ()  # each node's weight fetch, while weights move
        self.on_link_lost: Callable[[str], None] = lambda reason: None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._requests: dict[int, _Request] = {}
        self._sock: socket.socket | None = None
        self._metrics: dict[str, float] = {}
        self._generation = 0  # which connection is current; a stale reader's EOF is ignored

    # EngineClient
    def status(self) -> EngineStatus:
        return EngineStatus(self.state, self.progress, self.detail, self.fetch)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            pending = sum(not r.started for r in self._requests.values())
        return dict(self._metrics) | {"gateway_requests_waiting": pending}

    async def generate(
        self, prompt: list[int], params: SamplingParams, *, replayable: bool = False
    ) -> AsyncIterator[Delta]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        req = _Request(
            next(self._ids),
            list(prompt),
            params,
            lambda d: loop.call_soon_threadsafe(queue.put_nowait, d),
            replayable,
        )
        with self._lock:
            # Admitted just before a loss: it waits for the next instance like the queued ones.
            failed = self.state == "failed"
            if not failed:
                self._requests[req.id] = req
            sock = self._sock
        if failed:
            yield Delta("", "error", len(prompt), error=self.detail)
            return
        if sock is not None:
            self._send(sock, _submit(req))
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.finish_reason is not None
                yield delta
        finally:
            with self._lock:
                known = self._requests.pop(req.id, None) is not None
                sock = self._sock
            if not finished and known and sock is not None:
                self._send(sock, link.Cancel(id=req.id))

    # The supervisor's side
    def loading(
        self, progress: float, detail: str, state: str = "loading", fetch: tuple[dict, ...] = ()
    ) -> None:
        """No instance serves yet: the first one loading, or a new one after a loss."""
        self.state, self.progress, self.detail, self.fetch = state, progress, detail, fetch

    def attach(self, host: str, port: int) -> None:
        """Connect to a ready leader, then resubmit every request that has not started."""
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            link.answer(sock, self.token)
            info = link.recv(sock, link.ToGateway)
            if not isinstance(info, link.Info):
                raise link.FrameError("the leader closed the engine link (a wrong token?)")
        except (link.FrameError, OSError):
            sock.close()
            raise
        sock.settimeout(None)
        with self._lock:
            self._generation += 1
            self._sock = sock
            waiting = sorted(self._requests.values(), key=lambda r: r.id)
            self.state, self.progress, self.detail, self.fetch = "ready", 1.0, "", ()
        reader = threading.Thread(
            target=self._read, args=(sock, self._generation), name="engine-link", daemon=True
        )
        reader.start()
        for req in waiting:
            self._send(sock, _submit(req))
        if waiting:
            log.info("resubmitted %d request(s) that had not started", len(waiting))

    def lost(self, reason: str, state: str = "recovering") -> None:
        """The instance is gone: end started streams with an error, keep the others waiting."""
        with self._lock:
            sock, self._sock = self._sock, None
            self._generation += 1
            self.state, self.progress, self.detail, self.fetch = state, 0.0, reason, ()
            started = [r for r in self._requests.values() if r.started or state == "failed"]
            for r in started:
                del self._requests[r.id]
            for r in self._requests.values():
                r.held.clear()  # a replayable request starts over on the next instance
        if sock is not None:
            sock.close()
        for r in started:
            r.deliver(
                Delta("", "error", len(r.prompt), error=f"{reason}; the request was interrupted")
            )

    def set_cluster(self, **fields) -> None:
        """Add or replace top-level entries of what /v1/cluster reports."""
        self.info = dataclasses.replace(self.info, cluster={**self.info.cluster, **fields})

    def draining(self, detail: str) -> None:
        """New requests get 503; the ones running finish on the current instance."""
        self.state, self.detail = "recovering", detail

    def active_count(self) -> int:
        with self._lock:
            return len(self._requests)

    def _send(self, sock: socket.socket, msg) -> None:
        try:
            with self._send_lock:
                link.send(sock, msg)
        except OSError:
            pass  # the reader sees the broken link and reports it

    def _read(self, sock: socket.socket, generation: int) -> None:
        reason = "the leader rank closed the engine link"
        try:
            while (msg := link.recv(sock, link.ToGateway)) is not None:
                if isinstance(msg, link.Metrics):
                    self._metrics = msg.values
                elif isinstance(msg, link.DeltaMsg):
                    self._deliver(msg, generation)
        except (link.FrameError, OSError) as e:
            reason = f"engine link broken: {e}"
        with self._lock:
            current = generation == self._generation
        if current:
            log.warning("%s", reason)
            self.lost(reason)
            self.on_link_lost(reason)

    def _deliver(self, msg: link.DeltaMsg, generation: int) -> None:
        with self._lock:
            req = self._requests.get(msg.id)
            if req is None or generation != self._generation:
                return  # cancelled, ended by a loss, or from an instance already lost
            delta = msg.delta
            if req.replayable and delta.finish_reason is None:
                req.held.append(delta)
                return
            req.started = True
            if delta.finish_reason is not None:
                del self._requests[msg.id]
            deltas, req.held = [*req.held, delta], []
        for d in deltas:
            req.deliver(d)


def _submit(req: _Request) -> link.Submit:
    return link.Submit(id=req.id, prompt=req.prompt, params=req.params)
