"""`thunderpool node`: the per-node daemon.

It reports the node's capabilities, keeps the membership it has heard of (a ClusterState
built by the pure reducer), measures links on request, and starts, watches and stops rank
processes for the coordinator. Every request must be signed with the cluster token.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from thunderpool import __version__
from thunderpool.body import AGENT_LIMIT, BodyError, read_body
from thunderpool.cluster.control.auth import AuthError, Identity, NonceCache, verify
from thunderpool.cluster.control.client import AgentClient, AgentError, AgentUnreachable
from thunderpool.cluster.control.messages import (
    Hello,
    LinkMeasured,
    NodeInfo,
    ProbeRequest,
    StartRanks,
    StopInstance,
)
from thunderpool.cluster.control.probe import identify, measure
from thunderpool.cluster.control.ranks import RankManager
from thunderpool.cluster.control.state import ClusterState, apply
from thunderpool.cluster.node.thunderbolt import route
from thunderpool.cluster.weights.routes import Weights, add_weight_routes

REACH_TIMEOUT_S = 2.0
log = logging.getLogger("thunderpool.agent")


class Agent:
    def __init__(
        self,
        identity: Identity,
        info: NodeInfo,
        contact: str,
        probe_port: int,
        ranks: RankManager,
        cache_dir: Path | None = None,
    ):
        from thunderpool.models.source import default_cache_dir

        # The revision is a clock reading, so a restarted agent's report outranks the copies
        # its peers kept from before.
        info = info.model_copy(update={"revision": max(info.revision, time.time_ns())})
        self.identity, self.info, self.contact = identity, info, contact
        self.probe_port = probe_port
        self.ranks = ranks
        # Serves this node's models to members and fetches the shards its ranks need.
        self.weights = Weights(
            identity.token, ranks.resolve_model, cache_dir or default_cache_dir()
        )
        self.lock = threading.Lock()
        self.nonces = NonceCache()
        self.state = apply(ClusterState(), Hello(node=info, contact=contact))

    def hello(self) -> Hello:
        return Hello(node=self.info, contact=self.contact)

    def accept(self, msg: Hello) -> None:
        if msg.node.version != __version__:
            raise HTTPException(
                409,
                f"version mismatch: this node runs thunderpool "
                f"{__version__}, the joining node {msg.node.name} runs "
                f"{msg.node.version}; install the same version on both",
            )
        with self.lock:
            self.state = apply(self.state, msg)

    def refresh(self, fresh: NodeInfo) -> bool:
        """Take this node's re-read network facts (addresses, cables, RDMA devices) when they
        changed, and tell every known peer; measurements stay as measured at start."""
        network = ("interfaces", "thunderbolt", "rdma_devices", "rdma", "backends")
        if all(getattr(fresh, f) == getattr(self.info, f) for f in network):
            return False
        revision = max(self.info.revision + 1, time.time_ns())
        update = {f: getattr(fresh, f) for f in network} | {"revision": revision}
        with self.lock:
            self.info = self.info.model_copy(update=update)
            self.state = apply(self.state, self.hello())
            peers = [c for n, c in self.state.contacts.items() if n != self.identity.node_id]
        log.info(
            "network changed (%d addresses); telling %d peers", len(fresh.interfaces), len(peers)
        )
        for contact in peers:
            try:
                AgentClient(contact, self.identity.token).call("POST", "/v1/hello", self.hello())
            except AgentError as e:
                log.warning("could not tell %s of the new addresses: %s", contact, e)
        return True

    def join(self, seed: str) -> list[str]:
        """Say hello to `seed`, then to every peer it knows; returns the peers greeted."""
        todo, greeted = [seed], []
        while todo:
            address = todo.pop()
            reply = AgentClient(address, self.identity.token).call(
                "POST", "/v1/hello", self.hello()
            )
            greeted.append(address)
            for node_id, contact in reply["contacts"].items():
                node = NodeInfo.model_validate(reply["nodes"][node_id])
                self.accept(Hello(node=node, contact=contact))
                if node_id != self.identity.node_id and contact not in greeted + todo:
                    todo.append(contact)
        return greeted

    def probe(self, req: ProbeRequest) -> LinkMeasured:
        rtt, bw, mine = measure(req.address, req.port)
        # The interface the kernel sent from, by the socket's own address (not a guess by
        # address octets: a LAN and a Thunderbolt cable may share 192.168.0.x).
        via = next((i for i in self.info.interfaces if i.address == mine), None)
        via = via or route(self.info.interfaces, req.address)
        kind = "loopback" if req.address.startswith("127.") else (via.kind if via else "other")
        return LinkMeasured(
            a=self.identity.node_id,
            b=req.peer,
            a_address=mine,
            b_address=req.address,
            rtt_s=rtt,
            bandwidth_Bps=bw,
            link=kind,
        )


def signed_path(request: Request) -> str:
    """The path and query exactly as the client sent (and signed) them."""
    path = request.scope.get("raw_path", request.url.path.encode()).decode("latin-1")
    query = request.scope.get("query_string", b"").decode("latin-1")
    return f"{path}?{query}" if query else path


def create_agent_app(agent: Agent) -> FastAPI:
    app = FastAPI(title="thunderpool node", docs_url=None, redoc_url=None, openapi_url=None)

    async def signed(request: Request) -> bytes:
        try:
            body = await read_body(request, AGENT_LIMIT, log)
        except BodyError as e:
            raise HTTPException(e.status, e.message) from None
        try:
            verify(
                agent.identity.token,
                request.method,
                signed_path(request),
                body,
                request.headers,
                agent.nonces,
            )
        except AuthError as e:
            log.warning("refused a control message from %s: %s", request.client.host, e)
            raise HTTPException(401, str(e)) from None
        return body

    @app.exception_handler(ValueError)
    async def bad_message(request: Request, exc: ValueError):
        return JSONResponse({"detail": f"invalid message: {exc}"}, status_code=400)

    @app.post("/v1/hello")
    def hello(body: bytes = Depends(signed), request: Request = None):
        msg = Hello.model_validate_json(body)
        # Reach the peer where its packets came from, at the port it announced.
        port = msg.contact.rsplit(":", 1)[-1] if msg.contact else str(msg.node.port)
        agent.accept(msg.model_copy(update={"contact": f"{request.client.host}:{port}"}))
        return agent.state.model_dump(mode="json")

    @app.get("/v1/state")
    def state(_: bytes = Depends(signed)):
        return agent.state.model_dump(mode="json")

    @app.post("/v1/probe")
    def probe(body: bytes = Depends(signed)):
        req = ProbeRequest.model_validate_json(body)
        try:
            return agent.probe(req).model_dump(mode="json")
        except OSError as e:
            raise HTTPException(502, f"cannot probe {req.address}:{req.port}: {e}") from None

    @app.post("/v1/reach")
    def reach(body: bytes = Depends(signed)):
        # Whether this node can open a TCP connection to address:port (a jaccl coordinator's
        # address must be routable from every rank's node), from which local address, and
        # which node answered there (its probe server proves its id with the cluster token):
        # two Macs holding one address both accept a connect.
        req = ProbeRequest.model_validate_json(body)
        try:
            with socket.create_connection((req.address, req.port), timeout=REACH_TIMEOUT_S) as s:
                s.settimeout(REACH_TIMEOUT_S)
                return {"via": s.getsockname()[0], "node": identify(s, agent.identity.token)}
        except (OSError, struct.error) as e:
            raise HTTPException(502, f"cannot reach {req.address}:{req.port}: {e}") from None

    @app.post("/v1/start")
    def start(body: bytes = Depends(signed)):
        msg = StartRanks.model_validate_json(body)
        for spec in msg.ranks:
            agent.ranks.start(spec)
        return {"started": [s.rank for s in msg.ranks]}

    @app.get("/v1/instances/{instance_id}")
    def poll(instance_id: str, after: int = 0, wait: float = 0.0, _: bytes = Depends(signed)):
        return agent.ranks.poll(instance_id, after, wait)

    @app.post("/v1/stop")
    def stop(body: bytes = Depends(signed)):
        msg = StopInstance.model_validate_json(body)
        # Answered once every process of its ranks is gone (or named: the kernel kept it).
        alive = agent.ranks.stop(msg.instance_id)
        return {"stopped": msg.instance_id, "alive": alive}

    add_weight_routes(app, agent.weights, signed)
    return app


JOIN_WAIT_S = 60.0  # nodes started together: a seed may still be measuring, not yet listening


def join_all(agent: Agent, seeds: list[str], wait_s: float = JOIN_WAIT_S, say=print) -> None:
    """Join through each seed; a refusal (wrong token, other version) is fatal at once, a
    seed that does not answer is retried for `wait_s` seconds."""
    for seed in seeds:
        deadline, said = time.monotonic() + wait_s, False
        while True:
            try:
                agent.join(seed)
                break
            except AgentUnreachable as e:
                if time.monotonic() >= deadline:
                    raise AgentError(f"cannot join through {seed}: {e}") from None
                if not said:
                    say(f"waiting up to {wait_s:.0f} s for {seed} to answer")
                    said = True
                time.sleep(1.0)
            except AgentError as e:
                raise AgentError(f"cannot join through {seed}: {e}") from None
