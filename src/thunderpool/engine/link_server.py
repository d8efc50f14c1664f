"""The leader rank's end of the engine link: requests in, deltas and metrics out.

Each connection gets a writer thread, so a slow gateway never stalls the scheduler's thread;
a connection that closes cancels its requests, which leave the batch at the next step.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import socketserver
import threading
import time
from collections.abc import Callable

from thunderpool.engine import link
from thunderpool.engine.service import Delta

METRICS_EVERY_S = 1.0
log = logging.getLogger("thunderpool.link")


class _Connection(socketserver.BaseRequestHandler):
    server: LeaderServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = self.client_address[0]
        try:
            link.challenge(sock, self.server.token)
        except (link.FrameError, OSError) as e:
            log.warning("engine link: refused a connection from %s: %s", peer, e)
            return
        out: queue.Queue = queue.Queue()
        sids: dict[int, int] = {}  # gateway id -> scheduler id
        writer = threading.Thread(target=self._write, args=(sock, out), daemon=True)
        out.put(link.Info(max_context=self.server.max_context))
        writer.start()
        try:
            while (msg := link.recv(sock, link.ToLeader)) is not None:
                self._apply(msg, sids, out)
        except link.FrameError as e:
            log.warning("engine link: dropped %s after a bad frame: %s", peer, e)
        except OSError:
            pass
        finally:
            for sid in sids.values():
                self.server.scheduler.cancel(sid)
            out.put(None)

    def _apply(self, msg, sids: dict[int, int], out: queue.Queue) -> None:
        scheduler = self.server.scheduler
        if isinstance(msg, link.Cancel):
            if (sid := sids.pop(msg.id, None)) is not None:
                scheduler.cancel(sid)
            return
        if not isinstance(msg, link.Submit):
            return

        def emit(d: Delta, rid: int = msg.id) -> None:
            if d.finish_reason is not None:
                sids.pop(rid, None)
            out.put(link.DeltaMsg(id=rid, delta=d))

        sids[msg.id] = scheduler.submit(msg.prompt, msg.params, emit)

    def _write(self, sock: socket.socket, out: queue.Queue) -> None:
        due = time.monotonic() + METRICS_EVERY_S  # Info goes first: the gateway waits for it
        try:
            while True:
                if time.monotonic() >= due:
                    link.send(sock, link.Metrics(values=self.server.metrics()))
                    due = time.monotonic() + METRICS_EVERY_S
                try:
                    msg = out.get(timeout=max(due - time.monotonic(), 0.0))
                except queue.Empty:
                    continue
                if msg is None:
                    return
                link.send(sock, msg)
        except OSError:
            pass  # the gateway went away; the reader sees it too and cancels
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class LeaderServer(socketserver.ThreadingTCPServer):
    """Listens for the gateway; `port` is the one the OS chose when asked for 0."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        host: str,
        token: str,
        scheduler,  # submit(prompt, params, emit) and cancel(id): sequence.TextRequests
        max_context: int,
        metrics: Callable[[], dict[str, float]],
    ):
        super().__init__((host, 0), _Connection)
        self.token, self.scheduler = token, scheduler
        self.max_context, self.metrics = max_context, metrics
        self.port = self.server_address[1]

    def start(self) -> LeaderServer:
        threading.Thread(target=self.serve_forever, name="engine-link", daemon=True).start()
        return self
